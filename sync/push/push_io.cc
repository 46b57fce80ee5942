// The push server's I/O thread (sync/push/internal/push_server_impl.h): it
// owns every socket; accepts, runs the job-secret handshake, answers
// hellos, takes receipts, and writes the queued frames of pushes as the
// sockets take them.
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "sync/push/internal/push_fp8.h"
#include "sync/push/internal/push_plan.h"
#include "sync/push/internal/push_server_impl.h"

namespace dte {

using push_internal::Frame;
using push_internal::Json;
using push_internal::Msg;

void PushServer::Impl::Loop() {
  std::vector<pollfd> fds;
  std::vector<uint64_t> ids;
  std::vector<char> buf(64 << 10);
  while (!stop_) {
    int timeout_ms;
    {
      MutexLock lock(&mu_);
      timeout_ms = PollSetLocked(&fds, &ids);
    }
    const int n = poll(fds.data(), fds.size(), timeout_ms);
    if (n < 0 && errno != EINTR) break;
    if (n <= 0) continue;
    if (fds[0].revents & POLLIN) {
      uint64_t drained;
      [[maybe_unused]] ssize_t r = read(wake_.get(), &drained, sizeof drained);
    }
    MutexLock lock(&mu_);
    if (fds[1].revents & POLLIN) AcceptLocked();
    for (size_t k = 2; k < fds.size(); ++k) {
      auto it = conns_.find(ids[k - 2]);
      if (it != conns_.end()) ServeLocked(*it->second, fds[k].revents, buf.data(), buf.size());
    }
  }
}

int PushServer::Impl::PollSetLocked(std::vector<pollfd>* fds, std::vector<uint64_t>* ids) {
  fds->clear();
  ids->clear();
  fds->push_back({wake_.get(), POLLIN, 0});
  fds->push_back({listen_.get(), POLLIN, 0});
  int timeout_ms = 1000;
  const auto now = Clock::now();
  for (auto it = conns_.begin(); it != conns_.end();) {
    Conn& c = *it->second;
    const bool waiting_hello = !c.hello_done && !c.held_hello;
    if (waiting_hello && c.drop.empty() && now >= c.hello_deadline) {
      if (c.auth && !c.auth->done()) {
        RefuseLocked(c, "no authentication within the timeout");
      } else {
        DropLocked(c, "no hello within the timeout");
      }
    }
    if (!c.drop.empty() || (c.close_after_flush && c.out.empty())) {
      if (c.awaiting) {
        gone_[it->first] = "receiver " + c.who + ": " + c.drop;
        cv_.SignalAll();
      }
      it = conns_.erase(it);
      continue;
    }
    fds->push_back({c.fd.get(), static_cast<short>(c.out.empty() ? POLLIN : POLLIN | POLLOUT), 0});
    ids->push_back(it->first);
    if (waiting_hello) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(c.hello_deadline - now);
      timeout_ms = std::min<int>(timeout_ms, static_cast<int>(left.count()) + 1);
    }
    ++it;
  }
  return timeout_ms;
}

