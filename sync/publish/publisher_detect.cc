// The Publisher's ranged publish: phases 3 (detection) and 4 (routing): the changed
// elements of this rank's pieces, found on the host or on their CUDA
// device, go to their tensor's owner (sync/publish/publisher.h).
#include <algorithm>
#include <chrono>
#include <utility>

#include "kernels/adamw.h"
#include "kernels/bf16_math.h"
#include "kernels/cuda.h"
#include "sync/convert/convert_matrix.h"
#include "sync/publish/internal/dist_plan.h"
#include "sync/publish/internal/dist_wire.h"
#include "sync/publish/internal/engine_screen.h"
#include "sync/publish/publisher.h"

namespace dte {

using dist_internal::Detected;
using dist_internal::DeviceFinder;
using dist_internal::kDeviceChunk;
using dist_internal::kScreenChunk;
using dist_internal::Plan;

namespace dist_internal {
namespace {

Status Failed(const std::string& what, const kernels::CudaStatus& st) {
  return Internal(what + ": " + st.message);
}

}  // namespace

Status DeviceFinder::Prepare(int dev, const std::string& what) {
  const std::string on = what + ": CUDA device " + std::to_string(dev);
  if (kernels::CudaStatus st = kernels::CudaSetDevice(dev); !st.ok()) return Failed(on, st);
  if (device_ == dev) return Status::Ok();
  device_ = -1;
  size_t ws = 0;
  if (kernels::CudaStatus st = kernels::CudaAdamWFindChangesWorkspaceBytes(kDeviceChunk, &ws);
      !st.ok()) {
    return Failed(on, st);
  }
  for (auto [buf, bytes] : {std::pair{&workspace_, ws}, std::pair{&idx_, kDeviceChunk * 8},
                            std::pair{&bits_, kDeviceChunk * 2}, std::pair{&count_, size_t{8}}}) {
    if (kernels::CudaStatus st = buf->Allocate(bytes); !st.ok()) return Failed(on, st);
  }
  workspace_bytes_ = ws;
  device_ = dev;
  return Status::Ok();
}

Result<size_t> DeviceFinder::Find(const float* theta, const float* m, const float* v, size_t n,
                                  const kernels::AdamWParams& p, uint32_t margin_ulps,
                                  const std::string& what) {
  auto* d_idx = static_cast<uint64_t*>(idx_.data());
  auto* d_bits = static_cast<uint16_t*>(bits_.data());
  auto* d_count = static_cast<uint64_t*>(count_.data());
  if (kernels::CudaStatus st =
          kernels::CudaAdamWFindChanges(workspace_.data(), workspace_bytes_, theta, m, v, n, p,
                                        margin_ulps, d_idx, d_bits, d_count, nullptr);
      !st.ok()) {
    return Failed(what, st);
  }
  uint64_t kept = 0;
  if (kernels::CudaStatus st = kernels::CudaCopyToHost(&kept, d_count, sizeof kept); !st.ok()) {
    return Failed(what, st);
  }
  host_idx_.resize(kept);
  host_bits_.resize(kept);
  if (kernels::CudaStatus st = kernels::CudaCopyToHost(host_idx_.data(), d_idx, kept * 8);
      !st.ok()) {
    return Failed(what, st);
  }
  if (kernels::CudaStatus st = kernels::CudaCopyToHost(host_bits_.data(), d_bits, kept * 2);
      !st.ok()) {
    return Failed(what, st);
  }
  return static_cast<size_t>(kept);
}

}  // namespace dist_internal

namespace {

// A run of consecutive elements of a range's target that are consecutive
// elements of one parent tensor too.
struct Segment {
  uint64_t from = 0, len = 0;  // in the target (tensor or MCore shard)
  size_t tensor = 0;           // the parent tensor
  uint64_t to = 0;             // its first element there
};

// The segments of an MCore shard, by their place in the shard.
void McoreSegments(const Plan& p, const Plan::Target& tg, std::vector<Segment>* segments) {
  const ConvertUnit& unit = p.units[tg.unit];
  const int64_t shard_cols = internal::MatrixCols(unit.shards[tg.shard].shape);
  for (const BlockCopy& c : unit.copies) {
    if (c.shard != tg.shard) continue;
    const size_t tensor = p.ordinal.at(unit.tensors[c.tensor].name);
    const int64_t tensor_cols = internal::MatrixCols(unit.tensors[c.tensor].shape);
    for (int64_t r = 0; r < c.rows; ++r) {
      const uint64_t from = static_cast<uint64_t>((c.shard_row + r) * shard_cols + c.shard_col);
      const uint64_t to = static_cast<uint64_t>((c.tensor_row + r) * tensor_cols + c.tensor_col);
      const uint64_t len = static_cast<uint64_t>(c.cols);
      Segment* last = segments->empty() ? nullptr : &segments->back();
      if (last && last->tensor == tensor && last->from + last->len == from &&
          last->to + last->len == to) {
        last->len += len;  // rows that stay contiguous on both sides
      } else {
        segments->push_back({from, len, tensor, to});
      }
    }
  }
  std::sort(segments->begin(), segments->end(),
            [](const Segment& a, const Segment& b) { return a.from < b.from; });
}

// Routes the kept entries of one piece, found a chunk at a time, to their
// tensor's owner: as groups (tensor u32, base u64, count u32) of (offset
// u32, bits u16) in Hugging Face coordinates.
class Router {
 public:
  Router(const Plan& p, const Plan::Target& tg, Detected* d) : p_(p), d_(d) {
    if (p.mcore) {
      McoreSegments(p, tg, &segments_);
    } else {
      segments_.push_back({0, tg.elements, tg.tensor, 0});
    }
  }

