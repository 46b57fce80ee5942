// The push receiver of sync/push/push_server.h: a thread per sender (the server at the
// receiver's address, and the other parts' servers its welcome names) that
// connects (and reconnects), reads each part of a push whole and checks it
// against the receiver's tensors; once every part of a version is in, the
// version is queued and confirmed to every sender. Applying writes the
// queued pushes into the tensors in version order, on the caller's thread
// (or a link's, with auto_apply). A catch-up copies a version from the
// store through the same transfer plan the server uses.
#include "sync/push/push_receiver.h"

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>

#include "kernels/cuda.h"
#include "kernels/parallel.h"
#include "kernels/remap.h"
#include "kernels/remap_cuda.h"
#include "store/materialize.h"
#include "store/store.h"
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
using namespace std::chrono_literals;

// One push, checked and decoded: per segment (an op has one or more) the
// own tensor and its entries.
struct Pending {
  uint64_t version = 0, parent = 0;
  struct Segment {
    uint32_t tensor;
    size_t op;  // which op of the push it belongs to
    push_internal::OpEntries entries;
  };
  std::vector<Segment> segments;
  uint64_t elements = 0;
};

// The connection to one sender (part `part` of each push).
struct Link {
  int part = 0;
  std::string address;
  std::mutex send_mu;  // fd writes and replacement
  ScopedFd fd;
  bool welcomed = false;                  // guarded by the receiver's mu_
  std::optional<uint64_t> hello_version;  // what its hello said is held; mu_
  std::atomic<bool> retired{false};
  std::thread thread;
};

// The parts of one version received so far.
struct Assembly {
  uint64_t version = 0, parent = 0;
  std::vector<std::optional<Pending>> parts;
};

}  // namespace

class PushReceiver::Impl {
 public:
  explicit Impl(PushReceiverOptions o) : options_(std::move(o)) {
    for (const PushTensor& t : options_.tensors) {
      numel_.push_back(ShapeElements(t.shape));
      plan_tensors_.push_back({t.name, t.dtype, t.shape});
    }
    held_ = options_.version;
    expected_parent_ = options_.version;
  }
  ~Impl() {
    stop_ = true;
    std::vector<std::shared_ptr<Link>> all;
    {
      std::lock_guard lock(mu_);
      all = links_;
      all.insert(all.end(), retired_.begin(), retired_.end());
    }
    for (auto& l : all) {
      std::lock_guard lock(l->send_mu);
      if (l->fd.get() >= 0) shutdown(l->fd.get(), SHUT_RDWR);
    }
    // Links are added only by link threads, which see stop_ and add none.
    for (;;) {
      std::shared_ptr<Link> next;
      {
        std::lock_guard lock(mu_);
        for (auto& l : links_) {
          if (l->thread.joinable()) next = l;
        }
        for (auto& l : retired_) {
          if (l->thread.joinable()) next = l;
        }
      }
      if (!next) break;
      next->thread.join();
    }
  }

  void Start() {
    auto primary = std::make_shared<Link>();
    primary->address = options_.address;
    std::lock_guard lock(mu_);
    links_.push_back(primary);
    primary->thread = std::thread([this, primary] { Run(primary); });
  }

  Result<uint64_t> ApplyPending() {
    std::lock_guard apply(apply_mu_);
    return ApplyPendingLocked();
  }

  Status WaitFor(uint64_t version, std::chrono::milliseconds timeout) {
    const auto deadline = Clock::now() + timeout;
    for (;;) {
      {
        std::lock_guard apply(apply_mu_);
        RETURN_IF_ERROR(ApplyPendingLocked().status());
      }
      std::unique_lock lock(mu_);
      if (held_ && *held_ >= version) return Status::Ok();
      if (!refused_.empty()) return InvalidArgument(refused_);
      if (inconsistent_) {
        return Corruption("receiver is inconsistent after a failed catch-up: catch up again");
      }
      if (behind_ && pending_.empty() && (!held_ || *held_ < *behind_)) {
        return NotFound("receiver holds " + HeldText() + " and missed pushes; the trainer is at " +
                        VersionName(*behind_) + ": catch up from the store");
      }
      if (Clock::now() >= deadline) {
        return IOError("timed out after " + std::to_string(timeout.count()) + " ms waiting for " +
                       VersionName(version) + " (holding " + HeldText() +
                       (ConnectedLocked() ? ")" : ", not connected: " + error_ + ")"));
      }
      cv_.wait_until(lock, deadline);
    }
  }

