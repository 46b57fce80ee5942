// FP8 receivers of a live apply (sync/live/live.h): step 2's FP8 change
// sets, one FP8 block row at a time.
#include <algorithm>
#include <cstring>
#include <map>
#include <tuple>

#include "kernels/parallel.h"
#include "sync/live/internal/live_changes.h"
#include "sync/live/internal/live_fp8.h"

namespace dte::live {

namespace {

// One FP8 block row (`band`) of a changed quantized tensor: the block
// rows' BF16 content of both versions is read and the band's changed
// elements idx[begin, end) examined.
struct BandJob {
  const Live::Changes* c;
  uint32_t canonical;
  uint64_t band;
  size_t begin, end;
};

// The band-local results, merged per tensor in band order.
struct BandResult {
  kernels::Fp8ChangeSet set;
  dte::Status status;
};

class Fp8Step {
 public:
  Fp8Step(const LiveView& from, const LiveView& to, LiveMount* mount, Live::Fp8Sets* out)
      : from_(from), to_(to), mount_(mount), out_(out) {}
  void ListJobs(const std::vector<Live::Changes>& changes,
                const std::vector<uint32_t>& first_canonical);
  Status Run();

 private:
  // A worker's buffers, reused from band to band: both versions' band, a
  // store block, the band's changed indices.
  struct Scratch {
    std::vector<uint16_t> live, target, block;
    std::vector<uint64_t> idx;
  };
  Status RunJob(const BandJob& job, Scratch* w, kernels::Fp8ChangeSet* out) const;
  Status ReadBand(const Live::Changes& c, uint64_t e0, uint64_t e1, Scratch* w) const;
  uint64_t NumElements(const Live::Changes& c) const {
    const TensorEntry& t = to_.version->manifest.files[c.file].tensors[c.tensor];
    return (t.end - t.begin) / 2;
  }
  const std::string& NameOf(const Live::Changes& c) const {
    return to_.version->manifest.files[c.file].tensors[c.tensor].name;
  }

