// Steps 1 and 2 of a live apply (sync/live/live.h): the target must have the live
// version's layout, and the changed set between them, composed from the
// delta records along the chain (or compared block by block where it cannot
// be), decoded and verified before anything is written.
#include "sync/live/internal/live_changes.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <vector>

#include "kernels/parallel.h"
#include "kernels/width.h"
#include "store/changes.h"

namespace dte::live {
namespace {

// The unsigned integer of a W-byte element's bits.
template <int W>
using Bits = typename kernels::ElementBits<W>::type;

}  // namespace

Status Live::CheckLayout(const Version& from, const Version& to) {
  const std::string a = VersionName(from.manifest.version), b = VersionName(to.manifest.version);
  const std::string refuse = "cannot apply " + b + " over live " + a + ": ";
  if (from.manifest.block_bytes != to.manifest.block_bytes) {
    return InvalidArgument(refuse + "block sizes differ (" +
                           std::to_string(from.manifest.block_bytes) + " vs " +
                           std::to_string(to.manifest.block_bytes) + ")");
  }
  const auto& fa = from.manifest.files;
  const auto& fb = to.manifest.files;
  for (size_t i = 0; i < std::max(fa.size(), fb.size()); ++i) {
    if (i >= fa.size() || i >= fb.size() || fa[i].name != fb[i].name) {
      const std::string& name = i < fb.size() ? fb[i].name : fa[i].name;
      return InvalidArgument(refuse + "the file sets differ (" + name + ")");
    }
    const FileEntry& x = fa[i];
    const FileEntry& y = fb[i];
    if (x.safetensors != y.safetensors || x.size != y.size) {
      return InvalidArgument(refuse + x.name + " changed size or kind (live/ files keep theirs)");
    }
    if (!x.safetensors) continue;  // same size; its pages are replaced whole
    if (x.header_size != y.header_size || x.tensors.size() != y.tensors.size()) {
      return InvalidArgument(refuse + x.name + ": the tensor set or header size differs");
    }
    for (size_t t = 0; t < x.tensors.size(); ++t) {
      const TensorEntry& p = x.tensors[t];
      const TensorEntry& q = y.tensors[t];
      if (p.name != q.name || p.dtype != q.dtype || p.shape != q.shape || p.begin != q.begin ||
          p.end != q.end || p.first_block != q.first_block || p.blocks != q.blocks) {
        return InvalidArgument(refuse + x.name + " tensor \"" + q.name +
                               "\" differs in name, dtype, shape or offset");
      }
    }
  }
  if (from.records.size() != to.records.size()) {
    return InvalidArgument(refuse + "the block tables differ in length");
  }
  return Status::Ok();
}

// --- the changed set ---------------------------------------------------------------

namespace {

// One decoded record as a list of entries (see Live::BlockChange).
using Entries = BlockEntries;

// Composes the entries of several records of one block, applied in order,
// into one list: per element, differences add up; a whole value replaces
// what came before and later differences add to it; differences that sum
// to zero drop out (the element is back to its old value). Dense per-block
// arrays instead of merging sorted lists: each entry costs an add and a
// bit, and the union comes out sorted from the bitmap.
class Composer {
 public:
  // Before the first Add of a block of `elements` elements of `width` bytes.
  void Start(size_t elements, int width) {
    width_ = width;
    const size_t words = (elements + 63) / 64;
    if (bits_.size() < words) bits_.resize(words, 0);
    if (acc_.size() < elements * width) acc_.resize(elements * width, 0);
    if (whole_.size() < elements) whole_.resize(elements, 0);
    words_ = words;
  }
  void Add(const Entries& e) {
    kernels::DispatchWidth(width_, [&](auto w) { AddTyped<Bits<w.value>>(e); });
  }
  // The composed entries; leaves the arrays cleared for the next block.
  void Finish(Entries* out) {
    kernels::DispatchWidth(width_, [&](auto w) { FinishTyped<Bits<w.value>>(out); });
  }

