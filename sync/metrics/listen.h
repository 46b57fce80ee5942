// Where a metrics endpoint listens (dtefs --metrics, PublishMetrics::Serve).
#pragma once

#include <string>

namespace dte {

// HOST:PORT as given, or 127.0.0.1:PORT for a bare PORT: metrics listen on
// loopback unless told otherwise.
std::string MetricsListenAddress(const std::string& address);

}  // namespace dte
