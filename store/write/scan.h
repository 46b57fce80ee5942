// Scanning and validating a checkpoint directory before anything is stored.
#pragma once

#include <string>
#include <vector>

#include "store/base/status.h"
#include "store/manifest.h"
#include "store/safetensors.h"

namespace dte::internal {

struct InputFile {
  std::string name;
  std::string path;
  uint64_t size = 0;
  bool safetensors = false;
  std::string header_bytes;  // prefix + JSON, for safetensors files
  SafetensorsHeader header;
};

// Lists the regular files of `dir` (following symlinks, as Hugging Face
// cache snapshots use them), validates every safetensors header and the
// shard index, and returns the files sorted by name. Fails on anything a
// reader could trip on, naming the file and tensor: nothing is stored yet.
Result<std::vector<InputFile>> ScanCheckpoint(const std::string& dir);

// The manifest file entries for the scanned files (hashes left empty);
// tensors get consecutive block ranges for `block_bytes`.
std::vector<FileEntry> LayoutEntries(const std::vector<InputFile>& files, uint64_t block_bytes);

}  // namespace dte::internal