  Status CatchUp(Store& store, std::optional<uint64_t> version);
  Status FillFromStore(Store& store, const std::shared_ptr<const Version>& v,
                       const TransferPlan& plan, const std::vector<uint32_t>& own,
                       const std::string& what);
  static Status ReadCanonical(Materializer& reader, const std::shared_ptr<const Version>& v,
                              const std::string& name, std::vector<uint8_t>* buf,
                              const std::string& what);

  PushReceiverStatus GetStatus() const {
    std::lock_guard lock(mu_);
    PushReceiverStatus s;
    s.version = inconsistent_ ? std::nullopt : held_;
    s.inconsistent = inconsistent_;
    s.connected = ConnectedLocked();
    s.behind = behind_;
    s.pending = pending_.size();
    s.pushes = pushes_;
    s.elements = elements_;
    s.error = !refused_.empty() ? refused_ : error_;
    return s;
  }

 private:
  // Every sender's link is up and welcomed.
  bool ConnectedLocked() const {
    if (links_.size() != parts_) return false;
    for (const auto& l : links_) {
      if (!l->welcomed) return false;
    }
    return true;
  }

  std::string HeldText() const {
    if (inconsistent_) return "an inconsistent state";
    return held_ ? VersionName(*held_) : "an unknown version";
  }

  // Writes every queued push in order; apply_mu_ held.
  Result<uint64_t> ApplyPendingLocked() {
    uint64_t n = 0;
    for (;;) {
      Pending p;
      {
        std::lock_guard lock(mu_);
        if (pending_.empty()) break;
        p = std::move(pending_.front());
        pending_.pop_front();
        // Parents were checked when queued; only a catch-up in between can
        // leave a push that does not fit. The server learns the truth at the
        // next push (refused) and the reconnect's hello.
        if (inconsistent_ || !held_ || *held_ != p.parent) {
          error_ = "dropped the push of " + VersionName(p.version) + " onto " +
                   VersionName(p.parent) + ": this receiver holds " + HeldText();
          continue;
        }
      }
      // Segments write disjoint elements (the plan ships each element once).
      kernels::ParallelFor(p.segments.size(), 1, [&](size_t lo, size_t hi) {
        for (size_t i = lo; i < hi; ++i) {
          const PushTensor& t = options_.tensors[p.segments[i].tensor];
          if (t.device < 0) {
            push_internal::ApplyOpEntries(p.segments[i].entries, DTypeWidth(t.dtype), t.data);
          }
        }
      });
      // Device tensors: each segment's entries copied over and applied there.
      for (const Pending::Segment& seg : p.segments) {
        const PushTensor& t = options_.tensors[seg.tensor];
        if (t.device < 0) continue;
        Status s = ApplyOnDevice(seg.entries, t, numel_[seg.tensor]);
        if (!s.ok()) {
          std::lock_guard lock(mu_);
          inconsistent_ = true;
          error_ = s.message();
          return s;
        }
      }
      {
        std::lock_guard lock(mu_);
        held_ = p.version;
        pushes_++;
        elements_ += p.elements;
        if (behind_ && *behind_ <= p.version) behind_.reset();
      }
      SendAll(Msg::kApplied, {{"version", p.version}});
      cv_.notify_all();
      ++n;
    }
    return n;
  }

  static Status FromCuda(const kernels::CudaStatus& s, const std::string& what) {
    return s.ok() ? Status::Ok() : IOError(what + ": " + s.message);
  }

