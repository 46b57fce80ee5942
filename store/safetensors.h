// Reading and validating safetensors files and Hugging Face index files.
//
// A safetensors file is: 8-byte little-endian header length N, N bytes of
// UTF-8 JSON (tensor name -> {dtype, shape, data_offsets}, optional
// "__metadata__" string map), then the data section. dte keeps the header
// bytes verbatim (so exports are byte-identical) and validates everything a
// reader could trip on before any byte is stored.
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "store/base/status.h"
#include "store/dtype.h"

namespace dte {

inline constexpr uint64_t kMaxSafetensorsHeader = 100'000'000;  // as the reference reader

struct TensorInfo {
  std::string name;
  DType dtype = DType::kU8;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // data_offsets, relative to the start of the data section
  uint64_t end = 0;
  uint64_t elements() const;
  uint64_t bytes() const { return end - begin; }
};

struct SafetensorsHeader {
  uint64_t header_len = 0;                      // N, the JSON length from the prefix
  uint64_t data_offset = 0;                     // 8 + N: where the data section starts
  uint64_t data_size = 0;                       // bytes of the data section
  std::vector<TensorInfo> tensors;              // sorted by data offset
  std::map<std::string, std::string> metadata;  // "__metadata__", if any
};

// Validates `json` (the N header bytes) for a file of `file_size` bytes.
// Errors name `file` and, where it applies, the tensor: invalid UTF-8 or JSON,
// unknown dtype, negative or overflowing shape, byte length not matching
// dtype x shape, offsets beyond the data section, overlapping tensors, holes
// between tensors, duplicate tensor names.
Result<SafetensorsHeader> ParseSafetensorsHeader(std::string_view json, uint64_t file_size,
                                                 const std::string& file);

// Validates a whole file held in memory: the 8-byte prefix, the header and
// the size of the data section (its bytes are not looked at).
Result<SafetensorsHeader> ParseSafetensorsFile(std::string_view bytes, const std::string& file);

// Reads the prefix and header of the file at `path` and validates them
// (truncated file, N over kMaxSafetensorsHeader, N beyond the file). Never
// reads the data section.
Result<SafetensorsHeader> ReadSafetensorsHeader(const std::string& path);

// As above, and also stores the raw header bytes (prefix included) in
// `*header_bytes`, so a caller that keeps them verbatim reads the file once.
Result<SafetensorsHeader> ReadSafetensorsHeader(const std::string& path, std::string* header_bytes);

// Returns the raw header bytes (prefix included) of the file at `path`.
// Checks the prefix (file long enough, N within limits) but not the JSON.
Result<std::string> ReadSafetensorsHeaderBytes(const std::string& path);

// Serializes a header for `tensors` (their begin/end must already be laid
// out contiguously from 0) in the layout the Python writer produces: JSON
// with "__metadata__" first if present, then tensors in order, padded with
// spaces to a multiple of 8 bytes. Returns prefix + JSON.
//
// The bytes equal the Python writer's for the same tensors in the same order
// when `metadata` has at most one key: that writer emits metadata keys in hash
// order, this function in sorted order. An empty map writes no "__metadata__"
// (the Python writer writes "__metadata__":{} when handed an empty dict).
// Names and metadata must be valid UTF-8, or the result will not parse.
std::string BuildSafetensorsHeader(const std::vector<TensorInfo>& tensors,
                                   const std::map<std::string, std::string>& metadata);

// model.safetensors.index.json: "weight_map" tensor -> shard file name.
struct SafetensorsIndex {
  std::map<std::string, std::string> weight_map;
  std::vector<std::string> shards;  // distinct shard names, sorted
};

// Parses an index file's bytes; `file` names it in errors. Rejects invalid
// JSON, a missing or non-object "weight_map", non-string shard names,
// duplicate keys, and shard names that are not plain file names (empty,
// leading '.', or containing '/', '\\', "..", NUL).
Result<SafetensorsIndex> ParseSafetensorsIndex(std::string_view json, const std::string& file);

}  // namespace dte
