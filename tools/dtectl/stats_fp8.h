// dtectl stats --fp8: per version, what the FP8 form of the tensors the FP8
// policy quantizes changed against the parent, under both scale rules
// (store/ops/fp8_stats.h, docs/cli.md).
//
// Thread-safety: functions of the command's main thread.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "store/store.h"
#include "tools/dtectl/commands.h"

namespace dte::cli {

// Prints the FP8 rows of the `selected` versions of `store` (number and
// manifest key, ascending) as a table, JSON or CSV, and a total line; the
// exit status. a.by must be "tensor" or "version".
int RunStatsFp8(const Common& c, const StatsArgs& a, Store& store,
                const std::vector<std::pair<uint64_t, std::string>>& selected);

}  // namespace dte::cli
