#include "fs/inode_table.h"

namespace dte::fs {

uint64_t InodeTable::Intern(uint64_t version, uint32_t file) {
  MutexLock lock(&mu_);
  auto [it, inserted] = by_key_.try_emplace({version, file}, 0);
  if (inserted) {
    it->second = kFirstDynamicIno + by_ino_.size();
    by_ino_.push_back(InodeKey{version, file});
  }
  return it->second;
}

std::optional<InodeKey> InodeTable::Find(uint64_t ino) const {
  MutexLock lock(&mu_);
  if (ino < kFirstDynamicIno || ino - kFirstDynamicIno >= by_ino_.size()) return std::nullopt;
  return by_ino_[ino - kFirstDynamicIno];
}

size_t InodeTable::size() const {
  MutexLock lock(&mu_);
  return by_ino_.size();
}

}  // namespace dte::fs
