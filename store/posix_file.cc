#include "store/posix_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
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

}  // namespace dte
