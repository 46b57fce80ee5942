#include "fs/live.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
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
#include "fs/log.h"
#include "kernels/cuda.h"
#include "kernels/parallel.h"
#include "kernels/remap_cuda.h"
#include "sync/convert.h"

namespace dte::fs {

// --- receivers ------------------------------------------------------------------

// The changed elements of one tensor: flat indices (increasing) and the
// target's values, width bytes each.
struct Live::Changes {
  uint32_t file = 0, tensor = 0;
  int width = 0;
  std::vector<uint64_t> idx;
  std::vector<uint8_t> vals;
};

namespace {

using Clock = std::chrono::steady_clock;

uint64_t Nanos(Clock::time_point since) {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - since).count());
}

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

// Writes vals[pos[j]] to dst[dst_idx[j]] for j < n (width bytes each); every
// index is checked against `elements`. False on a SIGBUS or a bad index.
bool GuardedScatter(uint8_t* dst, uint64_t elements, const uint64_t* dst_idx, const uint64_t* pos,
                    const uint8_t* vals, size_t n, int width) {
  for (size_t j = 0; j < n; ++j) {
    if (dst_idx[j] >= elements) return false;
  }
  sigjmp_buf jump;
  if (sigsetjmp(jump, 0) != 0) {
    t_bus_jump = nullptr;
    return false;
  }
  t_bus_jump = &jump;
  if (width == 2) {
    for (size_t j = 0; j < n; ++j) std::memcpy(dst + dst_idx[j] * 2, vals + pos[j] * 2, 2);
  } else {
    for (size_t j = 0; j < n; ++j) {
      std::memcpy(dst + dst_idx[j] * width, vals + pos[j] * width, static_cast<size_t>(width));
    }
  }
  t_bus_jump = nullptr;
  return true;
}

std::string CString(const char* field, size_t size) {
  return std::string(field, strnlen(field, size));
}

std::string LayoutText(const ShardLayout& l, int rank) {
  return "tp=" + std::to_string(l.tp) + " rank " + std::to_string(rank) +
         (l.fuse_qkv ? ", fused qkv_proj" : "") + (l.fuse_gate_up ? ", fused gate_up_proj" : "");
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

Result<std::vector<Live::Changes>> Live::ChangedSet(const LiveView& from, const LiveView& to,
                                                    uint64_t* entries) {
  const Version& L = *from.version;
  const Version& T = *to.version;
  // The versions whose records lead from the older of the two to the newer.
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

  struct Job {
    uint32_t file, tensor, block;
    size_t record;
    bool diff;  // compare L and T instead of reading the deltas' indices
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
        bool diff = !on_chain;
        for (const auto& v : path) {
          const BlockRecord& rec = v->records[r];
          if (rec.kind == BlockKind::kSparse) {
            blobs.emplace(std::make_pair(v.get(), rec.blob), std::string());
          } else if (rec.kind != BlockKind::kSame) {
            diff = true;
          }
        }
        jobs.push_back({f, t, b, r, diff || path.empty()});
      }
    }
  }
  // Delta blobs are small (a version's changed elements): each is read whole
  // and checked against its content hash before its indices are trusted.
  for (auto& [key, bytes] : blobs) {
    const BlobRef& ref = key.first->manifest.blobs[key.second];
    ASSIGN_OR_RETURN(
        bytes, reader_->materializer().ReadWholeBlob(
                   ref.hash, ref.size,
                   VersionName(key.first->manifest.version) + " delta blob " + BlobKey(ref.hash)));
  }

  struct Out {
    std::vector<uint32_t> idx;  // block-relative
    std::vector<uint8_t> vals;
  };
  std::vector<Out> outs(jobs.size());
  Mutex err_mu;
  dte::Status first_error;
  kernels::ParallelFor(jobs.size(), 4, [&](size_t begin, size_t end) {
    CodecScratch scratch;
    std::vector<uint32_t> one, merged;
    for (size_t j = begin; j < end; ++j) {
      const Job& job = jobs[j];
      const FileEntry& file = T.manifest.files[job.file];
      const TensorEntry& tensor = file.tensors[job.tensor];
      const int width = DTypeWidth(tensor.dtype);
      auto tb = reader_->TensorBlock(to.version, job.file, job.tensor, job.block, &to.chain);
      dte::Status s = tb.status();
      Out& out = outs[j];
      if (s.ok() && job.diff) {
        auto lb = reader_->TensorBlock(from.version, job.file, job.tensor, job.block, &from.chain);
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
        }
      } else if (s.ok()) {
        const size_t len = (*tb)->size();
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
          s = DecodeSparseIndices(std::string_view(blob).substr(rec.offset, rec.length), len, width,
                                  &one, &scratch, what);
          if (!s.ok()) break;
          merged.clear();
          std::set_union(out.idx.begin(), out.idx.end(), one.begin(), one.end(),
                         std::back_inserter(merged));
          out.idx.swap(merged);
        }
      }
      if (!s.ok()) {
        MutexLock lock(&err_mu);
        if (first_error.ok()) first_error = s;
        continue;
      }
      out.vals.resize(out.idx.size() * static_cast<size_t>(width));
      const char* y = (*tb)->data();
      for (size_t k = 0; k < out.idx.size(); ++k) {
        std::memcpy(out.vals.data() + k * width, y + size_t{out.idx[k]} * width,
                    static_cast<size_t>(width));
      }
    }
  });
  if (!first_error.ok()) return first_error;

  std::vector<Changes> changes;
  *entries = 0;
  for (size_t j = 0; j < jobs.size(); ++j) {
    const Job& job = jobs[j];
    const TensorEntry& tensor = T.manifest.files[job.file].tensors[job.tensor];
    const int width = DTypeWidth(tensor.dtype);
    if (changes.empty() || changes.back().file != job.file || changes.back().tensor != job.tensor) {
      changes.push_back({job.file, job.tensor, width, {}, {}});
    }
    Changes& c = changes.back();
    const uint64_t first = uint64_t{job.block} * (T.manifest.block_bytes / width);
    for (uint32_t i : outs[j].idx) c.idx.push_back(first + i);
    c.vals.insert(c.vals.end(), outs[j].vals.begin(), outs[j].vals.end());
    *entries += outs[j].idx.size();
    Out().idx.swap(outs[j].idx);  // free as we go
    Out().vals.swap(outs[j].vals);
  }
  return changes;
}

