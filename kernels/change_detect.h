// Bit-level change detection and its inverse, sparse scatter (CPU backend).
//
// Elements are compared as raw bits of `width` bytes (1, 2, 4 or 8; any other
// width is a caller bug and is treated as 8), never as floating-point values,
// so NaN payloads and signed zeros are preserved: BF16 is compared as uint16,
// F32 as uint32 and so on.
//
// Thread-safety: pure functions over caller-owned buffers; callers may run
// them concurrently on disjoint outputs.
#pragma once

#include <cstddef>
#include <cstdint>

namespace dte::kernels {

// Returns the number of i in [0, n) where old[i] and new[i] differ bitwise.
size_t CountChanges(const void* old_data, const void* new_data, size_t n, int width);

// For each i in [0, n) where the elements differ bitwise, in increasing i,
// writes i to idx_out[k] and the new element's bits to the k-th element
// (width bytes) of val_out. Returns k, the number of changes. idx_out and
// val_out must have room for n entries. n must be < 2^32.
size_t DetectChanges(const void* old_data, const void* new_data, size_t n, int width,
                     uint32_t* idx_out, void* val_out);

// dst[idx[k]] = vals[k] for k in [0, count), elements of `width` bytes. The
// caller guarantees every idx[k] is in bounds (decoders check before calling).
void Scatter(void* dst, int width, const uint32_t* idx, const void* vals, size_t count);

// Gathers src[idx[k]] into vals_out[k].
void Gather(const void* src, int width, const uint32_t* idx, size_t count, void* vals_out);

// Multi-threaded forms over large arrays, splitting the work across the CPU
// backend's thread pool (kernels/parallel.h). 64-bit indices, no limit on n;
// otherwise the same contract and the same output as the serial forms.
// ScatterParallel additionally requires the idx[k] to be distinct: two writes
// to one element would race and leave either value.
size_t CountChangesParallel(const void* old_data, const void* new_data, size_t n, int width);
size_t DetectChangesParallel(const void* old_data, const void* new_data, size_t n, int width,
                             uint64_t* idx_out, void* val_out);
void ScatterParallel(void* dst, int width, const uint64_t* idx, const void* vals, size_t count);

}  // namespace dte::kernels
