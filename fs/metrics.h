// dtefs --metrics ADDR: the daemon's counters and gauges (those of
// .dte/status) and its read and apply latency histograms in the Prometheus
// exposition format at http://ADDR/metrics, through sync/metrics (a
// Collector read at each scrape). Every scrape reads the values of the
// moment; names and their meaning are in docs/fs.md ("Metrics").
//
// Thread-safety: the server's threads read the filesystem's thread-safe
// status; Start and the destructor from one thread.
#pragma once

#include <memory>
#include <string>

#include "store/base/status.h"

namespace dte::fs {

class Filesystem;

class MetricsServer {
 public:
  // Listens on `address` (HOST:PORT; port 0: any free port); `fs` must
  // outlive the server. IOError naming the address if it cannot listen.
  static Result<std::unique_ptr<MetricsServer>> Start(const std::string& address, Filesystem* fs);
  ~MetricsServer();
  int port() const;

  class Impl;

 private:
  explicit MetricsServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// The exposition text a scrape returns (for tests without a server).
std::string MetricsText(Filesystem& fs);

}  // namespace dte::fs
