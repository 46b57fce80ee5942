// Metrics read at each scrape rather than kept: a Collector returns the
// Families of the moment (one unlabelled series each, or a gauge with one
// series per value of one label), for a program whose
// figures already live elsewhere (dtefs's .dte/status). Served by
// metrics::Server; Text gives what a scrape of them returns.
//
// Thread-safety: a Collector runs on the server's threads, possibly several
// at once; Text from any thread.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace dte::metrics {

// One metric and its single series.
struct Family {
  enum class Type { kCounter, kGauge, kHistogram };
  std::string name;
  std::string help;
  Type type = Type::kGauge;
  double value = 0;  // kCounter, kGauge
  // kHistogram: upper bounds (+Inf implied), the observations in each
  // bucket (bounds.size() + 1 of them, not cumulative) and their sum.
  std::vector<double> bounds;
  std::vector<uint64_t> counts;
  double sum = 0;
  // A labelled gauge (LabelledGaugeFamily): `label` names the label, and
  // each (label value, value) of `series` is one series; `value` unused.
  std::string label;
  std::vector<std::pair<std::string, double>> series;
};

Family CounterFamily(std::string name, std::string help, double value);
Family GaugeFamily(std::string name, std::string help, double value);
// One series per (value of `label`, value); values are escaped by Text.
Family LabelledGaugeFamily(std::string name, std::string help, std::string label,
                           std::vector<std::pair<std::string, double>> series);
Family HistogramFamily(std::string name, std::string help, std::vector<double> bounds,
                       std::vector<uint64_t> counts, double sum);

using Collector = std::function<std::vector<Family>()>;

// The exposition text of `families`, in their order.
std::string Text(const std::vector<Family>& families);

}  // namespace dte::metrics
