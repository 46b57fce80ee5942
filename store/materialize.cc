#include "store/materialize.h"

#include "kernels/parallel.h"

#include <algorithm>
#include <cstring>
#include <vector>

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

}  // namespace

Result<std::string> Materializer::ReadWholeBlob(const Hash128& blob, uint64_t size,
                                                const std::string& what) {
  auto bytes = store_->objects().Get(BlobKey(blob));
  if (!bytes.ok()) return bytes.status().WithContext(what);
  if (bytes->size() != size || HashBytes(bytes->data(), bytes->size()) != blob) {
    return Corruption(what + ": blob " + blob.Hex() + " does not match its hash (" +
                      std::to_string(bytes->size()) + " bytes, expected " +
                      std::to_string(size) + ")");
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

Status Materializer::ReadBlock(const std::shared_ptr<const Version>& v, const FileEntry& file,
                               const TensorEntry& tensor, uint32_t block, uint8_t* dst) {
  const uint64_t bb = v->manifest.block_bytes;
  const uint64_t len = std::min<uint64_t>(bb, tensor.bytes() - uint64_t{block} * bb);
  const int width = DTypeWidth(tensor.dtype);
  const size_t r = size_t{tensor.first_block} + block;
  // Walk back to the nearest dense record, remembering sparse ones.
  std::vector<ChainLink> sparse;
  std::shared_ptr<const Version> cur = v;
  thread_local CodecScratch scratch;
  thread_local std::string payload;
  while (true) {
    if (cur->records.size() != v->records.size()) {
      return Corruption(BlockWhat(*v, file, tensor, block) + ": parent " +
                        VersionName(cur->manifest.version) + " has a different layout");
    }
    const BlockRecord& rec = cur->records[r];
    if (rec.kind == BlockKind::kDenseRaw || rec.kind == BlockKind::kDenseZstd) {
      std::string what = BlockWhat(*cur, file, tensor, block);
      if (rec.kind == BlockKind::kDenseRaw) {
        const BlobRef& blob = cur->manifest.blobs[rec.blob];
        RETURN_IF_ERROR(store_->objects()
                            .ReadRange(BlobKey(blob.hash), rec.offset, rec.length, dst)
                            .WithContext(what));
        counters_.payload_bytes += rec.length;
      } else {
        RETURN_IF_ERROR(ReadRecord(*cur, rec, &payload, what));
        RETURN_IF_ERROR(DecodeBlock(rec.kind, payload, width, dst, len, &scratch, what));
      }
      counters_.records++;
      break;
    }
    if (rec.kind == BlockKind::kSparse) sparse.push_back({cur, &rec});
    if (!cur->manifest.parent) {
      return Corruption(BlockWhat(*cur, file, tensor, block) + ": no dense record in its chain");
    }
    ASSIGN_OR_RETURN(cur, store_->GetVersion(*cur->manifest.parent));
  }
  for (auto it = sparse.rbegin(); it != sparse.rend(); ++it) {
    std::string what = BlockWhat(*it->version, file, tensor, block);
    RETURN_IF_ERROR(ReadRecord(*it->version, *it->record, &payload, what));
    RETURN_IF_ERROR(DecodeBlock(BlockKind::kSparse, payload, width, dst, len, &scratch, what));
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
    ASSIGN_OR_RETURN(std::string header, ReadWholeBlob(file.header_blob, file.header_size,
                                                       what + " header"));
    uint64_t n = std::min(len, file.header_size - offset);
    std::memcpy(dst, header.data() + offset, n);
    offset += n;
    len -= n;
    dst += n;
  }
  if (len == 0) return Status::Ok();
  return ReadData(v, file, offset - file.header_size, len, dst);
}

Status Materializer::StreamTensor(const std::shared_ptr<const Version>& v, const FileEntry& file,
                                  const TensorEntry& t, const Sink& sink) {
  constexpr uint32_t kChunkBlocks = 64;
  const uint64_t bb = v->manifest.block_bytes;
  std::vector<uint8_t> chunk;
  Hasher128 hasher;
  for (uint32_t first = 0; first < t.blocks; first += kChunkBlocks) {
    uint32_t count = std::min(kChunkBlocks, t.blocks - first);
    uint64_t off = uint64_t{first} * bb;
    uint64_t len = std::min<uint64_t>(uint64_t{count} * bb, t.bytes() - off);
    chunk.resize(len);
    std::vector<Status> errors(count);
    kernels::ParallelFor(count, 1, [&](size_t lo, size_t hi) {
      for (size_t i = lo; i < hi; ++i) {
        errors[i] = ReadBlock(v, file, t, first + static_cast<uint32_t>(i), chunk.data() + i * bb);
      }
    });
    for (const auto& e : errors) RETURN_IF_ERROR(e);
    hasher.Update(chunk.data(), len);
    if (first + count == t.blocks && hasher.Finish() != t.hash) {
      return Corruption(VersionName(v->manifest.version) + "/" + file.name + " tensor \"" +
                        t.name + "\": content does not match the tensor hash");
    }
    RETURN_IF_ERROR(sink(file.header_size + t.begin + off, chunk.data(), len));
  }
  if (t.blocks == 0 && HashBytes(nullptr, 0) != t.hash) {
    return Corruption(VersionName(v->manifest.version) + "/" + file.name + " tensor \"" + t.name +
                      "\": empty tensor does not match the tensor hash");
  }
  return Status::Ok();
}

Status Materializer::StreamFile(const std::shared_ptr<const Version>& v, const FileEntry& file,
                                const Sink& sink) {
  std::string what = VersionName(v->manifest.version) + "/" + file.name;
  if (!file.safetensors) {
    ASSIGN_OR_RETURN(std::string bytes, ReadWholeBlob(file.blob, file.size, what));
    return sink(0, reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
  }
  ASSIGN_OR_RETURN(std::string header,
                   ReadWholeBlob(file.header_blob, file.header_size, what + " header"));
  RETURN_IF_ERROR(sink(0, reinterpret_cast<const uint8_t*>(header.data()), header.size()));
  for (const auto& t : file.tensors) RETURN_IF_ERROR(StreamTensor(v, file, t, sink));
  return Status::Ok();
}

}  // namespace dte
