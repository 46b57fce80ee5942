// The push server of sync/push/push_server.h: one I/O thread owns every socket (accepts,
// hellos, acknowledgements, and the queued frames of pushes, written as the
// sockets take them); Push() reads the changes in batches of tensors
// (counts first, then each batch's data, packed once per layout and rank
// and queued for the receivers that hold the parent, their queues
// bounded), and waits for their receipts.
#include "sync/push/push_server.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
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
#include "sync/convert/convert.h"
#include "sync/push/changes.h"
#include "sync/push/internal/push_plan.h"
#include "sync/push/internal/push_wire.h"
#include "sync/transfer/plan_inputs.h"
#include "sync/transport/internal/auth_handshake.h"
#include "sync/transport/job_secret.h"

namespace dte {

using push_internal::Frame;
using push_internal::Msg;
using transport_internal::Deadline;

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

  void Stop() {
    if (!io_.joinable()) return;
    stop_ = true;
    Wake();
    io_.join();
  }

  int port() const { return port_; }
  uint64_t expected() const { return options_.receivers; }
  uint64_t cache_bytes() const { return options_.cache_bytes; }

  std::string address() const {
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

  Status SetGroup(int part, int parts) {
    if (parts < 1 || part < 0 || part >= parts) {
      return InvalidArgument("push server: part " + std::to_string(part) + " of " +
                             std::to_string(parts));
    }
    {
      std::lock_guard lock(mu_);
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

  Status SetSenders(const std::vector<std::string>& senders) {
    {
      std::lock_guard lock(mu_);
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

  std::pair<int, int> group() const {
    std::lock_guard lock(mu_);
    return {part_, parts_};
  }

  Status SetLatest(Store& store, const std::shared_ptr<const Version>& v) {
    ASSIGN_OR_RETURN(PlanInputs in, PlanInputsOf(store, *v));
    {
      std::lock_guard lock(mu_);
      InstallLocked(v, std::move(in));
      // Receivers that hold something else catch up to it.
      for (auto& [id, c] : conns_) {
        if (!c->hello_done || !c->drop.empty()) continue;
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

  Result<PushReport> Push(Store& store, const std::shared_ptr<const Version>& v,
                          ChangesSource& changes);

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

  uint64_t refused() const {
    std::lock_guard lock(mu_);
    return refused_;
  }
  bool authenticated() const { return !secret_.empty(); }

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
    std::vector<PlanTensor> tensors;        // as the hello lists them
    std::optional<uint64_t> awaiting;       // version sent, receipt not yet confirmed
    std::vector<uint32_t> plan_to_own;      // plan receiver tensor -> index in `tensors`
    std::optional<std::string> held_hello;  // until the senders are known (SetSenders)
    // With a job secret: the handshake, and the bytes read until it is done.
    std::optional<auth_internal::ServerHandshake> auth;
    std::string auth_in;
  };
  void DropAllLocked(const std::string& why) {
    for (auto& [id, c] : conns_) {
      if (c->hello_done) DropLocked(*c, why);
    }
  }

  // Part 0 of several answers hellos only once it can name every sender.
  bool HoldHellosLocked() const { return part_ == 0 && parts_ > 1 && senders_.empty(); }
  // Hellos held until then are answered now.
  void AnswerHeldLocked() {
    if (HoldHellosLocked()) return;
    for (auto& [id, c] : conns_) {
      if (!c->held_hello) continue;
      std::string body = std::exchange(*c->held_hello, {});
      c->held_hello.reset();
      if (c->drop.empty()) OnHello(*c, body);
    }
  }

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

  // A connection that did not prove it knows the job secret: closed before
  // anything of it is read or anything sent to it but the handshake.
  void RefuseLocked(Conn& c, const std::string& why) {
    if (!c.drop.empty()) return;
    c.drop = why;
    ++refused_;
    const std::string line = c.who + " refused: " + why;
    EventLocked(line);
    Log("push server on " + address() + ": " + line);
    shutdown(c.fd.get(), SHUT_RDWR);
  }
  // Bytes read from c: the handshake's first, then the protocol's frames.
  void OnBytesLocked(Conn& c, const char* data, size_t n) {
    if (!c.auth || c.auth->done()) return c.in.Append(data, n);
    c.auth_in.append(data, n);
    std::string answer;
    Result<bool> done = c.auth->Feed(&c.auth_in, &answer);
    if (!done.ok()) return RefuseLocked(c, done.status().message());
    if (!answer.empty()) SendLocked(c, std::move(answer));
    if (*done) c.in.Append(c.auth_in.data(), c.auth_in.size());
  }
  static void Log(const std::string& line) { std::fprintf(stderr, "dte: %s\n", line.c_str()); }

  // Kept for StatusJson/TakeEvents; the oldest go past kMaxEvents.
  void EventLocked(std::string line) {
    constexpr size_t kMaxEvents = 1000;
    if (events_.size() == kMaxEvents) events_.erase(events_.begin());
    events_.push_back(std::move(line));
  }

  void SendLocked(Conn& c, std::string frame) {
    c.out.push_back({std::make_shared<const std::string>(std::move(frame)), 0});
  }
  // One frame for several receivers, not copied.
  void SendLocked(Conn& c, const std::shared_ptr<const std::string>& frame) {
    c.out.push_back({frame, 0});
  }
  static uint64_t QueuedBytes(const Conn& c) {
    uint64_t n = 0;
    for (const Out& o : c.out) n += o.data->size() - o.off;
    return n;
  }

  void OnHello(Conn& c, const std::string& body);
  void OnMessage(Conn& c, const push_internal::Parsed& m);
  void Loop();

  PushServerOptions options_;
  std::string secret_;  // the job secret; empty: none (loopback only)
  ScopedFd listen_, wake_;
  int port_ = 0;
  std::thread io_;
  std::atomic<bool> stop_{false};

  mutable std::mutex mu_;
  // A receipt arrived, a receiver was dropped, or a queue was written out.
  std::condition_variable cv_;
  std::map<uint64_t, std::unique_ptr<Conn>> conns_;
  uint64_t next_id_ = 1;
  std::optional<PlanInputs> inputs_;
  std::shared_ptr<const Version> latest_;
  std::map<LayoutKey, TransferPlan> plans_;
  std::vector<std::string> events_;
  uint64_t refused_ = 0;  // connections refused at the handshake
  // Receivers dropped and closed while a push awaited them: id -> reason,
  // for that push's report (cleared by each push).
  std::map<uint64_t, std::string> gone_;
  std::set<uint64_t> confirmed_;      // receivers that confirmed the current push
  int part_ = 0, parts_ = 1;          // SetGroup
  std::vector<std::string> senders_;  // every part's address, once known (SetSenders)
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
  nlohmann::json welcome = {{"latest", nullptr}, {"part", part_}, {"parts", parts_}};
  if (part_ == 0 && parts_ > 1) welcome["senders"] = senders_;
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
    if (m.type != Msg::kHello || c.held_hello) {
      return DropLocked(c, "the first message was not a hello");
    }
    if (HoldHellosLocked()) {
      c.held_hello = m.body;  // answered by SetSenders
      return;
    }
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
        if (!c.hello_done && !c.held_hello && c.drop.empty() && now >= c.hello_deadline) {
          if (c.auth && !c.auth->done()) {
            RefuseLocked(c, "no authentication within the timeout");
          } else {
            DropLocked(c, "no hello within the timeout");
          }
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
        if (!c.hello_done && !c.held_hello) {
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
        c->who = "connection " + std::to_string(c->info.id) + " from " +
                 transport_internal::PeerName(c->fd.get());
        if (!secret_.empty()) c->auth.emplace(secret_, "push");
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
        cv_.notify_all();  // a push may be waiting for this queue to shrink
      }
      if (re & (POLLIN | POLLHUP | POLLERR)) {
        const ssize_t r = recv(c.fd.get(), buf, sizeof buf, 0);
        if (r == 0 || (r < 0 && errno != EAGAIN && errno != EINTR)) {
          const std::string why = r == 0 ? "closed the connection (exited or crashed?)"
                                         : std::string("recv failed: ") + std::strerror(errno);
          if (c.auth && !c.auth->done()) {
            RefuseLocked(c, why + " before authenticating");
          } else {
            DropLocked(c, why);
          }
          cv_.notify_all();
          continue;
        }
        if (r > 0) OnBytesLocked(c, buf, static_cast<size_t>(r));
        if (!c.drop.empty()) continue;
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

namespace {

// Checks one tensor's changes against the version's tensor t.
Status CheckChanges(const TensorChanges& c, const PlanTensor& t, const std::string& what) {
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
  return Status::Ok();
}

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
    std::set<std::string> names;
    for (const FileEntry& f : m.files) {
      for (const TensorEntry& t : f.tensors) names.insert(t.name);
    }
    const std::string what = "push of " + VersionName(m.version) + ": tensor ";
    for (const auto& [name, c] : by_name_) {
      if (!names.count(name)) return InvalidArgument(what + name + " is not in the version");
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

// One op of a plan applied to one tensor's changes.
struct OpJob {
  const TransferPlan* plan;
  size_t op;  // index into plan->ops
  const TensorChanges* changes;
};

// An op's entries for its receiver rank: how many, and (in round 2) their
// encoding.
struct OpOut {
  uint64_t count = 0;
  std::string data;
};

// Remaps each job's changes into its op and, when `encode`, encodes them
// (sync/push/internal/push_wire.h). Runs of an op's entries are independent
// (each becomes its own segments): pieces of at most kPieceEntries of every
// job run in parallel.
std::vector<OpOut> PackOps(const std::vector<OpJob>& jobs, bool encode) {
  constexpr size_t kPieceEntries = size_t{1} << 18;
  struct Piece {
    size_t job, begin, end;
    uint64_t count = 0;
    std::string data;
  };
  std::vector<Piece> pieces;
  for (size_t k = 0; k < jobs.size(); ++k) {
    const size_t n = jobs[k].changes->indices.size();
    for (size_t b = 0; b < n; b += kPieceEntries) {
      pieces.push_back({k, b, std::min(n, b + kPieceEntries), 0, {}});
    }
  }
  kernels::ParallelFor(pieces.size(), 1, [&](size_t lo, size_t hi) {
    std::vector<uint64_t> dst, pos;
    for (size_t i = lo; i < hi; ++i) {
      Piece& pc = pieces[i];
      const OpJob& job = jobs[pc.job];
      const TransferOp& op = job.plan->ops[job.op];
      const TensorChanges& c = *job.changes;
      const size_t len = pc.end - pc.begin;
      dst.resize(len);
      pos.resize(len);
      const size_t j = RemapOpIndices(op, c.indices.data() + pc.begin, len, dst.data(), pos.data());
      pc.count = j;
      if (j == 0 || !encode) continue;
      for (size_t q = 0; q < j; ++q) pos[q] += pc.begin;
      push_internal::AppendOpSegments(
          dst.data(), pos.data(), j, DTypeWidth(job.plan->canonical[op.canonical].dtype),
          c.values.data(), c.old_values.empty() ? nullptr : c.old_values.data(),
          c.known.empty() ? nullptr : c.known.data(), &pc.data);
    }
  });
  std::vector<OpOut> out(jobs.size());
  for (Piece& pc : pieces) {
    out[pc.job].count += pc.count;
    out[pc.job].data += pc.data;
    std::string().swap(pc.data);
  }
  return out;
}

}  // namespace

Result<PushReport> PushServer::Impl::Push(Store& store, const std::shared_ptr<const Version>& v,
                                          ChangesSource& changes) {
  const auto t0 = Clock::now();
  PushReport report;
  report.version = v->manifest.version;
  const std::string vname = VersionName(v->manifest.version);
  if (!v->manifest.parent) {
    return InvalidArgument("push of " + vname +
                           ": a version without a parent is not a change (receivers catch up)");
  }
  const uint64_t parent = *v->manifest.parent;
  ASSIGN_OR_RETURN(PlanInputs in, PlanInputsOf(store, *v));
  const std::vector<PlanTensor> canonical = in.canonical;

  // Which receivers get what: snapshot them, then pack outside the lock.
  struct Target {
    uint64_t id;
    std::pair<LayoutKey, int> key;  // layout and receiver rank: who shares its messages
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
        targets.push_back({id, {KeyOf(c.info.layout), c.info.rank}, c.plan_to_own});
      } else if (c.info.version != v->manifest.version) {
        c.info.behind = true;
        SendLocked(c, Frame(Msg::kBehind, Json({{"latest", v->manifest.version}})));
        report.behind++;
      }
    }
  }
  Wake();

  // Each plan's ops by the canonical tensor they come from (plan order:
  // canonical order, so tensors in order are plan order for every rank).
  std::map<LayoutKey, std::vector<std::vector<size_t>>> ops_of;
  for (const auto& [key, plan] : plans) {
    auto& by = ops_of[key];
    by.resize(canonical.size());
    for (size_t k = 0; k < plan->ops.size(); ++k) by[plan->ops[k].canonical].push_back(k);
  }
  std::vector<size_t> changed;  // canonical tensors with changes, in order
  if (!plans.empty()) {
    for (size_t c = 0; c < canonical.size(); ++c) {
      if (changes.MayChange(canonical[c].name)) changed.push_back(c);
    }
  }
  // Consecutive changed tensors of about options_.batch_entries entries in
  // all (or one tensor), packed together. Round 1 packs each batch whole
  // while the encodings kept so far fit options_.cache_bytes (then round 2
  // only sends them: one pass, as for most versions), and only counts the
  // rest, which round 2 reads and packs again.
  struct PackedBatch {
    std::vector<size_t> tensors;
    bool encoded = false;
    std::map<std::pair<LayoutKey, int>, std::string> data;  // while encoded, until sent
  };
  std::vector<PackedBatch> packed;
  uint64_t cached = 0;
  using Batch = std::vector<std::pair<size_t, const TensorChanges*>>;
  // Reads tensor c, checked; copied into `held` unless the source keeps it.
  auto read = [&](size_t c, std::deque<TensorChanges>* held) -> Result<const TensorChanges*> {
    const std::string what = "push of " + vname + ": tensor " + canonical[c].name;
    ASSIGN_OR_RETURN(const TensorChanges* tc, changes.Read(canonical[c].name));
    RETURN_IF_ERROR(CheckChanges(*tc, canonical[c], what));
    if (changes.Stable()) return tc;
    held->push_back(*tc);
    return &held->back();
  };
  // Packs a batch: per op (plan order within each layout and rank) its
  // count and, when `encode`, the ranks' data in op order.
  std::map<LayoutKey, std::vector<uint64_t>> op_counts;
  for (const auto& [key, plan] : plans) op_counts[key].assign(plan->ops.size(), 0);
  auto pack_batch = [&](const Batch& batch, bool encode, bool check,
                        std::map<std::pair<LayoutKey, int>, std::string>* data) -> Status {
    std::vector<OpJob> jobs;
    std::vector<LayoutKey> keys;
    for (const auto& [c, tc] : batch) {
      for (const auto& [key, plan] : plans) {
        for (size_t k : ops_of[key][c]) {
          jobs.push_back({plan, k, tc});
          keys.push_back(key);
        }
      }
    }
    std::vector<OpOut> out = PackOps(jobs, encode);
    for (size_t j = 0; j < jobs.size(); ++j) {
      const TransferOp& op = jobs[j].plan->ops[jobs[j].op];
      uint64_t& count = op_counts[keys[j]][jobs[j].op];
      if (check && out[j].count != count) {
        return Internal("push of " + vname + ": tensor " + canonical[op.canonical].name +
                        " read differently in the second pass");
      }
      count = out[j].count;
      if (encode) (*data)[{keys[j], op.receiver}] += out[j].data;
      std::string().swap(out[j].data);
    }
    return Status::Ok();
  };

  // Round 1: every op's count, from a first pass over the changes.
  {
    Batch batch;
    std::deque<TensorChanges> held;
    uint64_t entries = 0;
    auto flush = [&]() -> Status {
      PackedBatch pb;
      for (const auto& item : batch) pb.tensors.push_back(item.first);
      pb.encoded = cached < options_.cache_bytes;
      RETURN_IF_ERROR(pack_batch(batch, pb.encoded, false, &pb.data));
      for (const auto& [rk, bytes] : pb.data) cached += bytes.size();
      packed.push_back(std::move(pb));
      batch.clear();
      held.clear();
      entries = 0;
      return Status::Ok();
    };
    for (size_t c : changed) {
      ASSIGN_OR_RETURN(const TensorChanges* tc, read(c, &held));
      if (tc->indices.empty()) continue;
      batch.emplace_back(c, tc);
      entries += tc->indices.size();
      if (entries >= options_.batch_entries) RETURN_IF_ERROR(flush());
    }
    if (!batch.empty()) RETURN_IF_ERROR(flush());
  }
  std::map<std::pair<LayoutKey, int>, push_internal::CountsMsg> counts;
  std::map<std::pair<LayoutKey, int>, uint64_t> elements;
  const auto [part, parts] = group();
  for (const auto& [key, plan] : plans) {
    for (int r = 0; r < std::get<0>(key); ++r) {
      push_internal::CountsMsg& m = counts[{key, r}];
      m.version = v->manifest.version;
      m.parent = parent;
      m.part = static_cast<uint32_t>(part);
      m.parts = static_cast<uint32_t>(parts);
    }
    for (size_t k = 0; k < plan->ops.size(); ++k) {
      if (op_counts[key][k] == 0) continue;
      const auto rk = std::make_pair(key, plan->ops[k].receiver);
      counts[rk].op.push_back(static_cast<uint32_t>(k));
      counts[rk].tensor.push_back(plan->ops[k].receiver_tensor);
      counts[rk].count.push_back(op_counts[key][k]);
      elements[rk] += op_counts[key][k];
    }
  }
  double pack = std::chrono::duration<double>(Clock::now() - t0).count();

  const auto deadline = Clock::now() + options_.timeout;
  std::vector<uint64_t> sent;
  // Queues a frame for every live target of `rk` (every target: null).
  auto send_all = [&](const std::pair<LayoutKey, int>* rk,
                      const std::shared_ptr<const std::string>& frame) {
    for (Target& t : targets) {
      if (rk && t.key != *rk) continue;
      auto it = conns_.find(t.id);
      if (it == conns_.end() || !it->second->drop.empty()) continue;
      Conn& c = *it->second;
      SendLocked(c, frame);
      report.bytes += frame->size();
      c.info.bytes += frame->size();
    }
  };
  {
    std::lock_guard lock(mu_);
    gone_.clear();
    confirmed_.clear();
    for (Target& t : targets) {
      auto it = conns_.find(t.id);
      if (it == conns_.end() || !it->second->drop.empty()) continue;
      Conn& c = *it->second;
      push_internal::CountsMsg m = counts[t.key];
      for (uint32_t& tensor : m.tensor) tensor = t.plan_to_own[tensor];
      std::string f1 = Frame(Msg::kCounts, push_internal::EncodeCounts(m));
      report.bytes += f1.size();
      c.info.bytes += f1.size();
      report.elements += elements[t.key];
      c.info.elements += elements[t.key];
      SendLocked(c, std::move(f1));
      c.awaiting = v->manifest.version;
      sent.push_back(t.id);
    }
  }
  Wake();

  // Round 2, a batch at a time: each layout and rank's data of the batch
  // (kept from round 1, or read and packed again), queued once for every
  // receiver of that layout and rank. Before the next batch, every
  // receiver's queue drains below options_.queue_bytes (or it is dropped at
  // the deadline).
  Status streamed = [&]() -> Status {
    for (PackedBatch& pb : packed) {
      if (sent.empty()) break;
      const auto p0 = Clock::now();
      std::map<std::pair<LayoutKey, int>, std::string> data = std::move(pb.data);
      if (!pb.encoded) {
        Batch batch;
        std::deque<TensorChanges> held;
        for (size_t c : pb.tensors) {
          ASSIGN_OR_RETURN(const TensorChanges* tc, read(c, &held));
          batch.emplace_back(c, tc);
        }
        RETURN_IF_ERROR(pack_batch(batch, true, true, &data));
      }
      pack += std::chrono::duration<double>(Clock::now() - p0).count();
      std::unique_lock lock(mu_);
      for (auto& [rk, bytes] : data) {
        if (bytes.empty()) continue;
        send_all(&rk, std::make_shared<const std::string>(Frame(Msg::kData, bytes)));
      }
      Wake();
      cv_.wait_until(lock, deadline, [&] {
        for (const Target& t : targets) {
          auto it = conns_.find(t.id);
          if (it != conns_.end() && it->second->drop.empty() &&
              QueuedBytes(*it->second) > options_.queue_bytes) {
            return false;
          }
        }
        return true;
      });
      for (const Target& t : targets) {
        auto it = conns_.find(t.id);
        if (it != conns_.end() && QueuedBytes(*it->second) > options_.queue_bytes) {
          DropLocked(*it->second, "did not take " + vname + " within " +
                                      std::to_string(options_.timeout.count()) + " ms");
        }
      }
    }
    return Status::Ok();
  }();
  {
    std::lock_guard lock(mu_);
    if (!streamed.ok()) {
      // Receivers hold part of round 2 and never apply it: close them (they
      // reconnect and catch up from the store).
      for (uint64_t id : sent) {
        auto it = conns_.find(id);
        if (it != conns_.end()) DropLocked(*it->second, "push aborted: " + streamed.message());
      }
    } else {
      send_all(nullptr, std::make_shared<const std::string>(Frame(Msg::kDataEnd, {})));
    }
  }
  if (!streamed.ok()) {
    Wake();
    return streamed;
  }
  Wake();
  report.pack_seconds = pack;

  std::unique_lock lock(mu_);
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
      DropLocked(c, "did not confirm " + vname + " within " +
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
  report.missing = options_.receivers > report.pushed ? options_.receivers - report.pushed : 0;
  report.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return report;
}

namespace {

// Reads one tensor's changes of v against its parent from the store: every
// sparse record decoded (its differences and whole values, exactly what a
// push sends), and blocks stored dense compared with the parent's.
class StoreChangesSource : public ChangesSource {
 public:
  StoreChangesSource(Store& store, std::shared_ptr<const Version> v,
                     std::shared_ptr<const Version> parent)
      : v_(std::move(v)), parent_(std::move(parent)), reader_(&store) {
    for (const FileEntry& f : v_->manifest.files) {
      for (const TensorEntry& t : f.tensors) where_[t.name] = {&f, &t};
    }
  }

  bool MayChange(const std::string& name) const override {
    auto it = where_.find(name);
    if (it == where_.end()) return false;
    const TensorEntry& t = *it->second.second;
    for (uint32_t b = 0; b < t.blocks; ++b) {
      if (v_->records[size_t{t.first_block} + b].kind != BlockKind::kSame) return true;
    }
    return false;
  }

  Result<const TensorChanges*> Read(const std::string& name) override {
    c_ = TensorChanges{};
    c_.name = name;
    auto it = where_.find(name);
    if (it == where_.end()) return &c_;
    const FileEntry& f = *it->second.first;
    const TensorEntry& t = *it->second.second;
    const uint64_t bb = v_->manifest.block_bytes;
    const int w = DTypeWidth(t.dtype);
    const uint64_t block_elems = bb / w;
    for (uint32_t b = 0; b < t.blocks; ++b) {
      const BlockRecord& rec = v_->records[size_t{t.first_block} + b];
      if (rec.kind == BlockKind::kSame) continue;
      const uint64_t len = std::min<uint64_t>(bb, t.bytes() - uint64_t{b} * bb);
      const uint64_t first = uint64_t{b} * block_elems;
      const std::string what = VersionName(v_->manifest.version) + "/" + f.name + ": tensor " +
                               t.name + " block " + std::to_string(b);
      if (rec.kind == BlockKind::kSparse) {
        // Differences where the record has them (old value 0 makes the
        // push send the difference itself), whole values where not.
        RETURN_IF_ERROR(reader_.ReadRecordPayload(*v_, rec, &payload_, what));
        RETURN_IF_ERROR(
            DecodeSparseEntries(payload_, len, w, &idx_, &vals_, &sets_, nullptr, what));
        for (size_t k = 0; k < idx_.size(); ++k) {
          c_.indices.push_back(first + idx_[k]);
          c_.values.insert(c_.values.end(), vals_.begin() + k * w, vals_.begin() + (k + 1) * w);
          c_.old_values.insert(c_.old_values.end(), w, 0);
          c_.known.push_back(sets_.empty() || !sets_[k]);
        }
        continue;
      }
      // Stored dense: compare with the parent's block.
      old_block_.resize(len);
      new_block_.resize(len);
      RETURN_IF_ERROR(reader_.ReadBlock(parent_, f, t, b, old_block_.data()));
      RETURN_IF_ERROR(reader_.ReadBlock(v_, f, t, b, new_block_.data()));
      for (uint64_t k = 0; k < len / w; ++k) {
        if (std::memcmp(&old_block_[k * w], &new_block_[k * w], w) == 0) continue;
        c_.indices.push_back(first + k);
        c_.values.insert(c_.values.end(), new_block_.begin() + k * w,
                         new_block_.begin() + (k + 1) * w);
        c_.old_values.insert(c_.old_values.end(), old_block_.begin() + k * w,
                             old_block_.begin() + (k + 1) * w);
        c_.known.push_back(1);
      }
    }
    return &c_;
  }

 private:
  std::shared_ptr<const Version> v_, parent_;
  Materializer reader_;
  std::map<std::string, std::pair<const FileEntry*, const TensorEntry*>> where_;
  TensorChanges c_;
  std::string payload_;
  std::vector<uint32_t> idx_;
  std::vector<uint8_t> vals_, sets_, old_block_, new_block_;
};

}  // namespace

Result<std::unique_ptr<ChangesSource>> StoreChanges(Store& store,
                                                    const std::shared_ptr<const Version>& v) {
  const std::string name = VersionName(v->manifest.version);
  if (!v->manifest.parent) return InvalidArgument(name + " has no parent: it is not a change");
  ASSIGN_OR_RETURN(auto parent, store.GetVersion(*v->manifest.parent));
  return std::unique_ptr<ChangesSource>(new StoreChangesSource(store, v, std::move(parent)));
}

Result<std::vector<TensorChanges>> ChangesFromStore(Store& store,
                                                    const std::shared_ptr<const Version>& v) {
  ASSIGN_OR_RETURN(auto source, StoreChanges(store, v));
  std::vector<TensorChanges> out;
  for (const FileEntry& f : v->manifest.files) {
    for (const TensorEntry& t : f.tensors) {
      if (!source->MayChange(t.name)) continue;
      ASSIGN_OR_RETURN(const TensorChanges* c, source->Read(t.name));
      if (!c->indices.empty()) out.push_back(*c);
    }
  }
  return out;
}

std::string PushReportJson(const PushReport& r) {
  return Json({{"version", r.version},
               {"pushed", r.pushed},
               {"behind", r.behind},
               {"missing", r.missing},
               {"elements", r.elements},
               {"bytes", r.bytes},
               {"seconds", r.seconds},
               {"pack_seconds", r.pack_seconds},
               {"dropped", r.dropped}});
}

std::string PushServer::StatusJson(bool take_events) {
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
  return Json({{"port", port()},
               {"address", address()},
               {"authenticated", impl_->authenticated()},
               {"refused", refused()},
               {"part", part()},
               {"parts", parts()},
               {"expected", impl_->expected()},
               {"receivers", rs},
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

std::vector<std::string> PushServer::TakeEvents() { return impl_->TakeEvents(); }

uint64_t PushServer::refused() const { return impl_->refused(); }

}  // namespace dte