 private:
  template <typename U>
  void AddTyped(const Entries& e) {
    auto* acc = reinterpret_cast<U*>(acc_.data());
    const auto* v = reinterpret_cast<const U*>(e.vals.data());
    const size_t n = e.idx.size();
    added_ += n;
    for (size_t k = 0; k < n; ++k) {
      const uint32_t i = e.idx[k];
      bits_[i >> 6] |= uint64_t{1} << (i & 63);
      if (!e.whole.empty() && e.whole[k]) {
        acc[i] = v[k];
        whole_[i] = 1;
      } else {
        acc[i] = static_cast<U>(acc[i] + v[k]);
      }
    }
  }
  template <typename U>
  void FinishTyped(Entries* out) {
    auto* acc = reinterpret_cast<U*>(acc_.data());
    out->idx.resize(added_);  // the union has at most this many elements
    out->vals.resize(added_ * sizeof(U));
    out->whole.resize(added_);
    uint32_t* idx = out->idx.data();
    auto* vals = reinterpret_cast<U*>(out->vals.data());
    uint8_t* whole = out->whole.data();
    size_t n = 0;
    bool any_whole = false;
    for (size_t w = 0; w < words_; ++w) {
      for (uint64_t word = bits_[w]; word != 0; word &= word - 1) {
        const auto i = static_cast<uint32_t>(w * 64 + static_cast<size_t>(std::countr_zero(word)));
        const U v = acc[i];
        const uint8_t wh = whole_[i];
        acc[i] = 0;
        whole_[i] = 0;
        idx[n] = i;
        vals[n] = v;
        whole[n] = wh;
        any_whole = any_whole || wh != 0;
        n += (wh != 0 || v != 0) ? 1 : 0;  // differences that cancel drop out
      }
      bits_[w] = 0;
    }
    out->idx.resize(n);
    out->vals.resize(n * sizeof(U));
    out->whole.resize(any_whole ? n : 0);
    added_ = 0;
  }

  int width_ = 2;
  size_t words_ = 0;
  size_t added_ = 0;  // entries added since Start
  std::vector<uint64_t> bits_;
  std::vector<uint8_t> acc_;
  std::vector<uint8_t> whole_;
};

// Turns differences that lead from the parent to a version into the ones
// that lead back (no set elements).
template <typename U>
void NegateTyped(std::vector<uint8_t>* vals) {
  const size_t n = vals->size() / sizeof(U);
  for (size_t i = 0; i < n; ++i) {
    U v;
    std::memcpy(&v, vals->data() + i * sizeof(U), sizeof(U));
    v = static_cast<U>(U{0} - v);
    std::memcpy(vals->data() + i * sizeof(U), &v, sizeof(U));
  }
}

void Negate(std::vector<uint8_t>* vals, int width) {
  kernels::DispatchWidth(width, [&](auto w) { NegateTyped<Bits<w.value>>(vals); });
}

// The steps of Live::ChangedSet, one method each: the versions whose records
// lead from the live version to the target, the blocks that differ, the
// delta blobs their records point into, each block's entries (composed from
// the records, or compared), and the per-tensor lists.
class ChangeStep {
 public:
  ChangeStep(const LiveView& from, const LiveView& to, LiveMount* mount)
      : from_(from), to_(to), live_(*from.version), target_(*to.version), mount_(mount) {}

  void FindPath();
  void ListJobs();
  Status ReadBlobs();
  Status ComputeBlocks();
  std::vector<Live::Changes> Gather(dte_live_counts* counts);

 private:
  struct Job {
    uint32_t file, tensor, block;
    size_t record;
    bool diff;  // compare the two versions instead of composing the deltas' entries
  };
  // A worker's buffers, reused from block to block.
  struct Scratch {
    CodecScratch codec;
    Entries one, acc;
    Composer composer;
  };
  Status ComputeBlock(const Job& job, Scratch* w, Live::BlockChange* out) const;
  // Composes the records' entries of the job's block (`len` bytes) into
  // *out; sets *diff where they cannot say (then *out is left alone).
  Status Compose(const Job& job, size_t len, int width, Scratch* w, Live::BlockChange* out,
                 bool* diff) const;
  Status Compare(const Job& job, int width, Live::BlockChange* out) const;

  const LiveView& from_;
  const LiveView& to_;
  const Version& live_;
  const Version& target_;
  LiveMount* const mount_;

