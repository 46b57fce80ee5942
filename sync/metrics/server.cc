#include "sync/metrics/server.h"

#include <prometheus/exposer.h>
#include <prometheus/registry.h>

#include <exception>
#include <utility>
#include <vector>

#include "sync/metrics/internal/collectable.h"

namespace dte::metrics {

struct Server::Impl {
  // The exposer holds weak pointers: the collectors live here, declared
  // first so that they are destroyed after the exposer has stopped.
  std::vector<std::shared_ptr<prometheus::Collectable>> collectors;
  std::unique_ptr<prometheus::Exposer> exposer;
};

Result<std::unique_ptr<Server>> Server::Start(const std::string& address, int threads) {
  auto impl = std::make_unique<Impl>();
  try {
    impl->exposer = std::make_unique<prometheus::Exposer>(address, threads);
  } catch (const std::exception& e) {
    return IOError("cannot listen on " + address + ": " + e.what());
  }
  return std::unique_ptr<Server>(new Server(std::move(impl)));
}

Server::Server(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Server::~Server() = default;

void Server::Serve(const Registry& registry) {
  impl_->exposer->RegisterCollectable(registry.native());
}

void Server::Serve(Collector collect) {
  auto c = std::make_shared<internal::CollectorCollectable>(std::move(collect));
  impl_->collectors.push_back(c);
  impl_->exposer->RegisterCollectable(c);
}

int Server::port() const {
  const std::vector<int> ports = impl_->exposer->GetListeningPorts();
  return ports.empty() ? 0 : ports.front();
}

}  // namespace dte::metrics
