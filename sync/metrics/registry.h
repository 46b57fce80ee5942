// The metrics a dte module keeps itself: a Registry of unlabelled counters,
// gauges and histograms, each a handle recording into the registry, and the
// exposition text a scrape returns. Served by metrics::Server
// (sync/metrics/server.h), pushed by PushToGateway (sync/metrics/gateway.h).
// This folder is the only one that links the Prometheus client library
// (prometheus-cpp); no header here includes it.
//
// Thread-safety: handles record from any thread (atomic values); Add* and
// Text may run concurrently with recording and with each other.
#pragma once

#include <memory>
#include <string>
#include <vector>

namespace prometheus {
class Counter;
class Gauge;
class Histogram;
class Registry;
}  // namespace prometheus

namespace dte::metrics {

// A value that only goes up. Valid while its Registry lives.
class Counter {
 public:
  void Increment(double by = 1.0);

 private:
  friend class Registry;
  explicit Counter(prometheus::Counter* c) : c_(c) {}
  prometheus::Counter* c_;
};

// A value that is set.
class Gauge {
 public:
  void Set(double value);

 private:
  friend class Registry;
  explicit Gauge(prometheus::Gauge* g) : g_(g) {}
  prometheus::Gauge* g_;
};

// Observations counted in buckets of fixed upper bounds (+Inf implied).
class Histogram {
 public:
  void Observe(double value);

 private:
  friend class Registry;
  explicit Histogram(prometheus::Histogram* h) : h_(h) {}
  prometheus::Histogram* h_;
};

class Registry {
 public:
  Registry();
  ~Registry();
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;

  // A new metric `name` described by `help`. Names are the caller's
  // constants and unique within the registry.
  Counter AddCounter(const std::string& name, const std::string& help);
  Gauge AddGauge(const std::string& name, const std::string& help);
  Histogram AddHistogram(const std::string& name, const std::string& help,
                         const std::vector<double>& bounds);

  // The exposition text a scrape returns.
  std::string Text() const;

  // The underlying registry, for a program that serves or pushes it with
  // its own Prometheus client (and links prometheus-cpp itself).
  std::shared_ptr<prometheus::Registry> native() const { return registry_; }

 private:
  std::shared_ptr<prometheus::Registry> registry_;
};

}  // namespace dte::metrics
