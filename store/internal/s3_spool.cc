#include "store/internal/s3_spool.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <memory>
#include <random>
#include <utility>

#include "store/base/posix_file.h"
#include "store/hash.h"

namespace dte::internal {
namespace {

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
  return RemoveFilesOlderThan(dir_, min_age_seconds);
}

}  // namespace dte::internal
