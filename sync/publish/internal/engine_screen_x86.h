// The screen's building blocks shared by its widths (engine_screen.cc:
// scalar and SSE2; engine_screen_avx.cc: AVX2 and AVX-512). Not for use
// outside the screen: callers go through sync/publish/internal/engine_screen.h.
//
// Every width runs in two passes over a range already in cache: pass 1
// collects, in increasing order, the indices of a superset of the candidates
// (exactly the candidates for SSE2; the lanes the fast path does not rule
// out for the wider widths); pass 2 (Classify*) applies CertainlyUnchanged
// and ScreenOldBits to those indices, in place, keeping the kept ones. The
// elements after the last whole vector go through ScreenScalarRange.
//
// Thread-safety: pure functions.
#pragma once

#include <cstddef>
#include <cstdint>

#include "sync/publish/internal/engine_screen.h"

#if defined(__x86_64__) && defined(__SSE2__)
#define DTE_SCREEN_X86 1
#endif

namespace dte::internal::screen_detail {

// Elements [i, n) one at a time, appended to the outputs after r.kept
// entries; returns r updated.
ScreenCounts ScreenScalarRange(const float* theta, const float* m, const float* v, size_t i,
                               size_t n, const ScreenScalars& c, uint32_t* idx_out,
                               uint32_t* old_out, uint16_t* bf16_out, ScreenCounts r);

// Pass 2, one element at a time: filters idx[0, k) in place (see above) and
// writes the kept ones' ScreenOldBits to old_out.
ScreenCounts ClassifyScalar(const float* theta, const float* m, const float* v,
                            const ScreenScalars& c, uint32_t* idx, size_t k, uint32_t* old_out);

#if defined(DTE_SCREEN_X86)
ScreenCounts ScreenSse2(const float* theta, const float* m, const float* v, size_t n,
                        const ScreenScalars& c, uint32_t* idx_out, uint32_t* old_out,
                        uint16_t* bf16_out);
ScreenCounts ScreenAvx2(const float* theta, const float* m, const float* v, size_t n,
                        const ScreenScalars& c, uint32_t* idx_out, uint32_t* old_out,
                        uint16_t* bf16_out);
ScreenCounts ScreenAvx512(const float* theta, const float* m, const float* v, size_t n,
                          const ScreenScalars& c, uint32_t* idx_out, uint32_t* old_out,
                          uint16_t* bf16_out);
#endif

}  // namespace dte::internal::screen_detail