  const LiveView& from_;
  const LiveView& to_;
  LiveMount* const mount_;
  Live::Fp8Sets* const out_;
  std::map<const Live::Changes*, std::vector<uint64_t>> changed_;  // flat indices, ascending
  std::vector<BandJob> jobs_;
};

void Fp8Step::ListJobs(const std::vector<Live::Changes>& changes,
                       const std::vector<uint32_t>& first_canonical) {
  for (const Live::Changes& c : changes) {
    const uint32_t canonical = first_canonical[c.file] + c.tensor;
    if (!out_->plan->canonical_fp8[canonical]) continue;
    const kernels::Fp8Layout& l = out_->plan->canonical_layout[canonical];
    std::vector<uint64_t>& idx = changed_[&c];
    for (const Live::BlockChange& bc : c.blocks) {
      const uint64_t first = uint64_t{bc.block} * c.block_elements;
      for (uint32_t i : bc.idx) idx.push_back(first + i);
    }
    const uint64_t band_elements = l.block_rows * l.cols;
    for (size_t k = 0; k < idx.size();) {
      const uint64_t band = idx[k] / band_elements;
      size_t e = k;
      while (e < idx.size() && idx[e] / band_elements == band) ++e;
      jobs_.push_back({&c, canonical, band, k, e});
      k = e;
    }
  }
}

// The BF16 elements [e0, e1) of the tensor in both versions. The target's
// store blocks are read (checked against their hashes); the live version's
// are the same where no change lies, and the target's minus the
// differences where the changes are differences; blocks with whole values
// or compared ones are read from the live version too.
Status Fp8Step::ReadBand(const Live::Changes& c, uint64_t e0, uint64_t e1, Scratch* w) const {
  std::vector<uint16_t>* live = &w->live;
  std::vector<uint16_t>* target = &w->target;
  std::vector<uint16_t>* scratch = &w->block;
  const uint64_t be = c.block_elements;
  for (uint64_t b = e0 / be; b * be < e1; ++b) {
    const uint64_t lo = std::max(e0, b * be), hi = std::min(e1, (b + 1) * be);
    const auto block = static_cast<uint32_t>(b);
    // A store block inside the band is read in place, one it shares with
    // another band through a scratch block. Not cached: the pass over a
    // version would only evict what reads of the mount use.
    const bool inside = lo == b * be && hi == std::min(NumElements(c), (b + 1) * be);
    if (!inside) scratch->resize(be);
    uint16_t* dst = inside ? target->data() + (lo - e0) : scratch->data();
    RETURN_IF_ERROR(mount_->CopyTensorBlock(to_.version, c.file, c.tensor, block,
                                            reinterpret_cast<uint8_t*>(dst), &to_.chain));
    if (!inside) {
      std::memcpy(target->data() + (lo - e0), scratch->data() + (lo - b * be), (hi - lo) * 2);
    }
    auto bc = std::lower_bound(c.blocks.begin(), c.blocks.end(), block,
                               [](const Live::BlockChange& x, uint32_t v) { return x.block < v; });
    const bool changed = bc != c.blocks.end() && bc->block == block;
    if (changed && (bc->values || !bc->whole.empty())) {
      ASSIGN_OR_RETURN(auto lb,
                       mount_->TensorBlock(from_.version, c.file, c.tensor, block, &from_.chain));
      std::memcpy(live->data() + (lo - e0), lb.data() + (lo - b * be) * 2, (hi - lo) * 2);
      continue;
    }
    std::memcpy(live->data() + (lo - e0), target->data() + (lo - e0), (hi - lo) * 2);
    if (!changed) continue;
    for (size_t k = 0; k < bc->idx.size(); ++k) {
      const uint64_t at = b * be + bc->idx[k];
      if (at < lo || at >= hi) continue;
      uint16_t diff;
      std::memcpy(&diff, bc->vals.data() + 2 * k, 2);
      (*live)[at - e0] = static_cast<uint16_t>((*live)[at - e0] - diff);
    }
  }
  return Status::Ok();
}

Status Fp8Step::RunJob(const BandJob& job, Scratch* w, kernels::Fp8ChangeSet* out) const {
  std::vector<uint16_t>* live = &w->live;
  std::vector<uint16_t>* target = &w->target;
  std::vector<uint64_t>* idx = &w->idx;
  const kernels::Fp8Layout& l = out_->plan->canonical_layout[job.canonical];
  kernels::Fp8Layout band = l;
  const uint64_t r0 = job.band * l.block_rows;
  band.rows = std::min(l.rows, r0 + l.block_rows) - r0;
  const uint64_t e0 = r0 * l.cols, e1 = e0 + band.num_elements();
  live->resize(band.num_elements());
  target->resize(band.num_elements());
  RETURN_IF_ERROR(ReadBand(*job.c, e0, e1, w));
  const std::vector<uint64_t>& all = changed_.at(job.c);
  idx->assign(all.begin() + static_cast<ptrdiff_t>(job.begin),
              all.begin() + static_cast<ptrdiff_t>(job.end));
  for (uint64_t& i : *idx) i -= e0;
  const std::string err = kernels::Fp8ChangesAt(band, live->data(), target->data(), idx->data(),
                                                idx->size(), NameOf(*job.c), out);
  if (!err.empty()) {
    return InvalidArgument("FP8 receivers: between live " +
                           VersionName(from_.version->manifest.version) + " and " +
                           VersionName(to_.version->manifest.version) + ": " + err);
  }
  for (uint64_t& i : out->byte_index) i += e0;
  for (uint64_t& i : out->scale_index) i += job.band * l.grid_cols();
  return Status::Ok();
}

Status Fp8Step::Run() {
  std::vector<BandResult> results(jobs_.size());
  kernels::ParallelFor(jobs_.size(), 1, [&](size_t begin, size_t end) {
    Scratch w;
    for (size_t j = begin; j < end; ++j) {
      results[j].status = RunJob(jobs_[j], &w, &results[j].set);
    }
  });
  out_->by_canonical.assign(out_->plan->canonical_fp8.size(), kernels::Fp8ChangeSet{});
  for (size_t j = 0; j < jobs_.size(); ++j) {
    RETURN_IF_ERROR(results[j].status);
    kernels::Fp8ChangeSet& to = out_->by_canonical[jobs_[j].canonical];
    const kernels::Fp8ChangeSet& from = results[j].set;
    to.byte_index.insert(to.byte_index.end(), from.byte_index.begin(), from.byte_index.end());
    to.byte_value.insert(to.byte_value.end(), from.byte_value.begin(), from.byte_value.end());
    to.scale_index.insert(to.scale_index.end(), from.scale_index.begin(), from.scale_index.end());
    to.scale_value.insert(to.scale_value.end(), from.scale_value.begin(), from.scale_value.end());
    to.blocks_touched += from.blocks_touched;
  }
  return Status::Ok();
}

}  // namespace

Result<std::vector<Live::Fp8Sets>> Live::Fp8ChangedSets(const LiveView& from, const LiveView& to,
                                                        const std::vector<Changes>& changes) {
  std::vector<Fp8Sets> sets;
  {
    MutexLock lock(&receivers_mu_);
    for (const auto& entry : receivers_) {
      const auto& fp8 = entry.second.fp8;  // a lambda may not capture a structured binding
      if (!fp8) continue;
      if (std::none_of(sets.begin(), sets.end(), [&](const Fp8Sets& s) { return s.For(*fp8); })) {
        sets.push_back({fp8, {}});
      }
    }
  }
  if (sets.empty()) return sets;
  std::vector<uint32_t> first_canonical;
  uint32_t n = 0;
  for (const FileEntry& f : to.version->manifest.files) {
    first_canonical.push_back(n);
    n += static_cast<uint32_t>(f.tensors.size());
  }
  for (Fp8Sets& s : sets) {
    Fp8Step step(from, to, mount_, &s);
    step.ListJobs(changes, first_canonical);
    RETURN_IF_ERROR(step.Run());
  }
  return sets;
}

}  // namespace dte::live