  // Entry k of a chunk starting at element `base`: its index in the chunk
  // and its new bits.
  template <typename IndexOf, typename BitsOf>
  void Route(uint64_t base, size_t count, const IndexOf& index_of, const BitsOf& bits_of) {
    for (size_t k = 0; k < count; ++k) {
      const uint64_t i = base + index_of(k);
      while (seg_ < segments_.size() && segments_[seg_].from + segments_[seg_].len <= i) ++seg_;
      if (seg_ == segments_.size() || i < segments_[seg_].from) continue;  // padding: no tensor
      const Segment& sg = segments_[seg_];
      d_->routed[p_.tensors[sg.tensor].owner].Add(static_cast<uint32_t>(sg.tensor),
                                                  sg.to + (i - sg.from), bits_of(k));
      d_->kept++;
    }
  }

 private:
  const Plan& p_;
  Detected* d_;
  std::vector<Segment> segments_;
  size_t seg_ = 0;
};

// The screen's candidate buffers, for a chunk of kScreenChunk elements.
struct ScreenBuffers {
  std::vector<uint64_t> idx = std::vector<uint64_t>(kScreenChunk + internal::kScreenSlack);
  std::vector<uint32_t> old = std::vector<uint32_t>(kScreenChunk + internal::kScreenSlack);
};

// The rigorous screen over a piece in host memory, a chunk at a time.
void ScreenOnHost(const Plan::Piece& pc, const kernels::AdamWParams& params, Router& router,
                  ScreenBuffers& buffers, Detected& d) {
  std::vector<uint64_t>& idx = buffers.idx;
  const RangeState& s = *pc.state;
  const internal::ScreenScalars scalars =
      internal::MakeScreenScalars(kernels::MakeAdamWScalars(params));
  for (uint64_t base = pc.range.begin; base < pc.range.end; base += kScreenChunk) {
    const uint64_t n = std::min(kScreenChunk, pc.range.end - base);
    const uint64_t off = base - s.begin;
    internal::ScreenCounts c =
        internal::ScreenCandidates(s.param + off, s.exp_avg + off, s.exp_avg_sq + off, n, scalars,
                                   idx.data(), buffers.old.data());
    d.flagged += c.flagged;
    router.Route(
        base, c.kept, [&](size_t k) { return idx[k]; },
        [&](size_t k) { return kernels::Fp32ToBf16Bits(s.param[off + idx[k]]); });
  }
}

// The search over a piece in CUDA device memory: only the kept entries come
// back.
Status FindOnDevice(DeviceFinder& device, const Plan& p, const Plan::Piece& pc,
                    const kernels::AdamWParams& params, Router& router, Detected& d,
                    DistPublishStats* stats) {
  const RangeState& s = *pc.state;
  const std::string what = p.at_step + ": " + p.targets[pc.target].what +
                           " (state on CUDA device " + std::to_string(s.device) + ")";
  RETURN_IF_ERROR(device.Prepare(s.device, what));
  for (uint64_t base = pc.range.begin; base < pc.range.end; base += kDeviceChunk) {
    const uint64_t n = std::min(kDeviceChunk, pc.range.end - base);
    const uint64_t off = base - s.begin;
    ASSIGN_OR_RETURN(size_t count, device.Find(s.param + off, s.exp_avg + off, s.exp_avg_sq + off,
                                               n, params, p.options.margin_ulps, what));
    d.flagged += count;
    stats->detect_device_bytes += sizeof(uint64_t) + count * (sizeof(uint64_t) + 2);
    router.Route(
        base, count, [&](size_t k) { return device.host_idx()[k]; },
        [&](size_t k) { return device.host_bits()[k]; });
  }
  return Status::Ok();
}

}  // namespace

// 3. Detection: the candidates of this rank's pieces not proven unchanged.
Detected Publisher::Detect(const Plan& p) {
  Detected d;
  d.routed.resize(p.world);
  const auto start = std::chrono::steady_clock::now();
  d.status = DetectPieces(p, d);
  stats_.entries_sent = d.kept;
  stats_.detect_ns = dist_internal::NanosSince(start);
  return d;
}

Status Publisher::DetectPieces(const Plan& p, Detected& d) {
  ScreenBuffers buffers;
  for (const Plan::Piece& pc : p.pieces) {
    const Plan::Target& tg = p.targets[pc.target];
    Router router(p, tg, &d);
    const kernels::AdamWParams params = dist_internal::ParamsOf(p.h, tg.lr, tg.wd);
    if (pc.state->device >= 0) {
      RETURN_IF_ERROR(FindOnDevice(*device_, p, pc, params, router, d, &stats_));
    } else {
      ScreenOnHost(pc, params, router, buffers, d);
    }
  }
  return Status::Ok();
}

// 4. Routing: the entries go to their owners in two rounds (sizes, then
// payloads).
Result<std::vector<std::string>> Publisher::Route(Transport& t, const Plan& p, Detected& d) {
  std::vector<std::string> out(p.world);
  for (int r = 0; r < p.world; ++r) out[r] = d.routed[r].Finish();
  d.routed.clear();
  return dist_internal::AllToAllMove(t, std::move(out), p.at_step + ": routing changed elements",
                                     &stats_);
}

}  // namespace dte
