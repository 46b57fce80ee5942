// The writers of step 4 of a live apply (sync/live/internal/live_writes.h):
// the changed set written in place into a receiver's buffers, remapped
// through the receiver's transfer plan, each index checked against the
// buffer, under a SIGBUS guard (a receiver whose shared memory goes away
// under the mapping fails, not the daemon); with an undo log, written back.
#include "sync/live/internal/live_writes.h"

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <csetjmp>
#include <csignal>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "kernels/cuda.h"
#include "kernels/parallel.h"
#include "kernels/remap_cuda.h"
#include "kernels/remap_math.h"
#include "kernels/width.h"
#include "sync/live/internal/live_fp8.h"

namespace dte::live {
namespace internal {
namespace {

// What the apply helpers read of a BlockChange, and how they write it.
// Forward, with `save`, the old value of each set entry is kept there (by
// entry) before it is written; with `undo`, the write goes back to the
// live version: each difference is subtracted, each set entry takes its
// saved value (a rank of a server written back, docs/live.md "Servers").
struct EntryView {
  bool values;
  const uint8_t* vals;
  const uint8_t* whole;  // null: no set elements
  uint8_t* save = nullptr;
  bool undo = false;
  bool Set(size_t i) const { return values || (whole != nullptr && whole[i] != 0); }
  bool Plain() const { return save == nullptr && !undo; }
};

// Entry i of c at d, as EntryView says (the slow path of a saving or undoing
// write; a plain one is ApplyElement alone).
template <int W>
inline void PutElement(uint8_t* d, const EntryView& c, size_t i) {
  const bool set = c.Set(i);
  if (c.undo) {
    if (set) {
      std::memcpy(d, c.save + i * W, W);
      return;
    }
    using U = typename kernels::ElementBits<W>::type;
    U a, b;
    std::memcpy(&a, d, W);
    std::memcpy(&b, c.vals + i * W, W);
    a = static_cast<U>(a - b);
    std::memcpy(d, &a, W);
    return;
  }
  if (set && c.save != nullptr) std::memcpy(c.save + i * W, d, W);
  kernels::ApplyElement<W>(d, c.vals + i * W, set);
}

// A SIGBUS while writing a receiver's shared memory (its object was
// truncated under the mapping) must fail that receiver, not kill the daemon.
thread_local sigjmp_buf* t_bus_jump = nullptr;

void OnSigbus(int sig, siginfo_t*, void*) {
  if (t_bus_jump) siglongjmp(*t_bus_jump, 1);
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

template <int W>
void ApplyAll(uint8_t* dst, const uint64_t* dst_idx, const uint64_t* pos, const uint8_t* vals,
              const EntryView& c, size_t n) {
  if (!c.Plain()) {
    for (size_t j = 0; j < n; ++j) PutElement<W>(dst + dst_idx[j] * W, c, pos[j]);
    return;
  }
  if (c.values || c.whole == nullptr) {
    for (size_t j = 0; j < n; ++j) {
      kernels::ApplyElement<W>(dst + dst_idx[j] * W, vals + pos[j] * W, c.values);
    }
    return;
  }
  for (size_t j = 0; j < n; ++j) {
    kernels::ApplyElement<W>(dst + dst_idx[j] * W, vals + pos[j] * W, c.whole[pos[j]] != 0);
  }
}

// Runs write() so that a SIGBUS in it (a receiver's memory went away under
// the mapping) returns false instead of killing the daemon.
template <typename F>
bool UnderBusGuard(const F& write) {
  sigjmp_buf jump;
  if (sigsetjmp(jump, 0) != 0) {
    t_bus_jump = nullptr;
    return false;
  }
  t_bus_jump = &jump;
  write();
  t_bus_jump = nullptr;
  return true;
}

// Applies entry pos[j] of c at dst[dst_idx[j]] for j < n (ApplyElement);
// every index is checked against `elements` first. False on a SIGBUS or a
// bad index.
bool GuardedApply(uint8_t* dst, uint64_t elements, const uint64_t* dst_idx, const uint64_t* pos,
                  const EntryView& c, size_t n, int width) {
  for (size_t j = 0; j < n; ++j) {
    if (dst_idx[j] >= elements) return false;
  }
  return UnderBusGuard([&] {
    kernels::DispatchWidth(width,
                           [&](auto w) { ApplyAll<w.value>(dst, dst_idx, pos, c.vals, c, n); });
  });
}

template <int W>
[[gnu::noinline]] void ApplyRunTyped(uint8_t* dst, uint64_t base, const uint32_t* idx,
                                     const EntryView& c, size_t begin, size_t end) {
  if (!c.Plain()) {
    for (size_t i = begin; i < end; ++i) PutElement<W>(dst + (base + idx[i]) * W, c, i);
    return;
  }
  if (c.values || c.whole == nullptr) {
    for (size_t i = begin; i < end; ++i) {
      kernels::ApplyElement<W>(dst + (base + idx[i]) * W, c.vals + i * W, c.values);
    }
    return;
  }
  for (size_t i = begin; i < end; ++i) {
    kernels::ApplyElement<W>(dst + (base + idx[i]) * W, c.vals + i * W, c.whole[i] != 0);
  }
}

// The fast form of GuardedApply for a run of entries [begin, end) that maps
// to the buffer by a constant shift: entry i goes to element base + idx[i]
// (modulo 2^64). The run's first and last destinations are checked against
// `elements` (idx is increasing, so the rest lie between).
bool GuardedApplyRun(uint8_t* dst, uint64_t elements, uint64_t base, const uint32_t* idx,
                     const EntryView& c, size_t begin, size_t end, int width) {
  if (begin >= end) return true;
  const uint64_t lo = base + idx[begin], hi = base + idx[end - 1];
  if (lo > hi || hi >= elements) return false;
  return UnderBusGuard([&] {
    kernels::DispatchWidth(width,
                           [&](auto w) { ApplyRunTyped<w.value>(dst, base, idx, c, begin, end); });
  });
}

// Whether a remap plan moves its box by a constant shift of flat indices:
// the box spans every dimension but the first whole, and the destination has
// the source's trailing dimensions (a row split, or a tensor copied whole or
// into a fused one). Then dst = src + dst_offset (modulo 2^64).
bool IsShift(const kernels::RemapPlan& p) {
  if (p.ndim < 1) return false;
  uint64_t stride = 1;
  for (int d = p.ndim - 1; d >= 1; --d) {
    if (p.lo[d] != 0 || p.hi[d] != p.src_shape[d] || p.dst_stride[d] != stride) return false;
    stride *= p.src_shape[d];
  }
  return p.dst_stride[0] == stride;
}

// Whether a two-dimensional plan keeps rows contiguous in the destination
// (any box, unit column stride): then the part of source row r inside the
// box lands at src + dst_offset + r * (dst_stride[0] - columns), modulo 2^64.
bool IsRows(const kernels::RemapPlan& p) { return p.ndim == 2 && p.dst_stride[1] == 1; }

// Block element x as an index relative to `first`, clamped to [0, 2^32).
uint64_t Relative(uint64_t x, uint64_t first) {
  return x <= first ? uint64_t{0} : std::min<uint64_t>(x - first, UINT32_MAX);
}

// The entries of bc inside the box of a shift plan (IsShift), written
// without a remap per element. Adds the bytes written to *wrote.
bool WriteShift(const Target& tg, const Live::BlockChange& bc, const EntryView& view,
                uint64_t* wrote) {
  const kernels::RemapPlan& rp = tg.op->remap;
  const uint64_t first = uint64_t{bc.block} * tg.c->block_elements;
  if (rp.src_first > rp.src_last) return true;
  const uint32_t* idx = bc.idx.data();
  const size_t b = static_cast<size_t>(
      std::lower_bound(idx, idx + bc.idx.size(), Relative(rp.src_first, first)) - idx);
  const size_t e = static_cast<size_t>(
      std::upper_bound(idx, idx + bc.idx.size(), Relative(rp.src_last, first)) - idx);
  if (rp.src_last < first) return true;
  if (!GuardedApplyRun(tg.buf.data, tg.buf.elements, first + rp.dst_offset, idx, view, b, e,
                       tg.c->width)) {
    return false;
  }
  *wrote += (e - b) * static_cast<uint64_t>(tg.c->width);
  return true;
}

// A column split (IsRows): each source row's part of the box is one run
// with its own shift.
bool WriteRows(const Target& tg, const Live::BlockChange& bc, const EntryView& view,
               uint64_t* wrote) {
  const kernels::RemapPlan& rp = tg.op->remap;
  const uint64_t first = uint64_t{bc.block} * tg.c->block_elements;
  const uint64_t cols = rp.src_shape[1];
  const uint32_t* idx = bc.idx.data();
  const size_t n = bc.idx.size();
  const uint64_t r0 = std::max<uint64_t>(rp.lo[0], (first + idx[0]) / cols);
  const uint64_t r1 = std::min<uint64_t>(rp.hi[0], (first + idx[n - 1]) / cols + 1);
  size_t from = 0;
  for (uint64_t r = r0; r < r1; ++r) {
    const uint64_t lo = r * cols + rp.lo[1], hi = r * cols + rp.hi[1] - 1;
    if (hi < first) continue;
    const size_t b =
        static_cast<size_t>(std::lower_bound(idx + from, idx + n, Relative(lo, first)) - idx);
    const size_t e =
        static_cast<size_t>(std::upper_bound(idx + b, idx + n, Relative(hi, first)) - idx);
    from = e;
    const uint64_t base = first + rp.dst_offset + r * (rp.dst_stride[0] - cols);
    if (!GuardedApplyRun(tg.buf.data, tg.buf.elements, base, idx, view, b, e, tg.c->width)) {
      return false;
    }
    *wrote += (e - b) * static_cast<uint64_t>(tg.c->width);
  }
  return true;
}

// Index buffers of one thread, reused from block to block.
struct Scratch {
  std::vector<uint64_t> src, dst, pos;
};

// Any other plan: every entry remapped (RemapOpIndices).
bool WriteRemapped(const Target& tg, const Live::BlockChange& bc, const EntryView& view, Scratch* s,
                   uint64_t* wrote) {
  const uint64_t first = uint64_t{bc.block} * tg.c->block_elements;
  s->src.resize(bc.idx.size());
  for (size_t i = 0; i < bc.idx.size(); ++i) s->src[i] = first + bc.idx[i];
  s->dst.resize(s->src.size());
  s->pos.resize(s->src.size());
  const size_t k =
      RemapOpIndices(*tg.op, s->src.data(), s->src.size(), s->dst.data(), s->pos.data());
  if (k == 0) return true;
  if (!GuardedApply(tg.buf.data, tg.buf.elements, s->dst.data(), s->pos.data(), view, k,
                    tg.c->width)) {
    return false;
  }
  *wrote += k * static_cast<uint64_t>(tg.c->width);
  return true;
}

bool WriteHostBlock(const Target& tg, const Live::BlockChange& bc, uint8_t* save, bool undo,
                    Scratch* s, uint64_t* wrote) {
  const EntryView view{bc.values, bc.vals.data(), bc.whole.empty() ? nullptr : bc.whole.data(),
                       save, undo};
  if (tg.shift) return WriteShift(tg, bc, view, wrote);
  if (tg.rows) return WriteRows(tg, bc, view, wrote);
  return WriteRemapped(tg, bc, view, s, wrote);
}

std::vector<std::pair<uint32_t, uint32_t>> HostWork(const std::vector<Target>& targets) {
  std::vector<std::pair<uint32_t, uint32_t>> work;  // (target, block)
  for (uint32_t t = 0; t < targets.size(); ++t) {
    if (targets[t].buf.device) continue;
    for (uint32_t k = 0; k < targets[t].c->blocks.size(); ++k) work.emplace_back(t, k);
  }
  return work;
}

// Host buffers: every block of every target is one piece of work, spread
// over the worker threads (the pieces write distinct elements). With a
// log, the old values of set entries are kept in it (undo: written back
// from it). False when a write failed.
bool WriteHost(const std::vector<Target>& targets, UndoLog* log, bool undo, uint64_t* bytes) {
  std::vector<std::pair<uint32_t, uint32_t>> own;
  if (log != nullptr && !undo) {
    log->work = HostWork(targets);
    log->saved.assign(log->work.size(), {});
  } else if (log == nullptr) {
    own = HostWork(targets);
  }
  const auto& work = log != nullptr ? log->work : own;
  std::atomic<bool> ok{true};
  std::atomic<uint64_t> written{0};
  kernels::ParallelFor(work.size(), 8, [&](size_t begin, size_t end) {
    Scratch scratch;
    uint64_t wrote = 0;
    for (size_t w = begin; w < end && ok.load(std::memory_order_relaxed); ++w) {
      const Target& tg = targets[work[w].first];
      const Live::BlockChange& bc = tg.c->blocks[work[w].second];
      uint8_t* save = nullptr;
      if (log != nullptr && (bc.values || !bc.whole.empty())) {
        std::vector<uint8_t>& saved = log->saved[w];
        if (!undo) saved.resize(bc.idx.size() * static_cast<size_t>(tg.c->width));
        save = saved.data();
      }
      if (!WriteHostBlock(tg, bc, save, undo, &scratch, &wrote)) {
        ok = false;
        break;
      }
    }
    written.fetch_add(wrote, std::memory_order_relaxed);
  });
  *bytes += written.load();
  return ok.load();
}

// A device buffer: one remap + apply kernel for the target, its blocks
// concatenated; the indices are checked on the host first.
bool WriteDevice(const Target& tg, uint64_t* bytes) {
  const Live::Changes& c = *tg.c;
  std::vector<uint64_t> src;
  std::vector<uint8_t> vals, whole;
  bool all_whole = true;
  for (const Live::BlockChange& bc : c.blocks) {
    const uint64_t first = uint64_t{bc.block} * c.block_elements;
    for (size_t i = 0; i < bc.idx.size(); ++i) {
      src.push_back(first + bc.idx[i]);
      whole.push_back(bc.Whole(i) ? 1 : 0);
      all_whole = all_whole && bc.Whole(i);
    }
    vals.insert(vals.end(), bc.vals.begin(), bc.vals.end());
  }
  std::vector<uint64_t> dst(src.size()), pos(src.size());
  const size_t k = RemapOpIndices(*tg.op, src.data(), src.size(), dst.data(), pos.data());
  if (k == 0) return true;
  bool ok = true;
  for (size_t j = 0; j < k; ++j) ok = ok && dst[j] < tg.buf.elements;
  kernels::CudaBuffer d_src, d_vals, d_whole;
  kernels::CudaStatus cs = d_src.Allocate(src.size() * 8);
  if (cs.ok()) cs = d_vals.Allocate(vals.size());
  if (cs.ok()) cs = d_whole.Allocate(whole.size());
  if (cs.ok()) cs = kernels::CudaCopyToDevice(d_src.data(), src.data(), src.size() * 8);
  if (cs.ok()) cs = kernels::CudaCopyToDevice(d_vals.data(), vals.data(), vals.size());
  if (cs.ok()) cs = kernels::CudaCopyToDevice(d_whole.data(), whole.data(), whole.size());
  if (cs.ok() && ok) {
    cs = kernels::CudaRemapApply(tg.op->remap, static_cast<const uint64_t*>(d_src.data()),
                                 d_vals.data(), static_cast<const uint8_t*>(d_whole.data()),
                                 all_whole, src.size(), c.width, tg.buf.data, nullptr);
  }
  if (cs.ok()) cs = kernels::CudaStreamSynchronize(nullptr);
  *bytes += k * static_cast<uint64_t>(c.width);
  return ok && cs.ok();
}

}  // namespace

void InstallSigbusHandler() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction sa = {};
    sa.sa_sigaction = OnSigbus;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGBUS, &sa, nullptr);
  });
}

