// The push server's FP8 change sets from block summaries (docs/push.md
// "FP8 receivers"): what the server keeps of the last pushed version so
// that the next version's change set costs the changed elements, not the
// tensor.
//
// Per block of a canonical tensor under one FP8 layout, a summary keeps a
// short list of its largest magnitudes (up to kFp8Top elements, with their
// positions and BF16 magnitude bits, largest first) and a bound that no
// other element of the block exceeds. A step applied to a summary
// (Fp8BlockTop::Apply) keeps it true without the block: a changed element
// leaves the list, and joins it when its new magnitude exceeds the bound; a
// list over kFp8Top entries drops its smallest and raises the bound to it.
// Listed magnitudes never fall below the bound, so the block's amax is the
// list's largest while the list holds an element; once steps empty it only
// the bound is known (unless it is 0), and the block is read again.
//
// A step's change set (kernels::Fp8ChangesAt's, bit for bit) is then made
// in three phases:
//   1. PlanFp8Step: per touched block, from the parent's summary and the
//      changes, whether the parent's elements are needed: a block whose
//      scale changes (every byte may change), whose new amax is not known
//      exactly, that holds a changed element without its exact old value or
//      a non-finite new one. The other blocks' bytes follow from the old
//      and new values at one unchanged scale.
//   2. The caller reads the block rows of the parent that some block needs
//      (Fp8ReadRows) and makes the version's rows (Fp8ChildRows).
//   3. FinishFp8Step: the change set, old bytes and scales, and the
//      summary of the new version.
//
// Memory: sizeof(Fp8BlockTop) (40 bytes) per block.
//
// Thread-safety: pure functions over caller-owned data.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/fp8.h"
#include "store/base/status.h"
#include "store/changes.h"
#include "store/hash.h"
#include "store/materialize.h"
#include "sync/push/internal/push_fp8.h"

namespace dte::push_internal {

inline constexpr int kFp8Top = 6;

// One block's largest magnitudes at one version (see the top).
struct Fp8BlockTop {
  uint16_t mag[kFp8Top];  // BF16 magnitude bits, descending
  uint32_t at[kFp8Top];   // their positions: row within the block * block_cols + column
  uint16_t bound = 0;     // no element outside the list is larger
  uint8_t n = 0;          // entries in the list

  // Element `at` now has magnitude bits `mag` (non-finite ones included).
  void Apply(uint32_t at, uint16_t mag);
  // The block's largest magnitude, when the summary knows it exactly.
  std::optional<uint16_t> Amax() const;
};

// The summary of one tensor under one layout.
struct Fp8Summary {
  kernels::Fp8Layout layout;
  Hash128 hash;                     // of the tensor it describes (TensorEntry::hash)
  std::vector<Fp8BlockTop> blocks;  // row-major over the block grid
};

// Summaries of the last version a push completed, per canonical tensor
// and block shape and rule.
using Fp8SummaryKey = std::tuple<std::string, uint64_t, uint64_t, kernels::Fp8ScaleRule>;
struct Fp8Summaries {
  std::optional<uint64_t> version;  // the version they describe
  std::map<Fp8SummaryKey, Fp8Summary> of;
};

// Whether summaries can describe tensors of layout l (a block's positions
// fit 32 bits).
bool Fp8Summarizable(const kernels::Fp8Layout& l);
// The bytes of a summary of layout l, and of every summary of s.
uint64_t Fp8SummaryBytes(const kernels::Fp8Layout& l);
uint64_t Fp8SummaryBytes(const Fp8Summaries& s);

// The summary of every block of x (l.num_elements() BF16 bit patterns).
Fp8Summary SummarizeFp8(const kernels::Fp8Layout& l, const uint16_t* x);

// Phase 1: one step of a tensor under one layout. The changes' entries
// grouped by block (blocks ascending, entries ascending within each), and
// per block whether it needs the parent's elements and, where not, its
// summary after the step.
struct Fp8StepPlan {
  std::vector<uint64_t> blocks;
  std::vector<size_t> starts;  // blocks[j]'s entries: entries[starts[j] .. starts[j + 1])
  std::vector<size_t> entries;
  std::vector<uint8_t> read;
  std::vector<Fp8BlockTop> next;
};
// `parent` describes the changes' parent; an entry's old value is exact
// where changes.old_exact and it is known.
void PlanFp8Step(const Fp8Summary& parent, const TensorChanges& changes, Fp8StepPlan* out);

// Phase 2. Marks in rows (one flag per tensor row) the rows of the blocks
// the plan reads.
void MarkFp8Rows(const kernels::Fp8Layout& l, const Fp8StepPlan& plan, std::vector<uint8_t>* rows);
// The marked rows of tensor `tensor` (2-D BF16, `cols` columns) of version
// v into their place in parent (sized to the tensor); returns the bytes
// read. Store blocks are read in parallel.
Result<uint64_t> Fp8ReadRows(Materializer& reader, const std::shared_ptr<const Version>& v,
                             const std::string& tensor, uint64_t cols,
                             const std::vector<uint8_t>& rows, const std::string& what,
                             std::vector<uint16_t>* parent);
// The version's marked rows: the parent's with the changes applied (as
// ReadFp8Versions applies them), into v->child (sized to the tensor).
void Fp8ChildRows(uint64_t cols, const std::vector<uint8_t>& rows, const TensorChanges& changes,
                  Fp8Versions* v);

// Phase 3: the step's change set with the parent's bytes and scales (what
// ComputeFp8Changes gives over the whole tensors), reading v only in the
// rows of the blocks the plan reads, and the summary of the version
// (*next). InvalidArgument naming the tensor when a block it reads holds
// NaN or inf.
Status FinishFp8Step(const Fp8Summary& parent, const Fp8StepPlan& plan, const Fp8Versions& v,
                     const TensorChanges& changes, const std::string& tensor, Fp8Changes* out,
                     Fp8Summary* next);

}  // namespace dte::push_internal
