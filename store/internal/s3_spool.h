// The local spool directory of S3 stores: files a writer fills before
// PutFile uploads them (NewTempPath).
//
// Names are DIR/<pid>-<random>-<counter>. The directory is shared by every
// S3 store of the user, made on first use with mode 0700, and must be a
// directory owned by the user (not a symlink planted in a shared /tmp).
//
// Thread-safety: SpoolDir may be used concurrently.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

#include "store/base/status.h"

namespace dte::internal {

class SpoolDir {
 public:
  explicit SpoolDir(std::string dir);

  const std::string& dir() const { return dir_; }

  // A fresh path in the directory (created if missing); the file is not.
  Result<std::string> NewPath();

  // Deletes regular files not modified for `min_age_seconds`; how many.
  Result<uint64_t> RemoveStale(int64_t min_age_seconds);

 private:
  Status Ensure();

  const std::string dir_;
  const uint64_t nonce_;
  std::atomic<uint64_t> counter_{0};
};

}  // namespace dte::internal
