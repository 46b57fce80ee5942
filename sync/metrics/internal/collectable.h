// A Collector as prometheus-cpp's Collectable, and Families as its
// MetricFamily, for the server and the text exposition.
#pragma once

#include <prometheus/collectable.h>
#include <prometheus/metric_family.h>

#include <utility>
#include <vector>

#include "sync/metrics/family.h"

namespace dte::metrics::internal {

std::vector<prometheus::MetricFamily> ToPrometheus(const std::vector<Family>& families);

class CollectorCollectable : public prometheus::Collectable {
 public:
  explicit CollectorCollectable(Collector collect) : collect_(std::move(collect)) {}
  std::vector<prometheus::MetricFamily> Collect() const override {
    return ToPrometheus(collect_());
  }

 private:
  Collector collect_;
};

}  // namespace dte::metrics::internal
