// Receivers of a live apply (sync/live/live.h): registering, checking and mapping
// their buffers (shared memory or CUDA IPC) against the live version's
// transfer plan for their layout, and forgetting them.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cuda.h"
#include "sync/live/internal/live_changes.h"
#include "sync/live/internal/live_fp8.h"
#include "sync/transfer/plan_inputs.h"

namespace dte::live {
namespace {

std::string CString(const char* field, size_t size) {
  return std::string(field, strnlen(field, size));
}

// The tensor name of a registration; refuses another ABI version and a
// name that is empty or not NUL-terminated.
Result<std::string> RequestName(const dte_live_register& r) {
  if (r.abi_version != DTE_LIVE_ABI_VERSION) {
    return InvalidArgument("register: ABI version " + std::to_string(r.abi_version) +
                           " (this daemon speaks " + std::to_string(DTE_LIVE_ABI_VERSION) + ")");
  }
  std::string name = CString(r.name, sizeof r.name);
  if (name.empty() || name.size() == sizeof r.name) {
    return InvalidArgument("register: the tensor name is empty or not NUL-terminated");
  }
  return name;
}

Status CheckKindAndRank(const dte_live_register& r, const std::string& what) {
  if (r.kind != DTE_LIVE_HOST_SHM && r.kind != DTE_LIVE_CUDA_IPC) {
    return InvalidArgument(what + ": unknown buffer kind " + std::to_string(r.kind));
  }
  if (r.tp < 1 || r.rank < 0 || r.rank >= r.tp) {
    return InvalidArgument(what + ": rank " + std::to_string(r.rank) + " of tp " +
                           std::to_string(r.tp));
  }
  return Status::Ok();
}

// The server a registration names, and its size: ("", 1) for none. Refuses
// a size below 1, a size above 1 without a name, a name that is not
// NUL-terminated and a rank not below the size.
Result<std::pair<std::string, int>> RequestServer(const dte_live_register& r,
                                                  const std::string& what) {
  std::string server = CString(r.server, sizeof r.server);
  if (server.size() == sizeof r.server) {
    return InvalidArgument(what + ": the server name is not NUL-terminated");
  }
  const int size = server.empty() && r.server_size == 0 ? 1 : r.server_size;
  const std::string named = what + ": server \"" + server + "\"";
  if (size < 1 || (server.empty() && size != 1)) {
    return InvalidArgument(named + ": size " + std::to_string(r.server_size) +
                           " (a server has a name and at least one rank)");
  }
  if (!server.empty() && r.rank >= size) {
    return InvalidArgument(named + ": rank " + std::to_string(r.rank) +
                           " is not below the server's size " + std::to_string(size));
  }
  return std::make_pair(std::move(server), size);
}

// The layout of a buffer of an owner that registered before: the owner's.
Status CheckSameLayout(const ShardLayout& had, int had_rank, const ShardLayout& layout, int rank,
                       const std::string& what) {
  if (had_rank != rank || had.tp != layout.tp || had.fuse_qkv != layout.fuse_qkv ||
      had.fuse_gate_up != layout.fuse_gate_up) {
    return InvalidArgument(what + ": layout " + LayoutText(layout, rank) +
                           " differs from this receiver's " + LayoutText(had, had_rank));
  }
  return Status::Ok();
}

// The FP8 options of a buffer of an owner that registered before: the owner's.
Status CheckSameFp8(uint32_t had_block, uint32_t had_rule, const dte_live_register& r,
                    const std::string& what) {
  const uint32_t block = internal::Fp8BlockOf(r);
  if (had_block != block || had_rule != r.fp8_scale_rule) {
    return InvalidArgument(what + ": FP8 block " + std::to_string(block) + " and scale rule " +
                           std::to_string(r.fp8_scale_rule) + " differ from this receiver's (" +
                           std::to_string(had_block) + ", " + std::to_string(had_rule) + ")");
  }
  return Status::Ok();
}

// The registration's dtype and shape against those of the layout's tensor.
Status CheckDTypeAndShape(const dte_live_register& r, const PlanTensor& t,
                          const std::string& what) {
  const std::string dtype = CString(r.dtype, sizeof r.dtype);
  std::optional<DType> dt = ParseDType(dtype);
  std::vector<uint64_t> shape;
  for (uint32_t d = 0; d < std::min<uint32_t>(r.ndim, DTE_LIVE_MAX_DIMS); ++d) {
    shape.push_back(r.shape[d] < 0 ? UINT64_MAX : static_cast<uint64_t>(r.shape[d]));
  }
  if (dt && *dt == t.dtype && r.ndim <= DTE_LIVE_MAX_DIMS && shape == t.shape) {
    return Status::Ok();
  }
  auto text = [](const std::vector<uint64_t>& v) {
    return ShapeString(std::vector<int64_t>(v.begin(), v.end()));
  };
  return InvalidArgument(what + ": " + dtype + " " + text(shape) + " given, the layout has " +
                         DTypeName(t.dtype) + " " + text(t.shape));
}

// Where a registered buffer's bytes are: the mapping (or the opened CUDA
// allocation) and the tensor's first byte in it.
struct Mapping {
  void* map = nullptr;
  size_t map_len = 0;
  uint8_t* data = nullptr;
};

Result<Mapping> OpenCudaIpc(const dte_live_register& r, const std::string& what) {
  if (!kernels::CudaDeviceAvailable()) {
    return Status(Code::kUnimplemented,
                  what + ": CUDA IPC buffers need a CUDA device, and this host has none");
  }
  void* ptr = nullptr;
  kernels::CudaStatus cs = kernels::CudaIpcOpenMemHandle(r.cuda_ipc_handle, r.cuda_device, &ptr);
  if (!cs.ok()) return InvalidArgument(what + ": " + cs.message);
  // A handle names a whole allocation (a caching allocator's block holds
  // many tensors): the tensor starts `offset` bytes into it.
  return Mapping{ptr, 0, static_cast<uint8_t*>(ptr) + r.offset};
}

// Opens /dev/shm/SHM_NAME, a regular file of uid (any, for root) with room
// for `bytes` at the registration's offset; *size is its size.
Result<int> OpenShm(const dte_live_register& r, uid_t uid, uint64_t bytes, const std::string& path,
                    const std::string& what) {
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
  return fd;
}

Result<Mapping> MapShm(const dte_live_register& r, uid_t uid, uint64_t bytes,
                       const std::string& what) {
  const std::string shm = CString(r.shm_name, sizeof r.shm_name);
  if (!IsPlainFileName(shm)) {
    return InvalidArgument(what + ": shm_name \"" + shm + "\" must name an object in /dev/shm");
  }
  const std::string path = "/dev/shm/" + shm;
  ASSIGN_OR_RETURN(const int fd, OpenShm(r, uid, bytes, path, what));
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  const uint64_t map_off = r.offset / page * page;
  Mapping m;
  m.map_len = static_cast<size_t>(r.offset - map_off + std::max<uint64_t>(bytes, 1));
  // Populated now, so the first apply does not fault the mapping in.
  m.map = ::mmap(nullptr, m.map_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd,
                 static_cast<off_t>(map_off));
  const int e = errno;
  ::close(fd);
  if (m.map == MAP_FAILED) {
    return IOError(what + ": cannot map " + path + ": " + std::strerror(e));
  }
  m.data = static_cast<uint8_t*>(m.map) + (r.offset - map_off);
  return m;
}

}  // namespace

Live::Buffer::~Buffer() {
  if (kind == DTE_LIVE_CUDA_IPC) {
    if (map) (void)kernels::CudaIpcCloseMemHandle(map);
  } else if (map) {
    ::munmap(map, map_len);
  }
}

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

Result<Live::BufferSpec> Live::Spec(const dte_live_register& r, const std::string& name,
                                    const Plan& plan, std::shared_ptr<const Fp8ReceiverPlan>* fp8,
                                    const std::string& what, uint64_t live) {
  const auto& tensors = plan.plan.receiver_tensors[static_cast<size_t>(r.rank)];
  auto it = std::find_if(tensors.begin(), tensors.end(),
                         [&](const PlanTensor& t) { return t.name == name; });
  if (internal::IsFp8Registration(r, name, it != tensors.end())) {
    return Fp8Spec(r, name, plan, fp8, what);
  }
  if (it == tensors.end()) {
    const ShardLayout layout{r.tp, r.fuse_qkv != 0, r.fuse_gate_up != 0};
    return NotFound(what + ": no such tensor in layout " + LayoutText(layout, r.rank) + " of " +
                    VersionName(live));
  }
  RETURN_IF_ERROR(CheckDTypeAndShape(r, *it, what));
  return BufferSpec{static_cast<uint32_t>(it - tensors.begin()), Buffer::Role::kElements,
                    DTypeWidth(it->dtype), ShapeElements(it->shape)};
}

Status Live::CheckServer(uint64_t owner, const std::string& server, int size, int rank,
                         const std::string& what) {
  const std::string named = what + ": server \"" + server + "\"";
  for (const auto& [other, rc] : receivers_) {
    if (other == owner) {
      if (rc.server != server || rc.server_size != size) {
        return InvalidArgument(named + " of size " + std::to_string(size) +
                               " differs from this receiver's server \"" + rc.server +
                               "\" of size " + std::to_string(rc.server_size));
      }
      continue;
    }
    if (server.empty() || rc.server != server) continue;
    if (rc.server_size != size) {
      return InvalidArgument(named + ": size " + std::to_string(size) +
                             " disagrees with the size " + std::to_string(rc.server_size) +
                             " its ranks registered on this mount");
    }
    if (rc.rank == rank) {
      return InvalidArgument(named + ": rank " + std::to_string(rank) +
                             " is registered by another receiver");
    }
  }
  return Status::Ok();
}

Result<uint64_t> Live::Register(uint64_t owner, uid_t uid, const dte_live_register& r) {
  ASSIGN_OR_RETURN(const std::string name, RequestName(r));
  const std::string what = "register \"" + name + "\"";
  RETURN_IF_ERROR(CheckKindAndRank(r, what));
  ASSIGN_OR_RETURN(auto server, RequestServer(r, what));
  const ShardLayout layout{r.tp, r.fuse_qkv != 0, r.fuse_gate_up != 0};
  std::shared_ptr<const LiveView> view = View();
  if (!view) return FailedPrecondition(what + ": the mount has no live version yet");

  MutexLock lock(&receivers_mu_);
  // An apply adds its changes to what a buffer holds, so the buffer must
  // hold the live version. Refused during an apply (its scatter may have
  // run already); otherwise, holding receivers_mu_, a later apply's
  // scatter includes this buffer.
  if (applying_.load())
    return Unavailable(what + ": a live apply is running or prepared; register after it");
  view = View();
  const uint64_t live = view->version->manifest.version;
  if (r.version != DTE_LIVE_LATEST && r.version != live) {
    return InvalidArgument(what + ": the buffer holds " + VersionName(r.version) +
                           " but the live version is " + VersionName(live) +
                           "; load it again from MOUNT/live/ and register");
  }
  RETURN_IF_ERROR(CheckServer(owner, server.first, server.second, r.rank, what));
  std::shared_ptr<const Fp8ReceiverPlan> fp8;
  if (auto existing = receivers_.find(owner); existing != receivers_.end()) {
    const Receiver& rc = existing->second;
    RETURN_IF_ERROR(CheckSameLayout(rc.layout, rc.rank, layout, r.rank, what));
    RETURN_IF_ERROR(CheckSameFp8(rc.fp8_block, rc.fp8_rule, r, what));
    for (const auto& b : rc.buffers) {
      if (b->name == name) return AlreadyExists(what + ": already registered by this receiver");
    }
    fp8 = rc.fp8;
  }
  ASSIGN_OR_RETURN(const Plan* plan, PlanFor(*view->version, layout));
  ASSIGN_OR_RETURN(const BufferSpec spec, Spec(r, name, *plan, &fp8, what, live));
  auto buf = std::make_unique<Buffer>();
  buf->name = name;
  buf->receiver_tensor = spec.receiver_tensor;
  buf->role = spec.role;
  buf->width = spec.width;
  buf->elements = spec.elements;
  buf->kind = r.kind;
  const uint64_t bytes = buf->elements * static_cast<uint64_t>(buf->width);
  ASSIGN_OR_RETURN(
      Mapping m, r.kind == DTE_LIVE_CUDA_IPC ? OpenCudaIpc(r, what) : MapShm(r, uid, bytes, what));
  buf->map = m.map;
  buf->map_len = m.map_len;
  buf->data = m.data;
  buf->id = next_buffer_id_++;
  const uint64_t id = buf->id;
  Receiver& rc = receivers_[owner];
  if (rc.buffers.empty()) {
    rc.layout = layout;
    rc.rank = r.rank;
    rc.uid = uid;
    rc.fp8_block = internal::Fp8BlockOf(r);
    rc.fp8_rule = r.fp8_scale_rule;
    rc.server = std::move(server.first);
    rc.server_size = server.second;
  }
  rc.fp8 = std::move(fp8);
  rc.buffers.push_back(std::move(buf));
  return id;
}

std::vector<Live::Server> Live::ServersLocked() {
  std::map<std::string, Server> by_name;
  for (const auto& [owner, rc] : receivers_) {
    if (rc.server.empty()) continue;
    Server& s = by_name[rc.server];
    s.name = rc.server;
    s.size = rc.server_size;
    s.ranks.push_back(rc.rank);
  }
  std::vector<Server> out;
  for (auto& [name, s] : by_name) {
    std::sort(s.ranks.begin(), s.ranks.end());
    // CheckServer keeps a server's ranks distinct and below its size.
    s.complete = s.ranks.size() == static_cast<size_t>(s.size);
    out.push_back(std::move(s));
  }
  return out;
}

Status Live::ServersComplete() {
  for (const Server& s : ServersLocked()) {
    if (s.complete) continue;
    std::string ranks;
    for (int r : s.ranks) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
    return FailedPrecondition("server \"" + s.name + "\" is incomplete on this mount: ranks [" +
                              ranks + "] of its " + std::to_string(s.size) +
                              " registered; every server keeps the version it holds");
  }
  return Status::Ok();
}

Status Live::ServersAre(const std::vector<Server>& expect) {
  const std::vector<Server> now = ServersLocked();
  auto text = [](const Server& s) {
    std::string ranks;
    for (int r : s.ranks) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
    return "ranks [" + ranks + "] of " + std::to_string(s.size);
  };
  for (const Server& e : expect) {
    auto it =
        std::find_if(now.begin(), now.end(), [&](const Server& s) { return s.name == e.name; });
    if (it == now.end() || it->size != e.size || it->ranks != e.ranks) {
      return Aborted("server \"" + e.name +
                     "\" changed on this mount since the apply was prepared (" + text(e) +
                     " then, " + (it == now.end() ? "none" : text(*it)) +
                     " now); every server keeps the version it holds");
    }
  }
  for (const Server& s : now) {
    auto it = std::find_if(expect.begin(), expect.end(),
                           [&](const Server& e) { return e.name == s.name; });
    if (it == expect.end()) {
      return Aborted("server \"" + s.name +
                     "\" registered on this mount since the apply was prepared");
    }
  }
  return Status::Ok();
}

std::vector<Live::Server> Live::Servers() {
  std::shared_ptr<const LiveView> view = View();
  MutexLock lock(&receivers_mu_);
  std::vector<Server> out = ServersLocked();
  for (Server& s : out) s.version = view ? view->version->manifest.version : DTE_LIVE_LATEST;
  return out;
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
  {
    MutexLock lock(&receivers_mu_);
    receivers_.erase(owner);
  }
  // A prepared apply of this control file is forgotten with it (its
  // coordinator went away).
  std::optional<PreparedInfo> held = Prepared();
  if (held && Abort(owner, held->id).ok()) {
    mount_->Log("dtefs: live apply " + std::to_string(held->id) +
                " dropped: the control file that prepared it was closed");
  }
}

}  // namespace dte::live
