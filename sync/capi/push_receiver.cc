// The C ABI of dte_push_receiver: an inference server's end of a push.
#include "sync/push/push_receiver.h"

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "sync/capi/c_api.h"
#include "sync/capi/internal/c_api_glue.h"
#include "sync/capi/internal/c_api_objects.h"

using dte::capi::Close;
using dte::capi::Fail;
using dte::capi::FailWith;
using dte::capi::Find;
using dte::capi::Guard;
using dte::capi::Issue;
using dte::capi::WithHandle;

namespace {

// Tensor i of a dte_push_receiver_open call; refuses a missing name, dtype
// or shape, an unknown dtype and a negative extent.
int ToPushTensor(const dte_push_tensor& t, size_t i, dte::PushTensor* out) {
  if (t.name == nullptr || t.dtype == nullptr || (t.shape == nullptr && t.ndim > 0) || t.ndim < 0) {
    return FailWith(DTE_INVALID_ARGUMENT,
                    "push receiver tensor " + std::to_string(i) + ": name, dtype, shape");
  }
  auto dtype = dte::ParseDType(t.dtype);
  if (!dtype) {
    return FailWith(DTE_INVALID_ARGUMENT,
                    std::string("push receiver tensor ") + t.name + ": unknown dtype " + t.dtype);
  }
  *out = dte::PushTensor{t.name, *dtype, {}, t.data, t.device};
  for (int32_t d = 0; d < t.ndim; ++d) {
    if (t.shape[d] < 0) {
      return FailWith(DTE_INVALID_ARGUMENT,
                      std::string("push receiver tensor ") + t.name + ": negative shape");
    }
    out->shape.push_back(static_cast<uint64_t>(t.shape[d]));
  }
  return DTE_OK;
}

// The FP8 options of an open call (block sizes 0: the default).
dte::Fp8ReceiverOptions Fp8Of(uint64_t block_rows, uint64_t block_cols, int32_t rule) {
  dte::Fp8ReceiverOptions fp8;
  fp8.block_rows = block_rows ? block_rows : dte::kernels::kFp8DefaultBlock;
  fp8.block_cols = block_cols ? block_cols : dte::kernels::kFp8DefaultBlock;
  fp8.rule = rule == DTE_PUSH_FP8_POW2 ? dte::kernels::Fp8ScaleRule::kPowerOfTwo
                                       : dte::kernels::Fp8ScaleRule::kPlain;
  return fp8;
}

// dte_push_receiver_open and dte_push_receiver_open_fp8 (fp8: null for none).
int OpenReceiver(const char* address, int32_t rank, int32_t tp, int32_t fuse_qkv,
                 int32_t fuse_gate_up, int32_t has_version, uint64_t version,
                 const dte_push_tensor* tensors, size_t count, int32_t auto_apply,
                 int64_t timeout_ms, const char* secret, const dte::Fp8ReceiverOptions* fp8,
                 const char* server, int32_t server_size, uint64_t stage_bytes,
                 dte_push_receiver** out) {
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
  if (fp8) o.fp8 = *fp8;
  if (server) o.server = server;
  o.server_size = server_size;
  if (stage_bytes) o.stage_bytes = stage_bytes;
  for (size_t i = 0; i < count; ++i) {
    dte::PushTensor pt;
    if (int rc = ToPushTensor(tensors[i], i, &pt); rc != DTE_OK) return rc;
    o.tensors.push_back(std::move(pt));
  }
  auto r = dte::PushReceiver::Open(o);
  if (!r.ok()) return Fail(r.status());
  *out = Issue(new dte_push_receiver{std::move(r).value(), {}, {}});
  return static_cast<int>(DTE_OK);
}

}  // namespace

int dte_push_receiver_open(const char* address, int32_t rank, int32_t tp, int32_t fuse_qkv,
                           int32_t fuse_gate_up, int32_t has_version, uint64_t version,
                           const dte_push_tensor* tensors, size_t count, int32_t auto_apply,
                           int64_t timeout_ms, const char* secret, dte_push_receiver** out) {
  return Guard([&] {
    return OpenReceiver(address, rank, tp, fuse_qkv, fuse_gate_up, has_version, version, tensors,
                        count, auto_apply, timeout_ms, secret, nullptr, nullptr, 1, 0, out);
  });
}

int dte_push_receiver_open_fp8(const char* address, int32_t rank, int32_t tp, int32_t fuse_qkv,
                               int32_t fuse_gate_up, int32_t has_version, uint64_t version,
                               const dte_push_tensor* tensors, size_t count, int32_t auto_apply,
                               int64_t timeout_ms, const char* secret, uint64_t fp8_block_rows,
                               uint64_t fp8_block_cols, int32_t fp8_scale_rule,
                               dte_push_receiver** out) {
  return Guard([&] {
    if (fp8_scale_rule != DTE_PUSH_FP8_PLAIN && fp8_scale_rule != DTE_PUSH_FP8_POW2) {
      return FailWith(DTE_INVALID_ARGUMENT, "dte_push_receiver_open_fp8: scale rule " +
                                                std::to_string(fp8_scale_rule) +
                                                " is neither DTE_PUSH_FP8_PLAIN nor _POW2");
    }
    const dte::Fp8ReceiverOptions fp8 = Fp8Of(fp8_block_rows, fp8_block_cols, fp8_scale_rule);
    return OpenReceiver(address, rank, tp, fuse_qkv, fuse_gate_up, has_version, version, tensors,
                        count, auto_apply, timeout_ms, secret, &fp8, nullptr, 1, 0, out);
  });
}

