// The C ABI of dte_dist_publisher: the ranks of a job publish one model
// together.
#include <cmath>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "sync/capi/c_api.h"
#include "sync/capi/internal/c_api_convert.h"
#include "sync/capi/internal/c_api_glue.h"
#include "sync/capi/internal/c_api_objects.h"
#include "sync/capi/internal/c_api_publishers.h"
#include "sync/convert/convert.h"

using dte::capi::Close;
using dte::capi::EditAnchorPolicy;
using dte::capi::Fail;
using dte::capi::FailWith;
using dte::capi::FillResult;
using dte::capi::Find;
using dte::capi::Guard;
using dte::capi::Issue;
using dte::capi::LastPushJson;
using dte::capi::MetricsText;
using dte::capi::OrEmpty;
using dte::capi::PushJson;
using dte::capi::PushMetrics;
using dte::capi::ServeMetrics;
using dte::capi::SetPush;
using dte::capi::ToLayout;
using dte::capi::ToStep;
using dte::capi::WithHandle;

namespace {

// Range i of a dte_dist_publisher_publish_adamw call; refuses a range with
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

int dte_dist_publisher_open(const char* store, const char* cache_dir, const char* config_json,
                            const char* config_file, const dte_mcore_layout* layout,
                            dte_dist_publisher** out) {
  return Guard([&] {
    if (store == nullptr || out == nullptr || (config_json != nullptr && layout == nullptr)) {
      return FailWith(DTE_INVALID_ARGUMENT,
                      "dte_dist_publisher_open: store and out (and layout with config_json) must "
                      "be set");
    }
    dte::PublisherOptions o;
    o.store = store;
    o.cache_dir = OrEmpty(cache_dir);
    if (config_json != nullptr) {
      o.converter = "mcore";
      auto spec = dte::ParseHfConfig(config_json, config_file ? config_file : "config.json");
      if (!spec.ok()) return Fail(spec.status());
      o.mcore = dte::McoreConverter{*spec, {}};
      if (int rc = ToLayout(*layout, &o.mcore->layout); rc != DTE_OK) return rc;
    }
    auto opened = dte::DistPublisher::Open(o);
    if (!opened.ok()) return Fail(opened.status());
    *out = Issue(new dte_dist_publisher{nullptr, std::move(opened).value(), "null", ""});
    return static_cast<int>(DTE_OK);
  });
}

int dte_dist_publisher_close(dte_dist_publisher* p) { return Close(p, __func__); }

int dte_dist_publisher_set_anchor_policy(dte_dist_publisher* p, double budget, uint64_t every) {
  return EditAnchorPolicy(p, __func__, [&](dte::AnchorPolicy* a) {
    a->budget = budget;
    a->every = every;
  });
}

int dte_dist_publisher_set_join_budget(dte_dist_publisher* p, double join_budget) {
  return EditAnchorPolicy(p, __func__, [&](dte::AnchorPolicy* a) { a->join_budget = join_budget; });
}

int dte_dist_publisher_last_stats(dte_dist_publisher* h, dte_dist_stats* out) {
  return WithHandle(h, __func__, [&](dte_dist_publisher& p) {
    if (out == nullptr) {
      return FailWith(DTE_INVALID_ARGUMENT, "dte_dist_publisher_last_stats: out must be set");
    }
    const dte::DistPublishStats& s = p.impl->last_stats();
    *out = dte_dist_stats{
        s.entries_sent,      s.bytes_sent,    s.bytes_received,    s.tensors_owned,
        s.parent_bytes_read, s.messages_sent, s.push_tensors_kept, s.push_tensors_read_back,
        s.detect_ns,         s.encode_ns,     s.commit_ns,         s.detect_device_bytes};
    return static_cast<int>(DTE_OK);
  });
}

int dte_dist_publisher_publish_adamw(dte_dist_publisher* h, dte_transport* th,
                                     const dte_adamw_step* step, const dte_adamw_range* ranges,
                                     size_t count, dte_publish_result* out) {
  return WithHandle(h, __func__, [&](dte_dist_publisher& p) {
    std::shared_ptr<dte_transport> t = Find(th, "dte_dist_publisher_publish_adamw");
    if (t == nullptr) return static_cast<int>(DTE_INVALID_ARGUMENT);
    if (step == nullptr || (ranges == nullptr && count > 0)) {
      return FailWith(DTE_INVALID_ARGUMENT,
                      "dte_dist_publisher_publish_adamw: step and ranges must be set");
    }
    dte::AdamWStep adamw;
    if (int rc = ToStep(*step, &adamw); rc != DTE_OK) return rc;
    std::vector<dte::RangeState> states(count);
    for (size_t i = 0; i < count; ++i) {
      if (int rc = ToRangeState(ranges[i], i, &states[i]); rc != DTE_OK) return rc;
    }
    auto r = p.impl->PublishAdamW(*t->impl, adamw, states);
    if (!r.ok()) return Fail(r.status());
    FillResult(*r, out);
    p.last_push = PushJson(*r);
    return static_cast<int>(DTE_OK);
  });
}

int dte_dist_publisher_set_push(dte_dist_publisher* p, dte_push_server* s) {
  return SetPush(p, s, __func__);
}

int dte_dist_publisher_share_push(dte_dist_publisher* h, dte_transport* th) {
  return WithHandle(h, __func__, [&](dte_dist_publisher& p) {
    std::shared_ptr<dte_transport> t = Find(th, "dte_dist_publisher_share_push");
    if (t == nullptr) return static_cast<int>(DTE_INVALID_ARGUMENT);
    dte::Status st = p.impl->SharePush(*t->impl);
    return st.ok() ? static_cast<int>(DTE_OK) : Fail(st);
  });
}

int dte_dist_publisher_last_push_json(dte_dist_publisher* p, const char** json_out) {
  return LastPushJson(p, __func__, json_out);
}

int dte_dist_publisher_metrics_text(dte_dist_publisher* p, const char** text_out) {
  return MetricsText(p, "dte_dist_publisher_metrics_text", text_out);
}

int dte_dist_publisher_serve_metrics(dte_dist_publisher* p, const char* address,
                                     int32_t* port_out) {
  return ServeMetrics(p, "dte_dist_publisher_serve_metrics", address, port_out);
}

int dte_dist_publisher_push_metrics(dte_dist_publisher* p, const char* gateway, const char* job,
                                    const char* const* label_names, const char* const* label_values,
                                    size_t label_count) {
  return PushMetrics(p, "dte_dist_publisher_push_metrics", gateway, job, label_names, label_values,
                     label_count);
}
