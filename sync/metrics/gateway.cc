#include "sync/metrics/gateway.h"

#include <prometheus/gateway.h>
#include <prometheus/registry.h>

#include <exception>

namespace dte::metrics {
namespace {

// `gateway` as http://HOST:PORT, or InvalidArgument.
Result<std::string> GatewayUrl(const std::string& gateway) {
  std::string url = gateway;
  while (!url.empty() && url.back() == '/') url.pop_back();
  if (url.find("://") == std::string::npos) url = "http://" + url;
  const size_t colon = url.rfind(':');
  if (colon == std::string::npos || colon < url.find("://") + 3 || colon + 1 == url.size()) {
    return InvalidArgument("gateway \"" + gateway + "\" is not HOST:PORT");
  }
  return url;
}

Status CheckGroup(const std::string& job, const std::map<std::string, std::string>& labels) {
  if (job.empty() || job.find('/') != std::string::npos) {
    return InvalidArgument("Pushgateway job \"" + job + "\" must be non-empty and without '/'");
  }
  for (const auto& [name, value] : labels) {
    if (name.empty() || value.empty() || value.find('/') != std::string::npos) {
      return InvalidArgument("grouping label " + name + "=\"" + value +
                             "\" must have a name and a non-empty value without '/'");
    }
  }
  return Status::Ok();
}

}  // namespace

Status PushToGateway(const Registry& registry, const std::string& gateway, const std::string& job,
                     const std::map<std::string, std::string>& labels) {
  ASSIGN_OR_RETURN(const std::string url, GatewayUrl(gateway));
  RETURN_IF_ERROR(CheckGroup(job, labels));
  const size_t colon = url.rfind(':');
  const std::string what = "push to " + url + " (job " + job + ")";
  try {
    prometheus::Gateway g(url.substr(0, colon), url.substr(colon + 1), job,
                          prometheus::Labels(labels.begin(), labels.end()));
    g.RegisterCollectable(registry.native());
    const int code = g.Push();
    if (code < 0) {  // no answer: the gateway is down or unreachable for now
      return Unavailable(what + ": transfer failed (curl error " + std::to_string(-code) + ")");
    }
    if (code < 200 || code >= 300) return IOError(what + ": HTTP " + std::to_string(code));
  } catch (const std::exception& e) {
    return IOError(what + ": " + e.what());
  }
  return Status::Ok();
}

}  // namespace dte::metrics
