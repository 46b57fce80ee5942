// The C ABI of live apply (dte_live and the mount-wide calls): buffers
// that a dtefs mount updates in place.
#include <optional>
#include <utility>

#include "sync/capi/c_api.h"
#include "sync/capi/internal/c_api_glue.h"
#include "sync/capi/internal/c_api_objects.h"
#include "sync/live/live_client.h"

using dte::capi::Close;
using dte::capi::Fail;
using dte::capi::FailWith;
using dte::capi::Guard;
using dte::capi::Issue;
using dte::capi::WithHandle;

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

int dte_live_prepare(dte_live* h, uint64_t version, uint32_t* prepared_out, dte_live_counts* out) {
  return WithHandle(h, __func__, [&](dte_live& l) {
    if (prepared_out == nullptr) {
      return FailWith(DTE_INVALID_ARGUMENT, "dte_live_prepare: prepared_out must be set");
    }
    std::optional<uint64_t> v;
    if (version != DTE_LIVE_LATEST) v = version;
    auto r = l.impl.Prepare(v);
    if (!r.ok()) return Fail(r.status());
    *prepared_out = r->prepared;
    if (out != nullptr) *out = r->counts;
    return static_cast<int>(DTE_OK);
  });
}

int dte_live_commit(dte_live* h, uint32_t prepared, dte_live_counts* out) {
  return WithHandle(h, __func__, [&](dte_live& l) {
    auto r = l.impl.Commit(prepared);
    if (!r.ok()) return Fail(r.status());
    if (out != nullptr) *out = r->counts;
    return static_cast<int>(DTE_OK);
  });
}

int dte_live_abort(dte_live* h, uint32_t prepared) {
  return WithHandle(h, __func__, [&](dte_live& l) {
    dte::Status s = l.impl.Abort(prepared);
    if (!s.ok()) return Fail(s);
    return static_cast<int>(DTE_OK);
  });
}

int dte_live_close(dte_live* l) { return Close(l, __func__); }
