// The C ABI over Publisher and the store reader. C++ exceptions (allocation
// failures) never cross it: each entry point catches them and reports
// DTE_INTERNAL.
#include "sync/capi/c_api.h"

#include <cmath>
#include <exception>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "store/hash.h"
#include "store/materialize.h"
#include "store/snapshot.h"
#include "store/store.h"
#include "sync/capi/internal/c_api_handles.h"
#include "sync/convert/convert.h"
#include "sync/live/live_client.h"
#include "sync/publish/dist_publisher.h"
#include "sync/publish/publish_metrics.h"
#include "sync/publish/publisher.h"
#include "sync/push/push_receiver.h"
#include "sync/push/push_server.h"

// The objects behind the handles. The C ABI hands out tokens of
// dte::capi::HandleTable, never these addresses; members a handle keeps
// alive (another handle's object) come first, so that they outlive impl.
struct dte_publisher {
  std::shared_ptr<dte_push_server> push;  // set by dte_publisher_set_push
  std::unique_ptr<dte::Publisher> impl;
  std::string last_push = "null";  // dte_publisher_last_push_json
  std::string metrics;             // dte_publisher_metrics_text
};

struct dte_push_server {
  std::unique_ptr<dte::PushServer> impl;
  std::string json;
};

struct dte_push_receiver {
  std::unique_ptr<dte::PushReceiver> impl;
  std::string error;
};

struct dte_store {
  std::unique_ptr<dte::Store> impl;
};

struct dte_transport {
  std::shared_ptr<dte_dist_publisher> store_of;  // dte_transport_store: whose store it uses
  std::unique_ptr<dte::Transport> impl;
};

struct dte_dist_publisher {
  std::shared_ptr<dte_push_server> push;  // set by dte_dist_publisher_set_push
  std::unique_ptr<dte::DistPublisher> impl;
  std::string last_push = "null";  // dte_dist_publisher_last_push_json
  std::string metrics;             // dte_dist_publisher_metrics_text
};

struct dte_live {
  dte::live::Control impl;
};

