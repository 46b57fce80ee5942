// The writers of step 4 of a live apply (sync/live/live.h,
// live_writes.cc): a receiver's targets, written into its buffers in place
// or written back to the live version (docs/live.md, "Servers"). Used by
// live_scatter.cc, which orders the receivers.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "sync/live/internal/live_changes.h"

namespace dte::live::internal {

// A registered buffer as the writers see it.
struct BufferRef {
  bool registered = false;  // false: no buffer for that receiver tensor
  uint8_t* data = nullptr;
  uint64_t elements = 0;
  bool device = false;  // a CUDA IPC buffer
};

// A (tensor, op) pair that writes one of a receiver's buffers.
struct Target {
  const Live::Changes* c;
  const TransferOp* op;
  BufferRef buf;
  bool shift;  // IsShift(op->remap)
  bool rows;   // IsRows(op->remap)
};

// What writing one receiver's host buffers back to the live version needs:
// its pieces of work and, for each piece whose block holds set entries,
// the old values of those entries (the differences are negated from the
// changed set itself). `exact` is false once something was written that
// this cannot undo (a CUDA IPC buffer; FP8 buffers keep a Live::Fp8Undo).
struct UndoLog {
  std::vector<std::pair<uint32_t, uint32_t>> work;  // (target, block)
  std::vector<std::vector<uint8_t>> saved;          // by piece; empty: no set entries
  bool exact = true;
};

// The targets of `changes` for receiver `rank` of `plan`, whose buffers are
// by_tensor (by receiver tensor). first_canonical[f]: the canonical index
// of file f's first tensor, the order ops_by_canonical lists them in.
std::vector<Target> TargetsOf(const std::vector<Live::Changes>& changes,
                              const std::vector<uint32_t>& first_canonical,
                              const std::vector<std::vector<uint32_t>>& ops_by_canonical,
                              const TransferPlan& plan, int rank,
                              const std::vector<BufferRef>& by_tensor);

// Every target of one receiver (with a log: kept to undo); false when a
// write failed.
bool WriteTargets(const std::vector<Target>& targets, UndoLog* log, uint64_t* bytes);

// The host buffers of `targets` written back to the live version from the
// log a WriteTargets kept; false when a write failed.
bool WriteBack(const std::vector<Target>& targets, UndoLog* log);

// Installs the SIGBUS handler the writers' guard needs (once).
void InstallSigbusHandler();

}  // namespace dte::live::internal