// --- registration -------------------------------------------------------------------

Result<const Live::Plan*> Live::PlanFor(const Version& v, const ShardLayout& layout) {
  const auto key = std::make_tuple(layout.tp, layout.fuse_qkv, layout.fuse_gate_up);
  if (auto it = plans_.find(key); it != plans_.end()) return &it->second;
  const std::string name = VersionName(v.manifest.version);
  const FileEntry* config = nullptr;
  std::vector<PlanTensor> canonical;
  for (const FileEntry& f : v.manifest.files) {
    if (f.name == "config.json") config = &f;
    for (const TensorEntry& t : f.tensors) {
      PlanTensor p{t.name, t.dtype, {}};
      for (int64_t d : t.shape) p.shape.push_back(static_cast<uint64_t>(d));
      canonical.push_back(std::move(p));
    }
  }
  if (!config) {
    return InvalidArgument("receivers need the attention geometry from config.json, and " + name +
                           " has none");
  }
  ASSIGN_OR_RETURN(std::string json, reader_->materializer().ReadWholeBlob(
                                         config->blob, config->size, name + "/config.json"));
  ASSIGN_OR_RETURN(ModelSpec spec, ParseHfConfig(json, name + "/config.json"));
  AttentionGeometry g{static_cast<uint64_t>(spec.num_attention_heads),
                      static_cast<uint64_t>(spec.num_kv_heads),
                      static_cast<uint64_t>(spec.head_dim)};
  auto plan = MakeTransferPlan(canonical, g, ShardLayout{1, false, false}, layout);
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
    void* m = ::mmap(nullptr, buf->map_len, PROT_READ | PROT_WRITE, MAP_SHARED, fd,
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
  std::vector<uint64_t> dst, pos;
  std::vector<uint64_t> failed;
  for (auto& [owner, rc] : receivers_) {
    auto plan = PlanFor(v, rc.layout);
    if (!plan.ok()) return plan.status();
    std::vector<Buffer*> by_tensor(
        (*plan)->plan.receiver_tensors[static_cast<size_t>(rc.rank)].size());
    for (const auto& b : rc.buffers) by_tensor[b->receiver_tensor] = b.get();
    bool wrote = false, ok = true;
    std::vector<bool> touched(by_tensor.size());
    for (const Changes& c : changes) {
      if (c.idx.empty()) continue;
      const uint32_t canonical = first_canonical[c.file] + c.tensor;
      for (uint32_t op_index : (*plan)->ops_by_canonical[canonical]) {
        const TransferOp& op = (*plan)->plan.ops[op_index];
        if (op.receiver != rc.rank) continue;
        Buffer* b = by_tensor[op.receiver_tensor];
        if (!b) continue;
        dst.resize(c.idx.size());
        pos.resize(c.idx.size());
        const size_t k = RemapOpIndices(op, c.idx.data(), c.idx.size(), dst.data(), pos.data());
        if (k == 0) continue;
        if (b->kind == DTE_LIVE_CUDA_IPC) {
          // Host-side check, then the remap + scatter kernel on the device.
          for (size_t j = 0; j < k; ++j) ok = ok && dst[j] < b->elements;
          std::vector<uint64_t> src(k);
          std::vector<uint8_t> vals(k * static_cast<size_t>(c.width));
          for (size_t j = 0; j < k; ++j) {
            src[j] = c.idx[pos[j]];
            std::memcpy(vals.data() + j * c.width, c.vals.data() + pos[j] * c.width,
                        static_cast<size_t>(c.width));
          }
          kernels::CudaBuffer d_src, d_vals;
          kernels::CudaStatus cs = d_src.Allocate(k * 8);
          if (cs.ok()) cs = d_vals.Allocate(vals.size());
          if (cs.ok()) cs = kernels::CudaCopyToDevice(d_src.data(), src.data(), k * 8);
          if (cs.ok()) cs = kernels::CudaCopyToDevice(d_vals.data(), vals.data(), vals.size());
          if (cs.ok() && ok) {
            cs = kernels::CudaRemapScatter(op.remap, static_cast<const uint64_t*>(d_src.data()),
                                           d_vals.data(), k, c.width, b->data, nullptr);
          }
          if (cs.ok()) cs = kernels::CudaStreamSynchronize(nullptr);
          ok = ok && cs.ok();
        } else {
          ok = GuardedScatter(b->data, b->elements, dst.data(), pos.data(), c.vals.data(), k,
                              c.width);
        }
        if (!ok) break;
        wrote = true;
        touched[op.receiver_tensor] = true;
        counts->bytes += k * static_cast<uint64_t>(c.width);
      }
      if (!ok) break;
    }
    if (!ok) {
      // Its memory went away under the mapping (or a device call failed):
      // the receiver is dropped and the apply goes on for the others.
      LogLine("dtefs: live apply: dropped receiver (" + LayoutText(rc.layout, rc.rank) +
              "): writing its buffers failed");
      failed.push_back(owner);
      continue;
    }
    if (wrote) counts->receivers++;
    counts->buffers += static_cast<uint64_t>(std::count(touched.begin(), touched.end(), true));
  }
  for (uint64_t owner : failed) receivers_.erase(owner);
  return Status::Ok();
}

Status Live::PushPages(const LiveView& from, const LiveView& to,
                       const std::vector<Changes>& changes, PageCache* pages, uint64_t* pushed) {
  const Version& T = *to.version;
  std::string buf;
  for (uint32_t f = 0; f < T.manifest.files.size(); ++f) {
    const FileEntry& file = T.manifest.files[f];
    const FileEntry& old = from.version->manifest.files[f];
    if (file.size == 0) continue;
    const uint64_t npages = (file.size + kPageBytes - 1) / kPageBytes;
    std::vector<uint8_t> changed(npages, 0);
    bool any = false;
    // A whole blob that differs (a header, or a file other than safetensors,
    // of the same size) is replaced whole.
    const uint64_t whole = file.safetensors ? file.header_size : file.size;
    if (file.safetensors ? !(old.header_blob == file.header_blob) : !(old.blob == file.blob)) {
      for (uint64_t p = 0; p * kPageBytes < whole; ++p) changed[p] = 1;
      any = true;
    }
    for (const Changes& c : changes) {
      if (c.file != f || c.idx.empty()) continue;
      const uint64_t base = file.header_size + file.tensors[c.tensor].begin;
      for (uint64_t i : c.idx)
        changed[(base + i * static_cast<uint64_t>(c.width)) / kPageBytes] = 1;
      any = true;
    }
    if (!any) continue;
    std::vector<uint8_t> resident;
    dte::Status s = pages->Resident(file.name, file.size, &resident);
    if (!s.ok() || resident.size() != npages) {
      // Unknown residency: push every changed page (the kernel then caches
      // them all, which costs memory but never shows old bytes).
      LogLine("dtefs: live apply: page residency of live/" + file.name + " unknown (" +
              s.message() + "); pushing every changed page");
      resident.assign(npages, 1);
    }
    constexpr uint64_t kMaxPush = uint64_t{1} << 20;
    for (uint64_t p = 0; p < npages;) {
      if (!changed[p] || !(resident[p] & 1)) {
        ++p;
        continue;
      }
      uint64_t q = p;
      while (q < npages && changed[q] && (resident[q] & 1) && (q - p) * kPageBytes < kMaxPush) ++q;
      const uint64_t off = p * kPageBytes;
      const uint64_t len = std::min(q * kPageBytes, file.size) - off;
      buf.resize(len);
      RETURN_IF_ERROR(reader_->Read(to.version, f, off, len, reinterpret_cast<uint8_t*>(buf.data()),
                                    &to.chain));
      RETURN_IF_ERROR(pages->Store(f, off, buf.data(), len));
      *pushed += q - p;
      p = q;
    }
  }
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
  auto changes = ChangedSet(*from, *to, &counts.entries);
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
  {
    MutexLock lock(&view_mu_);
    view_ = to;
  }
  // Reads that picked the old view before the switch have replied once this
  // returns; every page they filled is resident now and replaced below.
  while (from->readers.load(std::memory_order_acquire) > 0) {
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  if (pages) {
    if (dte::Status s = PushPages(*from, *to, *changes, pages, &counts.pages); !s.ok()) {
      return fail(s.WithContext("live apply of " + VersionName(counts.to_version) +
                                ": replacing cached pages"));
    }
  }
  counts.pagecache_ns = Nanos(t);
  counts.elapsed_ns = Nanos(start);
  MutexLock lock(&status_mu_);
  applies_++;
  last_apply_time_ = static_cast<int64_t>(std::time(nullptr));
  last_error_ = 0;
  last_message_.clear();
  last_ = counts;
  return counts;
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
