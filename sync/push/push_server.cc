// The push server of sync/push/push_server.h: setup, the group of senders,
// the latest version, the connections' bookkeeping and its status. The I/O
// thread is in push_io.cc, a push in push_round.cc; their shared state in
// sync/push/internal/push_server_impl.h.
#include "sync/push/push_server.h"

#include <fcntl.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <map>

#include "store/store.h"
#include "sync/push/internal/push_fp8.h"
#include "sync/push/internal/push_plan.h"
#include "sync/push/internal/push_server_impl.h"
#include "sync/transport/job_secret.h"

namespace dte {

using push_internal::Frame;
using push_internal::Json;
using push_internal::Msg;

Status PushServer::Impl::Start() {
  ASSIGN_OR_RETURN(std::optional<JobSecret> secret,
                   FindJobSecret(options_.secret, options_.rendezvous_dir));
  if (!secret) RETURN_IF_ERROR(CheckListenWithoutSecret(options_.address, "the push server"));
  ASSIGN_OR_RETURN(listen_, transport_internal::ListenTcp(options_.address, 64, &port_));
  if (secret) {
    secret_ = std::move(secret->key);
    Log("push server on " + address() + " authenticates every connection with the job " +
        "secret from " + secret->source);
  } else {
    Log("push server on " + address() + " has no job secret: it listens on loopback only; " +
        HowToGiveASecret() + " to listen on other interfaces");
  }
  const int flags = fcntl(listen_.get(), F_GETFL, 0);
  fcntl(listen_.get(), F_SETFL, flags | O_NONBLOCK);
  wake_ = ScopedFd(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (wake_.get() < 0) return ErrnoStatus("eventfd", errno);
  io_ = std::thread([this] { Loop(); });
  return Status::Ok();
}

void PushServer::Impl::Stop() {
  if (!io_.joinable()) return;
  stop_ = true;
  Wake();
  io_.join();
}

std::string PushServer::Impl::address() const {
  std::string host;
  int port = 0;
  transport_internal::SplitHostPort(options_.address, &host, &port).IgnoreError();
  if (!options_.advertise.empty()) {
    host = options_.advertise;
  } else if (host.empty() || host == "0.0.0.0" || host == "::" || host == "[::]") {
    char name[256] = {};
    host = gethostname(name, sizeof name - 1) == 0 ? name : "localhost";
  }
  return host + ":" + std::to_string(port_);
}

Status PushServer::Impl::SetGroup(int part, int parts) {
  if (parts < 1 || part < 0 || part >= parts) {
    return InvalidArgument("push server: part " + std::to_string(part) + " of " +
                           std::to_string(parts));
  }
  {
    MutexLock lock(&mu_);
    if (part == part_ && parts == parts_) return Status::Ok();
    senders_.clear();
    part_ = part;
    parts_ = parts;
    DropAllLocked("the trainer's push senders changed: reconnect to learn them");
    AnswerHeldLocked();
  }
  Wake();
  return Status::Ok();
}

Status PushServer::Impl::SetSenders(const std::vector<std::string>& senders) {
  {
    MutexLock lock(&mu_);
    if (static_cast<int>(senders.size()) != parts_) {
      return InvalidArgument("push server part " + std::to_string(part_) + " of " +
                             std::to_string(parts_) + ": " + std::to_string(senders.size()) +
                             " sender addresses");
    }
    if (senders == senders_) return Status::Ok();
    // Receivers told of other senders (a trainer rank restarted) learn
    // the new ones when they reconnect.
    if (!senders_.empty()) {
      DropAllLocked("the trainer's push senders changed: reconnect to learn them");
    }
    senders_ = senders;
    AnswerHeldLocked();
  }
  Wake();
  return Status::Ok();
}

std::pair<int, int> PushServer::Impl::group() const {
  MutexLock lock(&mu_);
  return {part_, parts_};
}

Status PushServer::Impl::SetLatest(Store& store, const std::shared_ptr<const Version>& v) {
  ASSIGN_OR_RETURN(PlanInputs in, PlanInputsOf(store, *v));
  {
    MutexLock lock(&mu_);
    InstallLocked(v, std::move(in));
    // Receivers that hold something else catch up to it; those whose
    // tensors no longer fit it (another model, or a split an FP8 receiver's
    // blocks do not divide) are dropped, and refused when they say hello.
    for (auto& [id, c] : conns_) {
      if (!c->hello_done || !c->drop.empty()) continue;
      if (Status fits = FitsLatestLocked(*c); !fits.ok()) {
        DropLocked(*c, fits.message());
        continue;
      }
      // One that got ahead of this server (caught up from the store before
      // it heard of the version) is no longer behind.
      c->info.behind = c->info.version != v->manifest.version;
      if (!c->info.behind) continue;
      SendLocked(*c, Frame(Msg::kBehind, Json({{"latest", v->manifest.version}})));
    }
  }
  Wake();
  return Status::Ok();
}

std::vector<PushReceiverInfo> PushServer::Impl::Receivers() const {
  MutexLock lock(&mu_);
  std::vector<PushReceiverInfo> out;
  for (const auto& [id, c] : conns_) {
    if (c->hello_done && c->drop.empty()) out.push_back(c->info);
  }
  return out;
}

std::vector<std::string> PushServer::Impl::TakeEvents() { return events_.Take(); }

uint64_t PushServer::Impl::refused() const { return events_.refused(); }

void PushServer::Impl::DropAllLocked(const std::string& why) {
  for (auto& [id, c] : conns_) {
    if (c->hello_done) DropLocked(*c, why);
  }
}

void PushServer::Impl::AnswerHeldLocked() {
  if (HoldHellosLocked()) return;
  for (auto& [id, c] : conns_) {
    if (!c->held_hello) continue;
    std::string body = std::exchange(*c->held_hello, {});
    c->held_hello.reset();
    if (c->drop.empty()) OnHello(*c, body);
  }
}

void PushServer::Impl::Wake() {
  const uint64_t one = 1;
  [[maybe_unused]] ssize_t n = write(wake_.get(), &one, sizeof one);
}

void PushServer::Impl::InstallLocked(const std::shared_ptr<const Version>& v, PlanInputs in) {
  if (plans_.Install(v, std::move(in))) {
    for (auto& [id, c] : conns_) c->plan_to_own.clear();
  }
}

Result<const Fp8ReceiverPlan*> PushServer::Impl::Fp8PlanLocked(const Conn& c,
                                                               const TransferPlan& plan) {
  return plans_.Fp8Plan(c.info.layout, c.info.rank, c.fp8_key, *c.fp8, plan);
}

Status PushServer::Impl::FitsLatestLocked(Conn& c) {
  if (!c.plan_to_own.empty()) return Status::Ok();
  ASSIGN_OR_RETURN(const TransferPlan* plan, plans_.Plan(c.info.layout));
  if (plan->receiver_tensors[c.info.rank].empty()) return Status::Ok();
  return MatchLocked(c, *plan,
                     "receiver " + LayoutText(c.info.layout, c.info.rank) + " against " +
                         VersionName(plans_.latest()->manifest.version));
}

Status PushServer::Impl::MatchLocked(Conn& c, const TransferPlan& plan, const std::string& what) {
  if (!c.fp8) {
    ASSIGN_OR_RETURN(c.plan_to_own,
                     push_internal::MatchReceiverTensors(plan, c.info.rank, c.tensors, what));
    return Status::Ok();
  }
  auto fp8 = Fp8PlanLocked(c, plan);
  if (!fp8.ok()) return fp8.status().WithContext(what);
  ASSIGN_OR_RETURN(c.plan_to_own,
                   push_internal::MatchFp8ReceiverTensors(plan, **fp8, c.tensors, what));
  return Status::Ok();
}

void PushServer::Impl::DropLocked(Conn& c, const std::string& why) {
  if (!c.drop.empty()) return;
  c.drop = why;
  events_.Add("receiver " + c.who + " dropped: " + why);
  shutdown(c.fd.get(), SHUT_RDWR);
  cv_.SignalAll();
}

void PushServer::Impl::RefuseLocked(Conn& c, const std::string& why) {
  if (!c.drop.empty()) return;
  c.drop = why;
  const std::string line = c.who + " refused: " + why;
  events_.AddRefused(line);
  Log("push server on " + address() + ": " + line);
  shutdown(c.fd.get(), SHUT_RDWR);
}

void PushServer::Impl::Log(const std::string& line) {
  std::fprintf(stderr, "dte: %s\n", line.c_str());
}

uint64_t PushServer::Impl::QueuedBytes(const Conn& c) {
  uint64_t n = 0;
  for (const Out& o : c.out) n += o.data->size() - o.off;
  return n;
}

PushServer::Impl::Conn* PushServer::Impl::LiveLocked(uint64_t id) {
  auto it = conns_.find(id);
  return it == conns_.end() || !it->second->drop.empty() ? nullptr : it->second.get();
}

namespace {

// Changes held whole in memory (a single-process publisher's).
class VectorChanges : public ChangesSource {
 public:
  explicit VectorChanges(const std::vector<TensorChanges>& changes) {
    for (const TensorChanges& c : changes) {
      if (!by_name_.emplace(c.name, &c).second && !twice_) twice_ = &c.name;
    }
  }
  // Every tensor named once and in the version (from its manifest: no
  // store read).
  Status Validate(const Manifest& m) const {
    const std::string what = "push of " + VersionName(m.version) + ": tensor ";
    for (const auto& [name, c] : by_name_) {
      if (!m.FindTensor(name)) return InvalidArgument(what + name + " is not in the version");
    }
    if (twice_) return InvalidArgument(what + *twice_ + " is given twice");
    return Status::Ok();
  }
  bool MayChange(const std::string& name) const override { return by_name_.count(name) > 0; }
  bool Stable() const override { return true; }
  Result<const TensorChanges*> Read(const std::string& name) override {
    auto it = by_name_.find(name);
    return it == by_name_.end() ? &empty_ : it->second;
  }

 private:
  std::map<std::string, const TensorChanges*> by_name_;
  const std::string* twice_ = nullptr;  // a name given twice
  TensorChanges empty_;
};

}  // namespace

std::string PushReportJson(const PushReport& r) {
  return Json({{"version", r.version},
               {"pushed", r.pushed},
               {"behind", r.behind},
               {"missing", r.missing},
               {"elements", r.elements},
               {"bytes", r.bytes},
               {"seconds", r.seconds},
               {"pack_seconds", r.pack_seconds},
               {"dropped", r.dropped},
               {"fp8_parent_reads", r.fp8_parent_reads},
               {"fp8_parent_bytes", r.fp8_parent_bytes}});
}

std::string PushServer::StatusJson(bool take_events) {
  nlohmann::json rs = nlohmann::json::array();
  for (const PushReceiverInfo& i : Receivers()) {
    rs.push_back({{"id", i.id},
                  {"rank", i.rank},
                  {"tp", i.layout.tp},
                  {"fuse_qkv", i.layout.fuse_qkv},
                  {"fuse_gate_up", i.layout.fuse_gate_up},
                  {"fp8", i.fp8 ? push_internal::Fp8OptionsJson(*i.fp8) : nlohmann::json(nullptr)},
                  {"version", i.version ? nlohmann::json(*i.version) : nlohmann::json(nullptr)},
                  {"behind", i.behind},
                  {"pushes", i.pushes},
                  {"elements", i.elements},
                  {"bytes", i.bytes},
                  {"server", i.server},
                  {"server_size", i.server_size}});
  }
  auto opt = [](const std::optional<uint64_t>& v) {
    return v ? nlohmann::json(*v) : nlohmann::json(nullptr);
  };
  nlohmann::json ss = nlohmann::json::array();
  for (const PushServerGroup& g : Servers()) {
    ss.push_back({{"name", g.name},
                  {"size", g.size},
                  {"ranks", g.ranks},
                  {"complete", g.complete},
                  {"version", opt(g.version)},
                  {"staleness", opt(g.staleness)},
                  {"inconsistent", g.inconsistent},
                  {"error", g.error}});
  }
  return Json({{"port", port()},
               {"address", address()},
               {"authenticated", impl_->authenticated()},
               {"refused", refused()},
               {"part", part()},
               {"parts", parts()},
               {"expected", impl_->expected()},
               {"receivers", rs},
               {"servers", ss},
               {"events", take_events ? TakeEvents() : std::vector<std::string>{}}});
}

PushServer::PushServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
PushServer::~PushServer() = default;

Result<std::unique_ptr<PushServer>> PushServer::Start(const PushServerOptions& options) {
  auto impl = std::make_unique<Impl>(options);
  RETURN_IF_ERROR(impl->Start().WithContext("push server on " + options.address));
  return std::unique_ptr<PushServer>(new PushServer(std::move(impl)));
}

int PushServer::port() const { return impl_->port(); }

std::string PushServer::address() const { return impl_->address(); }

Status PushServer::SetGroup(int part, int parts) { return impl_->SetGroup(part, parts); }

Status PushServer::SetSenders(const std::vector<std::string>& senders) {
  return impl_->SetSenders(senders);
}

int PushServer::part() const { return impl_->group().first; }

int PushServer::parts() const { return impl_->group().second; }

uint64_t PushServer::cache_bytes() const { return impl_->cache_bytes(); }

Status PushServer::SetLatest(Store& store, const std::shared_ptr<const Version>& v) {
  return impl_->SetLatest(store, v);
}

Result<PushReport> PushServer::Push(Store& store, const std::shared_ptr<const Version>& v,
                                    const std::vector<TensorChanges>& changes) {
  VectorChanges source(changes);
  RETURN_IF_ERROR(source.Validate(v->manifest));
  return impl_->Push(store, v, source);
}

Result<PushReport> PushServer::Push(Store& store, const std::shared_ptr<const Version>& v,
                                    ChangesSource& changes) {
  return impl_->Push(store, v, changes);
}

std::vector<PushReceiverInfo> PushServer::Receivers() const { return impl_->Receivers(); }

std::vector<PushServerGroup> PushServer::Servers() const {
  std::map<std::string, PushServerGroup> by;
  std::map<std::string, bool> unreported;
  for (const PushReceiverInfo& i : Receivers()) {
    if (i.server.empty()) continue;
    PushServerGroup& g = by[i.server];
    g.name = i.server;
    g.size = std::max(g.size, i.server_size);
    g.ranks.push_back(i.rank);
    if (i.server_inconsistent) {
      g.inconsistent = true;
      g.error = i.server_error;
    }
    if (!i.server_version) {
      unreported[i.server] = true;
    } else if (!g.version || *i.server_version < *g.version) {
      g.version = i.server_version;
    }
  }
  const std::optional<uint64_t> latest = impl_->latest();
  std::vector<PushServerGroup> out;
  for (auto& [name, g] : by) {
    std::sort(g.ranks.begin(), g.ranks.end());
    std::vector<int> all(static_cast<size_t>(g.size));
    for (int r = 0; r < g.size; ++r) all[static_cast<size_t>(r)] = r;
    g.complete = g.ranks == all;
    if (unreported.count(name)) g.version.reset();
    if (g.version && latest && *latest >= *g.version) g.staleness = *latest - *g.version;
    out.push_back(std::move(g));
  }
  return out;
}

std::vector<std::string> PushServer::TakeEvents() { return impl_->TakeEvents(); }

uint64_t PushServer::refused() const { return impl_->refused(); }

}  // namespace dte
