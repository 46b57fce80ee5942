// Safetensors element types and their widths.
//
// dte never interprets element values: changes are detected on raw bits, so a
// dtype matters only for its width in bytes. BOOL is stored as one byte.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace dte {

enum class DType : uint8_t {
  kBool,
  kU8,
  kI8,
  kF8E4M3,
  kF8E5M2,
  kU16,
  kI16,
  kF16,
  kBF16,
  kU32,
  kI32,
  kF32,
  kU64,
  kI64,
  kF64,
};

// The safetensors spelling ("BF16", "F8_E4M3", ...), or nullopt if unknown.
std::optional<DType> ParseDType(std::string_view name);
const char* DTypeName(DType dtype);
int DTypeWidth(DType dtype);  // bytes per element: 1, 2, 4 or 8
// A shape as messages show it: "[4096, 1024]" ("[]" for a scalar).
std::string ShapeString(const std::vector<int64_t>& shape);

}  // namespace dte
