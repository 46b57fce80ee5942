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
      : store_(store), materializer_(store), cache_(cache_bytes) {}

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

  VersionChain ChainOf(const std::shared_ptr<const Version>& v) { return materializer_.ChainOf(v); }

  // Blocks are looked up in `base` during chain walks (Materializer::SetBase).
  void SetBase(BlockBase* base) { materializer_.SetBase(base); }

  ReadCounters& counters() { return materializer_.counters(); }
  Materializer& materializer() { return materializer_; }
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

  Store* const store_;
  Materializer materializer_;
  BlockCache cache_;
};

}  // namespace dte::fs
