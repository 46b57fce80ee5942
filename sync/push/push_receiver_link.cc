// The push receiver's links (sync/push/internal/push_receiver_impl.h): a
// thread per sender that connects (and reconnects), says hello, takes the
// welcome, and reads each part of a push whole.
#include <poll.h>
#include <sys/socket.h>

#include <cstdio>

#include "sync/push/internal/push_receiver_impl.h"
#include "sync/transport/auth_handshake.h"
#include "sync/transport/socket.h"

namespace dte {

using push_internal::Assembly;
using push_internal::Frame;
using push_internal::Link;
using push_internal::Msg;
using push_internal::Pending;
using transport_internal::Deadline;
using namespace std::chrono_literals;

using Clock = std::chrono::steady_clock;

void PushReceiver::Impl::Run(const std::shared_ptr<Link>& link) {
  auto wait = options_.reconnect;
  while (!stop_ && !link->retired) {
    Status s = Session(link);
    std::vector<std::shared_ptr<Link>> tell;
    std::string lost;
    {
      std::lock_guard lock(mu_);
      link->welcomed = false;
      if (!s.ok() && !stop_) error_ = s.message();
      // A server that fails the handshake is logged once per reason (it
      // is retried on every reconnect).
      if (!s.ok() && !stop_ && s.code() == Code::kPermissionDenied && s.message() != logged_) {
        logged_ = s.message();
        std::fprintf(stderr, "dte: push receiver rank %d: %s\n", options_.rank, logged_.c_str());
      }
      lost = "the link to the push server at " + link->address + " (part " +
             std::to_string(link->part) + ") ended" + (s.ok() ? "" : ": " + s.message());
      if (!link->retired) tell = LoseAssemblyLocked(*link, lost);
    }
    for (const auto& l : tell) Send(*l, Msg::kError, {{"error", lost}});
    {
      std::lock_guard lock(link->send_mu);
      link->fd = ScopedFd();
    }
    cv_.notify_all();
    {
      std::lock_guard lock(mu_);
      if (stop_ || !refused_.empty()) return;
    }
    const auto until = Clock::now() + wait;
    while (!stop_ && !link->retired && Clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    wait = std::min(wait * 2, options_.reconnect * 8);
  }
}

Status PushReceiver::Impl::Session(const std::shared_ptr<Link>& link) {
  const std::string who = "the push server at " + link->address;
  // Short deadlines to connect and authenticate: the receiver's destructor
  // waits for them. ConnectTcp adds the address itself.
  ASSIGN_OR_RETURN(
      ScopedFd fd,
      transport_internal::ConnectTcp(
          link->address, Deadline(std::min<std::chrono::milliseconds>(options_.timeout, 1000ms)),
          "the push server"));
  const int raw = fd.get();
  if (!options_.secret.empty()) {
    RETURN_IF_ERROR(auth_internal::ClientHandshake(
        raw, options_.secret, "push",
        Deadline(std::min<std::chrono::milliseconds>(options_.timeout, 2000ms)), who));
  }
  {
    std::lock_guard lock(link->send_mu);
    if (stop_ || link->retired) return Status::Ok();
    link->fd = std::move(fd);
  }
  SendHello(*link);
  for (;;) {
    // Between pushes, wait for the next frame as long as it takes.
    for (;;) {
      if (stop_ || link->retired) return Status::Ok();
      pollfd p{raw, POLLIN, 0};
      const int n = poll(&p, 1, 100);
      if (n > 0) break;
    }
    ASSIGN_OR_RETURN(auto m, push_internal::RecvFrame(raw, push_internal::kMaxControlBytes,
                                                      Deadline(options_.timeout), who));
    if (m.type == Msg::kCounts || m.type == Msg::kCountsFp8) {
      RETURN_IF_ERROR(OnPush(*link, raw, m, who));
      continue;
    }
    nlohmann::json j = nlohmann::json::parse(m.body, nullptr, false);
    if (m.type == Msg::kWelcome) {
      RETURN_IF_ERROR(OnWelcome(*link, j, who));
    } else if (m.type == Msg::kBehind) {
      if (!j.is_object() || !j["latest"].is_number_unsigned()) {
        return Corruption(who + " sent a behind message without a version");
      }
      std::lock_guard lock(mu_);
      behind_ = j["latest"].get<uint64_t>();
      cv_.notify_all();
    } else {
      return Corruption(who + " sent an unexpected " + push_internal::MsgName(m.type));
    }
  }
}

void PushReceiver::Impl::SendHello(Link& link) {
  nlohmann::json hello = {{"rank", options_.rank},
                          {"tp", options_.layout.tp},
                          {"fuse_qkv", options_.layout.fuse_qkv},
                          {"fuse_gate_up", options_.layout.fuse_gate_up}};
  if (!options_.server.empty()) {
    hello["server"] = options_.server;
    hello["server_size"] = options_.server_size;
  }
  {
    std::lock_guard lock(mu_);
    // The version the server may push onto: the last one queued, else held.
    std::optional<uint64_t> v = pending_.empty() ? held_ : pending_.back().version;
    if (inconsistent_) v.reset();
    hello["version"] = v ? nlohmann::json(*v) : nlohmann::json(nullptr);
    expected_parent_ = v;
    link.hello_version = v;
  }
  nlohmann::json tensors = nlohmann::json::array();
  for (const PushTensor& t : options_.tensors) {
    tensors.push_back({{"name", t.name}, {"dtype", DTypeName(t.dtype)}, {"shape", t.shape}});
  }
  hello["tensors"] = std::move(tensors);
  if (options_.fp8) {
    hello["fp8"] = push_internal::Fp8OptionsJson(*options_.fp8);
    hello["wire"] = 2;  // takes kCountsFp8
  }
  Send(link, Msg::kHello, hello);
}

// A push's counts arrived: its data frames follow (a batch of tensors at a
// time) up to the end mark; then the part is checked and kept.
Status PushReceiver::Impl::OnPush(Link& link, int fd, const push_internal::Parsed& m,
                                  const std::string& who) {
  ASSIGN_OR_RETURN(auto counts, push_internal::DecodeCounts(m.type, m.body, who));
  std::string data;
  for (;;) {
    ASSIGN_OR_RETURN(
        auto f, push_internal::RecvFrame(fd, UINT64_MAX >> 8, Deadline(options_.timeout), who));
    if (f.type == Msg::kDataEnd) break;
    if (f.type != Msg::kData) {
      return Corruption(who + " sent a " + push_internal::MsgName(f.type) +
                        " inside the data of a push");
    }
    if (data.empty()) {
      data = std::move(f.body);
    } else {
      data += f.body;
    }
  }
  auto checked = Check(counts, data);
  Status bad = checked.ok() ? OnPart(link, counts, std::move(checked).value()) : checked.status();
  if (!bad.ok()) Send(link, Msg::kError, {{"error", bad.message()}});
  return bad;
}

Status PushReceiver::Impl::OnWelcome(Link& link, nlohmann::json& j, const std::string& who) {
  if (j.is_object() && j["error"].is_string()) {
    std::lock_guard lock(mu_);
    refused_ = "the push server refused this receiver: " + j["error"].get<std::string>();
    return InvalidArgument(refused_);
  }
  std::unique_lock lock(mu_);
  RETURN_IF_ERROR(CheckWelcomePartLocked(link, j, who));
  link.welcomed = true;
  if (ConnectedLocked()) error_.clear();
  if (j.is_object() && j["latest"].is_number_unsigned()) {
    const uint64_t latest = j["latest"].get<uint64_t>();
    if (expected_parent_ != latest) behind_ = latest;
  }
  // A catch-up between the hello and this welcome: tell this sender too.
  const std::optional<uint64_t> now = inconsistent_      ? std::nullopt
                                      : pending_.empty() ? held_
                                                         : pending_.back().version;
  const bool tell = now.has_value() && now != link.hello_version;
  const uint64_t held = now.value_or(0);
  const std::optional<nlohmann::json> server = ServerReportLocked();
  lock.unlock();
  if (tell) Send(link, Msg::kHeld, {{"version", held}});
  if (server) Send(link, Msg::kServer, *server);
  cv_.notify_all();
  return Status::Ok();
}

// The welcome's part and parts fit this link: part 0's names every sender
// (and makes them this receiver's), another's matches what part 0 said.
Status PushReceiver::Impl::CheckWelcomePartLocked(Link& link, nlohmann::json& j,
                                                  const std::string& who) {
  const int part = j.is_object() && j["part"].is_number_integer() ? j["part"].get<int>() : 0;
  const int parts = j.is_object() && j["parts"].is_number_integer() ? j["parts"].get<int>() : 1;
  if (link.part != 0) {
    if (part == link.part && static_cast<size_t>(parts) == parts_) return Status::Ok();
    return Corruption(who + " says it sends part " + std::to_string(part) + " of " +
                      std::to_string(parts) + ", but part 0 named it part " +
                      std::to_string(link.part) + " of " + std::to_string(parts_));
  }
  std::vector<std::string> senders;
  if (parts > 1) {
    if (!j["senders"].is_array() || j["senders"].size() != static_cast<size_t>(parts)) {
      return Corruption(who + " sends part 0 of " + std::to_string(parts) +
                        " but did not name every sender");
    }
    for (const auto& a : j["senders"]) {
      if (!a.is_string()) return Corruption(who + " named a sender that is not HOST:PORT");
      senders.push_back(a.get<std::string>());
    }
  }
  if (part != 0) return Corruption(who + " says it sends part " + std::to_string(part));
  SetSendersLocked(senders);
  return Status::Ok();
}

void PushReceiver::Impl::SetSendersLocked(const std::vector<std::string>& senders) {
  if (senders == senders_ && links_.size() == std::max<size_t>(1, senders.size())) return;
  // Another group of senders (the trainer restarted): drop the old links.
  for (size_t p = 1; p < links_.size(); ++p) {
    links_[p]->retired = true;
    {
      std::lock_guard lock(links_[p]->send_mu);
      if (links_[p]->fd.get() >= 0) shutdown(links_[p]->fd.get(), SHUT_RDWR);
    }
    retired_.push_back(links_[p]);
  }
  links_.resize(1);
  assembly_.reset();
  senders_ = senders;
  parts_ = std::max<size_t>(1, senders.size());
  if (stop_) return;
  for (size_t p = 1; p < senders.size(); ++p) {
    auto l = std::make_shared<Link>();
    l->part = static_cast<int>(p);
    l->address = senders[p];
    links_.push_back(l);
    l->thread = std::thread([this, l] { Run(l); });
  }
}

void PushReceiver::Impl::Send(Link& l, Msg type, const nlohmann::json& j) {
  std::lock_guard lock(l.send_mu);
  if (l.fd.get() < 0) return;
  const std::string f = Frame(type, j.dump());
  Status s = transport_internal::SendAll(l.fd.get(), f.data(), f.size(), Deadline(options_.timeout),
                                         "the push server at " + l.address);
  if (!s.ok()) shutdown(l.fd.get(), SHUT_RDWR);
}

// To every sender welcomed.
void PushReceiver::Impl::SendAll(Msg type, const nlohmann::json& j) {
  std::vector<std::shared_ptr<Link>> links;
  {
    std::lock_guard lock(mu_);
    for (const auto& l : links_) {
      if (l->welcomed) links.push_back(l);
    }
  }
  for (const auto& l : links) Send(*l, type, j);
}

// Forgets a version whose parts are not all in (a sender's link failed,
// or a part was refused): it can never be confirmed, so every other
// sender is told (and drops this receiver, which reconnects and catches
// up). Returns the links to tell; mu_ held.
std::vector<std::shared_ptr<Link>> PushReceiver::Impl::LoseAssemblyLocked(const Link& failed,
                                                                          const std::string& why) {
  std::vector<std::shared_ptr<Link>> tell;
  if (!assembly_) return tell;
  error_ = "lost the push of " + VersionName(assembly_->version) + ": " + why;
  assembly_.reset();
  for (const auto& l : links_) {
    if (l.get() != &failed && l->welcomed) tell.push_back(l);
  }
  return tell;
}

}  // namespace dte
