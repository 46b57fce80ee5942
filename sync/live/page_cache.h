// PageCache: the kernel's page cache of live/ files, as a live apply
// (sync/live/live.h) sees it.
//
// Thread-safety: as each method says.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "store/base/status.h"

namespace dte::live {

inline constexpr uint64_t kPageBytes = 4096;

// The kernel's page cache of live/ files, as an apply sees it. The FUSE
// adapter implements it with mincore(2) and fuse_lowlevel_notify_store;
// tests with a fake.
class PageCache {
 public:
  virtual ~PageCache() = default;
  // One entry per 4 KiB page of live file `file` (its name and size): non-zero
  // where the page is resident. An error means "unknown": the apply then
  // pushes nothing for that file and reports it.
  virtual Status Resident(const std::string& file, uint64_t size, std::vector<uint8_t>* out) = 0;
  // Replaces [offset, offset + len) of live file number `file_index` in the
  // page cache with `data`. Called from several threads at once.
  virtual Status Store(uint32_t file_index, uint64_t offset, const char* data, size_t len) = 0;
  // Copies the page cache's current bytes of [offset, offset + len) of live
  // file number `file_index` (offset page-aligned) into dst (room for len
  // bytes) and sets *got: fewer bytes than asked (none) where a page is
  // not resident any more, if the cache can tell; a cache that cannot
  // reads such a page through the mount (from the new view: it is then a
  // noted read, Live::NoteRead). An error (Unimplemented where the cache
  // cannot be read) makes the apply fill those pages from the read path
  // instead. Called from several threads at once.
  virtual Status Fetch(uint32_t file_index, uint64_t offset, size_t len, char* dst, size_t* got) {
    (void)file_index, (void)offset, (void)len, (void)dst, (void)got;
    return Unimplemented("this page cache cannot be read back");
  }
  // The apply's page step is over (files a cache opened can be closed).
  virtual void Done() {}
};

}  // namespace dte::live
