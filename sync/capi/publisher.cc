// The C ABI of dte_publisher: opening a publisher, and the publishes of
// whole tensors and of weights (its ranks: publisher_ranks.cc).
#include <memory>
#include <optional>
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
using dte::capi::FillOptimizerState;
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

int OpenPublisher(const dte::PublisherOptions& o, dte_publisher** out) {
  auto opened = dte::Publisher::Open(o);
  if (!opened.ok()) return Fail(opened.status());
  *out = Issue(new dte_publisher{nullptr, nullptr, std::move(opened).value(), "null", ""});
  return DTE_OK;
}

void RememberPush(dte_publisher* p, const dte::PublishResult& r) { p->last_push = PushJson(r); }

}  // namespace

int dte_publisher_open(const char* store, const char* cache_dir, const char* converter,
                       dte_publisher** out) {
  return Guard([&] {
    if (store == nullptr || out == nullptr) {
      return FailWith(DTE_INVALID_ARGUMENT, "dte_publisher_open: store and out must be set");
    }
    dte::PublisherOptions o;
    o.store = store;
    o.cache_dir = OrEmpty(cache_dir);
    if (converter != nullptr) o.converter = converter;
    return OpenPublisher(o, out);
  });
}

int dte_publisher_open_mcore(const char* store, const char* cache_dir, const char* config_json,
                             const char* config_file, const dte_mcore_layout* layout,
                             dte_publisher** out) {
  return Guard([&] {
    if (store == nullptr || config_json == nullptr || layout == nullptr || out == nullptr) {
      return FailWith(DTE_INVALID_ARGUMENT,
                      "dte_publisher_open_mcore: store, config_json, layout and out must be set");
    }
    dte::PublisherOptions o;
    o.store = store;
    o.cache_dir = OrEmpty(cache_dir);
    o.converter = "mcore";
    auto spec = dte::ParseHfConfig(config_json, config_file ? config_file : "config.json");
    if (!spec.ok()) return Fail(spec.status());
    o.mcore = dte::McoreConverter{*spec, {}};
    if (int rc = ToLayout(*layout, &o.mcore->layout); rc != DTE_OK) return rc;
    return OpenPublisher(o, out);
  });
}

int dte_publisher_close(dte_publisher* h) {
  // A store transport made from this publisher, set as its exchange, holds
  // it in turn: let go of the exchange first, so that the two can go.
  if (std::shared_ptr<dte_publisher> p = Find(h, __func__)) {
    const dte::PublishGroup& g = p->impl->group();
    p->impl->SetGroup({g.rank, g.world, nullptr}).IgnoreError();
    p->exchange.reset();
  }
  return Close(h, __func__);
}

int dte_publisher_import(dte_publisher* h, const char* dir, uint64_t* version_out) {
  return WithHandle(h, __func__, [&](dte_publisher& p) {
    if (dir == nullptr) return FailWith(DTE_INVALID_ARGUMENT, "dte_publisher_import: no dir");
    auto r = p.impl->ImportCheckpoint(dir);
    if (!r.ok()) return Fail(r.status());
    if (version_out != nullptr) *version_out = r->version;
    return static_cast<int>(DTE_OK);
  });
}

int dte_publisher_set_anchor_policy(dte_publisher* p, double budget, uint64_t every) {
  return EditAnchorPolicy(p, __func__, [&](dte::AnchorPolicy* a) {
    a->budget = budget;
    a->every = every;
  });
}

int dte_publisher_set_join_budget(dte_publisher* p, double join_budget) {
  return EditAnchorPolicy(p, __func__, [&](dte::AnchorPolicy* a) { a->join_budget = join_budget; });
}

int dte_publisher_publish_adamw(dte_publisher* h, const dte_adamw_step* step,
                                const dte_adamw_param* params, size_t count,
                                dte_publish_result* out) {
  return WithHandle(h, __func__, [&](dte_publisher& p) {
    if (step == nullptr || (params == nullptr && count > 0)) {
      return FailWith(DTE_INVALID_ARGUMENT,
                      "dte_publisher_publish_adamw: step and params must be set");
    }
    dte::AdamWStep adamw;
    if (int rc = ToStep(*step, &adamw); rc != DTE_OK) return rc;
    std::vector<dte::AdamWParamState> states(count);
    for (size_t i = 0; i < count; ++i) {
      const dte_adamw_param& in = params[i];
      if (in.name == nullptr) {
        return FailWith(DTE_INVALID_ARGUMENT, "parameter " + std::to_string(i) + " has no name");
      }
      states[i].name = in.name;
      FillOptimizerState(in, &states[i]);
    }
    auto r = p.impl->PublishAdamW(adamw, states);
    if (!r.ok()) return Fail(r.status());
    FillResult(*r, out);
    RememberPush(&p, *r);
    return static_cast<int>(DTE_OK);
  });
}

