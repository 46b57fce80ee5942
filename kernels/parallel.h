// The CPU backend's thread pool.
//
// Every multi-threaded CPU kernel runs on one process-wide pool. Its size is
// the DTE_THREADS environment variable when that holds an integer in
// [1, kMaxThreads], else std::thread::hardware_concurrency(); SetNumThreads
// overrides both. A size of N means N-1 worker threads plus the calling thread,
// which always takes part in its own ParallelFor.
//
// Thread-safety: every function here may be called from any thread at any
// time, concurrently. Concurrent ParallelFor calls share the workers. A
// ParallelFor issued from inside another ParallelFor's fn runs serially on the
// calling thread, so nesting cannot deadlock or oversubscribe.
#pragma once

#include <cstddef>
#include <type_traits>

namespace dte::kernels {

inline constexpr size_t kMaxThreads = 1024;

// Sets the pool size (clamped to [1, kMaxThreads]); 0 restores the default
// (DTE_THREADS or hardware concurrency). Calls in flight finish on the old
// workers; later calls use the new size. Must not be called from inside a
// ParallelFor fn.
void SetNumThreads(size_t n);

// The pool size ParallelFor currently uses (including the calling thread).
size_t NumThreads();

// The size SetNumThreads(0) restores: DTE_THREADS if valid, else hardware
// concurrency (at least 1). Reads the environment on every call.
size_t DefaultNumThreads();

namespace internal {
using RangeFnPtr = void (*)(void* ctx, size_t begin, size_t end);
void ParallelForRaw(size_t n, size_t grain, RangeFnPtr fn, void* ctx);
}  // namespace internal

// Calls fn(begin, end) on disjoint contiguous ranges covering [0, n), each at
// least `grain` long (except when n < grain), possibly concurrently, and
// returns when every call has returned. The partition depends on the pool
// size, so fn must not assume particular range boundaries; callers that need
// stable boundaries iterate over their own chunk ids. fn must not throw.
template <typename Fn>
void ParallelFor(size_t n, size_t grain, Fn&& fn) {
  using F = std::remove_reference_t<Fn>;
  internal::ParallelForRaw(
      n, grain, [](void* ctx, size_t b, size_t e) { (*static_cast<F*>(ctx))(b, e); },
      const_cast<void*>(static_cast<const void*>(&fn)));
}

}  // namespace dte::kernels
