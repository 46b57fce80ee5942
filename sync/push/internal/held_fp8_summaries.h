// HeldFp8Summaries: the FP8 receivers' block summaries of the last version
// a push completed (sync/push/internal/push_fp8_summary.h), held between
// pushes: a push takes them and puts back its own version's.
//
// Thread-safety: Take and Put may be called from any thread. Its mutex is
// a leaf, taken with no other lock held.
#pragma once

#include "store/base/thread_annotations.h"
#include "sync/push/internal/push_fp8_summary.h"

namespace dte::push_internal {

class HeldFp8Summaries {
 public:
  // The summaries held, none held after.
  Fp8Summaries Take() EXCLUDES(mu_);
  void Put(Fp8Summaries summaries) EXCLUDES(mu_);

 private:
  Mutex mu_;
  Fp8Summaries held_ GUARDED_BY(mu_);
};

}  // namespace dte::push_internal
