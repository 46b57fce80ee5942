// InodeTable: inode numbers for (version, file) pairs, stable while mounted.
//
// Inodes 1-15 are reserved for fixed nodes (root, `latest`, `.dte`, ...).
// Every other inode names a version directory (file == kDirFile) or file
// number `file` of a version's manifest. A pair gets its inode the first
// time it is asked for and keeps it for the life of the table, even if the
// version leaves the store and comes back (gc writes a new revision with the
// same content), so the kernel never sees one inode change identity.
//
// Thread-safety: all methods may be called concurrently.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <utility>
#include <vector>

#include "store/base/thread_annotations.h"

namespace dte::fs {

inline constexpr uint32_t kDirFile = UINT32_MAX;
inline constexpr uint64_t kFirstDynamicIno = 16;

struct InodeKey {
  uint64_t version = 0;
  uint32_t file = kDirFile;
};

class InodeTable {
 public:
  // The inode of (version, file), allocated on first use.
  uint64_t Intern(uint64_t version, uint32_t file) EXCLUDES(mu_);
  // What a dynamic inode names; nullopt for unknown or fixed inodes.
  std::optional<InodeKey> Find(uint64_t ino) const EXCLUDES(mu_);
  size_t size() const EXCLUDES(mu_);

 private:
  mutable Mutex mu_;
  std::map<std::pair<uint64_t, uint32_t>, uint64_t> by_key_ GUARDED_BY(mu_);
  std::vector<InodeKey> by_ino_ GUARDED_BY(mu_);  // index: ino - kFirstDynamicIno
};

}  // namespace dte::fs
