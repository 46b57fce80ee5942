#include "sync/metrics/listen.h"

namespace dte {

std::string MetricsListenAddress(const std::string& address) {
  return address.find(':') == std::string::npos ? "127.0.0.1:" + address : address;
}

}  // namespace dte
