// The C ABI of dte_publisher's ranks: the group a publisher publishes with,
// and the publish of the ranges each rank holds (any world, one included).
#include <cmath>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "sync/capi/c_api.h"
#include "sync/capi/internal/c_api_convert.h"
#include "sync/capi/internal/c_api_glue.h"
#include "sync/capi/internal/c_api_objects.h"

using dte::capi::Fail;
using dte::capi::FailWith;
using dte::capi::FillResult;
using dte::capi::Find;
using dte::capi::Guard;
using dte::capi::PushJson;
using dte::capi::ToStep;
using dte::capi::WithHandle;

namespace {

// Range i of a dte_publisher_publish_ranges call; refuses a range with
// no name, an unknown memory kind or a CUDA range with no device.
int ToRangeState(const dte_adamw_range& in, size_t i, dte::RangeState* r) {
  if (in.name == nullptr) {
    return FailWith(DTE_INVALID_ARGUMENT, "range " + std::to_string(i) + " has no name");
  }
  r->name = in.name;
  r->tp_rank = in.tp_rank;
  r->ep_rank = in.ep_rank;
  r->begin = in.begin;
  r->end = in.end;
  r->param = in.param;
  r->exp_avg = in.exp_avg;
  r->exp_avg_sq = in.exp_avg_sq;
  if (in.state_step >= 0) r->state_step = in.state_step;
  if (!std::isnan(in.lr)) r->lr = in.lr;
  if (!std::isnan(in.weight_decay)) r->weight_decay = in.weight_decay;
  if (in.memory == DTE_MEMORY_CUDA) {
    if (in.device < 0) {
      return FailWith(DTE_INVALID_ARGUMENT, "range " + std::to_string(i) + " (" + r->name +
                                                "): CUDA device " + std::to_string(in.device) +
                                                " is not a device ordinal");
    }
    r->device = in.device;
  } else if (in.memory != DTE_MEMORY_HOST) {
    return FailWith(DTE_INVALID_ARGUMENT, "range " + std::to_string(i) + " (" + r->name +
                                              "): unknown memory kind " +
                                              std::to_string(in.memory));
  }
  return DTE_OK;
}

}  // namespace

int dte_publisher_set_group(dte_publisher* h, int32_t rank, int32_t world,
                            dte_transport* exchange) {
  return WithHandle(h, __func__, [&](dte_publisher& p) {
    std::shared_ptr<dte_transport> t;
    if (exchange != nullptr && (t = Find(exchange, "dte_publisher_set_group")) == nullptr) {
      return static_cast<int>(DTE_INVALID_ARGUMENT);
    }
    dte::Status st = p.impl->SetGroup({rank, world, t ? t->impl.get() : nullptr});
    if (!st.ok()) return Fail(st);
    p.exchange = std::move(t);
    return static_cast<int>(DTE_OK);
  });
}

int dte_publisher_last_stats(dte_publisher* h, dte_dist_stats* out) {
  return WithHandle(h, __func__, [&](dte_publisher& p) {
    if (out == nullptr) {
      return FailWith(DTE_INVALID_ARGUMENT, "dte_publisher_last_stats: out must be set");
    }
    const dte::DistPublishStats& s = p.impl->last_stats();
    *out = dte_dist_stats{
        s.entries_sent,      s.bytes_sent,    s.bytes_received,    s.tensors_owned,
        s.parent_bytes_read, s.messages_sent, s.push_tensors_kept, s.push_tensors_read_back,
        s.detect_ns,         s.encode_ns,     s.commit_ns,         s.detect_device_bytes};
    return static_cast<int>(DTE_OK);
  });
}

int dte_publisher_publish_ranges(dte_publisher* h, const dte_adamw_step* step,
                                 const dte_adamw_range* ranges, size_t count,
                                 dte_publish_result* out) {
  return WithHandle(h, __func__, [&](dte_publisher& p) {
    if (step == nullptr || (ranges == nullptr && count > 0)) {
      return FailWith(DTE_INVALID_ARGUMENT,
                      "dte_publisher_publish_ranges: step and ranges must be set");
    }
    dte::AdamWStep adamw;
    if (int rc = ToStep(*step, &adamw); rc != DTE_OK) return rc;
    std::vector<dte::RangeState> states(count);
    for (size_t i = 0; i < count; ++i) {
      if (int rc = ToRangeState(ranges[i], i, &states[i]); rc != DTE_OK) return rc;
    }
    auto r = p.impl->PublishRanges(adamw, states);
    if (!r.ok()) return Fail(r.status());
    FillResult(*r, out);
    p.last_push = PushJson(*r);
    return static_cast<int>(DTE_OK);
  });
}

int dte_publisher_share_push(dte_publisher* h) {
  return WithHandle(h, __func__, [&](dte_publisher& p) {
    dte::Status st = p.impl->SharePush();
    return st.ok() ? static_cast<int>(DTE_OK) : Fail(st);
  });
}
