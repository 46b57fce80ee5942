// The calls of dte_publisher that sync/capi/publisher.cc and
// publisher_ranks.cc share: anchor policy, push server, last push report
// and metrics. `fn` names the C function in errors.
#pragma once

#include <map>
#include <memory>
#include <string>

#include "sync/capi/internal/c_api_glue.h"
#include "sync/capi/internal/c_api_objects.h"
#include "sync/publish/publish_metrics.h"

namespace dte::capi {

// Changes a publisher's anchor policy with edit(&policy): the setters'
// C functions. `fn` names the C function in errors.
template <typename Edit>
int EditAnchorPolicy(dte_publisher* h, const char* fn, const Edit& edit) {
  return WithHandle(h, fn, [&](dte_publisher& p) {
    dte::AnchorPolicy policy = p.impl->anchor_policy();
    edit(&policy);
    dte::Status s = p.impl->SetAnchorPolicy(policy);
    return s.ok() ? static_cast<int>(DTE_OK) : Fail(s);
  });
}

// dte_publisher_set_push: the publisher
// holds the server (s NULL: none) until it is set again or closed, so a
// server closed while set goes on until then.
inline int SetPush(dte_publisher* h, dte_push_server* s, const char* fn) {
  return WithHandle(h, fn, [&](dte_publisher& p) {
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

inline int LastPushJson(dte_publisher* h, const char* fn, const char** json_out) {
  return WithHandle(h, fn, [&](dte_publisher& p) {
    if (json_out == nullptr) {
      return FailWith(DTE_INVALID_ARGUMENT, std::string(fn) + ": json_out must be set");
    }
    *json_out = p.last_push.c_str();
    return static_cast<int>(DTE_OK);
  });
}

// The metrics calls. `fn` names the C function in errors.
inline int MetricsText(dte_publisher* h, const char* fn, const char** text_out) {
  return WithHandle(h, fn, [&](dte_publisher& p) {
    if (text_out == nullptr) {
      return FailWith(DTE_INVALID_ARGUMENT, std::string(fn) + ": text_out must be set");
    }
    p.metrics = p.impl->metrics().Text();
    *text_out = p.metrics.c_str();
    return static_cast<int>(DTE_OK);
  });
}

inline int ServeMetrics(dte_publisher* h, const char* fn, const char* address, int32_t* port_out) {
  return WithHandle(h, fn, [&](dte_publisher& p) {
    if (address == nullptr) {
      return FailWith(DTE_INVALID_ARGUMENT, std::string(fn) + ": address must be set");
    }
    dte::Result<int> port = p.impl->metrics().Serve(address);
    if (!port.ok()) return Fail(port.status());
    if (port_out != nullptr) *port_out = *port;
    return static_cast<int>(DTE_OK);
  });
}

inline int PushMetrics(dte_publisher* h, const char* fn, const char* gateway, const char* job,
                       const char* const* label_names, const char* const* label_values,
                       size_t label_count) {
  return WithHandle(h, fn, [&](dte_publisher& p) {
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

}  // namespace dte::capi
