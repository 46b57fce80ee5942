#include "fs/dtefs_live_mount.h"

#include "fs/filesystem.h"
#include "fs/log.h"

namespace dte::fs {

VersionChain DtefsLiveMount::ChainOf(const std::shared_ptr<const Version>& v) {
  return reader_->ChainOf(v);
}

Result<std::string> DtefsLiveMount::ReadWholeBlob(const Hash128& blob, uint64_t size,
                                                  const std::string& what) {
  return reader_->materializer().ReadWholeBlob(blob, size, what);
}

Result<live::HeldBlock> DtefsLiveMount::TensorBlock(const std::shared_ptr<const Version>& v,
                                                    uint32_t file_index, uint32_t tensor,
                                                    uint32_t block, const VersionChain* chain) {
  ASSIGN_OR_RETURN(BlockCache::Value b, reader_->TensorBlock(v, file_index, tensor, block, chain));
  const char* data = b->data();
  const size_t size = b->size();
  return live::HeldBlock{std::move(b), data, size};
}

Status DtefsLiveMount::CopyTensorBlock(const std::shared_ptr<const Version>& v, uint32_t file_index,
                                       uint32_t tensor, uint32_t block, uint8_t* dst,
                                       const VersionChain* chain) {
  return reader_->CopyTensorBlock(v, file_index, tensor, block, dst, chain);
}

Status DtefsLiveMount::Read(const std::shared_ptr<const Version>& v, uint32_t file_index,
                            uint64_t offset, uint64_t len, uint8_t* dst,
                            const VersionChain* chain) {
  return reader_->Read(v, file_index, offset, len, dst, chain);
}

int DtefsLiveMount::Errno(const Status& s) { return LiveErrno(s); }

void DtefsLiveMount::Log(std::string_view line) { LogLine(line); }

}  // namespace dte::fs
