// The header every rank of a distributed publish sends every other before
// it (sync/publish/publisher.h, "Agreement"): a JSON object
//   {"error": "", "fields": {...}, "latest": V|null, "last_version": V|null,
//    "last_step": S|null, "push": "HOST:PORT" or "",
//    "ranges": [[name, begin, end, state_step|null, lr|null, wd|null, tp, ep], ...]}
// Its bytes come from another rank, or from the caller's exchange function
// of a dte_transport_callback: DecodeHeader takes any bytes (fuzzed by
// tests/fuzz/c_api_fuzz.cc).
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "store/base/status.h"

namespace dte::dist_internal {

struct Header {
  std::string error;
  nlohmann::json fields;  // step, hyper-parameters, store: must agree across ranks
  std::optional<uint64_t> latest;
  std::optional<uint64_t> last_version;
  std::optional<int64_t> last_step;
  std::string push;  // the address of this rank's push server; empty: none
  struct Range {
    std::string name;
    int tp = 0, ep = 0;
    uint64_t begin = 0, end = 0;
    std::optional<int64_t> state_step;
    std::optional<double> lr, wd;
  };
  std::vector<Range> ranges;
};

std::string EncodeHeader(const Header& h);

// The header rank `rank` sent; Corruption naming the rank when `text` is not
// one (not JSON, a field missing or of another type, an integer out of
// range).
Result<Header> DecodeHeader(const std::string& text, int rank);

}  // namespace dte::dist_internal