namespace {

thread_local std::string last_error;

// The one place dte::Code becomes dte_code.
int ToCode(dte::Code code) {
  switch (code) {
    case dte::Code::kOk:
      return DTE_OK;
    case dte::Code::kInvalidArgument:
      return DTE_INVALID_ARGUMENT;
    case dte::Code::kNotFound:
      return DTE_NOT_FOUND;
    case dte::Code::kAlreadyExists:
      return DTE_ALREADY_EXISTS;
    case dte::Code::kCorruption:
      return DTE_CORRUPTION;
    case dte::Code::kIOError:
      return DTE_IO_ERROR;
    case dte::Code::kBusy:
      return DTE_BUSY;
    case dte::Code::kPermissionDenied:
      return DTE_PERMISSION_DENIED;
    case dte::Code::kUnimplemented:
      return DTE_UNIMPLEMENTED;
    case dte::Code::kInternal:
      return DTE_INTERNAL;
  }
  return DTE_INTERNAL;
}

// The push report of a publish, as dte_publisher_last_push_json gives it.
std::string PushJson(const dte::PublishResult& r) {
  if (r.push) return dte::PushReportJson(*r.push);
  if (r.push_error.empty()) return "null";
  return nlohmann::json{{"error", r.push_error}}.dump();
}

void RememberPush(dte_publisher* p, const dte::PublishResult& r) { p->last_push = PushJson(r); }

int Fail(const dte::Status& s) {
  last_error = s.message();
  return ToCode(s.code());
}

int FailWith(int code, std::string message) {
  last_error = std::move(message);
  return code;
}

// Runs fn() -> int, turning exceptions into DTE_INTERNAL.
template <typename Fn>
int Guard(const Fn& fn) {
  try {
    return fn();
  } catch (const std::exception& e) {
    return FailWith(DTE_INTERNAL, std::string("dte: ") + e.what());
  } catch (...) {
    return FailWith(DTE_INTERNAL, "dte: unknown C++ exception");
  }
}

// Handles (sync/capi/internal/c_api_handles.h): the kind of each handle type.
using dte::capi::HandleKind;
using dte::capi::HandleTable;
template <typename T>
constexpr HandleKind kKindOf = HandleKind{};
template <>
constexpr HandleKind kKindOf<dte_publisher> = HandleKind::kPublisher;
template <>
constexpr HandleKind kKindOf<dte_store> = HandleKind::kStore;
template <>
constexpr HandleKind kKindOf<dte_transport> = HandleKind::kTransport;
template <>
constexpr HandleKind kKindOf<dte_dist_publisher> = HandleKind::kDistPublisher;
template <>
constexpr HandleKind kKindOf<dte_push_server> = HandleKind::kPushServer;
template <>
constexpr HandleKind kKindOf<dte_push_receiver> = HandleKind::kPushReceiver;
template <>
constexpr HandleKind kKindOf<dte_live> = HandleKind::kLive;

// Enters a fresh object in the table; returns its handle.
template <typename T>
T* Issue(T* fresh) {
  std::shared_ptr<T> object(fresh);
  return reinterpret_cast<T*>(HandleTable::Global().Add(kKindOf<T>, std::move(object)));
}

// The object of open handle h, or null after setting last_error.
template <typename T>
std::shared_ptr<T> Find(T* h, const char* fn) {
  std::string error;
  std::shared_ptr<void> object =
      HandleTable::Global().Find(reinterpret_cast<uintptr_t>(h), kKindOf<T>, fn, &error);
  if (object == nullptr) last_error = std::move(error);
  return std::static_pointer_cast<T>(object);
}

// Runs body(T&) -> int on the object of open handle h, under Guard;
// DTE_INVALID_ARGUMENT when h is not one. `fn` names the C function.
template <typename T, typename Body>
int WithHandle(T* h, const char* fn, const Body& body) {
  return Guard([&] {
    std::shared_ptr<T> object = Find(h, fn);
    if (object == nullptr) return static_cast<int>(DTE_INVALID_ARGUMENT);
    return static_cast<int>(body(*object));
  });
}

// The dte_*_close functions: the handle leaves the table first; its object
// is destroyed now, or when a call that holds it returns.
template <typename T>
int Close(T* h, const char* fn) {
  return Guard([&] {
    std::string error;
    std::shared_ptr<void> object =
        HandleTable::Global().Remove(reinterpret_cast<uintptr_t>(h), kKindOf<T>, fn, &error);
    if (object == nullptr) return FailWith(DTE_INVALID_ARGUMENT, std::move(error));
    object.reset();
    return static_cast<int>(DTE_OK);
  });
}

// Changes a publisher's anchor policy with edit(&policy): the setters of
// both publishers' C functions. `fn` names the C function in errors.
template <typename Handle, typename Edit>
int EditAnchorPolicy(Handle* h, const char* fn, const Edit& edit) {
  return WithHandle(h, fn, [&](Handle& p) {
    dte::AnchorPolicy policy = p.impl->anchor_policy();
    edit(&policy);
    dte::Status s = p.impl->SetAnchorPolicy(policy);
    return s.ok() ? static_cast<int>(DTE_OK) : Fail(s);
  });
}

// dte_publisher_set_push and dte_dist_publisher_set_push: the publisher
// holds the server (s NULL: none) until it is set again or closed, so a
// server closed while set goes on until then.
template <typename Handle>
int SetPush(Handle* h, dte_push_server* s, const char* fn) {
  return WithHandle(h, fn, [&](Handle& p) {
    std::shared_ptr<dte_push_server> server;
    if (s != nullptr && (server = Find(s, fn)) == nullptr) {
      return static_cast<int>(DTE_INVALID_ARGUMENT);
    }
    dte::Status st = p.impl->SetPush(server ? server->impl.get() : nullptr);
    if (!st.ok()) return Fail(st);
    p.push = std::move(server);
    return static_cast<int>(DTE_OK);
  });
}

template <typename Handle>
int LastPushJson(Handle* h, const char* fn, const char** json_out) {
  return WithHandle(h, fn, [&](Handle& p) {
    if (json_out == nullptr) {
      return FailWith(DTE_INVALID_ARGUMENT, std::string(fn) + ": json_out must be set");
    }
    *json_out = p.last_push.c_str();
    return static_cast<int>(DTE_OK);
  });
}

// The metrics calls of both publishers. `fn` names the C function in errors.
template <typename Handle>
int MetricsText(Handle* h, const char* fn, const char** text_out) {
  return WithHandle(h, fn, [&](Handle& p) {
    if (text_out == nullptr) {
      return FailWith(DTE_INVALID_ARGUMENT, std::string(fn) + ": text_out must be set");
    }
    p.metrics = p.impl->metrics().Text();
    *text_out = p.metrics.c_str();
    return static_cast<int>(DTE_OK);
  });
}

template <typename Handle>
int ServeMetrics(Handle* h, const char* fn, const char* address, int32_t* port_out) {
  return WithHandle(h, fn, [&](Handle& p) {
    if (address == nullptr) {
      return FailWith(DTE_INVALID_ARGUMENT, std::string(fn) + ": address must be set");
    }
    dte::Result<int> port = p.impl->metrics().Serve(address);
    if (!port.ok()) return Fail(port.status());
    if (port_out != nullptr) *port_out = *port;
    return static_cast<int>(DTE_OK);
  });
}

template <typename Handle>
int PushMetrics(Handle* h, const char* fn, const char* gateway, const char* job,
                const char* const* label_names, const char* const* label_values,
                size_t label_count) {
  return WithHandle(h, fn, [&](Handle& p) {
    if (gateway == nullptr || job == nullptr ||
        (label_count > 0 && (label_names == nullptr || label_values == nullptr))) {
      return FailWith(DTE_INVALID_ARGUMENT, std::string(fn) + ": arguments must be set");
    }
    std::map<std::string, std::string> labels;
    for (size_t i = 0; i < label_count; ++i) {
      if (label_names[i] == nullptr || label_values[i] == nullptr) {
        return FailWith(DTE_INVALID_ARGUMENT,
                        std::string(fn) + ": label " + std::to_string(i) + " is not set");
      }
      labels[label_names[i]] = label_values[i];
    }
    dte::Status s = p.impl->metrics().Push(gateway, job, labels);
    return s.ok() ? static_cast<int>(DTE_OK) : Fail(s);
  });
}

dte::DType ToDType(int32_t d) {
  switch (d) {
    case DTE_DTYPE_F32:
      return dte::DType::kF32;
    case DTE_DTYPE_BF16:
      return dte::DType::kBF16;
    case DTE_DTYPE_F16:
      return dte::DType::kF16;
    case DTE_DTYPE_F64:
      return dte::DType::kF64;
    default:
      return dte::DType::kU8;
  }
}

dte::TensorRef ToRef(const dte_array& a) {
  dte::TensorRef r;
  r.data = a.data;
  r.dtype = ToDType(a.dtype);
  if (a.shape != nullptr && a.ndim > 0) r.shape.assign(a.shape, a.shape + a.ndim);
  return r;
}

const char* OrEmpty(const char* s) { return s != nullptr ? s : ""; }

int ToStep(const dte_adamw_step& in, dte::AdamWStep* h) {
  h->lr = in.lr;
  h->beta1 = in.beta1;
  h->beta2 = in.beta2;
  h->eps = in.eps;
  h->weight_decay = in.weight_decay;
  h->step = in.step;
  h->amsgrad = in.amsgrad != 0;
  h->maximize = in.maximize != 0;
  if (in.order < 0 || in.order > DTE_ORDER_TORCH_CUDA_SINGLE_TENSOR) {
    return FailWith(DTE_INVALID_ARGUMENT, "unknown AdamW order " + std::to_string(in.order));
  }
  h->order = static_cast<dte::kernels::AdamWOrder>(in.order);
  return DTE_OK;
}

int ToLayout(const dte_mcore_layout& in, dte::ParallelLayout* out) {
  if (in.norms != DTE_MCORE_NORMS_TE && in.norms != DTE_MCORE_NORMS_LOCAL) {
    return FailWith(DTE_INVALID_ARGUMENT, "unknown MCore norms " + std::to_string(in.norms));
  }
  if (in.experts != DTE_MCORE_EXPERTS_SEQUENTIAL && in.experts != DTE_MCORE_EXPERTS_GROUPED) {
    return FailWith(DTE_INVALID_ARGUMENT, "unknown MCore experts " + std::to_string(in.experts));
  }
  out->tp = in.tp;
  out->ep = in.ep;
  out->etp = in.etp;
  if (in.vocab_divisible_by > 0) out->vocab_divisible_by = in.vocab_divisible_by;
  out->norms = in.norms == DTE_MCORE_NORMS_LOCAL ? dte::McoreNorms::kLocal
                                                 : dte::McoreNorms::kTransformerEngine;
  out->experts = in.experts == DTE_MCORE_EXPERTS_GROUPED ? dte::McoreExperts::kGrouped
                                                         : dte::McoreExperts::kSequential;
  return DTE_OK;
}

void FillResult(const dte::PublishResult& r, dte_publish_result* out) {
  if (out == nullptr) return;
  *out =
      dte_publish_result{r.version, r.parent,          r.tensors,   r.elements,     r.changed,
                         r.flagged, r.false_positives, r.uncertain, r.stored_bytes, r.state_bytes};
}

int OpenPublisher(const dte::PublisherOptions& o, dte_publisher** out) {
  auto opened = dte::Publisher::Open(o);
  if (!opened.ok()) return Fail(opened.status());
  *out = Issue(new dte_publisher{nullptr, std::move(opened).value(), "null", ""});
  return DTE_OK;
}

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

// A transport whose exchanges a dte_exchange_fn runs; broken after the
// first failure, as the other transports are.
class CallbackTransport : public dte::Transport {
 public:
  CallbackTransport(int rank, int size, dte_exchange_fn fn, void* ctx)
      : rank_(rank), size_(size), fn_(fn), ctx_(ctx) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  dte::Status Exchange(std::span<const dte::SendBuffer> sends,
                       std::span<const dte::RecvBuffer> recvs) override {
    if (!broken_.ok()) return broken_;
    std::vector<dte_message> s, r;
    for (const auto& b : sends) {
      s.push_back({b.peer, const_cast<void*>(b.data), static_cast<uint64_t>(b.bytes)});
    }
    for (const auto& b : recvs) r.push_back({b.peer, b.data, static_cast<uint64_t>(b.bytes)});
    char error[1024] = {0};
    if (fn_(ctx_, s.data(), s.size(), r.data(), r.size(), error, sizeof(error)) != 0) {
      error[sizeof(error) - 1] = 0;
      broken_ = dte::IOError(std::string("exchange failed: ") +
                             (error[0] ? error : "the exchange function gave no reason"));
    }
    return broken_;
  }

