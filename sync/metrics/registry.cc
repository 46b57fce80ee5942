#include "sync/metrics/registry.h"

#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

namespace dte::metrics {

void Counter::Increment(double by) { c_->Increment(by); }
void Gauge::Set(double value) { g_->Set(value); }
void Histogram::Observe(double value) { h_->Observe(value); }

Registry::Registry() : registry_(std::make_shared<prometheus::Registry>()) {}
Registry::~Registry() = default;

Counter Registry::AddCounter(const std::string& name, const std::string& help) {
  return Counter(&prometheus::BuildCounter().Name(name).Help(help).Register(*registry_).Add({}));
}

Gauge Registry::AddGauge(const std::string& name, const std::string& help) {
  return Gauge(&prometheus::BuildGauge().Name(name).Help(help).Register(*registry_).Add({}));
}

Histogram Registry::AddHistogram(const std::string& name, const std::string& help,
                                 const std::vector<double>& bounds) {
  return Histogram(
      &prometheus::BuildHistogram().Name(name).Help(help).Register(*registry_).Add({}, bounds));
}

std::string Registry::Text() const {
  return prometheus::TextSerializer().Serialize(registry_->Collect());
}

}  // namespace dte::metrics
