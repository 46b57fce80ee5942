#include "store/dtype.h"

#include <array>

namespace dte {
namespace {

struct DTypeInfo {
  DType dtype;
  const char* name;
  int width;
};

constexpr std::array<DTypeInfo, 15> kDTypes = {{
    {DType::kBool, "BOOL", 1},
    {DType::kU8, "U8", 1},
    {DType::kI8, "I8", 1},
    {DType::kF8E4M3, "F8_E4M3", 1},
    {DType::kF8E5M2, "F8_E5M2", 1},
    {DType::kU16, "U16", 2},
    {DType::kI16, "I16", 2},
    {DType::kF16, "F16", 2},
    {DType::kBF16, "BF16", 2},
    {DType::kU32, "U32", 4},
    {DType::kI32, "I32", 4},
    {DType::kF32, "F32", 4},
    {DType::kU64, "U64", 8},
    {DType::kI64, "I64", 8},
    {DType::kF64, "F64", 8},
}};

}  // namespace

std::optional<DType> ParseDType(std::string_view name) {
  for (const auto& info : kDTypes) {
    if (name == info.name) return info.dtype;
  }
  return std::nullopt;
}

const char* DTypeName(DType dtype) { return kDTypes[static_cast<int>(dtype)].name; }

int DTypeWidth(DType dtype) { return kDTypes[static_cast<int>(dtype)].width; }

std::string ShapeString(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

}  // namespace dte
