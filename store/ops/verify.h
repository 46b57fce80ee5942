// Verifying a store: every blob, every chain, every tensor hash.
//
// Thread-safety: may run concurrently with commits and readers.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "store/base/status.h"

namespace dte {

class Store;

struct VerifyReport {
  uint64_t versions = 0;
  uint64_t blobs = 0;
  uint64_t blob_bytes = 0;
  uint64_t files = 0;
  uint64_t tensors = 0;
  std::vector<std::string> problems;  // each names the version, file, tensor or blob
  bool ok() const { return problems.empty(); }
};

// Checks `version` (or every version): manifests and block tables parse and
// agree, every parent exists, every referenced blob exists and matches its
// hash, and every file materializes to its recorded hashes. Problems are
// collected, not returned as errors; an error means the check itself could
// not run (an unreachable store).
Result<VerifyReport> VerifyStore(Store& store, std::optional<uint64_t> version,
                                 const std::function<void(uint64_t, uint64_t)>& progress);

}  // namespace dte
