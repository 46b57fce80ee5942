#include "sync/metrics/family.h"

#include <prometheus/text_serializer.h>

#include <limits>
#include <utility>

#include "sync/metrics/internal/collectable.h"

namespace dte::metrics {
namespace {

prometheus::MetricFamily OneFamily(const Family& f) {
  if (!f.label.empty()) {
    prometheus::MetricFamily out{f.name, f.help, prometheus::MetricType::Gauge, {}};
    for (const auto& [value, x] : f.series) {
      prometheus::ClientMetric m;
      m.label.push_back({f.label, value});
      m.gauge.value = x;
      out.metric.push_back(std::move(m));
    }
    return out;
  }
  prometheus::ClientMetric m;
  prometheus::MetricType type = prometheus::MetricType::Gauge;
  switch (f.type) {
    case Family::Type::kCounter:
      type = prometheus::MetricType::Counter;
      m.counter.value = f.value;
      break;
    case Family::Type::kGauge:
      m.gauge.value = f.value;
      break;
    case Family::Type::kHistogram: {
      type = prometheus::MetricType::Histogram;
      uint64_t cumulative = 0;
      for (size_t b = 0; b < f.counts.size(); ++b) {
        cumulative += f.counts[b];
        prometheus::ClientMetric::Bucket bucket;
        bucket.cumulative_count = cumulative;
        bucket.upper_bound =
            b < f.bounds.size() ? f.bounds[b] : std::numeric_limits<double>::infinity();
        m.histogram.bucket.push_back(bucket);
      }
      m.histogram.sample_count = cumulative;
      m.histogram.sample_sum = f.sum;
      break;
    }
  }
  return prometheus::MetricFamily{f.name, f.help, type, {std::move(m)}};
}

Family Scalar(std::string name, std::string help, Family::Type type, double value) {
  Family f;
  f.name = std::move(name);
  f.help = std::move(help);
  f.type = type;
  f.value = value;
  return f;
}

}  // namespace

Family CounterFamily(std::string name, std::string help, double value) {
  return Scalar(std::move(name), std::move(help), Family::Type::kCounter, value);
}

Family GaugeFamily(std::string name, std::string help, double value) {
  return Scalar(std::move(name), std::move(help), Family::Type::kGauge, value);
}

Family LabelledGaugeFamily(std::string name, std::string help, std::string label,
                           std::vector<std::pair<std::string, double>> series) {
  Family f = Scalar(std::move(name), std::move(help), Family::Type::kGauge, 0);
  f.label = std::move(label);
  f.series = std::move(series);
  return f;
}

Family HistogramFamily(std::string name, std::string help, std::vector<double> bounds,
                       std::vector<uint64_t> counts, double sum) {
  Family f = Scalar(std::move(name), std::move(help), Family::Type::kHistogram, 0);
  f.bounds = std::move(bounds);
  f.counts = std::move(counts);
  f.sum = sum;
  return f;
}

std::string Text(const std::vector<Family>& families) {
  return prometheus::TextSerializer().Serialize(internal::ToPrometheus(families));
}

namespace internal {

std::vector<prometheus::MetricFamily> ToPrometheus(const std::vector<Family>& families) {
  std::vector<prometheus::MetricFamily> out;
  out.reserve(families.size());
  for (const Family& f : families) out.push_back(OneFamily(f));
  return out;
}

}  // namespace internal
}  // namespace dte::metrics
