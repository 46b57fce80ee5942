// DtefsLiveMount: dtefs as the mount of its live apply (sync/live/live_mount.h):
// reads through the mount's read path and block cache, errno values as
// LiveErrno maps them, lines to the daemon's log (fs/log.h).
//
// Thread-safety: as ReadPath; every method may be called concurrently.
#pragma once

#include "fs/read_path.h"
#include "sync/live/live_mount.h"

namespace dte::fs {

class DtefsLiveMount final : public live::LiveMount {
 public:
  explicit DtefsLiveMount(ReadPath* reader) : reader_(reader) {}

  VersionChain ChainOf(const std::shared_ptr<const Version>& v) override;
  Result<std::string> ReadWholeBlob(const Hash128& blob, uint64_t size,
                                    const std::string& what) override;
  Result<live::HeldBlock> TensorBlock(const std::shared_ptr<const Version>& v, uint32_t file_index,
                                      uint32_t tensor, uint32_t block,
                                      const VersionChain* chain) override;
  Status CopyTensorBlock(const std::shared_ptr<const Version>& v, uint32_t file_index,
                         uint32_t tensor, uint32_t block, uint8_t* dst,
                         const VersionChain* chain) override;
  Status Read(const std::shared_ptr<const Version>& v, uint32_t file_index, uint64_t offset,
              uint64_t len, uint8_t* dst, const VersionChain* chain) override;
  int Errno(const Status& s) override;
  void Log(std::string_view line) override;

 private:
  ReadPath* const reader_;
};

}  // namespace dte::fs