  bool forward_ = false;  // the target is newer than the live version
  bool on_chain_ = false;
  std::vector<std::shared_ptr<const Version>> path_;  // in the order records are applied
  std::vector<Job> jobs_;
  std::map<std::pair<const Version*, uint32_t>, std::string> blobs_;  // verified delta blobs
  std::vector<Live::BlockChange> outs_;                               // per job
};

// The versions whose records lead from the older of the two to the newer.
void ChangeStep::FindPath() {
  forward_ = target_.manifest.version > live_.manifest.version;
  const VersionChain& hi_chain = forward_ ? to_.chain : from_.chain;
  const uint64_t lo = std::min(live_.manifest.version, target_.manifest.version);
  // The chain is newest first.
  for (const auto& v : hi_chain) {
    if (v->manifest.version == lo) {
      on_chain_ = true;
      break;
    }
    path_.push_back(v);
  }
  if (!on_chain_) path_.clear();
  // The order records are applied in: forward oldest first; backward each
  // one undone, newest first.
  if (forward_) std::reverse(path_.begin(), path_.end());
}

// One job per block whose hash differs, and the delta blobs they need.
void ChangeStep::ListJobs() {
  for (uint32_t f = 0; f < target_.manifest.files.size(); ++f) {
    const FileEntry& file = target_.manifest.files[f];
    for (uint32_t t = 0; t < file.tensors.size(); ++t) {
      const TensorEntry& tensor = file.tensors[t];
      for (uint32_t b = 0; b < tensor.blocks; ++b) {
        const size_t r = size_t{tensor.first_block} + b;
        if (live_.records[r].hash == target_.records[r].hash) continue;  // same content
        bool diff = !on_chain_ || path_.empty();
        for (const auto& v : path_) {
          const BlockRecord& rec = v->records[r];
          if (rec.kind == BlockKind::kSparse) {
            blobs_.emplace(std::make_pair(v.get(), rec.blob), std::string());
          } else if (rec.kind != BlockKind::kSame) {
            diff = true;
          }
        }
        jobs_.push_back({f, t, b, r, diff});
      }
    }
  }
}

// Delta blobs are small (a version's changed elements): each is read whole
// and checked against its content hash before its entries are trusted.
Status ChangeStep::ReadBlobs() {
  for (auto& [key, bytes] : blobs_) {
    const BlobRef& ref = key.first->manifest.blobs[key.second];
    ASSIGN_OR_RETURN(bytes, mount_->ReadWholeBlob(ref.hash, ref.size,
                                                  VersionName(key.first->manifest.version) +
                                                      " delta blob " + BlobKey(ref.hash)));
  }
  return Status::Ok();
}

Status ChangeStep::ComputeBlocks() {
  outs_.resize(jobs_.size());
  Mutex err_mu;
  dte::Status first_error;
  kernels::ParallelFor(jobs_.size(), 4, [&](size_t begin, size_t end) {
    Scratch scratch;
    for (size_t j = begin; j < end; ++j) {
      dte::Status s = ComputeBlock(jobs_[j], &scratch, &outs_[j]);
      if (!s.ok()) {
        MutexLock lock(&err_mu);
        if (first_error.ok()) first_error = s;
      }
    }
  });
  return first_error;
}

Status ChangeStep::ComputeBlock(const Job& job, Scratch* w, Live::BlockChange* out) const {
  const TensorEntry& tensor = target_.manifest.files[job.file].tensors[job.tensor];
  const int width = DTypeWidth(tensor.dtype);
  const uint64_t block_bytes = target_.manifest.block_bytes;
  const uint64_t first_byte = uint64_t{job.block} * block_bytes;
  const size_t len = static_cast<size_t>(
      std::min<uint64_t>(block_bytes, (tensor.end - tensor.begin) - first_byte));
  out->block = job.block;
  bool diff = job.diff;
  if (!diff) RETURN_IF_ERROR(Compose(job, len, width, w, out, &diff));
  if (!diff) return Status::Ok();
  return Compare(job, width, out);
}

// No block of either version is materialized.
Status ChangeStep::Compose(const Job& job, size_t len, int width, Scratch* w,
                           Live::BlockChange* out, bool* diff) const {
  const FileEntry& file = target_.manifest.files[job.file];
  const TensorEntry& tensor = file.tensors[job.tensor];
  dte::Status s;
  int records = 0;
  for (const auto& v : path_) {
    const BlockRecord& rec = v->records[job.record];
    if (rec.kind != BlockKind::kSparse) continue;
    const std::string& blob = blobs_.at({v.get(), rec.blob});
    const std::string what = VersionName(v->manifest.version) + "/" + file.name + " tensor \"" +
                             tensor.name + "\" block " + std::to_string(job.block);
    s = DecodeRecordEntries(blob, rec, len, width, &w->one, &w->codec, what);
    if (!s.ok()) break;
    if (!forward_) {
      if (!w->one.whole.empty()) {
        // A set element does not say what it was before: take the values
        // from the blocks instead.
        *diff = true;
        break;
      }
      Negate(&w->one.vals, width);
    }
    if (records == 0) {
      std::swap(w->acc, w->one);  // a single record is used as it is
    } else {
      if (records == 1) {
        w->composer.Start(len / static_cast<size_t>(width), width);
        w->composer.Add(w->acc);
      }
      w->composer.Add(w->one);
    }
    ++records;
  }
  if (records > 1) w->composer.Finish(&w->acc);  // also clears it after a break
  if (s.ok() && !*diff) {
    out->idx.swap(w->acc.idx);
    out->vals.swap(w->acc.vals);
    out->whole.swap(w->acc.whole);
  }
  return s;
}

// Compares the live version's and the target's blocks (each checked against
// its block hash) and takes the values from the target's.
Status ChangeStep::Compare(const Job& job, int width, Live::BlockChange* out) const {
  out->values = true;
  out->idx.clear();
  out->whole.clear();
  ASSIGN_OR_RETURN(auto tb,
                   mount_->TensorBlock(to_.version, job.file, job.tensor, job.block, &to_.chain));
  ASSIGN_OR_RETURN(
      auto lb, mount_->TensorBlock(from_.version, job.file, job.tensor, job.block, &from_.chain));
  const char* x = lb.data();
  const char* y = tb.data();
  DifferingElements(reinterpret_cast<const uint8_t*>(x), reinterpret_cast<const uint8_t*>(y),
                    tb.size(), width, &out->idx);
  out->vals.resize(out->idx.size() * static_cast<size_t>(width));
  for (size_t k = 0; k < out->idx.size(); ++k) {
    std::memcpy(out->vals.data() + k * width, y + size_t{out->idx[k]} * width,
                static_cast<size_t>(width));
  }
  return Status::Ok();
}

// The changed blocks as per-tensor lists, in block order; those whose
// entries all cancelled are left out.
std::vector<Live::Changes> ChangeStep::Gather(dte_live_counts* counts) {
  std::vector<Live::Changes> changes;
  counts->entries = 0;
  counts->blocks = jobs_.size();
  counts->compared_blocks = 0;
  for (size_t j = 0; j < jobs_.size(); ++j) {
    const Job& job = jobs_[j];
    if (outs_[j].values) counts->compared_blocks++;
    if (outs_[j].idx.empty()) continue;
    const TensorEntry& tensor = target_.manifest.files[job.file].tensors[job.tensor];
    const int width = DTypeWidth(tensor.dtype);
    if (changes.empty() || changes.back().file != job.file || changes.back().tensor != job.tensor) {
      changes.push_back({job.file, job.tensor, width, target_.manifest.block_bytes / width, {}});
    }
    counts->entries += outs_[j].idx.size();
    changes.back().blocks.push_back(std::move(outs_[j]));
  }
  return changes;
}

}  // namespace

Result<std::vector<Live::Changes>> Live::ChangedSet(const LiveView& from, const LiveView& to,
                                                    dte_live_counts* counts) {
  ChangeStep step(from, to, mount_);
  step.FindPath();
  step.ListJobs();
  RETURN_IF_ERROR(step.ReadBlobs());
  RETURN_IF_ERROR(step.ComputeBlocks());
  return step.Gather(counts);
}

}  // namespace dte::live