// The targets of `changes` for receiver `rank` of `plan`, whose buffers are
// by_tensor (by receiver tensor). first_canonical[f]: the canonical index
// of file f's first tensor, the order ops_by_canonical lists them in.
std::vector<Target> TargetsOf(const std::vector<Live::Changes>& changes,
                              const std::vector<uint32_t>& first_canonical,
                              const std::vector<std::vector<uint32_t>>& ops_by_canonical,
                              const TransferPlan& plan, int rank,
                              const std::vector<BufferRef>& by_tensor) {
  std::vector<Target> targets;
  for (const Live::Changes& c : changes) {
    const uint32_t canonical = first_canonical[c.file] + c.tensor;
    for (uint32_t op_index : ops_by_canonical[canonical]) {
      const TransferOp& op = plan.ops[op_index];
      if (op.receiver != rank || !by_tensor[op.receiver_tensor].registered) continue;
      targets.push_back(
          {&c, &op, by_tensor[op.receiver_tensor], IsShift(op.remap), IsRows(op.remap)});
    }
  }
  return targets;
}

// Every target of one receiver (with a log: kept to undo); false when a
// write failed.
bool WriteTargets(const std::vector<Target>& targets, UndoLog* log, uint64_t* bytes) {
  if (!WriteHost(targets, log, false, bytes)) return false;
  for (const Target& tg : targets) {
    if (!tg.buf.device) continue;
    if (log != nullptr) log->exact = false;
    if (!WriteDevice(tg, bytes)) return false;
  }
  return true;
}

bool WriteBack(const std::vector<Target>& targets, UndoLog* log) {
  uint64_t ignored = 0;
  return WriteHost(targets, log, true, &ignored);
}

bool UnderSigbusGuard(const std::function<void()>& write) {
  InstallSigbusHandler();
  return UnderBusGuard(write);
}
}  // namespace internal
}  // namespace dte::live
