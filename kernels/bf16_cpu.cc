// CPU array forms of the BF16 conversions.
#include "kernels/bf16.h"
#include "kernels/parallel.h"

namespace dte::kernels {
namespace {
// Large enough that thread hand-off cost is noise next to the memory traffic.
constexpr size_t kCastGrain = size_t{1} << 16;
}  // namespace

void CastFp32ToBf16(const float* in, uint16_t* out, size_t n) {
  ParallelFor(n, kCastGrain, [&](size_t begin, size_t end) {
    for (size_t i = begin; i < end; ++i) out[i] = Fp32ToBf16Bits(in[i]);
  });
}

void CastBf16ToFp32(const uint16_t* in, float* out, size_t n) {
  ParallelFor(n, kCastGrain, [&](size_t begin, size_t end) {
    for (size_t i = begin; i < end; ++i) out[i] = Bf16BitsToFp32(in[i]);
  });
}

}  // namespace dte::kernels
