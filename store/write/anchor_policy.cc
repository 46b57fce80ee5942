#include "store/write/anchor_policy.h"

#include <cmath>
#include <iterator>
#include <utility>
#include <vector>

#include "store/base/units.h"
#include "store/store.h"

namespace dte {

Status CheckAnchorPolicy(const AnchorPolicy& policy) {
  if (!(policy.budget >= 0) || !std::isfinite(policy.budget)) {
    return InvalidArgument("--anchor-budget must be a number >= 0 (0: no budget), not " +
                           std::to_string(policy.budget));
  }
  if (!(policy.join_budget >= 0) || !std::isfinite(policy.join_budget)) {
    return InvalidArgument("--join-budget must be a number >= 0 (0: no join tables), not " +
                           std::to_string(policy.join_budget));
  }
  return Status::Ok();
}

Result<AnchorDistance> DistanceOf(Store& store, const std::shared_ptr<const Version>& v) {
  // Versions met on the way whose manifests predate since_full, newest first.
  std::vector<uint64_t> stored;
  std::shared_ptr<const Version> cur = v;
  AnchorDistance base;
  while (!cur->manifest.self_contained()) {
    if (cur->manifest.since_full) {
      base = *cur->manifest.since_full;
      break;
    }
    stored.push_back(cur->manifest.stats.stored_bytes);
    ASSIGN_OR_RETURN(cur, store.GetVersion(*cur->manifest.parent));
  }
  for (auto it = stored.rbegin(); it != stored.rend(); ++it) {
    base = NextDistance(base, false, *it);
  }
  return base;
}

namespace {

// `what` + bytes + ", " + `name` + " is " + the budget, once `bytes` reach
// `fraction` (> 0) of dense_bytes; "" before, and for fraction 0 (off).
std::string OverBudget(const std::string& what, const std::string& name, double fraction,
                       uint64_t bytes, uint64_t dense_bytes) {
  const double budget = fraction * static_cast<double>(dense_bytes);
  if (fraction <= 0 || static_cast<double>(bytes) < budget) return "";
  return what + FormatByteSize(bytes) + ", " + name + " is " +
         FormatByteSize(static_cast<uint64_t>(budget));
}

}  // namespace

std::string PolicyAnchorReason(const AnchorPolicy& policy, const AnchorDistance& parent_distance,
                               uint64_t dense_bytes) {
  if (policy.every > 0 && parent_distance.versions + 1 >= policy.every) {
    return "anchor policy: " + std::to_string(policy.every) + " versions since the last anchor";
  }
  return OverBudget("anchor policy: deltas since the last anchor hold ", "the budget",
                    policy.budget, parent_distance.bytes, dense_bytes);
}

Result<AnchorDistance> JoinDistanceOf(Store& store, const std::shared_ptr<const Version>& v,
                                      const AnchorDistance& v_distance) {
  if (v->manifest.self_contained()) return v_distance;
  ASSIGN_OR_RETURN(auto joins, store.ListJoins());
  auto it = joins.upper_bound(v->manifest.version);
  if (it == joins.begin()) return v_distance;
  const uint64_t j = std::prev(it)->first;
  // A join of a version before v's nearest self-contained one is behind it.
  if (v->manifest.version - j > v_distance.versions) return v_distance;
  auto jv = store.GetVersion(j);
  if (!jv.ok()) {
    if (jv.status().code() == Code::kNotFound) return v_distance;  // removed by gc
    return jv.status();
  }
  ASSIGN_OR_RETURN(AnchorDistance jd, DistanceOf(store, *jv));
  if (jd.versions > v_distance.versions || jd.bytes > v_distance.bytes) return v_distance;
  return AnchorDistance{v_distance.versions - jd.versions, v_distance.bytes - jd.bytes};
}

std::string JoinTableReason(const AnchorPolicy& policy, const AnchorDistance& parent_join_distance,
                            uint64_t dense_bytes) {
  return OverBudget("join table: deltas since the last full or join table hold ", "the join budget",
                    policy.join_budget, parent_join_distance.bytes, dense_bytes);
}

namespace {

// The policy anchor first; the join distance is asked for only when the
// version is not one.
template <typename JoinDistance>
Result<TableDecision> Decide(const AnchorPolicy& policy, const AnchorDistance& parent_distance,
                             uint64_t dense_bytes, JoinDistance join_distance) {
  TableDecision d;
  d.parent_distance = parent_distance;
  d.anchor_reason = PolicyAnchorReason(policy, parent_distance, dense_bytes);
  if (d.policy_anchor()) return d;
  ASSIGN_OR_RETURN(AnchorDistance jd, join_distance());
  d.join_reason = JoinTableReason(policy, jd, dense_bytes);
  return d;
}

}  // namespace

Result<TableDecision> DecideTables(Store& store, const AnchorPolicy& policy,
                                   const std::shared_ptr<const Version>& parent,
                                   uint64_t dense_bytes) {
  ASSIGN_OR_RETURN(AnchorDistance parent_distance, DistanceOf(store, parent));
  return Decide(policy, parent_distance, dense_bytes, [&]() -> Result<AnchorDistance> {
    return JoinDistanceOf(store, parent, parent_distance);
  });
}

TableDecision DecideTables(const AnchorPolicy& policy, const AnchorDistance& parent_distance,
                           const AnchorDistance& parent_join_distance, uint64_t dense_bytes) {
  auto d = Decide(policy, parent_distance, dense_bytes,
                  [&]() -> Result<AnchorDistance> { return parent_join_distance; });
  return std::move(d).value();  // the join distance is given: it cannot fail
}

AnchorDistance NextDistance(const AnchorDistance& parent_distance, bool self_contained,
                            uint64_t stored_bytes) {
  if (self_contained) return AnchorDistance{};
  return AnchorDistance{parent_distance.versions + 1, parent_distance.bytes + stored_bytes};
}

}  // namespace dte
