// PushPlans: the latest version a push server knows, the plan inputs read
// from it (its tensors and geometry), and the transfer plans made from
// them: one per receiver layout, and one per FP8 receivers' layout, rank
// and options (sync/transfer/fp8_plan.h).
//
// A plan returned stays valid until an Install that drops the plans (a
// version whose tensors or geometry differ from the last one's); the
// server installs only from SetLatest and Push, which its callers do not
// run concurrently with a push.
//
// Thread-safety: every method may be called from any thread. Its mutex is
// a leaf: taken while the server holds its connections' lock
// (sync/push/internal/push_server_impl.h), it takes no other.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>

#include "store/base/status.h"
#include "store/base/thread_annotations.h"
#include "store/store.h"
#include "sync/transfer/fp8_plan.h"
#include "sync/transfer/plan_inputs.h"
#include "sync/transfer/transfer_plan.h"

namespace dte::push_internal {

// A receiver layout as plans are kept: tp, fuse_qkv, fuse_gate_up.
using LayoutKey = std::tuple<int, bool, bool>;

inline LayoutKey KeyOf(const ShardLayout& l) { return {l.tp, l.fuse_qkv, l.fuse_gate_up}; }

class PushPlans {
 public:
  // Makes v, with its plan inputs `in`, the latest version. True when the
  // plans made so far were dropped (v's tensors or geometry differ from
  // the previous latest version's): receivers matched against them must be
  // matched again.
  bool Install(const std::shared_ptr<const Version>& v, PlanInputs in) EXCLUDES(mu_);
  // Null until the first Install.
  std::shared_ptr<const Version> latest() const EXCLUDES(mu_);
  // The plan from the latest version's tensors onto `layout`, made once.
  Result<const TransferPlan*> Plan(const ShardLayout& layout) EXCLUDES(mu_);
  // The FP8 plan of rank `rank` of `layout` with `options` (`options_key`:
  // the same as JSON), over `plan` (Plan(layout)'s), made once.
  Result<const Fp8ReceiverPlan*> Fp8Plan(const ShardLayout& layout, int rank,
                                         const std::string& options_key,
                                         const Fp8ReceiverOptions& options,
                                         const TransferPlan& plan) EXCLUDES(mu_);

 private:
  mutable Mutex mu_;
  std::optional<PlanInputs> inputs_ GUARDED_BY(mu_);
  std::shared_ptr<const Version> latest_ GUARDED_BY(mu_);
  std::map<LayoutKey, TransferPlan> plans_ GUARDED_BY(mu_);
  // Dropped with plans_.
  std::map<std::tuple<LayoutKey, int, std::string>, Fp8ReceiverPlan> fp8_plans_ GUARDED_BY(mu_);
};

}  // namespace dte::push_internal
