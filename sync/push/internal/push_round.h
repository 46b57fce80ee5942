// One push's state (sync/push/push_round.cc, its phases; FP8 receivers'
// part in push_round_fp8.cc), from its targets to its report.
//
// Thread-safety: a Round lives on the pushing thread; it touches the
// server's connections only through PushServer::Impl under its mutex.
#pragma once

#include <array>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "store/materialize.h"
#include "store/store.h"
#include "sync/push/internal/push_fp8.h"
#include "sync/push/internal/push_fp8_summary.h"
#include "sync/push/internal/push_server_impl.h"

namespace dte {

struct PushServer::Impl::Round {
  struct Target {
    uint64_t id;
    RankKey key;  // layout, receiver rank and FP8 variant: who shares its messages
    std::vector<uint32_t> plan_to_own;
  };
  // Consecutive changed tensors of about options' batch_entries entries in
  // all (or one tensor), packed together. Round 1 packs each batch whole
  // while the encodings kept so far fit options' cache_bytes (then round 2
  // only sends them: one pass, as for most versions), and only counts the
  // rest, which round 2 reads and packs again.
  struct PackedBatch {
    std::vector<size_t> tensors;
    bool encoded = false;
    std::map<RankKey, std::string> data;  // while encoded, until sent
  };
  using Batch = std::vector<std::pair<size_t, const TensorChanges*>>;

  // The FP8 receivers of one set of FP8 options (variant v > 0 of the
  // round's RankKeys is fp8[v - 1]).
  struct Fp8Variant {
    std::string key;  // the options as the hello gave them (JSON)
    // The FP8 plan of each layout and rank it has targets of.
    std::map<std::pair<LayoutKey, int>, const Fp8ReceiverPlan*> plans;
    std::string failed;  // set: the version cannot be quantized; its targets are dropped
  };
  // One FP8 op's entries for one variant: counts and encodings.
  struct Fp8OpOut {
    uint64_t bytes = 0, scales = 0;
    std::string data;  // the bytes' segments, then the scales'
  };
  // [variant, layout, plan op].
  using Fp8Key = std::tuple<int, LayoutKey, size_t>;
  // A variant's layout whose FP8 ops read a canonical tensor.
  struct Fp8Use {
    int variant;
    LayoutKey layout;
    const Fp8ReceiverPlan* plan;
  };
  // One FP8 op of a use, to encode from the change set of its block shape.
  struct Fp8Job {
    int variant;
    LayoutKey layout;
    const Fp8ReceiverOp* op;
    const push_internal::Fp8Changes* changes;
  };
  using Fp8Shape = std::tuple<uint64_t, uint64_t, kernels::Fp8ScaleRule>;
  using Fp8Layouts = std::map<Fp8Shape, kernels::Fp8Layout>;

  Round(Store& store, const std::shared_ptr<const Version>& v, ChangesSource& changes,
        const PushServerOptions& options)
      : store(store),
        v(v),
        changes(changes),
        options(options),
        vname(VersionName(v->manifest.version)),
        t0(Clock::now()) {
    report.version = v->manifest.version;
  }

  void IndexOps();
  Result<const TensorChanges*> ReadTensor(size_t c, std::deque<TensorChanges>* held);
  Status PackBatch(const Batch& batch, bool encode, bool check,
                   std::map<RankKey, std::string>* data);
  Status CountChanges();
  Status FlushBatch(Batch* batch);
  void MakeCounts(int part, int parts);
  Status EncodeAgain(PackedBatch& pb, std::map<RankKey, std::string>* data);