int dte_publisher_publish_weights(dte_publisher* h, int64_t step, const dte_weights_tensor* tensors,
                                  size_t count, dte_publish_result* out) {
  return WithHandle(h, __func__, [&](dte_publisher& p) {
    if (tensors == nullptr && count > 0) {
      return FailWith(DTE_INVALID_ARGUMENT, "dte_publisher_publish_weights: tensors must be set");
    }
    std::vector<dte::WeightsTensor> weights(count);
    for (size_t i = 0; i < count; ++i) {
      if (tensors[i].name == nullptr) {
        return FailWith(DTE_INVALID_ARGUMENT, "tensor " + std::to_string(i) + " has no name");
      }
      weights[i].name = tensors[i].name;
      weights[i].weights = dte::capi::ToRef(tensors[i].weights);
    }
    std::optional<int64_t> at;
    if (step >= 0) at = step;
    auto r = p.impl->PublishWeights(at, weights);
    if (!r.ok()) return Fail(r.status());
    FillResult(*r, out);
    RememberPush(&p, *r);
    return static_cast<int>(DTE_OK);
  });
}

int dte_publisher_weights_begin(dte_publisher* h, int64_t step) {
  return WithHandle(h, __func__, [&](dte_publisher& p) {
    std::optional<int64_t> at;
    if (step >= 0) at = step;
    dte::Status s = p.impl->BeginWeights(at);
    return s.ok() ? static_cast<int>(DTE_OK) : Fail(s);
  });
}

int dte_publisher_weights_add(dte_publisher* h, const dte_weights_tensor* tensor) {
  return WithHandle(h, __func__, [&](dte_publisher& p) {
    if (tensor == nullptr || tensor->name == nullptr) {
      return FailWith(DTE_INVALID_ARGUMENT, "dte_publisher_weights_add: the tensor has no name");
    }
    dte::Status s = p.impl->AddWeights({tensor->name, dte::capi::ToRef(tensor->weights)});
    return s.ok() ? static_cast<int>(DTE_OK) : Fail(s);
  });
}

int dte_publisher_weights_commit(dte_publisher* h, dte_publish_result* out) {
  return WithHandle(h, __func__, [&](dte_publisher& p) {
    auto r = p.impl->CommitWeights();
    if (!r.ok()) return Fail(r.status());
    FillResult(*r, out);
    RememberPush(&p, *r);
    return static_cast<int>(DTE_OK);
  });
}

int dte_publisher_publish_adamw_mcore(dte_publisher* h, const dte_adamw_step* step,
                                      const dte_mcore_adamw_shard* shards, size_t count,
                                      dte_publish_result* out) {
  return WithHandle(h, __func__, [&](dte_publisher& p) {
    if (step == nullptr || (shards == nullptr && count > 0)) {
      return FailWith(DTE_INVALID_ARGUMENT,
                      "dte_publisher_publish_adamw_mcore: step and shards must be set");
    }
    dte::AdamWStep adamw;
    if (int rc = ToStep(*step, &adamw); rc != DTE_OK) return rc;
    std::vector<dte::McoreAdamWShard> states(count);
    for (size_t i = 0; i < count; ++i) {
      const dte_mcore_adamw_shard& in = shards[i];
      if (in.name == nullptr) {
        return FailWith(DTE_INVALID_ARGUMENT, "MCore shard " + std::to_string(i) + " has no name");
      }
      states[i].key = dte::ShardKey{in.name, in.tp_rank, in.ep_rank};
      FillOptimizerState(in, &states[i]);
    }
    auto r = p.impl->PublishAdamWMcore(adamw, states);
    if (!r.ok()) return Fail(r.status());
    FillResult(*r, out);
    RememberPush(&p, *r);
    return static_cast<int>(DTE_OK);
  });
}

int dte_publisher_set_push(dte_publisher* p, dte_push_server* s) { return SetPush(p, s, __func__); }

int dte_publisher_last_push_json(dte_publisher* p, const char** json_out) {
  return LastPushJson(p, __func__, json_out);
}

int dte_publisher_metrics_text(dte_publisher* p, const char** text_out) {
  return MetricsText(p, "dte_publisher_metrics_text", text_out);
}

int dte_publisher_serve_metrics(dte_publisher* p, const char* address, int32_t* port_out) {
  return ServeMetrics(p, "dte_publisher_serve_metrics", address, port_out);
}

int dte_publisher_push_metrics(dte_publisher* p, const char* gateway, const char* job,
                               const char* const* label_names, const char* const* label_values,
                               size_t label_count) {
  return PushMetrics(p, "dte_publisher_push_metrics", gateway, job, label_names, label_values,
                     label_count);
}
