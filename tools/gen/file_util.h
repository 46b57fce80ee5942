// Small POSIX file helpers for the generator, returning Status.
//
// Thread-safety: a File may be written by several threads at disjoint
// offsets (pwrite); opening and closing belong to one thread.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "store/base/status.h"

namespace dte::gen {

// An owned file descriptor, closed on destruction (Close() reports errors).
class File {
 public:
  File() = default;
  ~File();
  File(File&& other) noexcept;
  File& operator=(File&& other) noexcept;
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  // Creates or truncates `path` and sizes it to `size` bytes (a hole).
  static Result<File> Create(const std::string& path, uint64_t size);

  Status PwriteAll(std::span<const uint8_t> data, uint64_t offset) const;
  Status Close();
  const std::string& path() const { return path_; }

 private:
  int fd_ = -1;
  std::string path_;
};

// Writes `contents` to `path`, replacing it.
Status WriteWholeFile(const std::string& path, const std::string& contents);

// Creates `path` and its parents if missing.
Status MakeDirs(const std::string& path);

// Removes the weight files (model*.safetensors, the index) a previous run
// left in `dir`, so a rerun with other sharding leaves no stale shard.
Status RemoveStaleWeights(const std::string& dir);

}  // namespace dte::gen