 private:
  int rank_, size_;
  dte_exchange_fn fn_;
  void* ctx_;
  dte::Status broken_;
};

}  // namespace

extern "C" {

const char* dte_last_error(void) { return last_error.c_str(); }

int dte_c_api_version(void) { return DTE_C_API_VERSION; }

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

int dte_publisher_close(dte_publisher* p) { return Close(p, __func__); }

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

int dte_store_open(const char* store, const char* cache_dir, dte_store** out) {
  return Guard([&] {
    if (store == nullptr || out == nullptr) {
      return FailWith(DTE_INVALID_ARGUMENT, "dte_store_open: store and out must be set");
    }
    dte::StoreOptions o;
    o.uri = store;
    o.cache_dir = OrEmpty(cache_dir);
    o.index_optional = true;
    auto opened = dte::Store::Open(o);
    if (!opened.ok()) return Fail(opened.status());
    *out = Issue(new dte_store{std::move(opened).value()});
    return static_cast<int>(DTE_OK);
  });
}

int dte_store_close(dte_store* s) { return Close(s, __func__); }

int dte_store_latest(dte_store* h, int* has_version_out, uint64_t* version_out) {
  return WithHandle(h, __func__, [&](dte_store& s) {
    if (has_version_out == nullptr || version_out == nullptr) {
      return FailWith(DTE_INVALID_ARGUMENT, "dte_store_latest: arguments must be set");
    }
    auto latest = s.impl->Latest();
    if (!latest.ok()) return Fail(latest.status());
    *has_version_out = latest->has_value() ? 1 : 0;
    *version_out = latest->value_or(0);
    return static_cast<int>(DTE_OK);
  });
}

int dte_store_read_tensor(dte_store* h, uint64_t version, const char* name, void* dst,
                          uint64_t bytes) {
  return WithHandle(h, __func__, [&](dte_store& s) {
    if (name == nullptr || (dst == nullptr && bytes > 0)) {
      return FailWith(DTE_INVALID_ARGUMENT, "dte_store_read_tensor: arguments must be set");
    }
    auto v = s.impl->GetVersion(version);
    if (!v.ok()) return Fail(v.status());
    for (const auto& f : (*v)->manifest.files) {
      for (const auto& t : f.tensors) {
        if (t.name != name) continue;
        if (t.bytes() != bytes) {
          return FailWith(DTE_INVALID_ARGUMENT,
                          "tensor " + t.name + " of " + dte::VersionName(version) + " holds " +
                              std::to_string(t.bytes()) + " bytes, not " + std::to_string(bytes));
        }
        dte::Materializer reader(s.impl.get());
        // Chain walks start at this host's snapshots where there are some.
        std::unique_ptr<dte::SnapshotSet> snapshots = dte::OpenStoreSnapshots(*s.impl);
        reader.SetBase(snapshots.get());
        auto* out = static_cast<uint8_t*>(dst);
        dte::Status st = reader.ReadFile(*v, f, f.header_size + t.begin, bytes, out);
        if (!st.ok()) return Fail(st);
        if (dte::HashBytes(out, bytes) != t.hash) {
          return FailWith(DTE_CORRUPTION, "tensor " + t.name + " of " + dte::VersionName(version) +
                                              " does not match its content hash");
        }
        return static_cast<int>(DTE_OK);
      }
    }
    return FailWith(DTE_NOT_FOUND, "tensor " + std::string(name) + " is not in " +
                                       dte::VersionName(version) + " of store " + s.impl->uri());
  });
}

int dte_live_apply_version(const char* mount, uint64_t version, dte_live_counts* out) {
  return Guard([&] {
    if (mount == nullptr) {
      return FailWith(DTE_INVALID_ARGUMENT, "dte_live_apply_version: mount must be set");
    }
    std::optional<uint64_t> v;
    if (version != DTE_LIVE_LATEST) v = version;
    auto r = dte::live::Apply(mount, v);
    if (!r.ok()) return Fail(r.status());
    if (out != nullptr) *out = r->counts;
    return static_cast<int>(DTE_OK);
  });
}

int dte_live_get_status(const char* mount, dte_live_status* out) {
  return Guard([&] {
    if (mount == nullptr || out == nullptr) {
      return FailWith(DTE_INVALID_ARGUMENT, "dte_live_get_status: mount and out must be set");
    }
    auto r = dte::live::GetStatus(mount);
    if (!r.ok()) return Fail(r.status());
    *out = *r;
    return static_cast<int>(DTE_OK);
  });
}

int dte_live_open(const char* mount, dte_live** out) {
  return Guard([&] {
    if (mount == nullptr || out == nullptr) {
      return FailWith(DTE_INVALID_ARGUMENT, "dte_live_open: mount and out must be set");
    }
    auto c = dte::live::Control::Open(mount);
    if (!c.ok()) return Fail(c.status());
    *out = Issue(new dte_live{std::move(c).value()});
    return static_cast<int>(DTE_OK);
  });
}

int dte_live_register_buffer(dte_live* h, dte_live_register* inout) {
  return WithHandle(h, __func__, [&](dte_live& l) {
    if (inout == nullptr) {
      return FailWith(DTE_INVALID_ARGUMENT, "dte_live_register_buffer: no buffer to register");
    }
    auto id = l.impl.Register(inout);
    if (!id.ok()) return Fail(id.status());
    return static_cast<int>(DTE_OK);
  });
}

int dte_live_unregister(dte_live* h, uint64_t id) {
  return WithHandle(h, __func__, [&](dte_live& l) {
    dte::Status s = l.impl.Unregister(id);
    if (!s.ok()) return Fail(s);
    return static_cast<int>(DTE_OK);
  });
}

int dte_live_close(dte_live* l) { return Close(l, __func__); }

int dte_transport_tcp(int32_t rank, int32_t size, const char* rendezvous_dir, int64_t timeout_ms,
                      const char* secret, dte_transport** out) {
  return Guard([&] {
    if (rendezvous_dir == nullptr || out == nullptr || timeout_ms <= 0) {
      return FailWith(DTE_INVALID_ARGUMENT,
                      "dte_transport_tcp: rendezvous_dir, out and a positive timeout must be set");
    }
    dte::TransportOptions o;
    o.rank = rank;
    o.size = size;
    o.rendezvous_dir = rendezvous_dir;
    if (secret) o.secret = secret;
    o.timeout = std::chrono::milliseconds(timeout_ms);
    auto t = dte::ConnectTcpTransport(o);
    if (!t.ok()) return Fail(t.status());
    *out = Issue(new dte_transport{nullptr, std::move(t).value()});
    return static_cast<int>(DTE_OK);
  });
}

int dte_transport_callback(int32_t rank, int32_t size, dte_exchange_fn fn, void* ctx,
                           dte_transport** out) {
  return Guard([&] {
    if (fn == nullptr || out == nullptr || size < 1 || rank < 0 || rank >= size) {
      return FailWith(DTE_INVALID_ARGUMENT,
                      "dte_transport_callback: fn and out must be set, 0 <= rank < size");
    }
    *out =
        Issue(new dte_transport{nullptr, std::make_unique<CallbackTransport>(rank, size, fn, ctx)});
    return static_cast<int>(DTE_OK);
  });
}

int dte_transport_store(dte_dist_publisher* h, int32_t rank, int32_t size, const char* job,
                        int64_t timeout_ms, dte_transport** out) {
  return Guard([&] {
    // The transport uses p's store: it keeps p alive.
    std::shared_ptr<dte_dist_publisher> p = Find(h, "dte_transport_store");
    if (p == nullptr) return static_cast<int>(DTE_INVALID_ARGUMENT);
    if (job == nullptr || *job == '\0' || out == nullptr || timeout_ms <= 0) {
      return FailWith(DTE_INVALID_ARGUMENT,
                      "dte_transport_store: job, out and a positive timeout must be set");
    }
    dte::StoreTransportOptions o;
    o.base.rank = rank;
    o.base.size = size;
    o.base.timeout = std::chrono::milliseconds(timeout_ms);
    o.prefix = std::string("exchange/") + job + "/";
    auto t = dte::ConnectStoreTransport(&p->impl->store().objects(), o);
    if (!t.ok()) return Fail(t.status());
    *out = Issue(new dte_transport{p, std::move(t).value()});
    return static_cast<int>(DTE_OK);
  });
}

int dte_transport_close(dte_transport* t) { return Close(t, __func__); }

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
      const dte_adamw_range& in = ranges[i];
      if (in.name == nullptr) {
        return FailWith(DTE_INVALID_ARGUMENT, "range " + std::to_string(i) + " has no name");
      }
      dte::RangeState& r = states[i];
      r.name = in.name;
      r.tp_rank = in.tp_rank;
      r.ep_rank = in.ep_rank;
      r.begin = in.begin;
      r.end = in.end;
      r.param = in.param;
      r.exp_avg = in.exp_avg;
      r.exp_avg_sq = in.exp_avg_sq;
      if (in.state_step >= 0) r.state_step = in.state_step;
      if (!std::isnan(in.lr)) r.lr = in.lr;
      if (!std::isnan(in.weight_decay)) r.weight_decay = in.weight_decay;
      if (in.memory == DTE_MEMORY_CUDA) {
        if (in.device < 0) {
          return FailWith(DTE_INVALID_ARGUMENT, "range " + std::to_string(i) + " (" + r.name +
                                                    "): CUDA device " + std::to_string(in.device) +
                                                    " is not a device ordinal");
        }
        r.device = in.device;
      } else if (in.memory != DTE_MEMORY_HOST) {
        return FailWith(DTE_INVALID_ARGUMENT, "range " + std::to_string(i) + " (" + r.name +
                                                  "): unknown memory kind " +
                                                  std::to_string(in.memory));
      }
    }
    auto r = p.impl->PublishAdamW(*t->impl, adamw, states);
    if (!r.ok()) return Fail(r.status());
    FillResult(*r, out);
    p.last_push = PushJson(*r);
    return static_cast<int>(DTE_OK);
  });
}

}  // extern "C"

