// The C ABI of dte_push_server: a publisher's push to inference servers.
#include "sync/push/push_server.h"

#include <chrono>
#include <string>
#include <utility>

#include "sync/capi/c_api.h"
#include "sync/capi/internal/c_api_glue.h"
#include "sync/capi/internal/c_api_objects.h"

using dte::capi::Close;
using dte::capi::Fail;
using dte::capi::FailWith;
using dte::capi::Guard;
using dte::capi::Issue;
using dte::capi::WithHandle;

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
