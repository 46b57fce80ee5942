// Fp8Reader: the FP8 views of versions (store/fp8_view.h) as the mount
// serves them under fp8/, materialized lazily from the BF16 read path.
//
// A view is built the first time a version's fp8/ directory is used, from
// the version's safetensors headers, config.json and index (read through
// the ReadPath, so checked like any read), and kept among the most recently
// used kMaxViews; open files hold theirs. Reading a view file serves
//   - computed bytes (headers, JSON) from the view,
//   - unchanged bytes straight from the ReadPath (no copy),
//   - E4M3 bytes and scales from quantized block rows: block row r of a
//     tensor is its BF16 rows [r * block_rows, ...), read through the
//     ReadPath (every BF16 block hash-checked) and quantized with
//     kernels::Fp8Quantize; the result (bytes, then the row's scales) is
//     kept in the mount's BlockCache under a slot of its own (kFp8SlotBase),
//     so a row is quantized once while it stays cached, for its weight
//     bytes and its scales alike, and concurrent readers wait for one load.
// A failing BF16 read, or a block holding NaN or infinity, fails the read
// (nothing partly quantized is served).
//
// Thread-safety: all methods may be called concurrently.
#pragma once

#include <atomic>
#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "fs/read_path.h"
#include "store/base/thread_annotations.h"
#include "store/fp8_view.h"

namespace dte::fs {

// Cache slots of quantized block rows: kFp8SlotBase | tensor << 32 | row
// (a tensor index of the view, a block row). The ReadPath's own slots are
// block records (below 2^32) and kFileSlotBase + file, so none collide.
inline constexpr uint64_t kFp8SlotBase = uint64_t{1} << 63;

// One version's view as the mount serves it.
struct Fp8Mounted {
  std::shared_ptr<const Version> version;
  Fp8View view;
  std::vector<BlockCache::Value> texts;  // by file: the bytes kText parts point into
};

struct Fp8ReaderStats {
  uint64_t views_built = 0, view_failures = 0;
  uint64_t rows_quantized = 0;  // block rows quantized (cache misses)
  uint64_t row_hits = 0;        // block rows found in the cache
  uint64_t bf16_bytes_read = 0, fp8_bytes_made = 0;
  uint64_t quantize_ns = 0;  // time in Fp8Quantize
};

class Fp8Reader {
 public:
  static constexpr size_t kMaxViews = 64;

  Fp8Reader(ReadPath* reader, Fp8ViewOptions options) : reader_(reader), options_(options) {}

  const Fp8ViewOptions& options() const { return options_; }

  // The view of v (chain: v's ancestors, as for ReadPath). Errors: the
  // view's refusal (InvalidArgument, naming the version and file), or the
  // read of a header or JSON file.
  Result<std::shared_ptr<const Fp8Mounted>> ViewOf(const std::shared_ptr<const Version>& v,
                                                   const VersionChain* chain) EXCLUDES(mu_);

  // [offset, offset + len) of view file `file` (within the file) appended
  // to *out as pieces, as ReadPath::ReadPieces.
  Status ReadPieces(const Fp8Mounted& m, uint32_t file, uint64_t offset, uint64_t len,
                    const VersionChain* chain, std::vector<ReadPath::Piece>* out);

  Fp8ReaderStats Stats() const;

 private:
  Result<std::shared_ptr<const Fp8Mounted>> Build(const std::shared_ptr<const Version>& v,
                                                  const VersionChain* chain);
  // Quantized block row `row` of tensor `tensor` of the view: rows x cols
  // E4M3 bytes, then grid_cols FP32 scales.
  Result<BlockCache::Value> BlockRow(const Fp8Mounted& m, uint32_t tensor, uint64_t row,
                                     const VersionChain* chain);
  Result<BlockCache::Value> QuantizeRow(const Fp8Mounted& m, const Fp8Tensor& t, uint64_t row,
                                        const VersionChain* chain);
  // The pieces of a kWeight or kScale part within [lo, hi) of the file.
  Status TensorPieces(const Fp8Mounted& m, const Fp8Part& p, uint64_t lo, uint64_t hi,
                      const VersionChain* chain, std::vector<ReadPath::Piece>* out);

  ReadPath* const reader_;
  const Fp8ViewOptions options_;

  using ViewKey = std::pair<uint64_t, uint32_t>;  // version, revision
  Mutex mu_;
  std::map<ViewKey, std::shared_ptr<const Fp8Mounted>> views_ GUARDED_BY(mu_);
  std::list<ViewKey> order_ GUARDED_BY(mu_);  // most recently built last

  std::atomic<uint64_t> views_built_{0}, view_failures_{0}, rows_quantized_{0}, row_hits_{0};
  std::atomic<uint64_t> bf16_bytes_{0}, fp8_bytes_{0}, quantize_ns_{0};
};

}  // namespace dte::fs
