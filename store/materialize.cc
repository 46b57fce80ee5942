#include "store/materialize.h"

#include <algorithm>
#include <cstring>
#include <future>
#include <optional>
#include <vector>

#include "kernels/parallel.h"
#include "store/cached_store.h"

namespace dte {
namespace {

std::string BlockWhat(const Version& v, const FileEntry& f, const TensorEntry& t, uint32_t b) {
  return VersionName(v.manifest.version) + "/" + f.name + " tensor \"" + t.name + "\" block " +
         std::to_string(b);
}

struct ChainLink {
  std::shared_ptr<const Version> version;
  const BlockRecord* record;
};

// Per-thread decode buffers, so the hot path does not allocate per block.
struct ThreadBuffers {
  CodecScratch scratch;
  std::string payload;
};

ThreadBuffers& Buffers() {
  thread_local ThreadBuffers buffers;
  return buffers;
}

}  // namespace

Result<std::string> Materializer::ReadWholeBlob(const Hash128& blob, uint64_t size,
                                                const std::string& what) {
  auto bytes = store_->objects().Get(BlobKey(blob));
  if (!bytes.ok()) return bytes.status().WithContext(what);
  if (bytes->size() != size || HashBytes(bytes->data(), bytes->size()) != blob) {
    return Corruption(what + ": blob " + blob.Hex() + " does not match its hash (" +
                      std::to_string(bytes->size()) + " bytes, expected " + std::to_string(size) +
                      ")");
  }
  return bytes;
}

Status Materializer::ReadRecord(const Version& v, const BlockRecord& rec, std::string* out,
                                const std::string& what) {
  out->resize(rec.length);
  const BlobRef& blob = v.manifest.blobs[rec.blob];
  Status s = store_->objects().ReadRange(BlobKey(blob.hash), rec.offset, rec.length, out->data());
  counters_.payload_bytes += rec.length;
  return s.WithContext(what);
}

Status Materializer::ReadDense(const std::vector<BlobRef>& blobs, const BlockRecord& rec, int width,
                               uint8_t* dst, uint64_t len, const std::string& what) {
  if (rec.kind == BlockKind::kDenseRaw) {
    if (rec.length != len) return Corruption(what + ": dense record has the wrong length");
    RETURN_IF_ERROR(store_->objects()
                        .ReadRange(BlobKey(blobs[rec.blob].hash), rec.offset, rec.length, dst)
                        .WithContext(what));
    counters_.payload_bytes += rec.length;
  } else {
    ThreadBuffers& b = Buffers();
    b.payload.resize(rec.length);
    RETURN_IF_ERROR(
        store_->objects()
            .ReadRange(BlobKey(blobs[rec.blob].hash), rec.offset, rec.length, b.payload.data())
            .WithContext(what));
    counters_.payload_bytes += rec.length;
    RETURN_IF_ERROR(DecodeBlock(rec.kind, b.payload, width, dst, len, &b.scratch, what));
  }
  counters_.records++;
  return Status::Ok();
}

VersionChain Materializer::ChainOf(std::shared_ptr<const Version> v, bool stop_at_joins) {
  VersionChain chain;
  while (v) {
    chain.push_back(v);
    // A self-contained version, or one with a join table, ends every chain
    // walk (ReadBlock).
    if (v->manifest.self_contained() || (stop_at_joins && store_->JoinOf(*v))) break;
    auto parent = store_->GetVersion(*v->manifest.parent);
    v = parent.ok() ? *parent : nullptr;
  }
  return chain;
}

Result<std::shared_ptr<const Version>> Materializer::ParentOf(const Version& cur, size_t depth,
                                                              const VersionChain* chain) {
  if (chain && depth < chain->size() && (*chain)[depth]->manifest.version == *cur.manifest.parent) {
    return (*chain)[depth];
  }
  return store_->GetVersion(*cur.manifest.parent);
}

Status Materializer::ReadBlock(const std::shared_ptr<const Version>& v, const FileEntry& file,
                               const TensorEntry& tensor, uint32_t block, uint8_t* dst,
                               const VersionChain* chain) {
  std::optional<uint64_t> from_join;
  Status s = WalkBlock(v, file, tensor, block, dst, chain, /*use_joins=*/true, &from_join);
  if (s.code() != Code::kCorruption) return s;
  if (from_join) {
    // A join table is only a shortcut: one whose record did not make the
    // block is forgotten, and the block is read along the deltas.
    store_->DropJoin(*from_join);
    s = WalkBlock(v, file, tensor, block, dst, chain, /*use_joins=*/false, &from_join);
    if (s.code() != Code::kCorruption) return s;
  }
  // Bytes damaged on the way in (a ranged read is checked by the block hash
  // alone) or in the blob cache are not a corrupt blob: the block is read
  // once more from the store, past the cache, before a blob is called so.
  DropCachedRecords(v, size_t{tensor.first_block} + block, chain);
  s = WalkBlock(v, file, tensor, block, dst, chain, /*use_joins=*/false, &from_join);
  if (s.code() != Code::kCorruption) return s;
  return Status(s.code(), s.message() + " (read twice from the store)");
}

void Materializer::DropCachedRecords(const std::shared_ptr<const Version>& v, size_t record,
                                     const VersionChain* chain) {
  CachedStore* cache = store_->blob_cache();
  if (!cache) return;  // every read goes to the store
  if (chain && (chain->empty() || chain->front() != v)) chain = nullptr;
  std::shared_ptr<const Version> cur = v;
  for (size_t depth = 1; cur && record < cur->records.size(); ++depth) {
    const BlockRecord& rec = cur->records[record];
    if (rec.kind != BlockKind::kSame) {
      cache->Drop(BlobKey(cur->manifest.blobs[rec.blob].hash), rec.offset, rec.length);
    }
    if (rec.kind == BlockKind::kDenseRaw || rec.kind == BlockKind::kDenseZstd) break;
    if (!cur->manifest.parent) break;
    auto parent = ParentOf(*cur, depth, chain);
    cur = parent.ok() ? *parent : nullptr;
  }
}

Status Materializer::WalkBlock(const std::shared_ptr<const Version>& v, const FileEntry& file,
                               const TensorEntry& tensor, uint32_t block, uint8_t* dst,
                               const VersionChain* chain, bool use_joins,
                               std::optional<uint64_t>* from_join) {
  const uint64_t bb = v->manifest.block_bytes;
  const size_t r = size_t{tensor.first_block} + block;
  if (block >= tensor.blocks || r >= v->records.size()) {
    return InvalidArgument(BlockWhat(*v, file, tensor, block) + ": no such block");
  }
  const uint64_t len = std::min<uint64_t>(bb, tensor.bytes() - uint64_t{block} * bb);
  const int width = DTypeWidth(tensor.dtype);
  BlockBase* const base = base_.load();
  // Walk back to the nearest version the base holds, that has a dense
  // record, or that has a full table, remembering the sparse records on the
  // way.
  std::vector<ChainLink> sparse;
  std::shared_ptr<const Version> cur = v;
  if (chain && (chain->empty() || chain->front() != v)) chain = nullptr;
  for (size_t depth = 1;; ++depth) {
    // Stores are untrusted: a parent must cut its data into the same blocks,
    // and no record may fill more than the block it stands for.
    if (cur->records.size() != v->records.size() ||
        cur->manifest.block_bytes != v->manifest.block_bytes) {
      return Corruption(BlockWhat(*v, file, tensor, block) + ": parent " +
                        VersionName(cur->manifest.version) + " has a different layout");
    }
    if (base && base->ReadBlock(*cur, r, len, dst)) {
      counters_.base_blocks++;
      // The base checked the block against v's own hash: nothing to apply
      // and nothing left to check.
      if (cur == v) {
        counters_.blocks++;
        return Status::Ok();
      }
      break;
    }
    const BlockRecord& rec = cur->records[r];
    const std::string what = BlockWhat(*cur, file, tensor, block);
    if (rec.kind == BlockKind::kDenseRaw || rec.kind == BlockKind::kDenseZstd) {
      RETURN_IF_ERROR(ReadDense(cur->manifest.blobs, rec, width, dst, len, what));
      break;
    }
    if (!cur->manifest.parent) return Corruption(what + ": no dense record in its chain");
    // A policy anchor that kept its delta, or a version with a join table:
    // one record onto the parent's block where the base holds that, else
    // its own full record. A join table that a writer pruned meanwhile (its
    // blobs are gone) or that is damaged is dropped and the walk goes on.
    const bool full = !cur->full_records.empty();
    std::shared_ptr<const LoadedJoin> join;
    if (!full && use_joins) join = store_->JoinOf(*cur);
    if (full || join) {
      auto parent = ParentOf(*cur, depth, chain);
      if (base && parent.ok() && base->ReadBlock(**parent, r, len, dst)) {
        counters_.base_blocks++;
        if (rec.kind == BlockKind::kSparse) sparse.push_back({cur, &rec});
        break;
      }
      if (full) {
        RETURN_IF_ERROR(ReadDense(cur->manifest.full->blobs, cur->full_records[r], width, dst, len,
                                  what + " (full table)"));
        break;
      }
      Status read = ReadDense(join->join.table.blobs, join->records[r], width, dst, len,
                              what + " (join table)");
      if (read.ok()) {
        counters_.join_blocks++;
        *from_join = cur->manifest.version;
        break;
      }
      if (read.code() != Code::kNotFound && read.code() != Code::kCorruption) return read;
      store_->DropJoin(cur->manifest.version);
    }
    if (rec.kind == BlockKind::kSparse) sparse.push_back({cur, &rec});
    ASSIGN_OR_RETURN(cur, ParentOf(*cur, depth, chain));
  }
  ThreadBuffers& b = Buffers();
  for (auto it = sparse.rbegin(); it != sparse.rend(); ++it) {
    std::string what = BlockWhat(*it->version, file, tensor, block);
    RETURN_IF_ERROR(ReadRecord(*it->version, *it->record, &b.payload, what));
    RETURN_IF_ERROR(DecodeBlock(BlockKind::kSparse, b.payload, width, dst, len, &b.scratch, what));
    counters_.records++;
  }
  counters_.blocks++;
  if (HashBlock(dst, len) != v->records[r].hash) {
    counters_.hash_failures++;
    return Corruption(BlockWhat(*v, file, tensor, block) +
                      ": materialized bytes do not match the block hash (a blob is corrupt)");
  }
  return Status::Ok();
}

Status Materializer::ReadFullBlock(const std::shared_ptr<const Version>& v, const FileEntry& file,
                                   const TensorEntry& tensor, uint32_t block, uint8_t* dst) {
  const size_t r = size_t{tensor.first_block} + block;
  if (!v->manifest.full || r >= v->full_records.size()) {
    return InvalidArgument(BlockWhat(*v, file, tensor, block) + " (full table): no such record");
  }
  return ReadStandalone(*v, v->manifest.full->blobs, v->full_records, file, tensor, block, dst,
                        " (full table)");
}

Status Materializer::ReadJoinBlock(const std::shared_ptr<const Version>& v, const LoadedJoin& join,
                                   const FileEntry& file, const TensorEntry& tensor, uint32_t block,
                                   uint8_t* dst) {
  return ReadStandalone(*v, join.join.table.blobs, join.records, file, tensor, block, dst,
                        " (join table)");
}

Status Materializer::ReadStandalone(const Version& v, const std::vector<BlobRef>& blobs,
                                    const std::vector<BlockRecord>& records, const FileEntry& file,
                                    const TensorEntry& tensor, uint32_t block, uint8_t* dst,
                                    const char* table) {
  const size_t r = size_t{tensor.first_block} + block;
  const std::string what = BlockWhat(v, file, tensor, block) + table;
  if (block >= tensor.blocks || r >= records.size() || r >= v.records.size()) {
    return InvalidArgument(what + ": no such record");
  }
  const uint64_t bb = v.manifest.block_bytes;
  const uint64_t len = std::min<uint64_t>(bb, tensor.bytes() - uint64_t{block} * bb);
  RETURN_IF_ERROR(ReadDense(blobs, records[r], DTypeWidth(tensor.dtype), dst, len, what));
  counters_.blocks++;
  if (HashBlock(dst, len) != v.records[r].hash) {
    counters_.hash_failures++;
    return Corruption(what + ": bytes do not match the block hash (a blob is corrupt)");
  }
  return Status::Ok();
}

Status Materializer::ReadData(const std::shared_ptr<const Version>& v, const FileEntry& file,
                              uint64_t offset, uint64_t len, uint8_t* dst) {
  const uint64_t bb = v->manifest.block_bytes;
  // First tensor ending after offset (tensors are contiguous and sorted).
  auto it = std::upper_bound(file.tensors.begin(), file.tensors.end(), offset,
                             [](uint64_t off, const TensorEntry& t) { return off < t.end; });
  std::vector<uint8_t> buf;
  const uint64_t stop = offset + len;
  for (; it != file.tensors.end() && it->begin < stop; ++it) {
    const TensorEntry& t = *it;
    uint64_t from = std::max(offset, t.begin) - t.begin;  // tensor-relative
    uint64_t to = std::min(stop, t.end) - t.begin;
    for (uint64_t b = from / bb; b * bb < to; ++b) {
      uint64_t blen = std::min(bb, t.bytes() - b * bb);
      uint64_t lo = std::max(from, b * bb), hi = std::min(to, b * bb + blen);
      uint8_t* out = dst + (t.begin + lo - offset);
      if (lo == b * bb && hi == b * bb + blen) {
        RETURN_IF_ERROR(ReadBlock(v, file, t, static_cast<uint32_t>(b), out));
      } else {
        buf.resize(blen);
        RETURN_IF_ERROR(ReadBlock(v, file, t, static_cast<uint32_t>(b), buf.data()));
        std::memcpy(out, buf.data() + (lo - b * bb), hi - lo);
      }
    }
  }
  return Status::Ok();
}

Status Materializer::ReadFile(const std::shared_ptr<const Version>& v, const FileEntry& file,
                              uint64_t offset, uint64_t len, uint8_t* dst) {
  if (offset > file.size || len > file.size - offset) {
    return InvalidArgument(VersionName(v->manifest.version) + "/" + file.name +
                           ": read beyond the end of the file");
  }
  std::string what = VersionName(v->manifest.version) + "/" + file.name;
  if (!file.safetensors) {
    ASSIGN_OR_RETURN(std::string bytes, ReadWholeBlob(file.blob, file.size, what));
    std::memcpy(dst, bytes.data() + offset, len);
    return Status::Ok();
  }
  if (offset < file.header_size) {
    ASSIGN_OR_RETURN(std::string header,
                     ReadWholeBlob(file.header_blob, file.header_size, what + " header"));
    uint64_t n = std::min(len, file.header_size - offset);
    std::memcpy(dst, header.data() + offset, n);
    offset += n;
    len -= n;
    dst += n;
  }
  if (len == 0) return Status::Ok();
  return ReadData(v, file, offset - file.header_size, len, dst);
}

namespace {

constexpr uint64_t kStreamChunk = 16 << 20;

struct ChunkItem {
  const TensorEntry* tensor;
  uint32_t block;
  uint64_t at;  // offset in the chunk buffer
};

// Checks tensor hashes as consecutive data arrives, tensor by tensor.
class TensorHashChecker {
 public:
  TensorHashChecker(const Version& v, const FileEntry& f) : v_(v), f_(f) {}

