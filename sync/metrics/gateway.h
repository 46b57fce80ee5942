// Pushing a Registry's current values to a Prometheus Pushgateway, for a
// job that is not scraped (a short run, a host behind a firewall).
#pragma once

#include <map>
#include <string>

#include "store/base/status.h"
#include "sync/metrics/registry.h"

namespace dte::metrics {

// Pushes `registry` to the Pushgateway at `gateway` (http://HOST:PORT or
// HOST:PORT) as job `job` with grouping labels `labels` (e.g.
// {{"rank", "0"}}), replacing what that group held. InvalidArgument naming
// the gateway, job or label that cannot form a group's URL; Unavailable
// naming the gateway and the job when the transfer fails (no answer);
// IOError naming them and the HTTP status when the gateway refuses it.
Status PushToGateway(const Registry& registry, const std::string& gateway, const std::string& job,
                     const std::map<std::string, std::string>& labels);

}  // namespace dte::metrics
