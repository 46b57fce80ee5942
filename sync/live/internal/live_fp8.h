// FP8 receivers of a live apply (sync/live/live.h, docs/live.md "FP8
// receivers"): the change sets an apply computes for them, shared by the
// file that computes them (live_changes_fp8.cc) and the one that writes
// them (live_scatter_fp8.cc), and the helpers registration and writing
// share.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kernels/fp8.h"
#include "sync/live/live.h"

namespace dte::live {

// The FP8 change sets between the live version and the target of every
// quantized canonical tensor that changed, for one block size and scale
// rule: canonical flat element indices and block-grid indices, ascending
// (kernels::Fp8ChangeSet).
struct Live::Fp8Sets {
  std::shared_ptr<const Fp8ReceiverPlan> plan;      // a receiver's plan with these options
  std::vector<kernels::Fp8ChangeSet> by_canonical;  // [canonical]: empty where none changed
  bool For(const Fp8ReceiverPlan& p) const {
    return p.options.block_rows == plan->options.block_rows &&
           p.options.block_cols == plan->options.block_cols && p.options.rule == plan->options.rule;
  }
};

// What writing an FP8 receiver's host buffers back to the live version
// needs (docs/live.md, "Servers"): the ops of its FP8 plan an apply wrote
// and, per op, the E4M3 bytes and scales its buffers held where it wrote
// them, in the order it wrote them.
struct Live::Fp8Undo {
  std::vector<uint32_t> work;  // ops written
  std::vector<std::vector<uint8_t>> bytes;
  std::vector<std::vector<float>> scales;
  bool exact = true;  // false: a CUDA IPC buffer was written (not kept)
};

namespace internal {

// The registration's FP8 block (0 means the default, 128).
uint32_t Fp8BlockOf(const dte_live_register& r);

// Whether a registration is of an FP8 buffer: dtype F8_E4M3, or a
// "<module>.weight_scale_inv" that is not a tensor of the layout.
bool IsFp8Registration(const dte_live_register& r, const std::string& name, bool in_layout);

// Runs write(); false if it raised SIGBUS (a receiver's shared memory went
// away under the mapping) instead of killing the daemon (live_scatter.cc).
bool UnderSigbusGuard(const std::function<void()>& write);

}  // namespace internal
}  // namespace dte::live
