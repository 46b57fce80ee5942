// FP8 receivers of the push (docs/push.md "FP8 receivers"): what both ends
// derive from a receiver's FP8 options and the shared FP8 receiver plan
// (sync/transfer/fp8_plan.h), and the server's FP8 change set of one
// canonical tensor.
//
// An FP8 receiver of a plan's rank holds the plan's N receiver tensors,
// those the FP8 plan marks FP8 as F8_E4M3, plus one F32 scale tensor per
// FP8 tensor. Both ends number them 0 .. 2N: receiver tensor rt at rt, its
// scale tensor (when it has one) at N + rt.
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "kernels/fp8.h"
#include "store/base/status.h"
#include "store/changes.h"
#include "store/materialize.h"
#include "sync/push/internal/push_wire.h"
#include "sync/transfer/fp8_plan.h"
#include "sync/transfer/transfer_plan.h"

namespace dte::push_internal {

inline constexpr uint32_t kNoTensor = UINT32_MAX;

// "plain" or "pow2".
const char* Fp8RuleName(kernels::Fp8ScaleRule rule);

// The hello's "fp8" object: {"block": [rows, cols], "scale_rule":
// "plain"|"pow2", "skip_modules": [...], "skip_substrings": [...],
// "partial_blocks": false} (the policy's lists and quantize_partial_blocks;
// each absent key is the default policy's).
nlohmann::json Fp8OptionsJson(const Fp8ReceiverOptions& o);
// Its inverse; InvalidArgument naming what is wrong.
Result<Fp8ReceiverOptions> ParseFp8Options(const nlohmann::json& j);

// The tensors an FP8 receiver of `fp8`'s rank must hold, numbered as above
// (a non-FP8 receiver tensor's scale slot has an empty name).
std::vector<PlanTensor> Fp8ReceiverTensors(const TransferPlan& plan, const Fp8ReceiverPlan& fp8);

// For each of those 2N slots, the index of the tensor of the same name in
// `have` (kNoTensor for an empty slot); `have` must hold exactly those
// tensors with the same dtypes and shapes. InvalidArgument naming the
// first tensor that is missing, extra or different; one given as F8_E4M3
// that the plan holds in BF16 is refused with the policy's reason ("not
// held in FP8 (shape not a multiple of the block, FP8 block 16 x 16)").
Result<std::vector<uint32_t>> MatchFp8ReceiverTensors(const TransferPlan& plan,
                                                      const Fp8ReceiverPlan& fp8,
                                                      const std::vector<PlanTensor>& have,
                                                      const std::string& what);

// What a receiver tensor holds, by its dtype and name, for a receiver with
// FP8 options: F8_E4M3 tensors hold E4M3 bytes, the F32
// "<module>.weight_scale_inv" of one of them its scales, every other tensor
// the version's elements. Without FP8 options every tensor is kElements.
std::vector<EntryKind> TensorKinds(const std::vector<PlanTensor>& tensors, bool fp8);
// "elements", "FP8 bytes", "FP8 scales", for messages.
const char* EntryKindName(EntryKind k);

// Checks a receiver's own FP8 tensors before it connects: each F8_E4M3
// tensor 2-D, with an F32 scale tensor of its block grid's shape.
Status CheckFp8Tensors(const std::vector<PlanTensor>& tensors, const Fp8ReceiverOptions& o,
                       const std::string& what);

// One canonical tensor's FP8 change set between a version's parent and the
// version, with the parent's byte and scale at every listed entry (so a
// push can send wrapping differences).
struct Fp8Changes {
  kernels::Fp8ChangeSet set;
  std::vector<uint8_t> old_bytes;  // parallel to set.byte_index
  std::vector<float> old_scales;   // parallel to set.scale_index
};

// The canonical tensor's BF16 elements in the parent (read whole from the
// store) and in the version (the parent with `changes` applied: values
// over old values, or whole where not known).
// A push reuses one Fp8Versions for every tensor: its buffers grow to the
// largest.
struct Fp8Versions {
  std::vector<uint16_t> parent, child;
};
Status ReadFp8Versions(Materializer& reader, const std::shared_ptr<const Version>& parent,
                       const PlanTensor& tensor, const TensorChanges& changes,
                       const std::string& what, Fp8Versions* out);
// Entry k of `changes` applied to x, its element in the parent (as
// ReadFp8Versions applies it).
uint16_t ApplyFp8Change(const TensorChanges& changes, size_t k, uint16_t x);

// The largest BF16 magnitude bits of x[0 .. n).
uint16_t Bf16AmaxBits(const uint16_t* x, uint64_t n);
// The block of element i (row-major over layout's grid).
uint64_t Fp8BlockOf(const kernels::Fp8Layout& layout, uint64_t i);

// The change set under `layout` (kernels::Fp8ChangesAt over the changed
// indices) and the parent's bytes and scales at its entries.
// InvalidArgument naming the tensor when a touched block holds NaN or inf.
Status ComputeFp8Changes(const kernels::Fp8Layout& layout, const Fp8Versions& v,
                         const TensorChanges& changes, const std::string& tensor, Fp8Changes* out);
// The same over the changed elements changed[0 .. n) (ascending) alone:
// v is read only in the blocks holding them.
Status ComputeFp8ChangesAt(const kernels::Fp8Layout& layout, const Fp8Versions& v,
                           const uint64_t* changed, size_t n, const std::string& tensor,
                           Fp8Changes* out);

// The entries of `changes` that one FP8 op writes, encoded as round 2
// sends them (push_wire.h): the bytes' segments into *bytes_out and the
// scales' into *scales_out; their counts returned in *n_bytes, *n_scales.
void EncodeFp8Op(const Fp8ReceiverOp& op, const Fp8Changes& changes, uint64_t* n_bytes,
                 std::string* bytes_out, uint64_t* n_scales, std::string* scales_out);

}  // namespace dte::push_internal