  // Writes one segment's entries into a tensor in device memory: indices,
  // values and set flags copied over, then the remap-and-apply kernel with
  // an identity plan over the whole tensor.
  static Status ApplyOnDevice(const push_internal::OpEntries& e, const PushTensor& t,
                              uint64_t numel) {
    const std::string what = "push into tensor " + t.name + " on cuda:" + std::to_string(t.device);
    kernels::RemapPlan plan;
    const std::string bad = kernels::MakeRemapPlan({{numel}, {0}, {numel}, {numel}, {0}}, &plan);
    if (!bad.empty()) return Internal(what + ": " + bad);
    RETURN_IF_ERROR(FromCuda(kernels::CudaSetDevice(t.device), what));
    kernels::CudaBuffer d_idx, d_vals, d_sets;
    RETURN_IF_ERROR(FromCuda(d_idx.Allocate(e.idx.size() * 8), what));
    RETURN_IF_ERROR(FromCuda(d_vals.Allocate(e.vals.size()), what));
    RETURN_IF_ERROR(FromCuda(d_sets.Allocate(e.sets.size()), what));
    RETURN_IF_ERROR(
        FromCuda(kernels::CudaCopyToDevice(d_idx.data(), e.idx.data(), e.idx.size() * 8), what));
    RETURN_IF_ERROR(
        FromCuda(kernels::CudaCopyToDevice(d_vals.data(), e.vals.data(), e.vals.size()), what));
    RETURN_IF_ERROR(
        FromCuda(kernels::CudaCopyToDevice(d_sets.data(), e.sets.data(), e.sets.size()), what));
    RETURN_IF_ERROR(
        FromCuda(kernels::CudaRemapApply(
                     plan, static_cast<const uint64_t*>(d_idx.data()), d_vals.data(),
                     e.sets.empty() ? nullptr : static_cast<const uint8_t*>(d_sets.data()),
                     /*all_whole=*/false, e.idx.size(), DTypeWidth(t.dtype), t.data, nullptr),
                 what));
    return FromCuda(kernels::CudaStreamSynchronize(nullptr), what);
  }

