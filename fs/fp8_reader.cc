#include "fs/fp8_reader.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <optional>
#include <string>

#include "kernels/parallel.h"

namespace dte::fs {
namespace {

// The whole of raw file `name` of v, if it has one.
Result<std::optional<std::string>> ReadRawFile(ReadPath* reader,
                                               const std::shared_ptr<const Version>& v,
                                               std::string_view name, const VersionChain* chain) {
  const auto& files = v->manifest.files;
  for (uint32_t i = 0; i < files.size(); ++i) {
    if (files[i].name != name || files[i].safetensors) continue;
    std::string bytes(files[i].size, '\0');
    RETURN_IF_ERROR(
        reader->Read(v, i, 0, bytes.size(), reinterpret_cast<uint8_t*>(bytes.data()), chain));
    return std::optional<std::string>(std::move(bytes));
  }
  return std::optional<std::string>();
}

// The refusal of block row `row` of t (whose BF16 rows are `bf16`), naming
// the first non-finite element by its row and column in the whole tensor
// (Fp8Quantize's `refusal` numbers blocks within the row).
Status NonFinite(const Fp8Mounted& m, const Fp8Tensor& t, uint64_t row, const uint16_t* bf16,
                 const std::string& refusal) {
  const uint64_t first = row * t.layout.block_rows;
  for (uint64_t i = 0; i < t.RowsOf(row) * t.layout.cols; ++i) {
    if ((bf16[i] & 0x7F80) != 0x7F80) continue;
    return IOError("FP8 view of " + VersionName(m.version->manifest.version) + ": tensor '" +
                   t.name + "' holds a NaN or infinite weight at element (" +
                   std::to_string(first + i / t.layout.cols) + ", " +
                   std::to_string(i % t.layout.cols) + "), in block row " + std::to_string(row) +
                   " (rows " + std::to_string(first) + ".." +
                   std::to_string(first + t.RowsOf(row) - 1) +
                   "); FP8 quantization refuses non-finite weights");
  }
  return IOError("FP8 view of " + VersionName(m.version->manifest.version) + ": " + refusal);
}

// Block rows of up to this many BF16 elements (8 MiB) are read into a buffer
// of the reading thread kept between calls; larger ones (wide tensors with
// large --fp8-block) into one freed after the row, so no thread keeps more.
constexpr uint64_t kKeptRowElements = uint64_t{4} << 20;

// A buffer for at least n BF16 elements, not zero-filled: this thread's kept
// one (allocating and faulting in fresh pages for every row cost more than
// copying into warm ones) or, above kKeptRowElements, its own.
class RowBuffer {
 public:
  explicit RowBuffer(uint64_t n) {
    thread_local std::unique_ptr<uint16_t[]> kept;
    thread_local uint64_t kept_size = 0;
    if (n > kKeptRowElements) {
      own_.reset(new uint16_t[n]);
      data_ = own_.get();
      return;
    }
    if (kept_size < n) {
      kept.reset(new uint16_t[kKeptRowElements]);
      kept_size = kKeptRowElements;
    }
    data_ = kept.get();
  }
  uint16_t* data() const { return data_; }