  // Feeds bytes [offset, offset+len) of the data section.
  Status Feed(uint64_t offset, const uint8_t* data, uint64_t len) {
    while (next_ < f_.tensors.size() && (len > 0 || f_.tensors[next_].bytes() == 0)) {
      const TensorEntry& t = f_.tensors[next_];
      uint64_t n = std::min(len, t.end - offset);
      hasher_.Update(data, n);
      data += n;
      offset += n;
      len -= n;
      if (offset < t.end) break;
      if (hasher_.Finish() != t.hash) {
        return Corruption(VersionName(v_.manifest.version) + "/" + f_.name + " tensor \"" + t.name +
                          "\": content does not match the tensor hash");
      }
      hasher_ = Hasher128();
      ++next_;
    }
    return Status::Ok();
  }

 private:
  const Version& v_;
  const FileEntry& f_;
  size_t next_ = 0;
  Hasher128 hasher_;
};

}  // namespace

Status Materializer::StreamData(const std::shared_ptr<const Version>& v, const FileEntry& file,
                                const Sink& sink, bool check_tensor_hashes) {
  const uint64_t bb = v->manifest.block_bytes;
  // Two buffers: the sink consumes one chunk (on its own thread) while the
  // pool materializes the next into the other.
  std::vector<uint8_t> bufs[2];
  int cur = 0;
  std::future<Status> pending;
  auto drain = [&]() { return pending.valid() ? pending.get() : Status::Ok(); };
  std::vector<ChunkItem> items;
  TensorHashChecker checker(*v, file);
  size_t t = 0;
  uint32_t b = 0;
  uint64_t pos = 0;
  Status s;
  while (s.ok()) {
    // Gather whole blocks, across tensors, until the chunk is full.
    items.clear();
    uint64_t len = 0;
    for (; t < file.tensors.size(); ++t, b = 0) {
      const TensorEntry& te = file.tensors[t];
      for (; b < te.blocks; ++b) {
        uint64_t blen = std::min(bb, te.bytes() - uint64_t{b} * bb);
        if (len > 0 && len + blen > kStreamChunk) break;
        items.push_back({&te, b, len});
        len += blen;
      }
      if (b < te.blocks) break;
    }
    if (items.empty()) break;
    std::vector<uint8_t>& chunk = bufs[cur];
    chunk.resize(len);
    std::vector<Status> errors(items.size());
    kernels::ParallelFor(items.size(), 1, [&](size_t lo, size_t hi) {
      for (size_t i = lo; i < hi; ++i) {
        errors[i] =
            ReadBlock(v, file, *items[i].tensor, items[i].block, chunk.data() + items[i].at);
      }
    });
    for (const auto& e : errors) {
      if (s.ok()) s = e;
    }
    if (s.ok() && check_tensor_hashes) s = checker.Feed(pos, chunk.data(), len);
    Status previous = drain();
    if (s.ok()) s = previous;
    if (!s.ok()) break;
    const uint64_t at = file.header_size + pos;
    pending = std::async(std::launch::async,
                         [&sink, &chunk, at, len]() { return sink(at, chunk.data(), len); });
    pos += len;
    cur ^= 1;
  }
  Status last = drain();  // never leave the sink running on our buffers
  RETURN_IF_ERROR(s);
  RETURN_IF_ERROR(last);
  // Zero-size tensors at the end have hashes too.
  return check_tensor_hashes ? checker.Feed(pos, nullptr, 0) : Status::Ok();
}

Status Materializer::StreamFile(const std::shared_ptr<const Version>& v, const FileEntry& file,
                                const Sink& sink, bool check_tensor_hashes) {
  std::string what = VersionName(v->manifest.version) + "/" + file.name;
  if (!file.safetensors) {
    ASSIGN_OR_RETURN(std::string bytes, ReadWholeBlob(file.blob, file.size, what));
    return sink(0, reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
  }
  ASSIGN_OR_RETURN(std::string header,
                   ReadWholeBlob(file.header_blob, file.header_size, what + " header"));
  RETURN_IF_ERROR(sink(0, reinterpret_cast<const uint8_t*>(header.data()), header.size()));
  return StreamData(v, file, sink, check_tensor_hashes);
}

}  // namespace dte
