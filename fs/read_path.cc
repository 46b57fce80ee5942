#include "fs/read_path.h"

#include <algorithm>
#include <cstring>
#include <optional>

#include "kernels/parallel.h"

namespace dte::fs {
namespace {

// The blobs a block of v is built from (its record and every record back to
// the dense one), so an error names the object an operator must look at.
std::string ChainBlobs(Store* store, std::shared_ptr<const Version> v, size_t record) {
  std::string out;
  while (v && record < v->records.size()) {
    const BlockRecord& rec = v->records[record];
    if (rec.kind != BlockKind::kSame) {
      out += (out.empty() ? "" : ", ") + BlobKey(v->manifest.blobs[rec.blob].hash) + " (" +
             VersionName(v->manifest.version) + ")";
    }
    if (rec.kind == BlockKind::kDenseRaw || rec.kind == BlockKind::kDenseZstd) break;
    if (!v->manifest.parent) break;
    auto parent = store->GetVersion(*v->manifest.parent);
    v = parent.ok() ? *parent : nullptr;
  }
  return out;
}

}  // namespace

bool ReadPath::CacheBase::ReadBlock(const Version& v, size_t record, uint64_t len, uint8_t* dst) {
  const BlockCache::Value cached =
      cache_->Peek(CacheKey{v.manifest.version, record, v.manifest.revision});
  if (cached && cached->size() == len) {
    std::memcpy(dst, cached->data(), len);
    hits++;
    return true;
  }
  BlockBase* next = this->next.load();
  return next && next->ReadBlock(v, record, len, dst);
}

Result<BlockCache::Value> ReadPath::WholeBlob(const std::shared_ptr<const Version>& v,
                                              uint32_t file_index) {
  const CacheKey key{v->manifest.version, kFileSlotBase + file_index, v->manifest.revision};
  return cache_.GetOrLoad(key, [&]() -> Result<BlockCache::Value> {
    const FileEntry& f = v->manifest.files[file_index];
    const std::string what = VersionName(v->manifest.version) + "/" + f.name;
    Result<std::string> bytes =
        f.safetensors ? materializer_.ReadWholeBlob(f.header_blob, f.header_size, what + " header")
                      : materializer_.ReadWholeBlob(f.blob, f.size, what);
    if (!bytes.ok()) {
      const Status& s = bytes.status();
      return Status(s.code(), s.message() + " [blob: " +
                                  BlobKey(f.safetensors ? f.header_blob : f.blob) + "]");
    }
    return std::make_shared<const Bytes>(std::move(bytes).value());
  });
}

Result<BlockCache::Value> ReadPath::Block(const std::shared_ptr<const Version>& v,
                                          const FileEntry& file, const TensorEntry& tensor,
                                          uint32_t block, const VersionChain* chain) {
  const size_t record = size_t{tensor.first_block} + block;
  const CacheKey key{v->manifest.version, record, v->manifest.revision};
  return cache_.GetOrLoad(key, [&]() -> Result<BlockCache::Value> {
    const uint64_t bb = v->manifest.block_bytes;
    auto bytes =
        std::make_shared<Bytes>(std::min<uint64_t>(bb, tensor.bytes() - uint64_t{block} * bb));
    auto* dst = reinterpret_cast<uint8_t*>(bytes->mutable_data());
    // A damaged read is read again from the store by the materializer.
    Status s = materializer_.ReadBlock(v, file, tensor, block, dst, chain);
    if (!s.ok()) {
      return Status(s.code(), s.message() + " [blobs: " + ChainBlobs(store_, v, record) + "]");
    }
    return std::shared_ptr<const Bytes>(std::move(bytes));
  });
}

Status ReadPath::CopyTensorBlock(const std::shared_ptr<const Version>& v, uint32_t file_index,
                                 uint32_t tensor, uint32_t block, uint8_t* dst,
                                 const VersionChain* chain) {
  const FileEntry& file = v->manifest.files[file_index];
  const TensorEntry& t = file.tensors[tensor];
  const size_t record = size_t{t.first_block} + block;
  const uint64_t bb = v->manifest.block_bytes;
  const uint64_t len = std::min<uint64_t>(bb, t.bytes() - uint64_t{block} * bb);
  const BlockCache::Value cached =
      cache_.Peek(CacheKey{v->manifest.version, record, v->manifest.revision});
  if (cached && cached->size() == len) {
    std::memcpy(dst, cached->data(), len);
    return Status::Ok();
  }
  Status s = materializer_.ReadBlock(v, file, t, block, dst, chain);
  if (!s.ok()) {
    return Status(s.code(), s.message() + " [blobs: " + ChainBlobs(store_, v, record) + "]");
  }
  return Status::Ok();
}

Status ReadPath::VisitData(const std::shared_ptr<const Version>& v, const FileEntry& file,
                           uint64_t offset, uint64_t len, const VersionChain* chain,
                           const PieceSink& take) {
  const uint64_t bb = v->manifest.block_bytes;
  const uint64_t stop = offset + len;
  // The blocks of the range, in file order: (tensor, block, tensor-relative
  // [from, to)).
  struct Want {
    const TensorEntry* tensor;
    uint32_t block;
    uint64_t from, to;
  };
  std::vector<Want> wants;
  // First tensor ending after offset (tensors are sorted and contiguous).
  auto it = std::upper_bound(file.tensors.begin(), file.tensors.end(), offset,
                             [](uint64_t off, const TensorEntry& t) { return off < t.end; });
  for (; it != file.tensors.end() && it->begin < stop; ++it) {
    const TensorEntry& t = *it;
    const uint64_t from = std::max(offset, t.begin) - t.begin;  // tensor-relative
    const uint64_t to = std::min(stop, t.end) - t.begin;
    for (uint64_t b = from / bb; b * bb < to; ++b) {
      wants.push_back({&t, static_cast<uint32_t>(b), from, to});
    }
  }
  // Blocks are materialized in parallel on the CPU backend's pool when a
  // read spans several (a kernel read of 1 MiB is four 256 KiB blocks): a
  // block far from its anchor or snapshot decodes many records, and the
  // reader waits for all of them.
  std::vector<std::optional<Result<BlockCache::Value>>> got(wants.size());
  auto load = [&](size_t i) {
    got[i].emplace(Block(v, file, *wants[i].tensor, wants[i].block, chain));
  };
  if (wants.size() > 1) {
    kernels::ParallelFor(wants.size(), 1, [&](size_t begin, size_t end) {
      for (size_t i = begin; i < end; ++i) load(i);
    });
  } else if (!wants.empty()) {
    load(0);
  }
  for (size_t i = 0; i < wants.size(); ++i) {
    if (!got[i]->ok()) return got[i]->status();
    const BlockCache::Value& block = **got[i];
    const uint64_t b = wants[i].block;
    const uint64_t lo = std::max(wants[i].from, b * bb);
    const uint64_t hi = std::min(wants[i].to, b * bb + block->size());
    take(block, block->data() + (lo - b * bb), hi - lo);
  }
  return Status::Ok();
}

Status ReadPath::Visit(const std::shared_ptr<const Version>& v, uint32_t file_index,
                       uint64_t offset, uint64_t len, const VersionChain* chain,
                       const PieceSink& take) {
  const FileEntry& f = v->manifest.files[file_index];
  if (offset > f.size || len > f.size - offset) {
    return InvalidArgument(VersionName(v->manifest.version) + "/" + f.name +
                           ": read beyond the end of the file");
  }
  if (len == 0) return Status::Ok();
  const uint64_t whole = f.safetensors ? f.header_size : f.size;
  if (offset < whole) {
    ASSIGN_OR_RETURN(BlockCache::Value blob, WholeBlob(v, file_index));
    const uint64_t n = std::min(len, whole - offset);
    take(blob, blob->data() + offset, n);
    offset += n;
    len -= n;
  }
  if (len == 0) return Status::Ok();
  return VisitData(v, f, offset - f.header_size, len, chain, take);
}

Status ReadPath::Read(const std::shared_ptr<const Version>& v, uint32_t file_index, uint64_t offset,
                      uint64_t len, uint8_t* dst, const VersionChain* chain) {
  return Visit(v, file_index, offset, len, chain,
               [&dst](const BlockCache::Value&, const char* data, size_t n) {
                 std::memcpy(dst, data, n);
                 dst += n;
               });
}

Status ReadPath::ReadPieces(const std::shared_ptr<const Version>& v, uint32_t file_index,
                            uint64_t offset, uint64_t len, std::vector<Piece>* out,
                            const VersionChain* chain) {
  return Visit(v, file_index, offset, len, chain,
               [out](const BlockCache::Value& hold, const char* data, size_t n) {
                 out->push_back(Piece{hold, data, n});
               });
}

}  // namespace dte::fs
