// LiveMount: what a live apply (sync/live/live.h) needs of the mount that
// serves its live/ files: reads of stored versions through the mount's
// block cache, the errno a failure is reported with, and the mount's log.
// dtefs implements it over its read path (fs/dtefs_live_mount.h); the
// apply engine never sees the FUSE layer.
//
// Thread-safety: every method may be called from several threads at once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "store/base/status.h"
#include "store/materialize.h"

namespace dte::live {

// Bytes of one tensor block, kept alive by `hold` for as long as the
// caller keeps the value.
struct HeldBlock {
  std::shared_ptr<const void> hold;
  const char* bytes = nullptr;
  size_t len = 0;
  const char* data() const { return bytes; }
  size_t size() const { return len; }
};

class LiveMount {
 public:
  virtual ~LiveMount() = default;

  // v and its ancestors, as reads walk them (Materializer::ChainOf).
  virtual VersionChain ChainOf(const std::shared_ptr<const Version>& v) = 0;

  // The content of a blob (a delta blob of a version), read whole and
  // checked against its hash; `what` names it in errors.
  virtual Result<std::string> ReadWholeBlob(const Hash128& blob, uint64_t size,
                                            const std::string& what) = 0;

  // Block `block` of tensor `tensor` of file `file_index` of v,
  // materialized and checked against its block hash, through the mount's
  // cache. With `chain` (v and its ancestors), parents come from it.
  virtual Result<HeldBlock> TensorBlock(const std::shared_ptr<const Version>& v,
                                        uint32_t file_index, uint32_t tensor, uint32_t block,
                                        const VersionChain* chain) = 0;

  // The same block copied into dst (room for the block's length), without
  // adding it to the cache (a pass over a whole version would only evict
  // what reads of the mount use).
  virtual Status CopyTensorBlock(const std::shared_ptr<const Version>& v, uint32_t file_index,
                                 uint32_t tensor, uint32_t block, uint8_t* dst,
                                 const VersionChain* chain) = 0;

  // Bytes [offset, offset + len) of file number `file_index` of v into dst
  // (the range lies within the file).
  virtual Status Read(const std::shared_ptr<const Version>& v, uint32_t file_index, uint64_t offset,
                      uint64_t len, uint8_t* dst, const VersionChain* chain) = 0;

  // The errno a failed apply or registration is reported with
  // (dte_live_status::last_error).
  virtual int Errno(const Status& s) = 0;

  // Writes one line to the mount's log.
  virtual void Log(std::string_view line) = 0;
};

}  // namespace dte::live