int dte_push_server_start(const char* address, const char* advertise, int64_t timeout_ms,
                          int64_t receivers, int64_t cache_bytes, const char* secret,
                          const char* rendezvous_dir, dte_push_server** out) {
  return Guard([&] {
    if (address == nullptr || out == nullptr || timeout_ms <= 0 || receivers < 0) {
      return FailWith(DTE_INVALID_ARGUMENT,
                      "dte_push_server_start: address and out must be set, timeout_ms > 0, "
                      "receivers >= 0");
    }
    dte::PushServerOptions o;
    o.address = address;
    if (advertise) o.advertise = advertise;
    if (secret) o.secret = secret;
    if (rendezvous_dir) o.rendezvous_dir = rendezvous_dir;
    o.receivers = static_cast<uint64_t>(receivers);
    if (cache_bytes >= 0) o.cache_bytes = static_cast<uint64_t>(cache_bytes);
    o.timeout = std::chrono::milliseconds(timeout_ms);
    auto s = dte::PushServer::Start(o);
    if (!s.ok()) return Fail(s.status());
    *out = Issue(new dte_push_server{std::move(s).value(), {}});
    return static_cast<int>(DTE_OK);
  });
}

int dte_push_server_close(dte_push_server* s) { return Close(s, __func__); }

int dte_push_server_port(dte_push_server* h, int32_t* port_out) {
  return WithHandle(h, __func__, [&](dte_push_server& s) {
    if (port_out == nullptr) {
      return FailWith(DTE_INVALID_ARGUMENT, "dte_push_server_port: port_out must be set");
    }
    *port_out = s.impl->port();
    return static_cast<int>(DTE_OK);
  });
}