void PushServer::Impl::AcceptLocked() {
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

void PushServer::Impl::ServeLocked(Conn& c, short revents, char* buf, size_t buf_size) {
  if (revents & POLLOUT) {
    WriteOutLocked(c);
    cv_.SignalAll();  // a push may be waiting for this queue to shrink
  }
  if (revents & (POLLIN | POLLHUP | POLLERR)) ReadInLocked(c, buf, buf_size);
}

void PushServer::Impl::WriteOutLocked(Conn& c) {
  while (!c.out.empty()) {
    Out& o = c.out.front();
    const ssize_t w =
        send(c.fd.get(), o.data->data() + o.off, o.data->size() - o.off, MSG_NOSIGNAL);
    if (w < 0) {
      if (errno != EAGAIN && errno != EINTR) {
        DropLocked(c, std::string("send failed: ") + std::strerror(errno));
      }
      return;
    }
    o.off += static_cast<size_t>(w);
    if (o.off < o.data->size()) return;
    c.out.pop_front();
  }
}

void PushServer::Impl::ReadInLocked(Conn& c, char* buf, size_t buf_size) {
  const ssize_t r = recv(c.fd.get(), buf, buf_size, 0);
  if (r == 0 || (r < 0 && errno != EAGAIN && errno != EINTR)) {
    const std::string why = r == 0 ? "closed the connection (exited or crashed?)"
                                   : std::string("recv failed: ") + std::strerror(errno);
    if (c.auth && !c.auth->done()) {
      RefuseLocked(c, why + " before authenticating");
    } else {
      DropLocked(c, why);
    }
    cv_.SignalAll();
    return;
  }
  if (r > 0) OnBytesLocked(c, buf, static_cast<size_t>(r));
  while (c.drop.empty()) {
    auto m = c.in.Next(push_internal::kMaxControlBytes, c.who);
    if (!m.ok()) {
      DropLocked(c, m.status().message());
      cv_.SignalAll();
      return;
    }
    if (!m->has_value()) return;
    OnMessage(c, **m);
  }
}

void PushServer::Impl::OnBytesLocked(Conn& c, const char* data, size_t n) {
  if (!c.auth || c.auth->done()) return c.in.Append(data, n);
  c.auth_in.append(data, n);
  std::string answer;
  Result<bool> done = c.auth->Feed(&c.auth_in, &answer);
  if (!done.ok()) return RefuseLocked(c, done.status().message());
  if (!answer.empty()) SendLocked(c, std::move(answer));
  if (*done) c.in.Append(c.auth_in.data(), c.auth_in.size());
}

namespace {

// A hello's tensors, or the reason it is refused.
Result<std::vector<PlanTensor>> HelloTensors(const nlohmann::json& list) {
  std::vector<PlanTensor> tensors;
  for (const auto& t : list) {  // const: operator[] must only see keys that are there
    if (!t.is_object() || !t.contains("name") || !t.contains("dtype") || !t.contains("shape") ||
        !t["name"].is_string() || !t["dtype"].is_string() || !t["shape"].is_array()) {
      return InvalidArgument("a tensor entry is not {name, dtype, shape}");
    }
    auto dtype = ParseDType(t["dtype"].get<std::string>());
    if (!dtype)
      return InvalidArgument("tensor " + t["name"].get<std::string>() + ": unknown dtype");
    PlanTensor p{t["name"].get<std::string>(), *dtype, {}};
    for (const auto& d : t["shape"]) {
      if (!d.is_number_unsigned()) return InvalidArgument("tensor " + p.name + ": bad shape");
      p.shape.push_back(d.get<uint64_t>());
    }
    tensors.push_back(std::move(p));
  }
  return tensors;
}

}  // namespace

void PushServer::Impl::OnHello(Conn& c, const std::string& body) {
  auto refuse = [&](const std::string& why) REQUIRES(mu_) {
    SendLocked(c, Frame(Msg::kWelcome, Json({{"error", why}})));
    c.close_after_flush = true;
    events_.Add("receiver " + c.who + " refused: " + why);
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
  auto tensors = HelloTensors(j["tensors"]);
  if (!tensors.ok()) return refuse(tensors.status().message());
  if (j.contains("server")) {
    if (!j["server"].is_string() || j["server"].get<std::string>().empty() ||
        !j["server_size"].is_number_integer() || j["server_size"].get<int>() < 1 ||
        rank >= j["server_size"].get<int>()) {
      return refuse(
          "hello names a server without a name, a server_size of at least 1, or "
          "with rank " +
          std::to_string(rank) + " outside it");
    }
    c.info.server = j["server"].get<std::string>();
    c.info.server_size = j["server_size"].get<int>();
  }
  c.info.rank = rank;
  c.info.layout = layout;
  c.who = "rank " + std::to_string(rank) + " (" + c.who + ")";
  if (j.contains("version") && j["version"].is_number_unsigned()) {
    c.info.version = j["version"].get<uint64_t>();
  }
  c.tensors = std::move(tensors).value();
  if (j.contains("fp8") && !j["fp8"].is_null()) {
    auto fp8 = push_internal::ParseFp8Options(j["fp8"]);
    if (!fp8.ok()) return refuse(fp8.status().message());
    c.fp8 = std::move(fp8).value();
    c.fp8_key = push_internal::Fp8OptionsJson(*c.fp8).dump();
    c.info.fp8 = c.fp8;
  }
  nlohmann::json welcome = {{"latest", nullptr}, {"part", part_}, {"parts", parts_}};
  if (part_ == 0 && parts_ > 1) welcome["senders"] = senders_;
  if (const std::shared_ptr<const Version> latest = plans_.latest()) {
    auto plan = plans_.Plan(layout);
    if (!plan.ok()) return refuse(plan.status().message());
    Status match = MatchLocked(c, **plan,
                               "receiver " + LayoutText(layout, rank) + " against " +
                                   VersionName(latest->manifest.version));
    if (!match.ok()) return refuse(match.message());
    welcome["latest"] = latest->manifest.version;
    c.info.behind = c.info.version != latest->manifest.version;
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
      events_.Add("receiver " + c.who +
                  " waits for the push senders: part 0 does not know them yet");
      return;
    }
    return OnHello(c, m.body);
  }
  nlohmann::json j = nlohmann::json::parse(m.body, nullptr, false);
  std::optional<uint64_t> version;
  if (j.is_object() && j["version"].is_number_unsigned()) version = j["version"].get<uint64_t>();
  switch (m.type) {
    case Msg::kReceived:
      return OnReceived(c, version);
    case Msg::kApplied:
      return;
    case Msg::kHeld:
      return OnHeld(c, version);
    case Msg::kServer:
      return OnServer(c, j);
    case Msg::kError: {
      std::string why = j.is_object() && j["error"].is_string() ? j["error"].get<std::string>()
                                                                : "an error without a message";
      DropLocked(c, "it reported: " + why);
      cv_.SignalAll();
      return;
    }
    default:
      DropLocked(c, std::string("sent an unexpected ") + push_internal::MsgName(m.type));
      cv_.SignalAll();
  }
}

void PushServer::Impl::OnReceived(Conn& c, std::optional<uint64_t> version) {
  if (!version || c.awaiting != version) {
    return DropLocked(c, "confirmed a push it was not sent");
  }
  c.awaiting.reset();
  confirmed_.insert(c.info.id);
  c.info.version = version;
  c.info.behind = false;
  c.info.pushes++;
  cv_.SignalAll();
}

void PushServer::Impl::OnHeld(Conn& c, std::optional<uint64_t> version) {
  if (!version) return DropLocked(c, "sent a held message without a version");
  c.info.version = version;
  const std::shared_ptr<const Version> latest = plans_.latest();
  c.info.behind = latest && *version != latest->manifest.version;
  if (c.info.behind) {
    SendLocked(c, Frame(Msg::kBehind, Json({{"latest", latest->manifest.version}})));
  }
}

// A rank of a server reports what its ranks agreed on (ApplyAgreed).
void PushServer::Impl::OnServer(Conn& c, const nlohmann::json& j) {
  if (c.info.server.empty() || !j.is_object()) {
    return DropLocked(c, "sent a server report but named no server in its hello");
  }
  c.info.server_inconsistent = j.value("inconsistent", false);
  c.info.server_error = j["why"].is_string() ? j["why"].get<std::string>() : std::string();
  if (j["version"].is_number_unsigned()) {
    c.info.server_version = j["version"].get<uint64_t>();
  } else if (c.info.server_inconsistent) {
    c.info.server_version.reset();
    events_.Add("server " + c.info.server + " is inconsistent (" + c.who +
                "): " + c.info.server_error);
  }
}

}  // namespace dte
