#include "sync/push/internal/held_fp8_summaries.h"

#include <utility>

namespace dte::push_internal {

Fp8Summaries HeldFp8Summaries::Take() {
  MutexLock lock(&mu_);
  return std::exchange(held_, {});
}

void HeldFp8Summaries::Put(Fp8Summaries summaries) {
  MutexLock lock(&mu_);
  held_ = std::move(summaries);
}

}  // namespace dte::push_internal