int dte_push_server_address(dte_push_server* h, const char** address_out) {
  return WithHandle(h, __func__, [&](dte_push_server& s) {
    if (address_out == nullptr) {
      return FailWith(DTE_INVALID_ARGUMENT, "dte_push_server_address: address_out must be set");
    }
    s.json = s.impl->address();
    *address_out = s.json.c_str();
    return static_cast<int>(DTE_OK);
  });
}

int dte_push_server_set_group(dte_push_server* h, int32_t part, int32_t parts) {
  return WithHandle(h, __func__, [&](dte_push_server& s) {
    dte::Status st = s.impl->SetGroup(part, parts);
    return st.ok() ? static_cast<int>(DTE_OK) : Fail(st);
  });
}

int dte_push_server_status_json(dte_push_server* h, int32_t take_events, const char** json_out) {
  return WithHandle(h, __func__, [&](dte_push_server& s) {
    if (json_out == nullptr) {
      return FailWith(DTE_INVALID_ARGUMENT, "dte_push_server_status_json: json_out must be set");
    }
    s.json = s.impl->StatusJson(take_events != 0);
    *json_out = s.json.c_str();
    return static_cast<int>(DTE_OK);
  });
}

int dte_publisher_set_push(dte_publisher* p, dte_push_server* s) { return SetPush(p, s, __func__); }

