// Order-preserving parallel stream compaction for the CPU backend.
//
// Every compacting kernel promises its caller that the outputs have room for
// n entries, which allows a single pass over the input:
//   1. (parallel over fixed chunks) chunk [b, e) writes its selected elements
//      to output slots b, b+1, ... (never past e, so chunks cannot collide)
//      and returns how many it wrote;
//   2. (serial) an exclusive prefix sum of the counts gives each chunk's final
//      position, and its entries are moved down there in chunk order.
// A chunk's destination always ends at or before the next chunk's start, so
// moving in increasing order never overwrites entries still to be moved. The
// move is serial but touches only the output, typically 1-2% of the input.
// Chunk boundaries are fixed here rather than by ParallelFor so results do not
// depend on the pool size.
//
// Thread-safety: reentrant; run() is called concurrently on disjoint chunks.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kernels/parallel.h"

namespace dte::kernels::internal {

inline constexpr size_t kCompactChunk = size_t{1} << 16;

// run(begin, end) -> size_t: writes the selected elements of [begin, end), in
//   order, to output slots begin, begin+1, ...; returns their number.
// move(from, to, count): moves output slots [from, from + count) to
//   [to, to + count), to < from (ranges may overlap, as for memmove).
// Returns the total number of selected elements, now in slots [0, total).
template <typename RunFn, typename MoveFn>
size_t ParallelCompact(size_t n, const RunFn& run, const MoveFn& move) {
  const size_t chunks = (n + kCompactChunk - 1) / kCompactChunk;
  std::vector<size_t> counts(chunks);
  ParallelFor(chunks, 1, [&](size_t cb, size_t ce) {
    for (size_t c = cb; c < ce; ++c) {
      counts[c] = run(c * kCompactChunk, std::min(n, (c + 1) * kCompactChunk));
    }
  });
  size_t total = 0;
  for (size_t c = 0; c < chunks; ++c) {
    const size_t begin = c * kCompactChunk;
    if (total != begin && counts[c] != 0) move(begin, total, counts[c]);
    total += counts[c];
  }
  return total;
}

// Sum of count(begin, end) over fixed chunks of [0, n), computed in parallel.
template <typename CountFn>
size_t ParallelCount(size_t n, const CountFn& count) {
  const size_t chunks = (n + kCompactChunk - 1) / kCompactChunk;
  std::vector<size_t> partial(chunks);
  ParallelFor(chunks, 1, [&](size_t cb, size_t ce) {
    for (size_t c = cb; c < ce; ++c) {
      partial[c] = count(c * kCompactChunk, std::min(n, (c + 1) * kCompactChunk));
    }
  });
  size_t total = 0;
  for (size_t p : partial) total += p;
  return total;
}

}  // namespace dte::kernels::internal
