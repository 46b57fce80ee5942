// Per-element unravel-remap-ravel for hyperrectangle overlaps, shared by the
// CPU and CUDA backends. Host-side planning and validation: kernels/remap.h.
//
// A source tensor (row-major, shape src_shape) and a destination tensor share
// a hyperrectangle: the source box [lo, hi) corresponds element by element to
// the destination box starting at dst_start. RemapElement takes a flat source
// index, unravels it into coordinates, rejects it unless every coordinate is
// inside the box, and ravels the shifted coordinates with the destination's
// strides.
//
// Thread-safety: pure functions over an immutable plan.
#pragma once

#include <cstdint>
#include <cstring>

#include "kernels/hd.h"
#include "kernels/width.h"

namespace dte::kernels {

inline constexpr int kRemapMaxDims = 8;

// Built by MakeRemapPlan (kernels/remap.h); plain data so it can be passed to
// a CUDA kernel by value.
struct RemapPlan {
  int ndim = 0;
  uint64_t src_shape[kRemapMaxDims] = {};
  uint64_t lo[kRemapMaxDims] = {};  // box start, source coordinates
  uint64_t hi[kRemapMaxDims] = {};  // box end (exclusive), source coordinates
  uint64_t dst_stride[kRemapMaxDims] = {};
  // sum over d of (dst_start[d] - lo[d]) * dst_stride[d], modulo 2^64: adding
  // sum of c[d] * dst_stride[d] wraps back to the true, in-range result.
  uint64_t dst_offset = 0;
  // Flat source indices of the box's first and last element; a sorted input
  // can skip everything outside [src_first, src_last]. first > last when the
  // box is empty.
  uint64_t src_first = 1;
  uint64_t src_last = 0;
};

namespace remap_internal {

// Quotient and remainder, with 32-bit division when both operands fit: the
// common case, and far cheaper than 64-bit division on CPUs and GPUs alike.
DTE_HD void DivMod(uint64_t x, uint64_t d, uint64_t* q, uint64_t* r) {
  if (((x | d) >> 32) == 0) {
    const uint32_t x32 = static_cast<uint32_t>(x);
    const uint32_t d32 = static_cast<uint32_t>(d);
    *q = x32 / d32;
    *r = x32 % d32;
  } else {
    *q = x / d;
    *r = x % d;
  }
}

}  // namespace remap_internal

// If flat source index src lies in the box, stores its flat destination index
// in *dst and returns true; otherwise returns false (also for src beyond the
// source tensor).
DTE_HD bool RemapElement(const RemapPlan& p, uint64_t src, uint64_t* dst) {
  uint64_t out = p.dst_offset;
  uint64_t rest = src;
  for (int d = p.ndim - 1; d > 0; --d) {
    uint64_t c;
    remap_internal::DivMod(rest, p.src_shape[d], &rest, &c);
    if (c < p.lo[d] || c >= p.hi[d]) return false;
    out += c * p.dst_stride[d];
  }
  // The outermost coordinate is what remains; it is out of range for any src
  // past the end of the tensor.
  if (rest < p.lo[0] || rest >= p.hi[0]) return false;
  *dst = out + rest * p.dst_stride[0];
  return true;
}

// How a live apply updates one element of W bytes in place: a whole value
// replaces it; otherwise `val` is a difference added to the element's bits
// as a little-endian W-byte integer, wrapping (the sparse delta codec's
// entries, store/delta_codec.h). Byte-wise, so neither buffer needs
// alignment.
template <int W>
DTE_HD void ApplyElement(unsigned char* out, const unsigned char* val, bool whole) {
  using U = typename ElementBits<W>::type;
  U a, b;
  memcpy(&a, out, W);
  memcpy(&b, val, W);
  a = whole ? b : static_cast<U>(a + b);
  memcpy(out, &a, W);
}

// Fused remap + in-place apply of one element (ApplyElement at src's
// destination slot); false if src lies outside the box.
template <int W>
DTE_HD bool RemapApplyElement(const RemapPlan& p, uint64_t src, const unsigned char* val,
                              bool whole, unsigned char* dst) {
  uint64_t d;
  if (!RemapElement(p, src, &d)) return false;
  ApplyElement<W>(dst + d * W, val, whole);
  return true;
}

// Fused remap + scatter of one element of W bytes: if src lies in the box,
// copies the element at val to its destination slot in dst and returns true
// (the apply of a whole value).
template <int W>
DTE_HD bool RemapScatterElement(const RemapPlan& p, uint64_t src, const unsigned char* val,
                                unsigned char* dst) {
  return RemapApplyElement<W>(p, src, val, true, dst);
}

}  // namespace dte::kernels
