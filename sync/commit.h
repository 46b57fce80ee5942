// Committing a Hugging Face checkpoint directory as a new store version.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "store/status.h"

namespace dte {

class Store;

struct CommitOptions {
  std::optional<uint64_t> version;  // default: latest + 1, or 0 for an empty store
  bool force_anchor = false;        // store full weights even if a delta is possible
  int threads = 0;                  // 0: hardware concurrency
  // Called with (bytes done, bytes total) as tensor data is processed.
  std::function<void(uint64_t, uint64_t)> progress;
};

struct CommitResult {
  uint64_t version = 0;
  std::optional<uint64_t> parent;
  bool anchor = false;
  uint64_t tensors = 0;
  uint64_t elements = 0;
  uint64_t changed_elements = 0;
  uint64_t stored_bytes = 0;  // bytes of blobs this version added
  uint64_t dense_bytes = 0;   // bytes of all tensor data of the version
  uint64_t input_bytes = 0;   // bytes of all files read from the directory
};

// Commits `dir` to `store`. `import_only` requires an empty store (dtectl import).
Result<CommitResult> CommitDirectory(Store& store, const std::string& dir,
                                     const CommitOptions& options, bool import_only);

}  // namespace dte
