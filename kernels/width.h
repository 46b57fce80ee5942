// Element widths: the unsigned integer type of an element's bits, and a
// dispatch from a run-time width to code specialized for it. Shared by the
// CPU and CUDA backends and by the store and daemon code that handles raw
// element bits (BF16 and the other safetensors dtypes of 1, 2, 4 or 8 bytes).
//
// Thread-safety: stateless.
#pragma once

#include <cstdint>
#include <type_traits>

namespace dte::kernels {

// ElementBits<W>::type: the unsigned integer of W bytes.
template <int W>
struct ElementBits;
template <>
struct ElementBits<1> {
  using type = uint8_t;
};
template <>
struct ElementBits<2> {
  using type = uint16_t;
};
template <>
struct ElementBits<4> {
  using type = uint32_t;
};
template <>
struct ElementBits<8> {
  using type = uint64_t;
};

// Calls fn(std::integral_constant<int, W>{}) for width W = 1, 2 or 4, and
// W = 8 for any other width (callers validate widths first).
template <typename Fn>
decltype(auto) DispatchWidth(int width, const Fn& fn) {
  switch (width) {
    case 1:
      return fn(std::integral_constant<int, 1>{});
    case 2:
      return fn(std::integral_constant<int, 2>{});
    case 4:
      return fn(std::integral_constant<int, 4>{});
    default:
      return fn(std::integral_constant<int, 8>{});
  }
}

}  // namespace dte::kernels
