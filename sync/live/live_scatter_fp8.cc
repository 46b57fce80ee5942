// Step 3 of a live apply for FP8 receivers (sync/live/live.h): each quantized
// tensor's FP8 change set remapped through the receiver's FP8 plan
// (RemapFp8Changes), and only the changed E4M3 bytes and scales written,
// every index checked against its buffer first. Host buffers are written in
// place under the SIGBUS guard, CUDA IPC buffers by the remap-scatter
// kernel (1-byte bytes, 4-byte scales).
#include <algorithm>
#include <atomic>
#include <cstring>
#include <vector>

#include "kernels/cuda.h"
#include "kernels/parallel.h"
#include "kernels/remap_cuda.h"
#include "sync/live/internal/live_fp8.h"

namespace dte::live {
namespace {

// A registered FP8 buffer as the writers see it.
struct Dst {
  uint8_t* data = nullptr;
  uint64_t elements = 0;
  bool device = false;
  explicit operator bool() const { return data != nullptr; }
};

bool InBounds(const std::vector<uint64_t>& idx, uint64_t elements) {
  return std::all_of(idx.begin(), idx.end(), [&](uint64_t i) { return i < elements; });
}

// The kept entries of one op as canonical indices and values, for the
// device kernel (which remaps them itself).
template <typename T>
bool ScatterDevice(const Dst& dst, const kernels::RemapPlan& plan,
                   const std::vector<uint64_t>& canonical, const std::vector<T>& values,
                   const std::vector<uint64_t>& pos) {
  const size_t n = pos.size();
  if (n == 0) return true;
  std::vector<uint64_t> src(n);
  std::vector<T> vals(n);
  for (size_t j = 0; j < n; ++j) {
    src[j] = canonical[pos[j]];
    vals[j] = values[pos[j]];
  }
  kernels::CudaBuffer d_src, d_vals;
  kernels::CudaStatus cs = d_src.Allocate(n * 8);
  if (cs.ok()) cs = d_vals.Allocate(n * sizeof(T));
  if (cs.ok()) cs = kernels::CudaCopyToDevice(d_src.data(), src.data(), n * 8);
  if (cs.ok()) cs = kernels::CudaCopyToDevice(d_vals.data(), vals.data(), n * sizeof(T));
  if (cs.ok()) {
    cs = kernels::CudaRemapScatter(plan, static_cast<const uint64_t*>(d_src.data()), d_vals.data(),
                                   n, static_cast<int>(sizeof(T)), dst.data, nullptr);
  }
  if (cs.ok()) cs = kernels::CudaStreamSynchronize(nullptr);
  return cs.ok();
}

// Where an op's host writes keep the old bytes and scales (save) or take
// them back from (undo).
struct Keep {
  std::vector<uint8_t>* bytes = nullptr;  // null: nothing kept
  std::vector<float>* scales = nullptr;
  bool undo = false;
};

// The host part of WriteOp, under the SIGBUS guard.
bool WriteHostOp(const kernels::Fp8ChangeSet& cs, const Dst& q, const Dst& s,
                 const Fp8OpIndices& idx, const Keep& keep) {
  const bool kq = q && !q.device, ks = s && !s.device;
  if (keep.bytes != nullptr && !keep.undo) {
    keep.bytes->resize(kq ? idx.byte_index.size() : 0);
    keep.scales->resize(ks ? idx.scale_index.size() : 0);
  }
  return internal::UnderSigbusGuard([&] {
    for (size_t j = 0; kq && j < idx.byte_index.size(); ++j) {
      uint8_t* d = q.data + idx.byte_index[j];
      if (keep.bytes != nullptr && keep.undo) {
        *d = (*keep.bytes)[j];
        continue;
      }
      if (keep.bytes != nullptr) (*keep.bytes)[j] = *d;
      *d = cs.byte_value[idx.byte_pos[j]];
    }
    for (size_t j = 0; ks && j < idx.scale_index.size(); ++j) {
      uint8_t* d = s.data + 4 * idx.scale_index[j];
      if (keep.scales != nullptr && keep.undo) {
        std::memcpy(d, &(*keep.scales)[j], 4);
        continue;
      }
      if (keep.scales != nullptr) std::memcpy(&(*keep.scales)[j], d, 4);
      std::memcpy(d, &cs.scale_value[idx.scale_pos[j]], 4);
    }
  });
}

// The changed bytes of one op into `q` and its changed scales into `s`
// (either may be absent), host buffers as `keep` says. Adds the bytes
// written to *wrote.
bool WriteOp(const Fp8ReceiverOp& op, const kernels::Fp8ChangeSet& cs, const Dst& q, const Dst& s,
             const Keep& keep, Fp8OpIndices* idx, uint64_t* wrote) {
  RemapFp8Changes(op, cs, idx);
  if ((q && !InBounds(idx->byte_index, q.elements)) ||
      (s && !InBounds(idx->scale_index, s.elements))) {
    return false;
  }
  bool ok = true;
  if (q && q.device && !keep.undo)
    ok = ScatterDevice(q, op.bytes, cs.byte_index, cs.byte_value, idx->byte_pos);
  if (ok && s && s.device && !keep.undo) {
    ok = ScatterDevice(s, op.scales, cs.scale_index, cs.scale_value, idx->scale_pos);
  }
  if (!ok) return false;
  ok = WriteHostOp(cs, q, s, *idx, keep);
  if (q) *wrote += idx->byte_index.size();
  if (s) *wrote += 4 * idx->scale_index.size();
  return ok;
}

}  // namespace

bool Live::WriteFp8(const Receiver& rc, const std::vector<Fp8Sets>& sets, uint64_t* bytes,
                    uint64_t* buffers, Fp8Undo* log, bool undo) {
  if (!rc.fp8) return true;
  auto set =
      std::find_if(sets.begin(), sets.end(), [&](const Fp8Sets& s) { return s.For(*rc.fp8); });
  if (set == sets.end()) return true;
  const Fp8ReceiverPlan& plan = *rc.fp8;
  std::vector<Dst> q(plan.tensors.size()), s(plan.tensors.size());
  for (const auto& b : rc.buffers) {
    const Dst d{b->data, b->elements, b->kind == DTE_LIVE_CUDA_IPC};
    if (b->role == Buffer::Role::kFp8Bytes) q[b->receiver_tensor] = d;
    if (b->role == Buffer::Role::kFp8Scales) s[b->receiver_tensor] = d;
  }
  // The ops with a buffer to write and changes for it; distinct ops write
  // distinct elements and blocks (block-aligned boxes), so they run in
  // parallel.
  std::vector<uint32_t> own;
  std::vector<uint32_t>& work = log != nullptr ? log->work : own;
  std::vector<uint8_t> touched(2 * plan.tensors.size(), 0);
  for (uint32_t k = 0; k < plan.ops.size() && !undo; ++k) {
    const Fp8ReceiverOp& op = plan.ops[k];
    const kernels::Fp8ChangeSet& cs = set->by_canonical[op.canonical];
    if (cs.byte_index.empty() && cs.scale_index.empty()) continue;
    if (!q[op.receiver_tensor] && !s[op.receiver_tensor]) continue;
    work.push_back(k);
    touched[2 * op.receiver_tensor] |= q[op.receiver_tensor] ? 1 : 0;
    touched[2 * op.receiver_tensor + 1] |= s[op.receiver_tensor] ? 1 : 0;
    if (log != nullptr && ((q[op.receiver_tensor] && q[op.receiver_tensor].device) ||
                           (s[op.receiver_tensor] && s[op.receiver_tensor].device))) {
      log->exact = false;
    }
  }
  if (log != nullptr && !undo) {
    log->bytes.assign(work.size(), {});
    log->scales.assign(work.size(), {});
  }
  std::atomic<bool> ok{true};
  std::atomic<uint64_t> written{0};
  kernels::ParallelFor(work.size(), 1, [&](size_t begin, size_t end) {
    Fp8OpIndices idx;
    uint64_t wrote = 0;
    for (size_t w = begin; w < end && ok.load(std::memory_order_relaxed); ++w) {
      const Fp8ReceiverOp& op = plan.ops[work[w]];
      const Keep keep = log == nullptr ? Keep{} : Keep{&log->bytes[w], &log->scales[w], undo};
      if (!WriteOp(op, set->by_canonical[op.canonical], q[op.receiver_tensor],
                   s[op.receiver_tensor], keep, &idx, &wrote)) {
        ok = false;
      }
    }
    written.fetch_add(wrote, std::memory_order_relaxed);
  });
  *bytes += written.load();
  *buffers += static_cast<uint64_t>(std::count(touched.begin(), touched.end(), 1));
  return ok.load();
}

}  // namespace dte::live
