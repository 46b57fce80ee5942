// Reading values back from Prometheus exposition text in tests.
#pragma once

#include <optional>
#include <sstream>
#include <string>

namespace dte::test {

// The value of sample `sample` (its name with labels as written, e.g.
// `x_bucket{le="+Inf"}`) in exposition text `text`; nullopt if absent.
inline std::optional<double> MetricValue(const std::string& text, const std::string& sample) {
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    const size_t space = line.rfind(' ');
    if (space != std::string::npos && line.compare(0, space, sample) == 0 &&
        space == sample.size()) {
      return std::stod(line.substr(space + 1));
    }
  }
  return std::nullopt;
}

}  // namespace dte::test