int dte_publisher_last_push_json(dte_publisher* p, const char** json_out) {
  return LastPushJson(p, __func__, json_out);
}

int dte_push_receiver_open(const char* address, int32_t rank, int32_t tp, int32_t fuse_qkv,
                           int32_t fuse_gate_up, int32_t has_version, uint64_t version,
                           const dte_push_tensor* tensors, size_t count, int32_t auto_apply,
                           int64_t timeout_ms, const char* secret, dte_push_receiver** out) {
  return Guard([&] {
    if (address == nullptr || out == nullptr || (tensors == nullptr && count > 0) ||
        timeout_ms <= 0) {
      return FailWith(DTE_INVALID_ARGUMENT,
                      "dte_push_receiver_open: address, tensors and out must be set, "
                      "timeout_ms > 0");
    }
    dte::PushReceiverOptions o;
    o.address = address;
    if (secret) o.secret = secret;
    o.rank = rank;
    o.layout = dte::ShardLayout{tp, fuse_qkv != 0, fuse_gate_up != 0};
    if (has_version) o.version = version;
    o.auto_apply = auto_apply != 0;
    o.timeout = std::chrono::milliseconds(timeout_ms);
    for (size_t i = 0; i < count; ++i) {
      const dte_push_tensor& t = tensors[i];
      if (t.name == nullptr || t.dtype == nullptr || (t.shape == nullptr && t.ndim > 0) ||
          t.ndim < 0) {
        return FailWith(DTE_INVALID_ARGUMENT,
                        "push receiver tensor " + std::to_string(i) + ": name, dtype, shape");
      }
      auto dtype = dte::ParseDType(t.dtype);
      if (!dtype) {
        return FailWith(DTE_INVALID_ARGUMENT, std::string("push receiver tensor ") + t.name +
                                                  ": unknown dtype " + t.dtype);
      }
      dte::PushTensor pt{t.name, *dtype, {}, t.data, t.device};
      for (int32_t d = 0; d < t.ndim; ++d) {
        if (t.shape[d] < 0) {
          return FailWith(DTE_INVALID_ARGUMENT,
                          std::string("push receiver tensor ") + t.name + ": negative shape");
        }
        pt.shape.push_back(static_cast<uint64_t>(t.shape[d]));
      }
      o.tensors.push_back(std::move(pt));
    }
    auto r = dte::PushReceiver::Open(o);
    if (!r.ok()) return Fail(r.status());
    *out = Issue(new dte_push_receiver{std::move(r).value(), {}});
    return static_cast<int>(DTE_OK);
  });
}

