// What a version changes in FP8 form (docs/fp8.md): per tensor that the FP8
// policy quantizes, the BF16 elements that differ from the parent's, and
// under each scale rule (plain, power of two) the E4M3 bytes and the block
// scales that differ. What `dtectl stats --fp8` prints (docs/cli.md).
//
// A version's changed elements come from store/changes.h (its records, and
// dense blocks compared with the parent's); the parent's and the version's
// BF16 content of one tensor at a time is materialized from the store
// (every block checked against its hash), and kernels::Fp8ChangesAt gives
// the FP8 change set from the changed elements. Memory: two BF16 copies of
// one tensor and its changed indices, whatever the model's size.
//
// Thread-safety: CountFp8Changes is a pure function. An Fp8StatsReader is
// used by one thread at a time (it runs its reads and the kernel on the
// process-wide pool, kernels/parallel.h).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "kernels/fp8.h"
#include "store/base/status.h"
#include "store/fp8_policy.h"
#include "store/store.h"

namespace dte {

class Materializer;
class SnapshotSet;

// One scale rule's changes of one tensor (or a sum of tensors).
struct Fp8RuleCounts {
  uint64_t bytes_changed = 0;   // E4M3 bytes that differ from the parent's
  uint64_t scales_changed = 0;  // block scales that differ bitwise
  // What a step of an FP8 receiver writes: the changed bytes and 4 bytes per
  // changed scale.
  uint64_t step_bytes() const { return bytes_changed + 4 * scales_changed; }
};

// The FP8 changes of one quantized tensor at a version, or a sum of them.
struct Fp8TensorCounts {
  std::string name;  // the tensor, or a group's name for a sum
  uint64_t tensors = 0;
  uint64_t elements = 0;
  uint64_t blocks = 0;        // FP8 blocks: the scales of the FP8 form
  uint64_t bf16_changed = 0;  // BF16 elements whose bits differ from the parent's
  Fp8RuleCounts plain, pow2;
  // What a step of a BF16 receiver writes: 2 bytes per changed element.
  uint64_t bf16_step_bytes() const { return 2 * bf16_changed; }
  // Adds o's counts (not its name) to these.
  void Add(const Fp8TensorCounts& o);
};

struct Fp8StatsOptions {
  Fp8Policy policy;
  uint64_t block_rows = kernels::kFp8DefaultBlock;
  uint64_t block_cols = kernels::kFp8DefaultBlock;
};

// Counts the FP8 changes of tensor `name` (rows x cols BF16 bit patterns
// parent and child) under both scale rules. `candidates` are increasing
// flat indices that include every element where parent and child differ
// (others are skipped). A block of either version holding NaN or +-inf is
// InvalidArgument with the quantizer's message, naming the tensor and block.
Result<Fp8TensorCounts> CountFp8Changes(const Fp8StatsOptions& options, std::string_view name,
                                        uint64_t rows, uint64_t cols, const uint16_t* parent,
                                        const uint16_t* child,
                                        std::span<const uint64_t> candidates);

// Reads versions of one store and counts their FP8 changes, starting block
// reads from the snapshots this host holds of the store.
class Fp8StatsReader {
 public:
  Fp8StatsReader(Store& store, Fp8StatsOptions options);
  ~Fp8StatsReader();

  // Calls sink with the counts of every tensor of v that the policy
  // quantizes, in the manifest's order; the first error (of the store, the
  // kernel or sink) ends the walk and is returned, naming v.
  // v must have a parent (InvalidArgument otherwise: an anchor is not a
  // change). A tensor that the parent lacks, or holds with another dtype or
  // shape, counts as wholly changed: every element, byte and scale.
  Status CountVersion(const std::shared_ptr<const Version>& v,
                      const std::function<Status(const Fp8TensorCounts&)>& sink);

 private:
  Status ReadTensor(const std::shared_ptr<const Version>& v, const FileEntry& file,
                    const TensorEntry& tensor, std::vector<uint16_t>* out);

  Store& store_;
  Fp8StatsOptions options_;
  std::unique_ptr<SnapshotSet> snapshots_;
  std::unique_ptr<Materializer> reader_;
  std::vector<uint16_t> parent_, child_;
};

}  // namespace dte