 private:
  std::unique_ptr<uint16_t[]> own_;
  uint16_t* data_ = nullptr;
};

// Block row `row` of view tensor `tensor` is cached under kFp8SlotBase |
// tensor << 32 | row: refuse a view whose numbers would not fit (2^31
// tensors, or 2^32 block rows in one tensor with a tiny block), rather than
// let two rows share a cache slot.
Status CheckSlots(const Fp8View& view, uint64_t version) {
  if (view.tensors().size() >= (uint64_t{1} << 31)) {
    return InvalidArgument("FP8 view of " + VersionName(version) + ": " +
                           std::to_string(view.tensors().size()) +
                           " tensors, more than it can hold");
  }
  for (const Fp8Tensor& t : view.tensors()) {
    if (t.layout.grid_rows() >= (uint64_t{1} << 32)) {
      return InvalidArgument("FP8 view of " + VersionName(version) + ": " + t.name + " has " +
                             std::to_string(t.layout.grid_rows()) +
                             " block rows, more than it can hold (use a larger --fp8-block)");
    }
  }
  return Status::Ok();
}

}  // namespace

Result<std::shared_ptr<const Fp8Mounted>> Fp8Reader::ViewOf(const std::shared_ptr<const Version>& v,
                                                            const VersionChain* chain) {
  const ViewKey key{v->manifest.version, v->manifest.revision};
  {
    MutexLock lock(&mu_);
    auto it = views_.find(key);
    if (it != views_.end()) return it->second;
  }
  // Two threads may build the same view at once; both results are equal and
  // the first one stored wins.
  Result<std::shared_ptr<const Fp8Mounted>> built = Build(v, chain);
  if (!built.ok()) {
    view_failures_++;
    return built;
  }
  views_built_++;
  MutexLock lock(&mu_);
  auto [it, inserted] = views_.try_emplace(key, *built);
  if (inserted) {
    order_.push_back(key);
    while (order_.size() > kMaxViews) {
      views_.erase(order_.front());
      order_.pop_front();
    }
  }
  return it->second;
}

Result<std::shared_ptr<const Fp8Mounted>> Fp8Reader::Build(const std::shared_ptr<const Version>& v,
                                                           const VersionChain* chain) {
  const Manifest& manifest = v->manifest;
  Fp8ViewSource source;
  source.manifest = &manifest;
  source.headers.resize(manifest.files.size());
  for (uint32_t i = 0; i < manifest.files.size(); ++i) {
    const FileEntry& f = manifest.files[i];
    if (!f.safetensors) continue;
    source.headers[i].resize(f.header_size);
    RETURN_IF_ERROR(reader_->Read(v, i, 0, f.header_size,
                                  reinterpret_cast<uint8_t*>(source.headers[i].data()), chain));
  }
  ASSIGN_OR_RETURN(source.config, ReadRawFile(reader_, v, kConfigFile, chain));
  ASSIGN_OR_RETURN(source.index, ReadRawFile(reader_, v, kIndexFile, chain));
  ASSIGN_OR_RETURN(Fp8View view, Fp8View::Build(source, options_));
  RETURN_IF_ERROR(CheckSlots(view, manifest.version));
  auto m = std::make_shared<Fp8Mounted>();
  m->version = v;
  m->view = std::move(view);
  for (const Fp8ViewFile& f : m->view.files()) {
    m->texts.push_back(std::make_shared<const Bytes>(std::string(f.text)));
  }
  return std::shared_ptr<const Fp8Mounted>(std::move(m));
}

Result<BlockCache::Value> Fp8Reader::QuantizeRow(const Fp8Mounted& m, const Fp8Tensor& t,
                                                 uint64_t row, const VersionChain* chain) {
  const uint64_t rows = t.RowsOf(row);
  const uint64_t cols = t.layout.cols;
  const RowBuffer buffer(rows * cols);
  uint16_t* bf16 = buffer.data();
  RETURN_IF_ERROR(reader_->Read(m.version, t.file,
                                t.source_offset + row * t.layout.block_rows * cols * 2,
                                rows * cols * 2, reinterpret_cast<uint8_t*>(bf16), chain));
  kernels::Fp8Layout layout = t.layout;
  layout.rows = rows;
  const uint64_t scales = layout.grid_cols();
  auto out = std::make_shared<Bytes>(rows * cols + scales * sizeof(float));
  auto* q = reinterpret_cast<uint8_t*>(out->mutable_data());
  std::vector<float> scale(scales);
  const auto start = std::chrono::steady_clock::now();
  std::string refusal = kernels::Fp8Quantize(layout, bf16, q, scale.data(), t.name);
  quantize_ns_ += static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start)
          .count());
  if (!refusal.empty()) return NonFinite(m, t, row, bf16, refusal);
  std::memcpy(q + rows * cols, scale.data(), scales * sizeof(float));
  rows_quantized_++;
  bf16_bytes_ += rows * cols * 2;
  fp8_bytes_ += out->size();
  return std::shared_ptr<const Bytes>(std::move(out));
}

