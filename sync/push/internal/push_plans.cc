#include "sync/push/internal/push_plans.h"

#include <algorithm>
#include <utility>

namespace dte::push_internal {

bool PushPlans::Install(const std::shared_ptr<const Version>& v, PlanInputs in) {
  MutexLock lock(&mu_);
  bool dropped = false;
  if (!inputs_ || inputs_->canonical.size() != in.canonical.size() ||
      !std::equal(in.canonical.begin(), in.canonical.end(), inputs_->canonical.begin(),
                  [](const PlanTensor& a, const PlanTensor& b) {
                    return a.name == b.name && a.dtype == b.dtype && a.shape == b.shape;
                  }) ||
      inputs_->geometry.num_heads != in.geometry.num_heads ||
      inputs_->geometry.num_kv_heads != in.geometry.num_kv_heads ||
      inputs_->geometry.head_dim != in.geometry.head_dim) {
    plans_.clear();
    fp8_plans_.clear();
    dropped = true;
  }
  inputs_ = std::move(in);
  latest_ = v;
  return dropped;
}

std::shared_ptr<const Version> PushPlans::latest() const {
  MutexLock lock(&mu_);
  return latest_;
}

Result<const TransferPlan*> PushPlans::Plan(const ShardLayout& layout) {
  MutexLock lock(&mu_);
  if (!inputs_) return InvalidArgument("the push server has no version yet");
  auto key = KeyOf(layout);
  if (auto it = plans_.find(key); it != plans_.end()) return &it->second;
  auto plan =
      MakeTransferPlan(inputs_->canonical, inputs_->geometry, ShardLayout{1, false, false}, layout);
  if (!plan.ok()) {
    return plan.status().WithContext("receiver layout " + LayoutText(layout, 0));
  }
  return &plans_.emplace(key, std::move(plan).value()).first->second;
}

Result<const Fp8ReceiverPlan*> PushPlans::Fp8Plan(const ShardLayout& layout, int rank,
                                                  const std::string& options_key,
                                                  const Fp8ReceiverOptions& options,
                                                  const TransferPlan& plan) {
  MutexLock lock(&mu_);
  const auto key = std::make_tuple(KeyOf(layout), rank, options_key);
  if (auto it = fp8_plans_.find(key); it != fp8_plans_.end()) return &it->second;
  auto made = MakeFp8ReceiverPlan(plan, rank, options);
  if (!made.ok()) return made.status();
  return &fp8_plans_.emplace(key, std::move(made).value()).first->second;
}

}  // namespace dte::push_internal
