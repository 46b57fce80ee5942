// Exporting a version as a plain Hugging Face model directory.
//
// Every byte is materialized and checked (block hashes as it is read, then
// each tensor's and raw file's content hash) before the directory appears:
// the export is built in a sibling temp directory that is renamed to the
// output path only when complete, so a failed export leaves nothing behind.
// Like cp, it leaves flushing to the kernel (no fsync): an export is a copy
// that can be made again, not the store's durable state.
//
// Thread-safety: may run concurrently with commits and other readers.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "store/base/status.h"

namespace dte {

class Store;

struct ExportResult {
  uint64_t version = 0;
  uint64_t files = 0;
  uint64_t bytes = 0;
};

// `out_dir` must not exist, or be an empty directory.
Result<ExportResult> ExportVersion(Store& store, uint64_t version, const std::string& out_dir,
                                   const std::function<void(uint64_t, uint64_t)>& progress);

}  // namespace dte
