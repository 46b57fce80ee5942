// The push server of sync/push.h: one I/O thread owns every socket (accepts,
// hellos, acknowledgements, and the queued frames of pushes, written as the
// sockets take them); Push() packs each layout's messages once, queues them
// for the receivers that hold the parent, and waits for their receipts.
#include "sync/push.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>
#include <tuple>

#include "kernels/parallel.h"
#include "store/delta_codec.h"
#include "store/materialize.h"
#include "store/store.h"
#include "sync/convert.h"
#include "sync/internal/push_plan.h"
#include "sync/internal/push_wire.h"

namespace dte {

using push_internal::Frame;
using push_internal::Msg;
using transport_internal::Deadline;

Result<PlanInputs> PlanInputsOf(Store& store, const Version& v) {
  const std::string name = VersionName(v.manifest.version);
  const FileEntry* config = nullptr;
  PlanInputs in;
  for (const FileEntry& f : v.manifest.files) {
    if (f.name == "config.json") config = &f;
    for (const TensorEntry& t : f.tensors) {
      PlanTensor p{t.name, t.dtype, {}};
      for (int64_t d : t.shape) p.shape.push_back(static_cast<uint64_t>(d));
      in.canonical.push_back(std::move(p));
    }
  }
  if (!config) {
    return InvalidArgument("receivers need the attention geometry from config.json, and " + name +
                           " has none");
  }
  Materializer reader(&store);
  ASSIGN_OR_RETURN(std::string json,
                   reader.ReadWholeBlob(config->blob, config->size, name + "/config.json"));
  ASSIGN_OR_RETURN(ModelSpec spec, ParseHfConfig(json, name + "/config.json"));
  in.geometry = {static_cast<uint64_t>(spec.num_attention_heads),
                 static_cast<uint64_t>(spec.num_kv_heads), static_cast<uint64_t>(spec.head_dim)};
  return in;
}

namespace {

using Clock = std::chrono::steady_clock;
using LayoutKey = std::tuple<int, bool, bool>;

LayoutKey KeyOf(const ShardLayout& l) { return {l.tp, l.fuse_qkv, l.fuse_gate_up}; }

std::string Json(const nlohmann::json& j) { return j.dump(); }

}  // namespace

class PushServer::Impl {
 public:
  explicit Impl(PushServerOptions o) : options_(std::move(o)) {}
  ~Impl() { Stop(); }

