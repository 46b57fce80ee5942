// A push into the receiver's tensors (sync/push/internal/push_receiver_impl.h):
// each part checked and decoded, the parts of a version joined into one,
// and queued versions applied in order, in host or device memory.
#include <algorithm>
#include <set>

#include "kernels/cuda.h"
#include "kernels/parallel.h"
#include "kernels/remap.h"
#include "kernels/remap_cuda.h"
#include "sync/push/internal/push_receiver_impl.h"

namespace dte {

using push_internal::Assembly;
using push_internal::Frame;
using push_internal::Link;
using push_internal::Msg;
using push_internal::Pending;
using transport_internal::Deadline;
using namespace std::chrono_literals;

Result<uint64_t> PushReceiver::Impl::ApplyPending() {
  if (InServer()) {
    return FailedPrecondition(
        "push receiver rank " + std::to_string(options_.rank) + " of server " + options_.server +
        " (" + std::to_string(options_.server_size) +
        " ranks) applies only what every rank of its server staged: ApplyAgreed with every "
        "rank's Path() (Python: apply_pending with the server's group)");
  }
  std::lock_guard apply(apply_mu_);
  return ApplyPendingLocked();
}

// Writes queued pushes in order, all or up to *upto; apply_mu_ held.
Result<uint64_t> PushReceiver::Impl::ApplyPendingLocked(std::optional<uint64_t> upto) {
  uint64_t n = 0;
  for (;;) {
    Pending p;
    {
      std::lock_guard lock(mu_);
      if (pending_.empty() || (upto && held_ == upto && !inconsistent_)) break;
      p = std::move(pending_.front());
      pending_.pop_front();
      staged_bytes_ -= std::min(staged_bytes_, p.Staged());
      // Parents were checked when queued; only a catch-up in between can
      // leave a push that does not fit. The server learns the truth at the
      // next push (refused) and the reconnect's hello.
      if (inconsistent_ || !held_ || *held_ != p.parent) {
        error_ = "dropped the push of " + VersionName(p.version) + " onto " +
                 VersionName(p.parent) + ": this receiver holds " + HeldText();
        continue;
      }
    }
    // Segments write disjoint elements (the plan ships each element once).
    kernels::ParallelFor(p.segments.size(), 1, [&](size_t lo, size_t hi) {
      for (size_t i = lo; i < hi; ++i) {
        const PushTensor& t = options_.tensors[p.segments[i].tensor];
        if (t.device < 0) {
          push_internal::ApplyOpEntries(p.segments[i].entries, DTypeWidth(t.dtype), t.data);
        }
      }
    });
    // Device tensors: each segment's entries copied over and applied there.
    for (const Pending::Segment& seg : p.segments) {
      const PushTensor& t = options_.tensors[seg.tensor];
      if (t.device < 0) continue;
      Status s = ApplyOnDevice(seg.entries, t, numel_[seg.tensor]);
      if (!s.ok()) {
        std::lock_guard lock(mu_);
        inconsistent_ = true;
        error_ = s.message();
        return s;
      }
    }
    {
      std::lock_guard lock(mu_);
      held_ = p.version;
      pushes_++;
      elements_ += p.elements;
      bytes_ += p.bytes;
      if (behind_ && *behind_ <= p.version) behind_.reset();
    }
    SendAll(Msg::kApplied, {{"version", p.version}});
    cv_.notify_all();
    ++n;
  }
  return n;
}

Status PushReceiver::Impl::FromCuda(const kernels::CudaStatus& s, const std::string& what) {
  return s.ok() ? Status::Ok() : IOError(what + ": " + s.message);
}

// Writes one segment's entries into a tensor in device memory: indices,
// values and set flags copied over, then the remap-and-apply kernel with
// an identity plan over the whole tensor.
Status PushReceiver::Impl::ApplyOnDevice(const push_internal::OpEntries& e, const PushTensor& t,
                                         uint64_t numel) {
  const std::string what = "push into tensor " + t.name + " on cuda:" + std::to_string(t.device);
  kernels::RemapPlan plan;
  const std::string bad = kernels::MakeRemapPlan({{numel}, {0}, {numel}, {numel}, {0}}, &plan);
  if (!bad.empty()) return Internal(what + ": " + bad);
  RETURN_IF_ERROR(FromCuda(kernels::CudaSetDevice(t.device), what));
  kernels::CudaBuffer d_idx, d_vals, d_sets;
  RETURN_IF_ERROR(FromCuda(d_idx.Allocate(e.idx.size() * 8), what));
  RETURN_IF_ERROR(FromCuda(d_vals.Allocate(e.vals.size()), what));
  RETURN_IF_ERROR(FromCuda(d_sets.Allocate(e.sets.size()), what));
  RETURN_IF_ERROR(
      FromCuda(kernels::CudaCopyToDevice(d_idx.data(), e.idx.data(), e.idx.size() * 8), what));
  RETURN_IF_ERROR(
      FromCuda(kernels::CudaCopyToDevice(d_vals.data(), e.vals.data(), e.vals.size()), what));
  RETURN_IF_ERROR(
      FromCuda(kernels::CudaCopyToDevice(d_sets.data(), e.sets.data(), e.sets.size()), what));
  RETURN_IF_ERROR(FromCuda(
      kernels::CudaRemapApply(plan, static_cast<const uint64_t*>(d_idx.data()), d_vals.data(),
                              e.sets.empty() ? nullptr : static_cast<const uint8_t*>(d_sets.data()),
                              /*all_whole=*/false, e.idx.size(), DTypeWidth(t.dtype), t.data,
                              nullptr),
      what));
  return FromCuda(kernels::CudaStreamSynchronize(nullptr), what);
}

// Checks and decodes a push against the tensors; Corruption naming what
// is wrong. Nothing is written here.
Result<Pending> PushReceiver::Impl::Check(const push_internal::CountsMsg& c,
                                          const std::string& data) {
  Pending p;
  p.version = c.version;
  p.parent = c.parent;
  const std::string what = "push of " + VersionName(c.version);
  std::string_view in(data);
  std::vector<push_internal::SegmentBytes> bytes;
  for (size_t k = 0; k < c.count.size(); ++k) {
    if (c.tensor[k] >= options_.tensors.size()) {
      return Corruption(what + ": op " + std::to_string(c.op[k]) + " names tensor " +
                        std::to_string(c.tensor[k]) + " of " +
                        std::to_string(options_.tensors.size()));
    }
    const PushTensor& t = options_.tensors[c.tensor[k]];
    if (c.count[k] > numel_[c.tensor[k]]) {
      return Corruption(what + ": " + std::to_string(c.count[k]) + " elements for tensor " +
                        t.name + " of " + std::to_string(numel_[c.tensor[k]]));
    }
    RETURN_IF_ERROR(CheckEntryKind(c, k, what));
    const size_t first = bytes.size();
    RETURN_IF_ERROR(
        push_internal::SplitOpSegments(&in, c.count[k], what + ", tensor " + t.name, &bytes));
    // Entries of one op but another kind write another tensor: their own "op".
    const size_t op = size_t{c.op[k]} * 3 + (c.kind.empty() ? 0 : static_cast<size_t>(c.kind[k]));
    for (size_t i = first; i < bytes.size(); ++i) p.segments.push_back({c.tensor[k], op, {}});
    p.elements += c.count[k];
    p.bytes += c.count[k] * DTypeWidth(t.dtype);
  }
  if (!in.empty()) {
    return Corruption(what + ": " + std::to_string(in.size()) + " bytes after the last op");
  }
  // Decode the segments in parallel; the first error (in order) is reported.
  std::vector<Status> errors(p.segments.size());
  kernels::ParallelFor(p.segments.size(), 1, [&](size_t lo, size_t hi) {
    for (size_t i = lo; i < hi; ++i) {
      Pending::Segment& seg = p.segments[i];
      const PushTensor& t = options_.tensors[seg.tensor];
      std::string_view b = bytes[i].bytes;
      errors[i] =
          push_internal::ReadOpSegments(&b, bytes[i].count, numel_[seg.tensor], DTypeWidth(t.dtype),
                                        what + ", tensor " + t.name, &seg.entries);
    }
  });
  for (const Status& e : errors) RETURN_IF_ERROR(e);
  // Within an op, segments must follow each other: no element twice.
  for (size_t i = 1; i < p.segments.size(); ++i) {
    const Pending::Segment &a = p.segments[i - 1], &b = p.segments[i];
    if (a.op == b.op && b.entries.idx.front() <= a.entries.idx.back()) {
      return Corruption(what + ", tensor " + options_.tensors[b.tensor].name +
                        ": segments overlap or are out of order");
    }
  }
  return p;
}

Status PushReceiver::Impl::OnPart(Link& link, const push_internal::CountsMsg& counts,
                                  Pending part) {
  const std::string what =
      "part " + std::to_string(counts.part) + " of the push of " + VersionName(counts.version);
  bool complete = false;
  {
    std::lock_guard lock(mu_);
    if (counts.part != static_cast<uint32_t>(link.part) || counts.parts != parts_) {
      return Corruption(what + " came as part " + std::to_string(counts.part) + " of " +
                        std::to_string(counts.parts) + " from the sender of part " +
                        std::to_string(link.part) + " of " + std::to_string(parts_));
    }
    if (expected_parent_ != counts.parent) {
      return Corruption("push of " + VersionName(counts.version) + " onto " +
                        VersionName(counts.parent) + ", but this receiver's last version is " +
                        (expected_parent_ ? VersionName(*expected_parent_) : "unknown"));
    }
    if (assembly_ && (assembly_->version != counts.version || assembly_->parent != counts.parent ||
                      assembly_->parts[counts.part])) {
      return Corruption(what + " arrived while the parts of " + VersionName(assembly_->version) +
                        " were coming in");
    }
    if (!assembly_) {
      assembly_ = Assembly{counts.version, counts.parent, {}};
      assembly_->parts.resize(parts_);
    }
    assembly_->parts[counts.part] = std::move(part);
    complete = std::all_of(assembly_->parts.begin(), assembly_->parts.end(),
                           [](const std::optional<Pending>& x) { return x.has_value(); });
    if (complete) {
      auto whole = JoinPartsLocked();
      assembly_.reset();
      if (!whole.ok()) return whole.status();
      const uint64_t staged = whole->Staged();
      if (staged_bytes_ + staged > options_.stage_bytes) {
        return FailedPrecondition("push of " + VersionName(counts.version) + ": staging its " +
                                  std::to_string(staged) + " bytes beside the " +
                                  std::to_string(staged_bytes_) +
                                  " staged would pass stage_bytes " +
                                  std::to_string(options_.stage_bytes) + ": apply them first");
      }
      staged_bytes_ += staged;
      pending_.push_back(std::move(whole).value());
      expected_parent_ = counts.version;
    }
  }
  if (!complete) return Status::Ok();
  SendAll(Msg::kReceived, {{"version", counts.version}});
  cv_.notify_all();
  if (options_.auto_apply && !InServer()) {
    std::lock_guard apply(apply_mu_);
    RETURN_IF_ERROR(ApplyPendingLocked().status());
  }
  return Status::Ok();
}

// One version from the assembly's parts: each op comes from one part (a
// tensor has one owner).
Result<Pending> PushReceiver::Impl::JoinPartsLocked() {
  Pending whole = std::move(*assembly_->parts[0]);
  std::set<size_t> ops;
  for (const auto& seg : whole.segments) ops.insert(seg.op);
  for (size_t p = 1; p < assembly_->parts.size(); ++p) {
    Pending& x = *assembly_->parts[p];
    std::set<size_t> mine;
    for (auto& seg : x.segments) {
      if (ops.count(seg.op)) {
        return Corruption("push of " + VersionName(assembly_->version) + ": parts 0-" +
                          std::to_string(p - 1) + " and part " + std::to_string(p) +
                          " both send elements of tensor " + options_.tensors[seg.tensor].name);
      }
      mine.insert(seg.op);
      whole.segments.push_back(std::move(seg));
    }
    ops.insert(mine.begin(), mine.end());
    whole.elements += x.elements;
    whole.bytes += x.bytes;
  }
  return whole;
}

}  // namespace dte
