// An HTTP server of http://ADDRESS/metrics: the Registries and Collectors
// given to it, read at each scrape. Stops in its destructor.
//
// Thread-safety: Start, Serve and the destructor from one thread; scrapes
// run on the server's own threads.
#pragma once

#include <memory>
#include <string>

#include "store/base/status.h"
#include "sync/metrics/family.h"
#include "sync/metrics/registry.h"

namespace dte::metrics {

class Server {
 public:
  // Listens on `address` (HOST:PORT; port 0: any free port) with `threads`
  // threads answering scrapes. IOError "cannot listen on ADDRESS: why".
  static Result<std::unique_ptr<Server>> Start(const std::string& address, int threads);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Serves `registry`, which must outlive the server.
  void Serve(const Registry& registry);
  // Serves what `collect` returns at each scrape.
  void Serve(Collector collect);

  // The port it listens on.
  int port() const;

  struct Impl;

 private:
  explicit Server(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace dte::metrics