  Status Start() {
    ASSIGN_OR_RETURN(listen_, transport_internal::ListenTcp(options_.address, 64, &port_));
    const int flags = fcntl(listen_.get(), F_GETFL, 0);
    fcntl(listen_.get(), F_SETFL, flags | O_NONBLOCK);
    wake_ = ScopedFd(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
    if (wake_.get() < 0) return ErrnoStatus("eventfd", errno);
    io_ = std::thread([this] { Loop(); });
    return Status::Ok();
  }

  void Stop() {
    if (!io_.joinable()) return;
    stop_ = true;
    Wake();
    io_.join();
  }

  int port() const { return port_; }

  Status SetLatest(Store& store, const std::shared_ptr<const Version>& v) {
    ASSIGN_OR_RETURN(PlanInputs in, PlanInputsOf(store, *v));
    {
      std::lock_guard lock(mu_);
      InstallLocked(v, std::move(in));
      // Receivers that hold something else catch up to it.
      for (auto& [id, c] : conns_) {
        if (!c->hello_done || !c->drop.empty() || c->info.version == v->manifest.version) continue;
        c->info.behind = true;
        SendLocked(*c, Frame(Msg::kBehind, Json({{"latest", v->manifest.version}})));
      }
    }
    Wake();
    return Status::Ok();
  }

  Result<PushReport> Push(Store& store, const std::shared_ptr<const Version>& v,
                          const std::vector<TensorChanges>& changes);

  std::vector<PushReceiverInfo> Receivers() const {
    std::lock_guard lock(mu_);
    std::vector<PushReceiverInfo> out;
    for (const auto& [id, c] : conns_) {
      if (c->hello_done && c->drop.empty()) out.push_back(c->info);
    }
    return out;
  }

  std::vector<std::string> TakeEvents() {
    std::lock_guard lock(mu_);
    return std::exchange(events_, {});
  }

 private:
  struct Out {
    std::shared_ptr<const std::string> data;
    size_t off = 0;
  };
  struct Conn {
    ScopedFd fd;
    std::string who;
    push_internal::FrameReader in;
    std::deque<Out> out;
    bool hello_done = false;
    Clock::time_point hello_deadline;
    bool close_after_flush = false;
    std::string drop;  // set: close it and report this
    PushReceiverInfo info;
    std::vector<PlanTensor> tensors;    // as the hello lists them
    std::optional<uint64_t> awaiting;   // version sent, receipt not yet confirmed
    std::vector<uint32_t> plan_to_own;  // plan receiver tensor -> index in `tensors`
  };
  void Wake() {
    const uint64_t one = 1;
    [[maybe_unused]] ssize_t n = write(wake_.get(), &one, sizeof one);
  }

  void InstallLocked(const std::shared_ptr<const Version>& v, PlanInputs in) {
    if (!inputs_ || inputs_->canonical.size() != in.canonical.size() ||
        !std::equal(in.canonical.begin(), in.canonical.end(), inputs_->canonical.begin(),
                    [](const PlanTensor& a, const PlanTensor& b) {
                      return a.name == b.name && a.dtype == b.dtype && a.shape == b.shape;
                    }) ||
        inputs_->geometry.num_heads != in.geometry.num_heads ||
        inputs_->geometry.num_kv_heads != in.geometry.num_kv_heads ||
        inputs_->geometry.head_dim != in.geometry.head_dim) {
      plans_.clear();
      for (auto& [id, c] : conns_) c->plan_to_own.clear();
    }
    inputs_ = std::move(in);
    latest_ = v;
  }

  Result<const TransferPlan*> PlanLocked(const ShardLayout& layout) {
    if (!inputs_) return InvalidArgument("the push server has no version yet");
    auto key = KeyOf(layout);
    if (auto it = plans_.find(key); it != plans_.end()) return &it->second;
    auto plan = MakeTransferPlan(inputs_->canonical, inputs_->geometry,
                                 ShardLayout{1, false, false}, layout);
    if (!plan.ok()) {
      return plan.status().WithContext("receiver layout " + LayoutText(layout, 0));
    }
    return &plans_.emplace(key, std::move(plan).value()).first->second;
  }

  void DropLocked(Conn& c, const std::string& why) {
    if (!c.drop.empty()) return;
    c.drop = why;
    EventLocked("receiver " + c.who + " dropped: " + why);
    shutdown(c.fd.get(), SHUT_RDWR);
    cv_.notify_all();
  }

  // Kept for StatusJson/TakeEvents; the oldest go past kMaxEvents.
  void EventLocked(std::string line) {
    constexpr size_t kMaxEvents = 1000;
    if (events_.size() == kMaxEvents) events_.erase(events_.begin());
    events_.push_back(std::move(line));
  }

  void SendLocked(Conn& c, std::string frame) {
    c.out.push_back({std::make_shared<const std::string>(std::move(frame)), 0});
  }

  void OnHello(Conn& c, const std::string& body);
  void OnMessage(Conn& c, const push_internal::Parsed& m);
  void Loop();

  PushServerOptions options_;
  ScopedFd listen_, wake_;
  int port_ = 0;
  std::thread io_;
  std::atomic<bool> stop_{false};

  mutable std::mutex mu_;
  std::condition_variable cv_;  // a receipt arrived or a receiver was dropped
  std::map<uint64_t, std::unique_ptr<Conn>> conns_;
  uint64_t next_id_ = 1;
  std::optional<PlanInputs> inputs_;
  std::shared_ptr<const Version> latest_;
  std::map<LayoutKey, TransferPlan> plans_;
  std::vector<std::string> events_;
  // Receivers dropped and closed while a push awaited them: id -> reason,
  // for that push's report (cleared by each push).
  std::map<uint64_t, std::string> gone_;
  std::set<uint64_t> confirmed_;  // receivers that confirmed the current push
};

void PushServer::Impl::OnHello(Conn& c, const std::string& body) {
  auto refuse = [&](const std::string& why) {
    SendLocked(c, Frame(Msg::kWelcome, Json({{"error", why}})));
    c.close_after_flush = true;
    EventLocked("receiver " + c.who + " refused: " + why);
  };
  nlohmann::json j = nlohmann::json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || !j["rank"].is_number_integer() || !j["tp"].is_number_integer() ||
      !j["tensors"].is_array()) {
    return refuse("hello is not a JSON object with rank, tp and tensors");
  }
  ShardLayout layout{j["tp"].get<int>(), j.value("fuse_qkv", false),
                     j.value("fuse_gate_up", false)};
  const int rank = j["rank"].get<int>();
  if (layout.tp < 1 || rank < 0 || rank >= layout.tp) {
    return refuse("rank " + std::to_string(rank) + " of tp " + std::to_string(layout.tp));
  }
  std::vector<PlanTensor> tensors;
  for (const auto& t : j["tensors"]) {
    if (!t.is_object() || !t["name"].is_string() || !t["dtype"].is_string() ||
        !t["shape"].is_array()) {
      return refuse("a tensor entry is not {name, dtype, shape}");
    }
    auto dtype = ParseDType(t["dtype"].get<std::string>());
    if (!dtype) return refuse("tensor " + t["name"].get<std::string>() + ": unknown dtype");
    PlanTensor p{t["name"].get<std::string>(), *dtype, {}};
    for (const auto& d : t["shape"]) {
      if (!d.is_number_unsigned()) return refuse("tensor " + p.name + ": bad shape");
      p.shape.push_back(d.get<uint64_t>());
    }
    tensors.push_back(std::move(p));
  }
  c.info.rank = rank;
  c.info.layout = layout;
  c.who = "rank " + std::to_string(rank) + " (" + c.who + ")";
  if (j.contains("version") && j["version"].is_number_unsigned()) {
    c.info.version = j["version"].get<uint64_t>();
  }
  c.tensors = std::move(tensors);
  nlohmann::json welcome = {{"latest", nullptr}};
  if (latest_) {
    auto plan = PlanLocked(layout);
    if (!plan.ok()) return refuse(plan.status().message());
    auto match =
        push_internal::MatchReceiverTensors(**plan, rank, c.tensors,
                                            "receiver " + LayoutText(layout, rank) + " against " +
                                                VersionName(latest_->manifest.version));
    if (!match.ok()) return refuse(match.status().message());
    c.plan_to_own = std::move(match).value();
    welcome["latest"] = latest_->manifest.version;
    c.info.behind = c.info.version != latest_->manifest.version;
  }
  c.hello_done = true;
  SendLocked(c, Frame(Msg::kWelcome, Json(welcome)));
}

void PushServer::Impl::OnMessage(Conn& c, const push_internal::Parsed& m) {
  if (!c.hello_done) {
    if (m.type != Msg::kHello) return DropLocked(c, "the first message was not a hello");
    return OnHello(c, m.body);
  }
  nlohmann::json j = nlohmann::json::parse(m.body, nullptr, false);
  auto version = [&]() -> std::optional<uint64_t> {
    if (j.is_object() && j["version"].is_number_unsigned()) return j["version"].get<uint64_t>();
    return std::nullopt;
  };
  switch (m.type) {
    case Msg::kReceived: {
      auto v = version();
      if (!v || c.awaiting != v) {
        return DropLocked(c, "confirmed a push it was not sent");
      }
      c.awaiting.reset();
      confirmed_.insert(c.info.id);
      c.info.version = v;
      c.info.behind = false;
      c.info.pushes++;
      cv_.notify_all();
      return;
    }
    case Msg::kApplied:
      return;
    case Msg::kHeld: {
      auto v = version();
      if (!v) return DropLocked(c, "sent a held message without a version");
      c.info.version = v;
      c.info.behind = latest_ && *v != latest_->manifest.version;
      if (c.info.behind) {
        SendLocked(c, Frame(Msg::kBehind, Json({{"latest", latest_->manifest.version}})));
      }
      return;
    }
    case Msg::kError: {
      std::string why = j.is_object() && j["error"].is_string() ? j["error"].get<std::string>()
                                                                : "an error without a message";
      DropLocked(c, "it reported: " + why);
      cv_.notify_all();
      return;
    }
    default:
      DropLocked(c, std::string("sent an unexpected ") + push_internal::MsgName(m.type));
      cv_.notify_all();
  }
}

void PushServer::Impl::Loop() {
  std::vector<pollfd> fds;
  std::vector<uint64_t> ids;
  char buf[64 << 10];
  while (!stop_) {
    fds.clear();
    ids.clear();
    fds.push_back({wake_.get(), POLLIN, 0});
    fds.push_back({listen_.get(), POLLIN, 0});
    int timeout_ms = 1000;
    {
      std::lock_guard lock(mu_);
      const auto now = Clock::now();
      for (auto it = conns_.begin(); it != conns_.end();) {
        Conn& c = *it->second;
        if (!c.hello_done && c.drop.empty() && now >= c.hello_deadline) {
          DropLocked(c, "no hello within the timeout");
        }
        if (!c.drop.empty() || (c.close_after_flush && c.out.empty())) {
          if (c.awaiting) {
            gone_[it->first] = "receiver " + c.who + ": " + c.drop;
            cv_.notify_all();
          }
          it = conns_.erase(it);
          continue;
        }
        short ev = POLLIN;
        if (!c.out.empty()) ev |= POLLOUT;
        fds.push_back({c.fd.get(), ev, 0});
        ids.push_back(it->first);
        if (!c.hello_done) {
          auto left = std::chrono::duration_cast<std::chrono::milliseconds>(c.hello_deadline - now);
          timeout_ms = std::min<int>(timeout_ms, static_cast<int>(left.count()) + 1);
        }
        ++it;
      }
    }
    const int n = poll(fds.data(), fds.size(), timeout_ms);
    if (n < 0 && errno != EINTR) break;
    if (n <= 0) continue;
    if (fds[0].revents & POLLIN) {
      uint64_t drained;
      [[maybe_unused]] ssize_t r = read(wake_.get(), &drained, sizeof drained);
    }
    std::lock_guard lock(mu_);
    if (fds[1].revents & POLLIN) {
      for (;;) {
        sockaddr_storage peer{};
        socklen_t len = sizeof peer;
        ScopedFd fd(accept4(listen_.get(), reinterpret_cast<sockaddr*>(&peer), &len, SOCK_CLOEXEC));
        if (fd.get() < 0) break;
        if (!transport_internal::PrepareStream(fd.get()).ok()) continue;
        auto c = std::make_unique<Conn>();
        c->fd = std::move(fd);
        c->info.id = next_id_++;
        c->who = "connection " + std::to_string(c->info.id);
        c->hello_deadline = Clock::now() + options_.timeout;
        conns_.emplace(c->info.id, std::move(c));
      }
    }
    for (size_t k = 2; k < fds.size(); ++k) {
      auto it = conns_.find(ids[k - 2]);
      if (it == conns_.end()) continue;
      Conn& c = *it->second;
      const short re = fds[k].revents;
      if (re & POLLOUT) {
        while (!c.out.empty()) {
          Out& o = c.out.front();
          const ssize_t w =
              send(c.fd.get(), o.data->data() + o.off, o.data->size() - o.off, MSG_NOSIGNAL);
          if (w < 0) {
            if (errno != EAGAIN && errno != EINTR) {
              DropLocked(c, std::string("send failed: ") + std::strerror(errno));
            }
            break;
          }
          o.off += static_cast<size_t>(w);
          if (o.off < o.data->size()) break;
          c.out.pop_front();
        }
      }
      if (re & (POLLIN | POLLHUP | POLLERR)) {
        const ssize_t r = recv(c.fd.get(), buf, sizeof buf, 0);
        if (r == 0 || (r < 0 && errno != EAGAIN && errno != EINTR)) {
          DropLocked(c, r == 0 ? "closed the connection (exited or crashed?)"
                               : std::string("recv failed: ") + std::strerror(errno));
          cv_.notify_all();
          continue;
        }
        if (r > 0) c.in.Append(buf, static_cast<size_t>(r));
        for (;;) {
          auto m = c.in.Next(push_internal::kMaxControlBytes, c.who);
          if (!m.ok()) {
            DropLocked(c, m.status().message());
            cv_.notify_all();
            break;
          }
          if (!m->has_value()) break;
          OnMessage(c, **m);
          if (!c.drop.empty()) break;
        }
      }
    }
  }
}

Result<PushReport> PushServer::Impl::Push(Store& store, const std::shared_ptr<const Version>& v,
                                          const std::vector<TensorChanges>& changes) {
  const auto t0 = Clock::now();
  PushReport report;
  report.version = v->manifest.version;
  if (!v->manifest.parent) {
    return InvalidArgument("push of " + VersionName(v->manifest.version) +
                           ": a version without a parent is not a change (receivers catch up)");
  }
  const uint64_t parent = *v->manifest.parent;
  ASSIGN_OR_RETURN(PlanInputs in, PlanInputsOf(store, *v));
  // The changes, checked against the version's tensors.
  std::map<std::string, size_t> where;
  for (size_t i = 0; i < in.canonical.size(); ++i) where[in.canonical[i].name] = i;
  std::map<std::string, const TensorChanges*> by_name;
  for (const TensorChanges& c : changes) {
    auto it = where.find(c.name);
    const std::string what = "push of " + VersionName(v->manifest.version) + ": tensor " + c.name;
    if (it == where.end()) return InvalidArgument(what + " is not in the version");
    const PlanTensor& t = in.canonical[it->second];
    const uint64_t numel = ShapeElements(t.shape);
    if (c.values.size() != c.indices.size() * DTypeWidth(t.dtype)) {
      return InvalidArgument(what + ": " + std::to_string(c.values.size()) + " value bytes for " +
                             std::to_string(c.indices.size()) + " indices");
    }
    for (size_t k = 0; k < c.indices.size(); ++k) {
      if (c.indices[k] >= numel || (k > 0 && c.indices[k] <= c.indices[k - 1])) {
        return InvalidArgument(what + ": index " + std::to_string(c.indices[k]) +
                               " is out of range or out of order");
      }
    }
    if ((!c.old_values.empty() && c.old_values.size() != c.values.size()) ||
        (!c.known.empty() && c.known.size() != c.indices.size())) {
      return InvalidArgument(what + ": old values or known flags do not match the entries");
    }
    if (!by_name.emplace(c.name, &c).second) return InvalidArgument(what + " is given twice");
  }

  // Which receivers get what: snapshot them, then pack outside the lock.
  struct Target {
    uint64_t id;
    ShardLayout layout;
    int rank;
    std::vector<uint32_t> plan_to_own;
  };
  std::vector<Target> targets;
  std::map<LayoutKey, const TransferPlan*> plans;
  {
    std::lock_guard lock(mu_);
    InstallLocked(v, std::move(in));
    for (auto& [id, cp] : conns_) {
      Conn& c = *cp;
      if (!c.hello_done || !c.drop.empty()) continue;
      if (c.info.version == parent && !c.info.behind) {
        auto plan = PlanLocked(c.info.layout);
        if (!plan.ok()) {
          DropLocked(c, plan.status().message());
          continue;
        }
        if (c.plan_to_own.empty() && !(*plan)->receiver_tensors[c.info.rank].empty()) {
          auto match = push_internal::MatchReceiverTensors(**plan, c.info.rank, c.tensors,
                                                           "receiver " + c.who);
          if (!match.ok()) {
            DropLocked(c, match.status().message());
            continue;
          }
          c.plan_to_own = std::move(match).value();
        }
        plans[KeyOf(c.info.layout)] = *plan;
        targets.push_back({id, c.info.layout, c.info.rank, c.plan_to_own});
      } else if (c.info.version != v->manifest.version) {
        c.info.behind = true;
        SendLocked(c, Frame(Msg::kBehind, Json({{"latest", v->manifest.version}})));
        report.behind++;
      }
    }
  }
  Wake();

  // Each layout's messages, per receiver rank, packed once: the plan's ops
  // of that rank in plan order, each op's entries remapped into the
  // receiver tensor and encoded (sync/internal/push_wire.h).
  struct Packed {
    push_internal::CountsMsg counts;
    std::string data;
    uint64_t elements = 0;
  };
  std::map<std::pair<LayoutKey, int>, Packed> packed;
  for (const auto& [key, plan] : plans) {
    std::vector<const TensorChanges*> of(plan->canonical.size(), nullptr);
    for (size_t c = 0; c < plan->canonical.size(); ++c) {
      auto it = by_name.find(plan->canonical[c].name);
      if (it != by_name.end()) of[c] = it->second;
    }
    // Ops are independent, and so are runs of an op's entries (each becomes
    // its own segments): remap and encode pieces of at most kPieceEntries
    // source entries in parallel, then lay them out per rank in plan order.
    constexpr size_t kPieceEntries = size_t{1} << 18;
    struct Piece {
      size_t op, begin, end;
      uint64_t count = 0;
      std::string data;
    };
    std::vector<Piece> pieces;
    for (size_t k = 0; k < plan->ops.size(); ++k) {
      const TensorChanges* c = of[plan->ops[k].canonical];
      const size_t n = c ? c->indices.size() : 0;
      for (size_t b = 0; b < n; b += kPieceEntries) {
        pieces.push_back({k, b, std::min(n, b + kPieceEntries), 0, {}});
      }
    }
    const TransferPlan* layout_plan = plan;  // lambdas cannot capture structured bindings
    kernels::ParallelFor(pieces.size(), 1, [&](size_t lo, size_t hi) {
      std::vector<uint64_t> dst, pos;
      for (size_t i = lo; i < hi; ++i) {
        Piece& pc = pieces[i];
        const TransferOp& op = layout_plan->ops[pc.op];
        const TensorChanges* c = of[op.canonical];
        const size_t n = pc.end - pc.begin;
        dst.resize(n);
        pos.resize(n);
        const size_t j =
            RemapOpIndices(op, c->indices.data() + pc.begin, n, dst.data(), pos.data());
        pc.count = j;
        if (j == 0) continue;
        for (size_t q = 0; q < j; ++q) pos[q] += pc.begin;
        push_internal::AppendOpSegments(
            dst.data(), pos.data(), j, DTypeWidth(layout_plan->canonical[op.canonical].dtype),
            c->values.data(), c->old_values.empty() ? nullptr : c->old_values.data(),
            c->known.empty() ? nullptr : c->known.data(), &pc.data);
      }
    });
    std::vector<uint64_t> counts(plan->ops.size(), 0);
    std::vector<std::string> encoded(plan->ops.size());
    for (Piece& pc : pieces) {
      counts[pc.op] += pc.count;
      encoded[pc.op] += pc.data;
      std::string().swap(pc.data);
    }
    std::vector<Packed> ranks(std::get<0>(key));
    for (Packed& p : ranks) {
      p.counts.version = v->manifest.version;
      p.counts.parent = parent;
    }
    for (size_t k = 0; k < plan->ops.size(); ++k) {
      Packed& p = ranks[plan->ops[k].receiver];
      p.counts.tensor.push_back(plan->ops[k].receiver_tensor);
      p.counts.count.push_back(counts[k]);
      p.data += encoded[k];
      p.elements += counts[k];
      std::string().swap(encoded[k]);
    }
    for (int r = 0; r < std::get<0>(key); ++r) packed[{key, r}] = std::move(ranks[r]);
  }

  report.pack_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  std::vector<uint64_t> sent;
  {
    std::lock_guard lock(mu_);
    gone_.clear();
    confirmed_.clear();
    for (Target& t : targets) {
      auto it = conns_.find(t.id);
      if (it == conns_.end() || !it->second->drop.empty()) continue;
      Conn& c = *it->second;
      auto pk = packed.find({KeyOf(t.layout), t.rank});
      push_internal::CountsMsg counts;
      std::string data;
      uint64_t elements = 0;
      if (pk != packed.end()) {
        counts = pk->second.counts;
        for (uint32_t& tensor : counts.tensor) tensor = t.plan_to_own[tensor];
        data = pk->second.data;
        elements = pk->second.elements;
      } else {
        counts.version = v->manifest.version;
        counts.parent = parent;
      }
      std::string f1 = Frame(Msg::kCounts, push_internal::EncodeCounts(counts));
      std::string f2 = Frame(Msg::kData, data);
      report.bytes += f1.size() + f2.size();
      report.elements += elements;
      c.info.elements += elements;
      c.info.bytes += f1.size() + f2.size();
      SendLocked(c, std::move(f1));
      SendLocked(c, std::move(f2));
      c.awaiting = v->manifest.version;
      sent.push_back(t.id);
    }
  }
  Wake();

  std::unique_lock lock(mu_);
  const auto deadline = Clock::now() + options_.timeout;
  auto pending = [&] {
    for (uint64_t id : sent) {
      auto it = conns_.find(id);
      if (it != conns_.end() && it->second->drop.empty() && it->second->awaiting) return true;
    }
    return false;
  };
  cv_.wait_until(lock, deadline, [&] { return !pending(); });
  for (uint64_t id : sent) {
    auto it = conns_.find(id);
    if (confirmed_.count(id)) {
      report.pushed++;  // also when it closed after confirming (a receiver that is done)
      continue;
    }
    if (it == conns_.end()) {
      auto g = gone_.find(id);
      report.dropped.push_back(g != gone_.end() ? g->second
                                                : "receiver connection " + std::to_string(id) +
                                                      " closed during the push");
      continue;
    }
    Conn& c = *it->second;
    if (c.drop.empty() && c.awaiting) {
      DropLocked(c, "did not confirm " + VersionName(v->manifest.version) + " within " +
                        std::to_string(options_.timeout.count()) + " ms");
    }
    if (!c.drop.empty()) {
      report.dropped.push_back("receiver " + c.who + ": " + c.drop);
    } else {
      report.pushed++;
    }
  }
  lock.unlock();
  Wake();
  report.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return report;
}

Result<std::vector<TensorChanges>> ChangesFromStore(Store& store,
                                                    const std::shared_ptr<const Version>& v) {
  const std::string name = VersionName(v->manifest.version);
  if (!v->manifest.parent) return InvalidArgument(name + " has no parent: it is not a change");
  ASSIGN_OR_RETURN(auto parent, store.GetVersion(*v->manifest.parent));
  Materializer reader(&store);
  const uint64_t bb = v->manifest.block_bytes;
  std::vector<TensorChanges> out;
  std::string payload;
  std::vector<uint32_t> idx;
  std::vector<uint8_t> vals, sets, old_block, new_block;
  for (const FileEntry& f : v->manifest.files) {
    for (const TensorEntry& t : f.tensors) {
      const int w = DTypeWidth(t.dtype);
      const uint64_t block_elems = bb / w;
      TensorChanges c;
      c.name = t.name;
      for (uint32_t b = 0; b < t.blocks; ++b) {
        const BlockRecord& rec = v->records[size_t{t.first_block} + b];
        if (rec.kind == BlockKind::kSame) continue;
        const uint64_t len = std::min<uint64_t>(bb, t.bytes() - uint64_t{b} * bb);
        const uint64_t first = uint64_t{b} * block_elems;
        const std::string what =
            name + "/" + f.name + ": tensor " + t.name + " block " + std::to_string(b);
        if (rec.kind == BlockKind::kSparse) {
          // Differences where the record has them (old value 0 makes the
          // push send the difference itself), whole values where not.
          RETURN_IF_ERROR(reader.ReadRecordPayload(*v, rec, &payload, what));
          RETURN_IF_ERROR(DecodeSparseEntries(payload, len, w, &idx, &vals, &sets, nullptr, what));
          for (size_t k = 0; k < idx.size(); ++k) {
            c.indices.push_back(first + idx[k]);
            c.values.insert(c.values.end(), vals.begin() + k * w, vals.begin() + (k + 1) * w);
            c.old_values.insert(c.old_values.end(), w, 0);
            c.known.push_back(sets.empty() || !sets[k]);
          }
          continue;
        }
        // Stored dense: compare with the parent's block.
        old_block.resize(len);
        new_block.resize(len);
        RETURN_IF_ERROR(reader.ReadBlock(parent, f, t, b, old_block.data()));
        RETURN_IF_ERROR(reader.ReadBlock(v, f, t, b, new_block.data()));
        for (uint64_t k = 0; k < len / w; ++k) {
          if (std::memcmp(&old_block[k * w], &new_block[k * w], w) == 0) continue;
          c.indices.push_back(first + k);
          c.values.insert(c.values.end(), new_block.begin() + k * w,
                          new_block.begin() + (k + 1) * w);
          c.old_values.insert(c.old_values.end(), old_block.begin() + k * w,
                              old_block.begin() + (k + 1) * w);
          c.known.push_back(1);
        }
      }
      if (!c.indices.empty()) out.push_back(std::move(c));
    }
  }
  return out;
}

std::string PushReportJson(const PushReport& r) {
  return Json({{"version", r.version},
               {"pushed", r.pushed},
               {"behind", r.behind},
               {"elements", r.elements},
               {"bytes", r.bytes},
               {"seconds", r.seconds},
               {"pack_seconds", r.pack_seconds},
               {"dropped", r.dropped}});
}

std::string PushServer::StatusJson() {
  nlohmann::json rs = nlohmann::json::array();
  for (const PushReceiverInfo& i : Receivers()) {
    rs.push_back({{"id", i.id},
                  {"rank", i.rank},
                  {"tp", i.layout.tp},
                  {"fuse_qkv", i.layout.fuse_qkv},
                  {"fuse_gate_up", i.layout.fuse_gate_up},
                  {"version", i.version ? nlohmann::json(*i.version) : nlohmann::json(nullptr)},
                  {"behind", i.behind},
                  {"pushes", i.pushes},
                  {"elements", i.elements},
                  {"bytes", i.bytes}});
  }
  return Json({{"port", port()}, {"receivers", rs}, {"events", TakeEvents()}});
}

PushServer::PushServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
PushServer::~PushServer() = default;

Result<std::unique_ptr<PushServer>> PushServer::Start(const PushServerOptions& options) {
  auto impl = std::make_unique<Impl>(options);
  RETURN_IF_ERROR(impl->Start().WithContext("push server on " + options.address));
  return std::unique_ptr<PushServer>(new PushServer(std::move(impl)));
}

int PushServer::port() const { return impl_->port(); }

Status PushServer::SetLatest(Store& store, const std::shared_ptr<const Version>& v) {
  return impl_->SetLatest(store, v);
}

Result<PushReport> PushServer::Push(Store& store, const std::shared_ptr<const Version>& v,
                                    const std::vector<TensorChanges>& changes) {
  return impl_->Push(store, v, changes);
}

std::vector<PushReceiverInfo> PushServer::Receivers() const { return impl_->Receivers(); }

std::vector<std::string> PushServer::TakeEvents() { return impl_->TakeEvents(); }

}  // namespace dte