  void Send(Link& l, Msg type, const nlohmann::json& j) {
    std::lock_guard lock(l.send_mu);
    if (l.fd.get() < 0) return;
    const std::string f = Frame(type, j.dump());
    Status s =
        transport_internal::SendAll(l.fd.get(), f.data(), f.size(), Deadline(options_.timeout),
                                    "the push server at " + l.address);
    if (!s.ok()) shutdown(l.fd.get(), SHUT_RDWR);
  }
  // To every sender welcomed.
  void SendAll(Msg type, const nlohmann::json& j) {
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
  std::vector<std::shared_ptr<Link>> LoseAssemblyLocked(const Link& failed,
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

  // Checks and decodes a push against the tensors; Corruption naming what
  // is wrong. Nothing is written here.
  Result<Pending> Check(const push_internal::CountsMsg& c, const std::string& data) {
    Pending p;
    p.version = c.version;
    p.parent = c.parent;
    const std::string what = "push of " + VersionName(c.version);
    std::string_view in(data);
    std::vector<push_internal::SegmentBytes> bytes;
    for (size_t k = 0; k < c.count.size(); ++k) {
      if (c.tensor[k] >= options_.tensors.size()) {
        return Corruption(what + ": op " + std::to_string(c.op[k]) + " names tensor " +
                          std::to_string(c.tensor[k]) + " of " +
                          std::to_string(options_.tensors.size()));
      }
      const PushTensor& t = options_.tensors[c.tensor[k]];
      if (c.count[k] > numel_[c.tensor[k]]) {
        return Corruption(what + ": " + std::to_string(c.count[k]) + " elements for tensor " +
                          t.name + " of " + std::to_string(numel_[c.tensor[k]]));
      }
      const size_t first = bytes.size();
      RETURN_IF_ERROR(
          push_internal::SplitOpSegments(&in, c.count[k], what + ", tensor " + t.name, &bytes));
      for (size_t i = first; i < bytes.size(); ++i) {
        p.segments.push_back({c.tensor[k], c.op[k], {}});
      }
      p.elements += c.count[k];
    }
    if (!in.empty()) {
      return Corruption(what + ": " + std::to_string(in.size()) + " bytes after the last op");
    }
    // Decode the segments in parallel; the first error (in order) is reported.
    std::vector<Status> errors(p.segments.size());
    kernels::ParallelFor(p.segments.size(), 1, [&](size_t lo, size_t hi) {
      for (size_t i = lo; i < hi; ++i) {
        Pending::Segment& seg = p.segments[i];
        const PushTensor& t = options_.tensors[seg.tensor];
        std::string_view b = bytes[i].bytes;
        errors[i] = push_internal::ReadOpSegments(&b, bytes[i].count, numel_[seg.tensor],
                                                  DTypeWidth(t.dtype), what + ", tensor " + t.name,
                                                  &seg.entries);
      }
    });
    for (const Status& e : errors) RETURN_IF_ERROR(e);
    // Within an op, segments must follow each other: no element twice.
    for (size_t i = 1; i < p.segments.size(); ++i) {
      const Pending::Segment &a = p.segments[i - 1], &b = p.segments[i];
      if (a.op == b.op && b.entries.idx.front() <= a.entries.idx.back()) {
        return Corruption(what + ", tensor " + options_.tensors[b.tensor].name +
                          ": segments overlap or are out of order");
      }
    }
    return p;
  }

  // One link's connection: hello, then pushes until it fails or stops.
  Status Session(const std::shared_ptr<Link>& link);
  void SendHello(Link& link);
  Status OnPush(Link& link, int fd, const std::string& body, const std::string& who);
  Status OnWelcome(Link& link, nlohmann::json& j, const std::string& who);
  Status CheckWelcomePartLocked(Link& link, nlohmann::json& j, const std::string& who);
  // A part of a push arrived on `link`, checked: queue the version once
  // every part is in. Corruption when it does not fit.
  Status OnPart(Link& link, const push_internal::CountsMsg& counts, Pending part);
  Result<Pending> JoinPartsLocked();
  // The primary's welcome named these senders: links to the others.
  void SetSendersLocked(const std::vector<std::string>& senders);

  void Run(const std::shared_ptr<Link>& link) {
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

  PushReceiverOptions options_;
  std::vector<uint64_t> numel_;
  std::vector<PlanTensor> plan_tensors_;
  std::thread thread_;
  std::atomic<bool> stop_{false};

  std::mutex apply_mu_;  // tensor writes
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::optional<uint64_t> held_;             // what the tensors hold
  std::optional<uint64_t> expected_parent_;  // the last version queued or held
  std::deque<Pending> pending_;
  std::optional<uint64_t> behind_;
  bool inconsistent_ = false;
  std::string error_, refused_;
  std::string logged_;  // the last authentication failure logged
  // links_[p] receives part p of each push; links_[0] is options_.address.
  std::vector<std::shared_ptr<Link>> links_;
  std::vector<std::shared_ptr<Link>> retired_;  // links to senders no longer named
  size_t parts_ = 1;                            // senders of each push
  std::vector<std::string> senders_;            // as part 0's welcome named them
  std::optional<Assembly> assembly_;
  uint64_t pushes_ = 0, elements_ = 0;
};

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
    if (m.type == Msg::kCounts) {
      RETURN_IF_ERROR(OnPush(*link, raw, m.body, who));
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
  Send(link, Msg::kHello, hello);
}

// A push's counts arrived: its data frames follow (a batch of tensors at a
// time) up to the end mark; then the part is checked and kept.
Status PushReceiver::Impl::OnPush(Link& link, int fd, const std::string& body,
                                  const std::string& who) {
  ASSIGN_OR_RETURN(auto counts, push_internal::DecodeCounts(body, who));
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
  lock.unlock();
  if (tell) Send(link, Msg::kHeld, {{"version", held}});
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

Status PushReceiver::Impl::OnPart(Link& link, const push_internal::CountsMsg& counts,
                                  Pending part) {
  const std::string what =
      "part " + std::to_string(counts.part) + " of the push of " + VersionName(counts.version);
  bool complete = false;
  {
    std::lock_guard lock(mu_);
    if (counts.part != static_cast<uint32_t>(link.part) || counts.parts != parts_) {
      return Corruption(what + " came as part " + std::to_string(counts.part) + " of " +
                        std::to_string(counts.parts) + " from the sender of part " +
                        std::to_string(link.part) + " of " + std::to_string(parts_));
    }
    if (expected_parent_ != counts.parent) {
      return Corruption("push of " + VersionName(counts.version) + " onto " +
                        VersionName(counts.parent) + ", but this receiver's last version is " +
                        (expected_parent_ ? VersionName(*expected_parent_) : "unknown"));
    }
    if (assembly_ && (assembly_->version != counts.version || assembly_->parent != counts.parent ||
                      assembly_->parts[counts.part])) {
      return Corruption(what + " arrived while the parts of " + VersionName(assembly_->version) +
                        " were coming in");
    }
    if (!assembly_) {
      assembly_ = Assembly{counts.version, counts.parent, {}};
      assembly_->parts.resize(parts_);
    }
    assembly_->parts[counts.part] = std::move(part);
    complete = std::all_of(assembly_->parts.begin(), assembly_->parts.end(),
                           [](const std::optional<Pending>& x) { return x.has_value(); });
    if (complete) {
      auto whole = JoinPartsLocked();
      assembly_.reset();
      if (!whole.ok()) return whole.status();
      pending_.push_back(std::move(whole).value());
      expected_parent_ = counts.version;
    }
  }
  if (!complete) return Status::Ok();
  SendAll(Msg::kReceived, {{"version", counts.version}});
  cv_.notify_all();
  if (options_.auto_apply) {
    std::lock_guard apply(apply_mu_);
    RETURN_IF_ERROR(ApplyPendingLocked().status());
  }
  return Status::Ok();
}

// One version from the assembly's parts: each op comes from one part (a
// tensor has one owner).
Result<Pending> PushReceiver::Impl::JoinPartsLocked() {
  Pending whole = std::move(*assembly_->parts[0]);
  std::set<size_t> ops;
  for (const auto& seg : whole.segments) ops.insert(seg.op);
  for (size_t p = 1; p < assembly_->parts.size(); ++p) {
    Pending& x = *assembly_->parts[p];
    std::set<size_t> mine;
    for (auto& seg : x.segments) {
      if (ops.count(seg.op)) {
        return Corruption("push of " + VersionName(assembly_->version) + ": parts 0-" +
                          std::to_string(p - 1) + " and part " + std::to_string(p) +
                          " both send elements of tensor " + options_.tensors[seg.tensor].name);
      }
      mine.insert(seg.op);
      whole.segments.push_back(std::move(seg));
    }
    ops.insert(mine.begin(), mine.end());
    whole.elements += x.elements;
  }
  return whole;
}

Status PushReceiver::Impl::CatchUp(Store& store, std::optional<uint64_t> version) {
  std::lock_guard apply(apply_mu_);
  {
    std::lock_guard lock(mu_);
    if (!version) version = behind_;
    if (!version) {
      return InvalidArgument("catch-up: no version given and the server has not said one");
    }
  }
  ASSIGN_OR_RETURN(auto v, store.GetVersion(*version));
  ASSIGN_OR_RETURN(PlanInputs in, PlanInputsOf(store, *v));
  ASSIGN_OR_RETURN(
      TransferPlan plan,
      MakeTransferPlan(in.canonical, in.geometry, ShardLayout{1, false, false}, options_.layout));
  const std::string what = "catch-up to " + VersionName(*version) + " of receiver " +
                           LayoutText(options_.layout, options_.rank);
  ASSIGN_OR_RETURN(auto own,
                   push_internal::MatchReceiverTensors(plan, options_.rank, plan_tensors_, what));
  {
    std::lock_guard lock(mu_);
    inconsistent_ = true;
  }
  RETURN_IF_ERROR(FillFromStore(store, v, plan, own, what));
  {
    std::lock_guard lock(mu_);
    inconsistent_ = false;
    held_ = *version;
    // Pushes queued onto older versions are stale now; newer ones apply on top.
    while (!pending_.empty() && pending_.front().version <= *version) pending_.pop_front();
    if (pending_.empty()) expected_parent_ = *version;
    if (behind_ && *behind_ <= *version) behind_.reset();
  }
  SendAll(Msg::kHeld, {{"version", *version}});
  cv_.notify_all();
  return Status::Ok();
}

// One receiver tensor at a time (a host copy of it when it lives on a
// device), filled from the canonical tensors its ops read: memory is one
// receiver tensor and one canonical tensor.
Status PushReceiver::Impl::FillFromStore(Store& store, const std::shared_ptr<const Version>& v,
                                         const TransferPlan& plan, const std::vector<uint32_t>& own,
                                         const std::string& what) {
  Materializer reader(&store);
  std::vector<uint8_t> buf, mirror;
  std::optional<uint32_t> in_buf;
  for (uint32_t rt = 0; rt < plan.receiver_tensors[options_.rank].size(); ++rt) {
    const PushTensor& t = options_.tensors[own[rt]];
    const size_t bytes = numel_[own[rt]] * DTypeWidth(t.dtype);
    void* dst = t.data;
    if (t.device >= 0) {
      mirror.resize(bytes);
      RETURN_IF_ERROR(FromCuda(kernels::CudaSetDevice(t.device), what));
      RETURN_IF_ERROR(FromCuda(kernels::CudaCopyToHost(mirror.data(), t.data, bytes), what));
      dst = mirror.data();
    }
    for (const TransferOp& op : plan.ops) {
      if (op.receiver != options_.rank || op.receiver_tensor != rt) continue;
      if (in_buf != op.canonical) {
        RETURN_IF_ERROR(ReadCanonical(reader, v, plan.canonical[op.canonical].name, &buf, what));
        in_buf = op.canonical;
      }
      push_internal::CopyOpBox(plan, op, buf.data(), dst);
    }
    if (t.device >= 0) {
      RETURN_IF_ERROR(FromCuda(kernels::CudaCopyToDevice(t.data, mirror.data(), bytes), what));
    }
  }
  return Status::Ok();
}

// Canonical tensor `name` of v, whole.
Status PushReceiver::Impl::ReadCanonical(Materializer& reader,
                                         const std::shared_ptr<const Version>& v,
                                         const std::string& name, std::vector<uint8_t>* buf,
                                         const std::string& what) {
  auto at = v->manifest.FindTensor(name);
  if (!at) return Internal(what + ": tensor " + name + " of the plan is not in the version");
  const FileEntry& file = *at->file;
  const TensorEntry& tensor = *at->tensor;
  buf->resize(tensor.bytes());
  return reader.ReadFile(v, file, file.header_size + tensor.begin, tensor.bytes(), buf->data())
      .WithContext(what);
}

PushReceiver::PushReceiver(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
PushReceiver::~PushReceiver() = default;

Result<std::unique_ptr<PushReceiver>> PushReceiver::Open(const PushReceiverOptions& options) {
  if (options.layout.tp < 1 || options.rank < 0 || options.rank >= options.layout.tp) {
    return InvalidArgument("push receiver: rank " + std::to_string(options.rank) + " of tp " +
                           std::to_string(options.layout.tp));
  }
  std::string host;
  int port = 0;
  RETURN_IF_ERROR(transport_internal::SplitHostPort(options.address, &host, &port));
  for (const PushTensor& t : options.tensors) {
    if (t.data == nullptr && ShapeElements(t.shape) > 0) {
      return InvalidArgument("push receiver: tensor " + t.name + " has no memory");
    }
    if (t.device >= 0 && !kernels::CudaDeviceAvailable()) {
      return InvalidArgument("push receiver: tensor " + t.name +
                             " is on cuda:" + std::to_string(t.device) +
                             ", but this process has no CUDA device (or dte was built without "
                             "CUDA)");
    }
  }
  PushReceiverOptions resolved = options;
  ASSIGN_OR_RETURN(std::optional<JobSecret> secret, FindJobSecret(options.secret, ""));
  resolved.secret = secret ? std::move(secret->key) : "";
  auto impl = std::make_unique<Impl>(std::move(resolved));
  impl->Start();
  return std::unique_ptr<PushReceiver>(new PushReceiver(std::move(impl)));
}

Result<uint64_t> PushReceiver::ApplyPending() { return impl_->ApplyPending(); }

Status PushReceiver::WaitFor(uint64_t version, std::chrono::milliseconds timeout) {
  return impl_->WaitFor(version, timeout);
}

Status PushReceiver::CatchUp(Store& store, std::optional<uint64_t> version) {
  return impl_->CatchUp(store, version);
}

PushReceiverStatus PushReceiver::GetStatus() const { return impl_->GetStatus(); }

}  // namespace dte
