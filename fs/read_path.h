// ReadPath: byte ranges of version files, through the block cache.
//
// A safetensors file is its header blob followed by its tensors' blocks; a
// raw file is one blob. Each piece is materialized (and hash-checked) by the
// Materializer at most once while it stays in the BlockCache, so two 128 KiB
// kernel reads of one 256 KiB block decode it once. Cache slots: block
// record r of a version is slot r; the header or raw blob of the version's
// file i is slot kFileSlotBase + i.
//
// Thread-safety: all methods may be called concurrently.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "fs/block_cache.h"
#include "store/materialize.h"

namespace dte::fs {

inline constexpr uint64_t kFileSlotBase = uint64_t{1} << 62;

class ReadPath {
 public:
  ReadPath(Store* store, uint64_t cache_bytes)
      : store_(store), materializer_(store), cache_(cache_bytes), base_(&cache_) {
    materializer_.SetBase(&base_);
  }

  // Reads [offset, offset + len) of file number `file_index` of v into dst.
  // The range must lie within the file. Corruption when a block or blob does
  // not match its hash (the message names the version, file, tensor and the
  // blobs involved); dst is then unspecified. With `chain` (v and its
  // ancestors, Materializer::ChainOf), parents come from it, not the store.
  Status Read(const std::shared_ptr<const Version>& v, uint32_t file_index, uint64_t offset,
              uint64_t len, uint8_t* dst, const VersionChain* chain = nullptr);

  // One piece of a read: `size` bytes at `data`, kept alive by `hold` (null
  // for bytes the caller owns).
  struct Piece {
    BlockCache::Value hold;
    const char* data = nullptr;
    size_t size = 0;
  };
  // The same range as Read, appended to *out as pieces of cached blocks and
  // blobs in file order, without copying them (the FUSE adapter replies with
  // them as they are). Errors as Read; *out is then unspecified.
  Status ReadPieces(const std::shared_ptr<const Version>& v, uint32_t file_index, uint64_t offset,
                    uint64_t len, std::vector<Piece>* out, const VersionChain* chain = nullptr);

  // Block `block` of tensor `tensor` of file `file_index` of v, through the
  // cache: materialized and checked against its block hash. Errors as Read.
  Result<BlockCache::Value> TensorBlock(const std::shared_ptr<const Version>& v,
                                        uint32_t file_index, uint32_t tensor, uint32_t block,
                                        const VersionChain* chain = nullptr) {
    const FileEntry& f = v->manifest.files[file_index];
    return Block(v, f, f.tensors[tensor], block, chain);
  }

  // The same block copied into dst (room for the block's length): from the
  // cache when it holds it, else materialized and checked without being
  // cached, for a reader that passes over a whole version once (a live
  // apply's FP8 change sets) and would only evict what others read.
  Status CopyTensorBlock(const std::shared_ptr<const Version>& v, uint32_t file_index,
                         uint32_t tensor, uint32_t block, uint8_t* dst,
                         const VersionChain* chain = nullptr);

  VersionChain ChainOf(const std::shared_ptr<const Version>& v, bool stop_at_joins = false) {
    return materializer_.ChainOf(v, stop_at_joins);
  }

  // Chain walks stop at the first version whose block is in the block cache
  // (blocks there were checked against their hash when they were made), or
  // else in `base` (Materializer::SetBase; null: none). So a version read
  // after its parent (the next step, a live apply) costs one record per
  // block while the parent's blocks stay cached.
  void SetBase(BlockBase* base) { base_.next.store(base); }

  ReadCounters& counters() { return materializer_.counters(); }
  Materializer& materializer() { return materializer_; }
  // Chain walks that started from a block in the block cache; the rest of
  // counters().base_blocks started from a snapshot.
  uint64_t cached_base_blocks() const { return base_.hits.load(); }
  BlockCache& cache() { return cache_; }

 private:
  Result<BlockCache::Value> WholeBlob(const std::shared_ptr<const Version>& v, uint32_t file_index);
  Result<BlockCache::Value> Block(const std::shared_ptr<const Version>& v, const FileEntry& file,
                                  const TensorEntry& tensor, uint32_t block,
                                  const VersionChain* chain);
  // Calls `take` with each piece of [offset, offset + len) in file order.
  using PieceSink = std::function<void(const BlockCache::Value&, const char*, size_t)>;
  Status Visit(const std::shared_ptr<const Version>& v, uint32_t file_index, uint64_t offset,
               uint64_t len, const VersionChain* chain, const PieceSink& take);
  Status VisitData(const std::shared_ptr<const Version>& v, const FileEntry& file, uint64_t offset,
                   uint64_t len, const VersionChain* chain, const PieceSink& take);

  // The block cache, then the snapshots, as one BlockBase.
  class CacheBase : public BlockBase {
   public:
    explicit CacheBase(const BlockCache* cache) : cache_(cache) {}
    bool ReadBlock(const Version& v, size_t record, uint64_t len, uint8_t* dst) override;
    std::atomic<BlockBase*> next{nullptr};
    std::atomic<uint64_t> hits{0};  // walks that started from a cached block

   private:
    const BlockCache* const cache_;
  };

  Store* const store_;
  Materializer materializer_;
  BlockCache cache_;
  CacheBase base_;
};

}  // namespace dte::fs
