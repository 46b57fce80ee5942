#include "fs/live.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <chrono>
#include <csetjmp>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <mutex>
#include <thread>

#include "fs/filesystem.h"
#include "fs/internal/live_changes.h"
#include "fs/log.h"
#include "kernels/cuda.h"
#include "kernels/parallel.h"
#include "kernels/remap_cuda.h"
#include "kernels/remap_math.h"
#include "kernels/width.h"
#include "sync/convert.h"
#include "sync/push.h"

namespace dte::fs {

// --- receivers ------------------------------------------------------------------

namespace {

// The unsigned integer of a W-byte element's bits.
template <int W>
using Bits = typename kernels::ElementBits<W>::type;

// What the apply helpers read of a BlockChange.
struct EntryView {
  bool values;
  const uint8_t* vals;
  const uint8_t* whole;  // null: no set elements
};

using internal::Clock;
using internal::Nanos;

// A SIGBUS while writing a receiver's shared memory (its object was
// truncated under the mapping) must fail that receiver, not kill the daemon.
thread_local sigjmp_buf* t_bus_jump = nullptr;

void OnSigbus(int sig, siginfo_t*, void*) {
  if (t_bus_jump) siglongjmp(*t_bus_jump, 1);
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

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

template <int W>
void ApplyAll(uint8_t* dst, const uint64_t* dst_idx, const uint64_t* pos, const uint8_t* vals,
              const EntryView& c, size_t n) {
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

std::string CString(const char* field, size_t size) {
  return std::string(field, strnlen(field, size));
}

}  // namespace

int LiveErrno(const dte::Status& s) {
  // As any request, except that a refused caller is not permitted (not a
  // file mode matter) and a missing capability is not a read-only mount.
  switch (s.code()) {
    case Code::kPermissionDenied:
      return EPERM;
    case Code::kUnimplemented:
      return EOPNOTSUPP;
    default:
      return ErrnoOf(s);
  }
}

Live::Buffer::~Buffer() {
  if (map) ::munmap(map, map_len);
  if (kind == DTE_LIVE_CUDA_IPC && data) (void)kernels::CudaIpcCloseMemHandle(data);
}

Live::~Live() = default;

void Live::InitIfUnset(const std::shared_ptr<const Version>& v) {
  if (!v) return;
  {
    MutexLock lock(&view_mu_);
    if (view_) return;
  }
  auto view = std::make_shared<LiveView>();
  view->version = v;
  view->chain = reader_->ChainOf(v);
  MutexLock lock(&view_mu_);
  if (!view_) view_ = std::move(view);
}

Live::ReadGuard::ReadGuard(Live* live) {
  MutexLock lock(&live->view_mu_);  // no guard joins a view once it is switched out
  view_ = live->view_;
  if (view_) view_->readers.fetch_add(1, std::memory_order_relaxed);
}

Live::ReadGuard::~ReadGuard() {
  if (view_) view_->readers.fetch_sub(1, std::memory_order_release);
}

std::shared_ptr<const LiveView> Live::View() {
  MutexLock lock(&view_mu_);
  return view_;
}

// --- layout ---------------------------------------------------------------------

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
struct Entries {
  std::vector<uint32_t> idx;
  std::vector<uint8_t> vals;
  std::vector<uint8_t> whole;  // empty: no set elements
};

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

}  // namespace

Result<std::vector<Live::Changes>> Live::ChangedSet(const LiveView& from, const LiveView& to,
                                                    dte_live_counts* counts) {
  const Version& L = *from.version;
  const Version& T = *to.version;
  // The versions whose records lead from the older of the two to the newer,
  // newest first.
  const bool forward = T.manifest.version > L.manifest.version;
  const VersionChain& hi_chain = forward ? to.chain : from.chain;
  const uint64_t lo = std::min(L.manifest.version, T.manifest.version);
  std::vector<std::shared_ptr<const Version>> path;
  bool on_chain = false;
  for (const auto& v : hi_chain) {
    if (v->manifest.version == lo) {
      on_chain = true;
      break;
    }
    path.push_back(v);
  }
  if (!on_chain) path.clear();
  // The order records are applied in: forward oldest first; backward each
  // one undone, newest first.
  if (forward) std::reverse(path.begin(), path.end());

  struct Job {
    uint32_t file, tensor, block;
    size_t record;
    bool diff;  // compare L and T instead of composing the deltas' entries
  };
  std::vector<Job> jobs;
  std::map<std::pair<const Version*, uint32_t>, std::string> blobs;  // verified delta blobs
  for (uint32_t f = 0; f < T.manifest.files.size(); ++f) {
    const FileEntry& file = T.manifest.files[f];
    for (uint32_t t = 0; t < file.tensors.size(); ++t) {
      const TensorEntry& tensor = file.tensors[t];
      for (uint32_t b = 0; b < tensor.blocks; ++b) {
        const size_t r = size_t{tensor.first_block} + b;
        if (L.records[r].hash == T.records[r].hash) continue;  // same content
        bool diff = !on_chain || path.empty();
        for (const auto& v : path) {
          const BlockRecord& rec = v->records[r];
          if (rec.kind == BlockKind::kSparse) {
            blobs.emplace(std::make_pair(v.get(), rec.blob), std::string());
          } else if (rec.kind != BlockKind::kSame) {
            diff = true;
          }
        }
        jobs.push_back({f, t, b, r, diff});
      }
    }
  }
  // Delta blobs are small (a version's changed elements): each is read whole
  // and checked against its content hash before its entries are trusted.
  for (auto& [key, bytes] : blobs) {
    const BlobRef& ref = key.first->manifest.blobs[key.second];
    ASSIGN_OR_RETURN(
        bytes, reader_->materializer().ReadWholeBlob(
                   ref.hash, ref.size,
                   VersionName(key.first->manifest.version) + " delta blob " + BlobKey(ref.hash)));
  }

  std::vector<BlockChange> outs(jobs.size());
  Mutex err_mu;
  dte::Status first_error;
  kernels::ParallelFor(jobs.size(), 4, [&](size_t begin, size_t end) {
    CodecScratch scratch;
    Entries one, acc;
    Composer composer;
    for (size_t j = begin; j < end; ++j) {
      const Job& job = jobs[j];
      const FileEntry& file = T.manifest.files[job.file];
      const TensorEntry& tensor = file.tensors[job.tensor];
      const int width = DTypeWidth(tensor.dtype);
      const uint64_t block_bytes = T.manifest.block_bytes;
      const uint64_t first_byte = uint64_t{job.block} * block_bytes;
      const size_t len = static_cast<size_t>(
          std::min<uint64_t>(block_bytes, (tensor.end - tensor.begin) - first_byte));
      BlockChange& out = outs[j];
      out.block = job.block;
      dte::Status s;
      bool diff = job.diff;
      if (!diff) {
        // Compose the records' entries: no block of either version is
        // materialized.
        int records = 0;
        for (const auto& v : path) {
          const BlockRecord& rec = v->records[job.record];
          if (rec.kind != BlockKind::kSparse) continue;
          const std::string& blob = blobs.at({v.get(), rec.blob});
          const std::string what = VersionName(v->manifest.version) + "/" + file.name +
                                   " tensor \"" + tensor.name + "\" block " +
                                   std::to_string(job.block);
          if (rec.offset > blob.size() || rec.length > blob.size() - rec.offset) {
            s = Corruption(what + ": record lies outside its blob");
            break;
          }
          s = DecodeSparseEntries(std::string_view(blob).substr(rec.offset, rec.length), len, width,
                                  &one.idx, &one.vals, &one.whole, &scratch, what);
          if (!s.ok()) break;
          if (!forward) {
            if (!one.whole.empty()) {
              // A set element does not say what it was before: take the
              // values from the blocks instead.
              diff = true;
              break;
            }
            Negate(&one.vals, width);
          }
          if (records == 0) {
            std::swap(acc, one);  // a single record is used as it is
          } else {
            if (records == 1) {
              composer.Start(len / static_cast<size_t>(width), width);
              composer.Add(acc);
            }
            composer.Add(one);
          }
          ++records;
        }
        if (records > 1) composer.Finish(&acc);  // also clears it after a break
        if (s.ok() && !diff) {
          out.idx.swap(acc.idx);
          out.vals.swap(acc.vals);
          out.whole.swap(acc.whole);
        }
      }
      if (s.ok() && diff) {
        // Compare L's and T's blocks (each checked against its block hash)
        // and take the values from T's.
        out.values = true;
        out.idx.clear();
        out.whole.clear();
        auto tb = reader_->TensorBlock(to.version, job.file, job.tensor, job.block, &to.chain);
        auto lb = tb.ok() ? reader_->TensorBlock(from.version, job.file, job.tensor, job.block,
                                                 &from.chain)
                          : tb;
        s = lb.status();
        if (s.ok()) {
          const char* x = (*lb)->data();
          const char* y = (*tb)->data();
          const size_t n = (*tb)->size() / static_cast<size_t>(width);
          for (size_t i = 0; i < n; ++i) {
            if (std::memcmp(x + i * width, y + i * width, static_cast<size_t>(width)) != 0) {
              out.idx.push_back(static_cast<uint32_t>(i));
            }
          }
          out.vals.resize(out.idx.size() * static_cast<size_t>(width));
          for (size_t k = 0; k < out.idx.size(); ++k) {
            std::memcpy(out.vals.data() + k * width, y + size_t{out.idx[k]} * width,
                        static_cast<size_t>(width));
          }
        }
      }
      if (!s.ok()) {
        MutexLock lock(&err_mu);
        if (first_error.ok()) first_error = s;
      }
    }
  });
  if (!first_error.ok()) return first_error;

  std::vector<Changes> changes;
  counts->entries = 0;
  counts->blocks = jobs.size();
  counts->compared_blocks = 0;
  for (size_t j = 0; j < jobs.size(); ++j) {
    const Job& job = jobs[j];
    if (outs[j].values) counts->compared_blocks++;
    if (outs[j].idx.empty()) continue;
    const TensorEntry& tensor = T.manifest.files[job.file].tensors[job.tensor];
    const int width = DTypeWidth(tensor.dtype);
    if (changes.empty() || changes.back().file != job.file || changes.back().tensor != job.tensor) {
      changes.push_back({job.file, job.tensor, width, T.manifest.block_bytes / width, {}});
    }
    counts->entries += outs[j].idx.size();
    changes.back().blocks.push_back(std::move(outs[j]));
  }
  return changes;
}

// --- registration -------------------------------------------------------------------

Result<const Live::Plan*> Live::PlanFor(const Version& v, const ShardLayout& layout) {
  const auto key = std::make_tuple(layout.tp, layout.fuse_qkv, layout.fuse_gate_up);
  if (auto it = plans_.find(key); it != plans_.end()) return &it->second;
  ASSIGN_OR_RETURN(PlanInputs in, PlanInputsOf(*store_, v));
  auto plan = MakeTransferPlan(in.canonical, in.geometry, ShardLayout{1, false, false}, layout);
  if (!plan.ok()) return plan.status().WithContext("receiver layout " + LayoutText(layout, 0));
  Plan entry;
  entry.plan = std::move(plan).value();
  entry.ops_by_canonical.resize(entry.plan.canonical.size());
  for (uint32_t i = 0; i < entry.plan.ops.size(); ++i) {
    entry.ops_by_canonical[entry.plan.ops[i].canonical].push_back(i);
  }
  return &plans_.emplace(key, std::move(entry)).first->second;
}

Result<uint64_t> Live::Register(uint64_t owner, uid_t uid, const dte_live_register& r) {
  if (r.abi_version != DTE_LIVE_ABI_VERSION) {
    return InvalidArgument("register: ABI version " + std::to_string(r.abi_version) +
                           " (this daemon speaks " + std::to_string(DTE_LIVE_ABI_VERSION) + ")");
  }
  const std::string name = CString(r.name, sizeof r.name);
  if (name.empty() || name.size() == sizeof r.name) {
    return InvalidArgument("register: the tensor name is empty or not NUL-terminated");
  }
  const std::string what = "register \"" + name + "\"";
  if (r.kind != DTE_LIVE_HOST_SHM && r.kind != DTE_LIVE_CUDA_IPC) {
    return InvalidArgument(what + ": unknown buffer kind " + std::to_string(r.kind));
  }
  if (r.tp < 1 || r.rank < 0 || r.rank >= r.tp) {
    return InvalidArgument(what + ": rank " + std::to_string(r.rank) + " of tp " +
                           std::to_string(r.tp));
  }
  const ShardLayout layout{r.tp, r.fuse_qkv != 0, r.fuse_gate_up != 0};
  std::shared_ptr<const LiveView> view = View();
  if (!view) return NotFound(what + ": the mount has no live version yet");

  MutexLock lock(&receivers_mu_);
  // An apply adds its changes to what a buffer holds, so the buffer must
  // hold the live version. Refused during an apply (its scatter may have
  // run already); otherwise, holding receivers_mu_, a later apply's
  // scatter includes this buffer.
  if (applying_.load()) return Busy(what + ": a live apply is running; register after it");
  view = View();
  if (r.version != DTE_LIVE_LATEST && r.version != view->version->manifest.version) {
    return InvalidArgument(what + ": the buffer holds " + VersionName(r.version) +
                           " but the live version is " +
                           VersionName(view->version->manifest.version) +
                           "; load it again from MOUNT/live/ and register");
  }
  auto existing = receivers_.find(owner);
  if (existing != receivers_.end()) {
    const Receiver& rc = existing->second;
    if (rc.rank != r.rank || rc.layout.tp != layout.tp || rc.layout.fuse_qkv != layout.fuse_qkv ||
        rc.layout.fuse_gate_up != layout.fuse_gate_up) {
      return InvalidArgument(what + ": layout " + LayoutText(layout, r.rank) +
                             " differs from this receiver's " + LayoutText(rc.layout, rc.rank));
    }
    for (const auto& b : rc.buffers) {
      if (b->name == name) return AlreadyExists(what + ": already registered by this receiver");
    }
  }
  ASSIGN_OR_RETURN(const Plan* plan, PlanFor(*view->version, layout));
  const auto& tensors = plan->plan.receiver_tensors[static_cast<size_t>(r.rank)];
  auto it = std::find_if(tensors.begin(), tensors.end(),
                         [&](const PlanTensor& t) { return t.name == name; });
  if (it == tensors.end()) {
    return NotFound(what + ": no such tensor in layout " + LayoutText(layout, r.rank) + " of " +
                    VersionName(view->version->manifest.version));
  }
  const std::string dtype = CString(r.dtype, sizeof r.dtype);
  std::optional<DType> dt = ParseDType(dtype);
  std::vector<uint64_t> shape;
  for (uint32_t d = 0; d < std::min<uint32_t>(r.ndim, DTE_LIVE_MAX_DIMS); ++d) {
    shape.push_back(r.shape[d] < 0 ? UINT64_MAX : static_cast<uint64_t>(r.shape[d]));
  }
  if (!dt || *dt != it->dtype || r.ndim > DTE_LIVE_MAX_DIMS || shape != it->shape) {
    auto text = [](const std::vector<uint64_t>& v) {
      return ShapeString(std::vector<int64_t>(v.begin(), v.end()));
    };
    return InvalidArgument(what + ": " + dtype + " " + text(shape) + " given, the layout has " +
                           DTypeName(it->dtype) + " " + text(it->shape));
  }
  auto buf = std::make_unique<Buffer>();
  buf->name = name;
  buf->receiver_tensor = static_cast<uint32_t>(it - tensors.begin());
  buf->width = DTypeWidth(it->dtype);
  buf->elements = ShapeElements(it->shape);
  buf->kind = r.kind;
  const uint64_t bytes = buf->elements * static_cast<uint64_t>(buf->width);
  if (r.kind == DTE_LIVE_CUDA_IPC) {
    if (!kernels::CudaDeviceAvailable()) {
      return Status(Code::kUnimplemented,
                    what + ": CUDA IPC buffers need a CUDA device, and this host has none");
    }
    void* ptr = nullptr;
    kernels::CudaStatus cs = kernels::CudaIpcOpenMemHandle(r.cuda_ipc_handle, r.cuda_device, &ptr);
    if (!cs.ok()) return InvalidArgument(what + ": " + cs.message);
    buf->data = static_cast<uint8_t*>(ptr);
  } else {
    const std::string shm = CString(r.shm_name, sizeof r.shm_name);
    if (!IsPlainFileName(shm)) {
      return InvalidArgument(what + ": shm_name \"" + shm + "\" must name an object in /dev/shm");
    }
    const std::string path = "/dev/shm/" + shm;
    const int fd = ::open(path.c_str(), O_RDWR | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) {
      const int e = errno;
      return Status(e == EACCES || e == EPERM ? Code::kPermissionDenied : Code::kNotFound,
                    what + ": cannot open " + path + ": " + std::strerror(e));
    }
    struct stat st = {};
    const bool stat_ok = ::fstat(fd, &st) == 0;
    if (!stat_ok || !S_ISREG(st.st_mode) || (uid != 0 && st.st_uid != uid)) {
      ::close(fd);
      return Status(Code::kPermissionDenied,
                    what + ": " + path + " is not a regular file of the registering user");
    }
    if (r.offset > static_cast<uint64_t>(st.st_size) ||
        bytes > static_cast<uint64_t>(st.st_size) - r.offset) {
      ::close(fd);
      return InvalidArgument(what + ": " + std::to_string(bytes) + " bytes at offset " +
                             std::to_string(r.offset) + " do not fit in " + path + " (" +
                             std::to_string(st.st_size) + " bytes)");
    }
    const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
    const uint64_t map_off = r.offset / page * page;
    buf->map_len = static_cast<size_t>(r.offset - map_off + std::max<uint64_t>(bytes, 1));
    // Populated now, so the first apply does not fault the mapping in.
    void* m = ::mmap(nullptr, buf->map_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd,
                     static_cast<off_t>(map_off));
    const int e = errno;
    ::close(fd);
    if (m == MAP_FAILED) {
      return IOError(what + ": cannot map " + path + ": " + std::strerror(e));
    }
    buf->map = m;
    buf->data = static_cast<uint8_t*>(m) + (r.offset - map_off);
  }
  buf->id = next_buffer_id_++;
  const uint64_t id = buf->id;
  Receiver& rc = receivers_[owner];
  if (rc.buffers.empty()) {
    rc.layout = layout;
    rc.rank = r.rank;
    rc.uid = uid;
  }
  rc.buffers.push_back(std::move(buf));
  return id;
}

Status Live::Unregister(uint64_t owner, uint64_t id) {
  MutexLock lock(&receivers_mu_);
  auto it = receivers_.find(owner);
  if (id == 0) {
    if (it != receivers_.end()) receivers_.erase(it);
    return Status::Ok();
  }
  if (it != receivers_.end()) {
    auto& bufs = it->second.buffers;
    for (auto b = bufs.begin(); b != bufs.end(); ++b) {
      if ((*b)->id == id) {
        bufs.erase(b);
        if (bufs.empty()) receivers_.erase(it);
        return Status::Ok();
      }
    }
  }
  return NotFound("unregister: buffer " + std::to_string(id) + " is not registered here");
}

void Live::Drop(uint64_t owner) {
  MutexLock lock(&receivers_mu_);
  receivers_.erase(owner);
}

// --- apply ---------------------------------------------------------------------------

Status Live::Scatter(const Version& v, const std::vector<Changes>& changes,
                     dte_live_counts* counts) {
  InstallSigbusHandler();
  MutexLock lock(&receivers_mu_);
  // Canonical index of each (file, tensor): the order PlanFor lists them in.
  std::vector<uint32_t> first_canonical;
  uint32_t n = 0;
  for (const FileEntry& f : v.manifest.files) {
    first_canonical.push_back(n);
    n += static_cast<uint32_t>(f.tensors.size());
  }
  std::vector<uint64_t> failed;
  for (auto& [owner, rc] : receivers_) {
    auto plan = PlanFor(v, rc.layout);
    if (!plan.ok()) return plan.status();
    std::vector<Buffer*> by_tensor(
        (*plan)->plan.receiver_tensors[static_cast<size_t>(rc.rank)].size());
    for (const auto& b : rc.buffers) by_tensor[b->receiver_tensor] = b.get();
    // The (tensor, op) pairs that write this receiver's buffers.
    struct Target {
      const Changes* c;
      const TransferOp* op;
      Buffer* buf;
      bool shift;  // IsShift(op->remap)
      bool rows;   // IsRows(op->remap)
    };
    std::vector<Target> targets;
    for (const Changes& c : changes) {
      const uint32_t canonical = first_canonical[c.file] + c.tensor;
      for (uint32_t op_index : (*plan)->ops_by_canonical[canonical]) {
        const TransferOp& op = (*plan)->plan.ops[op_index];
        if (op.receiver != rc.rank || !by_tensor[op.receiver_tensor]) continue;
        targets.push_back(
            {&c, &op, by_tensor[op.receiver_tensor], IsShift(op.remap), IsRows(op.remap)});
      }
    }
    std::atomic<bool> ok{true};
    std::atomic<uint64_t> bytes{0};
    std::vector<uint8_t> touched(by_tensor.size(), 0);
    // Host buffers: every block of every target is one piece of work, spread
    // over the worker threads (the pieces write distinct elements).
    std::vector<std::pair<uint32_t, uint32_t>> work;  // (target, block)
    for (uint32_t t = 0; t < targets.size(); ++t) {
      if (targets[t].buf->kind == DTE_LIVE_CUDA_IPC) continue;
      for (uint32_t k = 0; k < targets[t].c->blocks.size(); ++k) work.emplace_back(t, k);
    }
    kernels::ParallelFor(work.size(), 8, [&](size_t begin, size_t end) {
      std::vector<uint64_t> src, dst, pos;
      uint64_t wrote = 0;
      for (size_t w = begin; w < end && ok.load(std::memory_order_relaxed); ++w) {
        const Target& tg = targets[work[w].first];
        const BlockChange& bc = tg.c->blocks[work[w].second];
        const uint64_t first = uint64_t{bc.block} * tg.c->block_elements;
        const EntryView view{bc.values, bc.vals.data(),
                             bc.whole.empty() ? nullptr : bc.whole.data()};
        if (tg.shift) {
          // The entries inside the box, written without a remap per element.
          const kernels::RemapPlan& rp = tg.op->remap;
          if (rp.src_first > rp.src_last) continue;
          auto rel = [&](uint64_t x) {
            return x <= first ? uint64_t{0} : std::min<uint64_t>(x - first, UINT32_MAX);
          };
          const uint32_t* idx = bc.idx.data();
          const size_t b = static_cast<size_t>(
              std::lower_bound(idx, idx + bc.idx.size(), rel(rp.src_first)) - idx);
          const size_t e = static_cast<size_t>(
              std::upper_bound(idx, idx + bc.idx.size(), rel(rp.src_last)) - idx);
          if (rp.src_last < first) continue;
          if (!GuardedApplyRun(tg.buf->data, tg.buf->elements, first + rp.dst_offset, idx, view, b,
                               e, tg.c->width)) {
            ok = false;
            break;
          }
          wrote += (e - b) * static_cast<uint64_t>(tg.c->width);
          continue;
        }
        if (tg.rows) {
          // A column split: each source row's part of the box is one run
          // with its own shift (see IsRows).
          const kernels::RemapPlan& rp = tg.op->remap;
          const uint64_t cols = rp.src_shape[1];
          const uint32_t* idx = bc.idx.data();
          const size_t n = bc.idx.size();
          auto rel = [&](uint64_t x) {
            return x <= first ? uint64_t{0} : std::min<uint64_t>(x - first, UINT32_MAX);
          };
          const uint64_t r0 = std::max<uint64_t>(rp.lo[0], (first + idx[0]) / cols);
          const uint64_t r1 = std::min<uint64_t>(rp.hi[0], (first + idx[n - 1]) / cols + 1);
          size_t from = 0;
          for (uint64_t r = r0; r < r1; ++r) {
            const uint64_t lo = r * cols + rp.lo[1], hi = r * cols + rp.hi[1] - 1;
            if (hi < first) continue;
            const size_t b =
                static_cast<size_t>(std::lower_bound(idx + from, idx + n, rel(lo)) - idx);
            const size_t e = static_cast<size_t>(std::upper_bound(idx + b, idx + n, rel(hi)) - idx);
            from = e;
            const uint64_t base = first + rp.dst_offset + r * (rp.dst_stride[0] - cols);
            if (!GuardedApplyRun(tg.buf->data, tg.buf->elements, base, idx, view, b, e,
                                 tg.c->width)) {
              ok = false;
              break;
            }
            wrote += (e - b) * static_cast<uint64_t>(tg.c->width);
          }
          continue;
        }
        src.resize(bc.idx.size());
        for (size_t i = 0; i < bc.idx.size(); ++i) src[i] = first + bc.idx[i];
        dst.resize(src.size());
        pos.resize(src.size());
        const size_t k = RemapOpIndices(*tg.op, src.data(), src.size(), dst.data(), pos.data());
        if (k == 0) continue;
        if (!GuardedApply(tg.buf->data, tg.buf->elements, dst.data(), pos.data(), view, k,
                          tg.c->width)) {
          ok = false;
          break;
        }
        wrote += k * static_cast<uint64_t>(tg.c->width);
      }
      bytes.fetch_add(wrote, std::memory_order_relaxed);
    });
    // Device buffers: one remap + apply kernel per target, its blocks
    // concatenated; the indices are checked on the host first.
    for (const Target& tg : targets) {
      if (tg.buf->kind != DTE_LIVE_CUDA_IPC || !ok) continue;
      const Changes& c = *tg.c;
      std::vector<uint64_t> src;
      std::vector<uint8_t> vals, whole;
      bool all_whole = true;
      for (const BlockChange& bc : c.blocks) {
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
      if (k == 0) continue;
      for (size_t j = 0; j < k; ++j) ok = ok && dst[j] < tg.buf->elements;
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
                                     all_whole, src.size(), c.width, tg.buf->data, nullptr);
      }
      if (cs.ok()) cs = kernels::CudaStreamSynchronize(nullptr);
      if (!cs.ok()) ok = false;
      bytes += k * static_cast<uint64_t>(c.width);
    }
    if (!ok) {
      // Its memory went away under the mapping (or a device call failed):
      // the receiver is dropped and the apply goes on for the others.
      LogLine("dtefs: live apply: dropped receiver (" + LayoutText(rc.layout, rc.rank) +
              "): writing its buffers failed");
      failed.push_back(owner);
      continue;
    }
    for (const Target& tg : targets) touched[tg.op->receiver_tensor] = 1;
    counts->bytes += bytes.load();
    if (!targets.empty()) counts->receivers++;
    counts->buffers += static_cast<uint64_t>(std::count(touched.begin(), touched.end(), 1));
  }
  for (uint64_t owner : failed) receivers_.erase(owner);
  return Status::Ok();
}

void Live::RecordFailure(const dte::Status& s) {
  MutexLock lock(&status_mu_);
  failed_applies_++;
  last_error_ = LiveErrno(s);
  last_message_ = s.message();
}

Result<dte_live_counts> Live::Apply(const std::shared_ptr<const Version>& target,
                                    PageCache* pages) {
  if (applying_.exchange(true)) return Busy("another live apply is running");
  struct Reset {
    std::atomic<bool>* flag;
    ~Reset() { *flag = false; }
  } reset{&applying_};
  const Clock::time_point start = Clock::now();
  dte_live_counts counts = {};
  std::shared_ptr<const LiveView> from = View();
  auto fail = [&](dte::Status s) -> Result<dte_live_counts> {
    RecordFailure(s);
    return s;
  };
  if (!from) return fail(NotFound("the mount has no live version yet"));
  counts.from_version = from->version->manifest.version;
  counts.to_version = target->manifest.version;
  if (dte::Status s = CheckLayout(*from->version, *target); !s.ok()) return fail(s);

  auto to = std::make_shared<LiveView>();
  to->version = target;
  to->chain = reader_->ChainOf(target);
  auto changes = ChangedSet(*from, *to, &counts);
  if (!changes.ok()) {
    return fail(changes.status().WithContext("apply of " + VersionName(counts.to_version) +
                                             " refused, live state unchanged"));
  }
  counts.decode_ns = Nanos(start);

  // Nothing has been written so far. From here on the apply completes.
  Clock::time_point t = Clock::now();
  if (dte::Status s = Scatter(*target, *changes, &counts); !s.ok()) return fail(s);
  counts.scatter_ns = Nanos(t);

  t = Clock::now();
  // Reads of the new view are noted from the switch on (PushPages).
  if (pages) WatchReads(to.get());
  {
    MutexLock lock(&view_mu_);
    view_ = to;
  }
  // Reads that picked the old view before the switch have replied once this
  // returns; every page they filled is resident now and replaced below.
  while (from->readers.load(std::memory_order_acquire) > 0) {
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  LivePageStats page_stats;
  if (pages) {
    dte::Status s = PushPages(*from, *to, *changes, pages, &counts.pages, &page_stats);
    if (!s.ok()) {
      return fail(s.WithContext("live apply of " + VersionName(counts.to_version) +
                                ": replacing cached pages"));
    }
  }
  counts.pagecache_ns = Nanos(t);
  counts.elapsed_ns = Nanos(start);
  apply_latency_.Observe(std::chrono::nanoseconds(counts.elapsed_ns));
  MutexLock lock(&status_mu_);
  applies_++;
  last_apply_time_ = static_cast<int64_t>(std::time(nullptr));
  last_error_ = 0;
  last_message_.clear();
  last_ = counts;
  last_pages_ = page_stats;
  return counts;
}

LivePageStats Live::LastPageStats() {
  MutexLock lock(&status_mu_);
  return last_pages_;
}

dte_live_status Live::GetStatus() {
  dte_live_status st = {};
  st.abi_version = DTE_LIVE_ABI_VERSION;
  st.applying = applying_ ? 1 : 0;
  std::shared_ptr<const LiveView> view = View();
  st.live_version = view ? view->version->manifest.version : DTE_LIVE_LATEST;
  st.latest_version = DTE_LIVE_LATEST;
  {
    MutexLock lock(&receivers_mu_);
    st.receivers = receivers_.size();
    for (const auto& [owner, rc] : receivers_) st.buffers += rc.buffers.size();
  }
  MutexLock lock(&status_mu_);
  st.applies = applies_;
  st.failed_applies = failed_applies_;
  st.last_apply_time = last_apply_time_;
  st.last_error = last_error_;
  st.last = last_;
  std::snprintf(st.last_message, sizeof st.last_message, "%s", last_message_.c_str());
  return st;
}

}  // namespace dte::fs
