#include "store/base/posix_file.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <ctime>
#include <memory>
#include <utility>

namespace dte {
namespace {

// Writes in pieces of at most 1 MiB: on this kernel a single write(2) of
// many MiB into the page cache runs several times slower than the same bytes
// in 1-4 MiB pieces (tools/bench measures it).
constexpr size_t kMaxWrite = 1 << 20;

constexpr size_t kReadChunk = 1 << 16;

}  // namespace

ScopedFd::ScopedFd(ScopedFd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}

ScopedFd& ScopedFd::operator=(ScopedFd&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

ScopedFd::~ScopedFd() {
  if (fd_ >= 0) ::close(fd_);
}

int ScopedFd::release() { return std::exchange(fd_, -1); }

Status ScopedFd::Close(const std::string& path) {
  if (::close(std::exchange(fd_, -1)) != 0) return ErrnoStatus("close " + path, errno);
  return Status::Ok();
}

Result<ScopedFd> OpenFile(const std::string& path, int flags, mode_t mode, int* err) {
  int fd;
  do {
    fd = ::open(path.c_str(), flags | O_CLOEXEC, mode);
  } while (fd < 0 && errno == EINTR);
  if (fd >= 0) return ScopedFd(fd);
  if (err != nullptr) *err = errno;
  return ErrnoStatus("open " + path, errno);
}

Status WriteAll(int fd, const void* data, size_t len, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (len > 0) {
    ssize_t n = ::write(fd, p, std::min(len, kMaxWrite));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ErrnoStatus("write " + path, errno);
    p += n;
    len -= static_cast<size_t>(n);
  }
  return Status::Ok();
}

Result<uint64_t> PreadUpTo(int fd, void* dst, uint64_t len, uint64_t offset,
                           const std::string& path) {
  char* p = static_cast<char*>(dst);
  uint64_t done = 0;
  while (done < len) {
    ssize_t n = ::pread(fd, p + done, len - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ErrnoStatus("read " + path, errno);
    if (n == 0) break;
    done += static_cast<uint64_t>(n);
  }
  return done;
}

Result<std::string> ReadWholeFile(const std::string& path) {
  ASSIGN_OR_RETURN(ScopedFd fd, OpenFile(path, O_RDONLY));
  std::string out;
  char buf[kReadChunk];
  while (true) {
    ssize_t n = ::read(fd.get(), buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ErrnoStatus("read " + path, errno);
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  return out;
}

Status CannotWording(const Status& status) {
  if (status.ok()) return status;
  return Status(status.code(), "cannot " + status.message());
}

Result<uint64_t> RemoveFilesOlderThan(const std::string& dir, int64_t min_age_seconds) {
  struct DirCloser {
    void operator()(DIR* d) const { ::closedir(d); }
  };
  std::unique_ptr<DIR, DirCloser> d(::opendir(dir.c_str()));
  if (d == nullptr && errno == ENOENT) return uint64_t{0};
  if (d == nullptr) return ErrnoStatus("list " + dir, errno);
  const int64_t now = ::time(nullptr);
  uint64_t removed = 0;
  for (;;) {
    errno = 0;
    const dirent* entry = ::readdir(d.get());
    if (entry == nullptr) break;
    struct stat st {};
    if (::fstatat(::dirfd(d.get()), entry->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0) continue;
    if (!S_ISREG(st.st_mode) || now - st.st_mtim.tv_sec < min_age_seconds) continue;
    if (::unlinkat(::dirfd(d.get()), entry->d_name, 0) == 0) {
      ++removed;
    } else if (errno != ENOENT) {
      return ErrnoStatus("unlink " + dir + "/" + entry->d_name, errno);
    }
  }
  if (errno != 0) return ErrnoStatus("list " + dir, errno);
  return removed;
}

}  // namespace dte
