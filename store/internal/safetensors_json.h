// The JSON half of store/safetensors.cc: the only code in dte that parses
// safetensors headers and index files with nlohmann-json, so that library
// stays out of every header.
//
// Thread-safety: pure functions.
#pragma once

#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "store/base/status.h"
#include "store/safetensors.h"

namespace dte::safetensors_internal {

inline std::string Quote(std::string_view s) { return "'" + std::string(s) + "'"; }

inline std::string RangeString(uint64_t begin, uint64_t end) {
  return "[" + std::to_string(begin) + ", " + std::to_string(end) + "]";
}

// Parses the header JSON (already checked to be UTF-8) into `tensors`, in
// header order, and `metadata`. Checks the grammar of each entry: types,
// duplicate names or keys, known dtype, shape and byte length consistent,
// begin <= end. Does not check the layout of tensors against each other.
Status ParseHeaderJson(std::string_view json, const std::string& file,
                       std::vector<TensorInfo>* tensors,
                       std::map<std::string, std::string>* metadata);

// Parses an index file's JSON into its "weight_map" (tensor -> shard),
// rejecting invalid JSON, duplicate keys and values of the wrong type. Does
// not check shard names.
Status ParseIndexJson(std::string_view json, const std::string& file,
                      std::map<std::string, std::string>* weight_map);

}  // namespace dte::safetensors_internal
