// PublishMetrics: what a trainer's publishes did, as Prometheus metrics in
// a metrics::Registry (sync/metrics/registry.h): versions committed and
// publishes failed, elements examined, flagged and changed, bytes of
// optimizer state read and of blobs stored, publish and push durations,
// and for a ranged publish what this rank routed and encoded. Every
// Publisher records into its own (metrics()). A trainer
// serves the registry (Serve, or its own prometheus::Exposer), pushes it to
// a Pushgateway (Push, or its own prometheus::Gateway), or reads the
// exposition text (Text). Names and meanings: docs/engine.md, "Metrics".
//
// With several ranks every rank records the committed version's
// figures (the same on every rank: scrape one rank, or aggregate with max);
// the dte_publish_dist_* counters are the rank's own.
//
// Thread-safety: recording, Text and scrapes may run concurrently (the
// registry's metrics are atomic); Serve and Push from one thread at a time.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "store/base/status.h"
#include "sync/metrics/listen.h"

namespace prometheus {
class Registry;
}  // namespace prometheus

namespace dte {

struct PublishResult;
struct DistPublishStats;

class PublishMetrics {
 public:
  PublishMetrics();
  ~PublishMetrics();
  PublishMetrics(const PublishMetrics&) = delete;
  PublishMetrics& operator=(const PublishMetrics&) = delete;

  // The prometheus-cpp registry holding the metrics, for a trainer's own
  // exposer or gateway (RegisterCollectable) or to collect next to its own
  // metrics; a trainer that uses it links prometheus-cpp itself.
  std::shared_ptr<prometheus::Registry> registry() const;

  // A publish of optimizer step `step` that committed `r` (its push, if
  // any, included) in `seconds`.
  void Committed(const PublishResult& r, int64_t step, double seconds);
  // A publish that failed after `seconds`: nothing was committed.
  void Failed(double seconds);
  // What a ranged publish (Publisher::PublishRanges) did on this rank,
  // committed or not.
  void Routed(const DistPublishStats& s);

  // Runs `publish` (returning a Result<PublishResult>), times it and
  // records what it committed, or the failure.
  template <typename Fn>
  auto Record(int64_t step, Fn&& publish) {
    const auto start = std::chrono::steady_clock::now();
    auto r = publish();
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (r.ok()) {
      Committed(*r, step, seconds);
    } else {
      Failed(seconds);
    }
    return r;
  }

  // The exposition text a scrape returns.
  std::string Text() const;

  // Serves the registry at http://ADDRESS/metrics (MetricsListenAddress;
  // port 0: any free port) until the next Serve or the destructor; returns
  // the port. An empty address stops serving. IOError naming the address if
  // it cannot listen (a server already running serves on).
  Result<int> Serve(const std::string& address);

  // Pushes the current values to the Pushgateway at `gateway`
  // (http://HOST:PORT or HOST:PORT) as job `job` with grouping labels
  // `labels` (e.g. {{"rank", "0"}}), replacing what that group held.
  // Unavailable naming the gateway and the job when it cannot be reached,
  // IOError naming them and the HTTP status when it does not accept it.
  Status Push(const std::string& gateway, const std::string& job,
              const std::map<std::string, std::string>& labels);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dte
