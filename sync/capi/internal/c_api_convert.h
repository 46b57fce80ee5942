// The C ABI's structs (sync/capi/c_api.h) as the publishers' C++ types, and
// back. The converters that can refuse their input return DTE_OK or a
// dte_code with the last error set (c_api_glue.h).
#pragma once

#include <cmath>
#include <string>

#include "sync/capi/c_api.h"
#include "sync/publish/publisher.h"

namespace dte::capi {

// An array of the caller's, borrowed.
dte::TensorRef ToRef(const dte_array& a);

// The step's hyper-parameters; refuses an unknown order.
int ToStep(const dte_adamw_step& in, dte::AdamWStep* h);

// An MCore parallel layout; refuses unknown norms or experts.
int ToLayout(const dte_mcore_layout& in, dte::ParallelLayout* out);

// *out = r's counts; nothing when out is NULL.
void FillResult(const dte::PublishResult& r, dte_publish_result* out);

// The push report of a publish, as dte_*publisher_last_push_json give it.
std::string PushJson(const dte::PublishResult& r);

// The tensors and per-parameter settings of one parameter (dte_adamw_param)
// or MCore shard (dte_mcore_adamw_shard); negative step and NaN lr or
// weight decay mean "the step's".
template <typename In, typename Out>
void FillOptimizerState(const In& in, Out* out) {
  out->param = ToRef(in.param);
  out->exp_avg = ToRef(in.exp_avg);
  out->exp_avg_sq = ToRef(in.exp_avg_sq);
  if (in.state_step >= 0) out->state_step = in.state_step;
  if (!std::isnan(in.lr)) out->lr = in.lr;
  if (!std::isnan(in.weight_decay)) out->weight_decay = in.weight_decay;
}

}  // namespace dte::capi