int dte_push_receiver_close(dte_push_receiver* r) { return Close(r, __func__); }

int dte_push_receiver_apply_pending(dte_push_receiver* h, uint64_t* applied_out) {
  return WithHandle(h, __func__, [&](dte_push_receiver& r) {
    auto n = r.impl->ApplyPending();
    if (!n.ok()) return Fail(n.status());
    if (applied_out) *applied_out = *n;
    return static_cast<int>(DTE_OK);
  });
}

int dte_push_receiver_wait_for(dte_push_receiver* h, uint64_t version, int64_t timeout_ms) {
  return WithHandle(h, __func__, [&](dte_push_receiver& r) {
    if (timeout_ms < 0) {
      return FailWith(DTE_INVALID_ARGUMENT, "dte_push_receiver_wait_for: negative timeout_ms");
    }
    dte::Status s = r.impl->WaitFor(version, std::chrono::milliseconds(timeout_ms));
    return s.ok() ? static_cast<int>(DTE_OK) : Fail(s);
  });
}

int dte_push_receiver_catch_up(dte_push_receiver* h, dte_store* sh, int32_t has_version,
                               uint64_t version) {
  return WithHandle(h, __func__, [&](dte_push_receiver& r) {
    std::shared_ptr<dte_store> s = Find(sh, "dte_push_receiver_catch_up");
    if (s == nullptr) return static_cast<int>(DTE_INVALID_ARGUMENT);
    dte::Status st =
        r.impl->CatchUp(*s->impl, has_version ? std::optional<uint64_t>(version) : std::nullopt);
    return st.ok() ? static_cast<int>(DTE_OK) : Fail(st);
  });
}