int dte_push_receiver_open_server(const char* address, int32_t rank, int32_t tp, int32_t fuse_qkv,
                                  int32_t fuse_gate_up, int32_t has_version, uint64_t version,
                                  const dte_push_tensor* tensors, size_t count, int32_t auto_apply,
                                  int64_t timeout_ms, const char* secret, int32_t fp8,
                                  uint64_t fp8_block_rows, uint64_t fp8_block_cols,
                                  int32_t fp8_scale_rule, const char* server, int32_t server_size,
                                  uint64_t stage_bytes, dte_push_receiver** out) {
  return Guard([&] {
    if (fp8 && fp8_scale_rule != DTE_PUSH_FP8_PLAIN && fp8_scale_rule != DTE_PUSH_FP8_POW2) {
      return FailWith(DTE_INVALID_ARGUMENT, "dte_push_receiver_open_server: scale rule " +
                                                std::to_string(fp8_scale_rule) +
                                                " is neither DTE_PUSH_FP8_PLAIN nor _POW2");
    }
    const dte::Fp8ReceiverOptions options = Fp8Of(fp8_block_rows, fp8_block_cols, fp8_scale_rule);
    return OpenReceiver(address, rank, tp, fuse_qkv, fuse_gate_up, has_version, version, tensors,
                        count, auto_apply, timeout_ms, secret, fp8 ? &options : nullptr, server,
                        server_size, stage_bytes, out);
  });
}

int dte_push_receiver_move_to(dte_push_receiver* h, dte_store* sh, uint64_t version) {
  return WithHandle(h, __func__, [&](dte_push_receiver& r) {
    std::shared_ptr<dte_store> s = Find(sh, "dte_push_receiver_move_to");
    if (s == nullptr) return static_cast<int>(DTE_INVALID_ARGUMENT);
    dte::Status st = r.impl->MoveTo(*s->impl, version);
    return st.ok() ? static_cast<int>(DTE_OK) : Fail(st);
  });
}

int dte_push_receiver_path(dte_push_receiver* h, uint64_t* out, size_t cap, size_t* n_out) {
  return WithHandle(h, __func__, [&](dte_push_receiver& r) {
    if ((out == nullptr && cap > 0) || n_out == nullptr) {
      return FailWith(DTE_INVALID_ARGUMENT, "dte_push_receiver_path: out (when cap > 0) and n_out");
    }
    const std::vector<uint64_t> path = r.impl->Path();
    for (size_t i = 0; i < path.size() && i < cap; ++i) out[i] = path[i];
    *n_out = path.size();
    return static_cast<int>(DTE_OK);
  });
}

int dte_push_receiver_apply_agreed(dte_push_receiver* h, const uint64_t* versions,
                                   const size_t* lengths, size_t ranks, uint64_t* applied_out) {
  return WithHandle(h, __func__, [&](dte_push_receiver& r) {
    if (lengths == nullptr && ranks > 0) {
      return FailWith(DTE_INVALID_ARGUMENT, "dte_push_receiver_apply_agreed: lengths must be set");
    }
    std::vector<std::vector<uint64_t>> paths(ranks);
    size_t at = 0;
    for (size_t i = 0; i < ranks; ++i) {
      if (lengths[i] > 0 && versions == nullptr) {
        return FailWith(DTE_INVALID_ARGUMENT, "dte_push_receiver_apply_agreed: versions unset");
      }
      paths[i].assign(versions + at, versions + at + lengths[i]);
      at += lengths[i];
    }
    auto n = r.impl->ApplyAgreed(paths);
    if (!n.ok()) return Fail(n.status());
    if (applied_out) *applied_out = *n;
    return static_cast<int>(DTE_OK);
  });
}

int dte_push_receiver_server_status(dte_push_receiver* h, int32_t* has_version, uint64_t* version,
                                    int32_t* inconsistent, const char** error_out) {
  return WithHandle(h, __func__, [&](dte_push_receiver& r) {
    if (has_version == nullptr || version == nullptr || inconsistent == nullptr) {
      return FailWith(DTE_INVALID_ARGUMENT,
                      "dte_push_receiver_server_status: has_version, version, inconsistent");
    }
    dte::PushReceiverStatus st = r.impl->GetStatus();
    *has_version = st.server_version.has_value();
    *version = st.server_version.value_or(0);
    *inconsistent = st.server_inconsistent;
    r.server_error = st.server_error;
    if (error_out) *error_out = r.server_error.c_str();
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
    out->bytes = st.bytes;
    out->staged_bytes = st.staged_bytes;
    r.error = st.error;
    if (error_out) *error_out = r.error.c_str();
    return static_cast<int>(DTE_OK);
  });
}
