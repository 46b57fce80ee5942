#include "store/internal/s3_spool.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <ctime>
#include <memory>
#include <random>
#include <utility>

#include "store/hash.h"

namespace dte::internal {
namespace {

struct DirCloser {
  void operator()(DIR* dir) const { ::closedir(dir); }
};

// mkdir -p with mode 0700 for the directories it creates.
Status MakeDirs(const std::string& dir) {
  for (size_t pos = 1; pos <= dir.size(); ++pos) {
    if (pos != dir.size() && dir[pos] != '/') continue;
    const std::string part = dir.substr(0, pos);
    if (::mkdir(part.c_str(), 0700) != 0 && errno != EEXIST) {
      return ErrnoStatus("mkdir " + part, errno);
    }
  }
  return Status::Ok();
}

}  // namespace

SpoolDir::SpoolDir(std::string dir)
    : dir_(std::move(dir)),
      nonce_((uint64_t{std::random_device{}()} << 32) ^ std::random_device{}()) {}

Status SpoolDir::Ensure() {
  struct stat st {};
  if (::lstat(dir_.c_str(), &st) != 0) {
    if (errno != ENOENT) return ErrnoStatus("spool directory " + dir_, errno);
    RETURN_IF_ERROR(MakeDirs(dir_));
    if (::lstat(dir_.c_str(), &st) != 0) return ErrnoStatus("spool directory " + dir_, errno);
  }
  if (!S_ISDIR(st.st_mode) || st.st_uid != ::geteuid()) {
    return InvalidArgument("spool directory " + dir_ +
                           " is not a directory owned by this user (set DTE_SPOOL_DIR)");
  }
  return Status::Ok();
}

Result<std::string> SpoolDir::NewPath() {
  RETURN_IF_ERROR(Ensure());
  return dir_ + "/" + std::to_string(::getpid()) + "-" + Hex64(nonce_) + "-" +
         std::to_string(counter_.fetch_add(1));
}

Result<uint64_t> SpoolDir::RemoveStale(int64_t min_age_seconds) {
  std::unique_ptr<DIR, DirCloser> d(::opendir(dir_.c_str()));
  if (d == nullptr && errno == ENOENT) return uint64_t{0};
  if (d == nullptr) return ErrnoStatus("list " + dir_, errno);
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
      return ErrnoStatus("unlink " + dir_ + "/" + entry->d_name, errno);
    }
  }
  if (errno != 0) return ErrnoStatus("list " + dir_, errno);
  return removed;
}

}  // namespace dte::internal