  // --- push_round_fp8.cc --------------------------------------------------
  // The variant of FP8 options `key` (added when new).
  int Fp8VariantOf(const std::string& key);
  // The FP8 plan of variant v for the op's layout and receiver rank when
  // the op writes an FP8 tensor there, else null.
  const Fp8ReceiverPlan* Fp8PlanOf(int v, const LayoutKey& layout, int rank) const;
  bool IsFp8Op(int v, const LayoutKey& layout, const TransferOp& op) const;
  // Whether the elements of `op` are sent as they are to some target: a
  // receiver without FP8, or one of a variant where op's tensor is not FP8.
  bool NeedsElements(const LayoutKey& layout, const TransferOp& op) const;
  // Every variant's FP8 entries of the batch's tensors, a tensor at a time
  // (its parent and version in BF16 held only while it is done). With
  // `check`, the counts must be those of the first pass.
  Status PackFp8(const Batch& batch, bool check, std::map<Fp8Key, Fp8OpOut>* out);
  Status PackFp8Tensor(size_t c, const TensorChanges& changes, bool check,
                       std::map<Fp8Key, Fp8OpOut>* out);
  std::vector<Fp8Use> Fp8UsesOf(size_t c) const;
  Status OpenParent();
  Status ReadFp8Versions(size_t c, const TensorChanges& changes);
  Status Fp8Jobs(size_t c, const TensorChanges& changes, const std::vector<Fp8Use>& uses,
                 std::map<Fp8Shape, push_internal::Fp8Changes>* sets, std::vector<Fp8Job>* jobs);
  // The change set of every block shape and rule of `layouts` into *sets,
  // and the version's summaries staged in fp8_next: stepped from the
  // parent's summaries, reading only the blocks they do not decide, when
  // the changes hold the parent's elements and every layout has a summary
  // of the parent; else from the parent read whole.
  Status Fp8Sets(size_t c, const TensorChanges& changes, const Fp8Layouts& layouts,
                 std::map<Fp8Shape, push_internal::Fp8Changes>* sets);
  Status Fp8SetsWhole(size_t c, const TensorChanges& changes, const Fp8Layouts& layouts,
                      std::map<Fp8Shape, push_internal::Fp8Changes>* sets);
  Status Fp8SetsStepped(size_t c, const TensorChanges& changes, const Fp8Layouts& layouts,
                        const std::vector<const push_internal::Fp8Summary*>& prev,
                        std::map<Fp8Shape, push_internal::Fp8Changes>* sets);
  push_internal::Fp8SummaryKey SummaryKey(size_t c, const Fp8Shape& shape) const;
  // Whether this push may stage a summary of layout l under `key`: one it
  // staged already (its first pass), or one that fits options'
  // fp8_summary_bytes beside those held (counted in fp8_held).
  bool HoldFp8Summary(const push_internal::Fp8SummaryKey& key, const kernels::Fp8Layout& l);
  // The summaries of the version once the push packed every tensor
  // (`complete`) for every FP8 variant; none otherwise (the next push
  // reads its parents whole).
  push_internal::Fp8Summaries Fp8SummariesAfter(bool complete);
  // Round 1's entries of an FP8 variant's layout and rank.
  void MakeFp8Counts(int v, const LayoutKey& layout, int rank, push_internal::CountsMsg* m,
                     uint64_t* elements) const;

  Store& store;
  std::shared_ptr<const Version> v;
  ChangesSource& changes;
  const PushServerOptions& options;
  const std::string vname;
  const Clock::time_point t0;
  uint64_t parent = 0;
  std::vector<PlanTensor> canonical;
  PushReport report;

  std::vector<Target> targets;
  std::map<LayoutKey, const TransferPlan*> plans;
  // Each plan's ops by the canonical tensor they come from (plan order:
  // canonical order, so tensors in order are plan order for every rank).
  std::map<LayoutKey, std::vector<std::vector<size_t>>> ops_of;
  std::vector<size_t> changed;                           // canonical tensors with changes, in order
  std::map<LayoutKey, std::vector<uint64_t>> op_counts;  // per plan op
  std::vector<PackedBatch> packed;
  uint64_t cached = 0;  // bytes of packed batches kept

  // FP8 receivers.
  std::vector<Fp8Variant> fp8;
  std::set<LayoutKey> plain_layouts;                     // layouts with targets that are not FP8
  std::map<Fp8Key, std::array<uint64_t, 2>> fp8_counts;  // bytes and scales per FP8 op
  std::shared_ptr<const Version> parent_version;         // read by PackFp8Tensor
  std::unique_ptr<Materializer> reader;
  push_internal::Fp8Versions fp8_versions;  // one tensor's, reused
  // The summaries of the last version pushed (the parent's when their
  // version is), those of this version staged tensor by tensor (committed
  // by Fp8SummariesAfter), and the tensors this version changed.
  push_internal::Fp8Summaries fp8_prev;
  std::map<push_internal::Fp8SummaryKey, push_internal::Fp8Summary> fp8_next;
  std::set<std::string> fp8_changed;
  uint64_t fp8_held = 0;          // bytes of fp8_prev and fp8_next
  std::vector<uint8_t> fp8_rows;  // the parent's rows a tensor's stepped sets read

  std::map<RankKey, push_internal::CountsMsg> counts;
  std::map<RankKey, uint64_t> elements;
  double pack = 0;
  Clock::time_point deadline;
  std::vector<uint64_t> sent;  // targets sent round 1
};

}  // namespace dte