int dte_push_receiver_get_status(dte_push_receiver* h, dte_push_receiver_status* out,
                                 const char** error_out) {
  return WithHandle(h, __func__, [&](dte_push_receiver& r) {
    if (out == nullptr) {
      return FailWith(DTE_INVALID_ARGUMENT, "dte_push_receiver_get_status: out must be set");
    }
    dte::PushReceiverStatus st = r.impl->GetStatus();
    *out = dte_push_receiver_status{};
    out->has_version = st.version.has_value();
    out->version = st.version.value_or(0);
    out->inconsistent = st.inconsistent;
    out->connected = st.connected;
    out->has_behind = st.behind.has_value();
    out->behind = st.behind.value_or(0);
    out->pending = st.pending;
    out->pushes = st.pushes;
    out->elements = st.elements;
    r.error = st.error;
    if (error_out) *error_out = r.error.c_str();
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

int dte_publisher_metrics_text(dte_publisher* p, const char** text_out) {
  return MetricsText(p, "dte_publisher_metrics_text", text_out);
}

int dte_dist_publisher_metrics_text(dte_dist_publisher* p, const char** text_out) {
  return MetricsText(p, "dte_dist_publisher_metrics_text", text_out);
}

int dte_publisher_serve_metrics(dte_publisher* p, const char* address, int32_t* port_out) {
  return ServeMetrics(p, "dte_publisher_serve_metrics", address, port_out);
}

int dte_dist_publisher_serve_metrics(dte_dist_publisher* p, const char* address,
                                     int32_t* port_out) {
  return ServeMetrics(p, "dte_dist_publisher_serve_metrics", address, port_out);
}

int dte_publisher_push_metrics(dte_publisher* p, const char* gateway, const char* job,
                               const char* const* label_names, const char* const* label_values,
                               size_t label_count) {
  return PushMetrics(p, "dte_publisher_push_metrics", gateway, job, label_names, label_values,
                     label_count);
}

int dte_dist_publisher_push_metrics(dte_dist_publisher* p, const char* gateway, const char* job,
                                    const char* const* label_names, const char* const* label_values,
                                    size_t label_count) {
  return PushMetrics(p, "dte_dist_publisher_push_metrics", gateway, job, label_names, label_values,
                     label_count);
}