Result<BlockCache::Value> Fp8Reader::BlockRow(const Fp8Mounted& m, uint32_t tensor, uint64_t row,
                                              const VersionChain* chain) {
  const Manifest& manifest = m.version->manifest;
  const CacheKey key{manifest.version, kFp8SlotBase | (uint64_t{tensor} << 32) | row,
                     manifest.revision};
  row_hits_++;  // less the loads, below
  return reader_->cache().GetOrLoad(key, [&]() -> Result<BlockCache::Value> {
    row_hits_--;
    return QuantizeRow(m, m.view.tensors()[tensor], row, chain);
  });
}

Status Fp8Reader::TensorPieces(const Fp8Mounted& m, const Fp8Part& p, uint64_t lo, uint64_t hi,
                               const VersionChain* chain, std::vector<ReadPath::Piece>* out) {
  const Fp8Tensor& t = m.view.tensors()[p.tensor];
  const bool weight = p.kind == Fp8PartKind::kWeight;
  // Bytes of one block row in this part.
  const uint64_t per_row =
      weight ? t.layout.block_rows * t.layout.cols : t.layout.grid_cols() * sizeof(float);
  // The block rows of the range, quantized in parallel on the CPU backend's
  // pool when there are several (a 1 MiB read of a 4096-column weight
  // spans two), as ReadPath materializes the blocks of one read.
  const uint64_t first = (lo - p.begin) / per_row;
  std::vector<std::optional<Result<BlockCache::Value>>> got((hi - p.begin - 1) / per_row - first +
                                                            1);
  auto load = [&](size_t i) { got[i].emplace(BlockRow(m, p.tensor, first + i, chain)); };
  if (got.size() > 1) {
    kernels::ParallelFor(got.size(), 1, [&](size_t begin, size_t end) {
      for (size_t i = begin; i < end; ++i) load(i);
    });
  } else {
    load(0);
  }
  uint64_t at = lo - p.begin;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!got[i]->ok()) return got[i]->status();
    const BlockCache::Value& value = **got[i];
    const uint64_t row = first + i;
    const uint64_t row_begin = row * per_row;
    const uint64_t row_size = weight ? t.RowsOf(row) * t.layout.cols : per_row;
    const uint64_t n = std::min(row_begin + row_size, hi - p.begin) - at;
    const uint64_t base = weight ? 0 : t.RowsOf(row) * t.layout.cols;
    out->push_back({value, value->data() + base + (at - row_begin), static_cast<size_t>(n)});
    at += n;
  }
  return Status::Ok();
}

Status Fp8Reader::ReadPieces(const Fp8Mounted& m, uint32_t file, uint64_t offset, uint64_t len,
                             const VersionChain* chain, std::vector<ReadPath::Piece>* out) {
  const uint64_t stop = offset + len;
  for (const Fp8Part& p : m.view.PartsAt(file, offset, len)) {
    const uint64_t lo = std::max(offset, p.begin);
    const uint64_t hi = std::min(stop, p.end());
    switch (p.kind) {
      case Fp8PartKind::kText: {
        const BlockCache::Value& text = m.texts[file];
        out->push_back(
            {text, text->data() + p.source_offset + (lo - p.begin), static_cast<size_t>(hi - lo)});
        break;
      }
      case Fp8PartKind::kCopy:
        RETURN_IF_ERROR(reader_->ReadPieces(m.version, file, p.source_offset + (lo - p.begin),
                                            hi - lo, out, chain));
        break;
      case Fp8PartKind::kWeight:
      case Fp8PartKind::kScale:
        RETURN_IF_ERROR(TensorPieces(m, p, lo, hi, chain, out));
        break;
    }
  }
  return Status::Ok();
}

Fp8ReaderStats Fp8Reader::Stats() const {
  Fp8ReaderStats s;
  s.views_built = views_built_.load();
  s.view_failures = view_failures_.load();
  s.rows_quantized = rows_quantized_.load();
  s.row_hits = row_hits_.load();
  s.bf16_bytes_read = bf16_bytes_.load();
  s.fp8_bytes_made = fp8_bytes_.load();
  s.quantize_ns = quantize_ns_.load();
  return s;
}

}  // namespace dte::fs
