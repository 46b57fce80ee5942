// The push receiver of sync/push/push_receiver.h: a thread per sender (the
// server at the receiver's address, and the other parts' servers its
// welcome names) that connects (and reconnects), reads each part of a push
// whole and checks it against the receiver's tensors; once every part of a
// version is in, the version is queued and confirmed to every sender.
// Applying writes the queued pushes into the tensors in version order, on
// the caller's thread (or a link's, with auto_apply). A catch-up copies a
// version from the store through the same transfer plan the server uses.
// This file: setup, waiting, status and the catch-up; the links are in
// push_receiver_link.cc, checking and applying in push_receiver_apply.cc.
#include "sync/push/push_receiver.h"

#include <sys/socket.h>

#include <algorithm>

#include "store/store.h"
#include "sync/push/internal/push_catchup.h"
#include "sync/push/internal/push_plan.h"
#include "sync/push/internal/push_receiver_impl.h"
#include "sync/transfer/plan_inputs.h"
#include "sync/transport/job_secret.h"
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

PushReceiver::Impl::Impl(PushReceiverOptions o) : options_(std::move(o)) {
  for (const PushTensor& t : options_.tensors) {
    numel_.push_back(ShapeElements(t.shape));
    plan_tensors_.push_back({t.name, t.dtype, t.shape});
  }
  kinds_ = push_internal::TensorKinds(plan_tensors_, options_.fp8.has_value());
  held_ = options_.version;
  expected_parent_ = options_.version;
}

PushReceiver::Impl::~Impl() {
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

void PushReceiver::Impl::Start() {
  auto primary = std::make_shared<Link>();
  primary->address = options_.address;
  std::lock_guard lock(mu_);
  links_.push_back(primary);
  primary->thread = std::thread([this, primary] { Run(primary); });
}

Status PushReceiver::Impl::WaitFor(uint64_t version, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    if (!InServer()) {
      std::lock_guard apply(apply_mu_);
      RETURN_IF_ERROR(ApplyPendingLocked().status());
    }
    std::unique_lock lock(mu_);
    if (!InServer() && held_ && *held_ >= version) return Status::Ok();
    if (InServer()) {
      const std::vector<uint64_t> path = PathLocked();
      if (std::find(path.begin(), path.end(), version) != path.end()) return Status::Ok();
    }
    if (!refused_.empty()) return InvalidArgument(refused_);
    if (inconsistent_) {
      return Corruption("receiver is inconsistent after a failed catch-up: catch up again");
    }
    if (behind_ && pending_.empty() && (!held_ || *held_ < *behind_)) {
      return FailedPrecondition("receiver holds " + HeldText() +
                                " and missed pushes; the trainer is at " + VersionName(*behind_) +
                                ": catch up from the store");
    }
    if (Clock::now() >= deadline) {
      return DeadlineExceeded("timed out after " + std::to_string(timeout.count()) +
                              " ms waiting for " + VersionName(version) + " (holding " +
                              HeldText() +
                              (ConnectedLocked() ? ")" : ", not connected: " + error_ + ")"));
    }
    cv_.wait_until(lock, deadline);
  }
}

PushReceiverStatus PushReceiver::Impl::GetStatus() const {
  std::lock_guard lock(mu_);
  PushReceiverStatus s;
  s.version = inconsistent_ ? std::nullopt : held_;
  s.inconsistent = inconsistent_;
  s.connected = ConnectedLocked();
  s.behind = behind_;
  s.pending = pending_.size();
  s.pushes = pushes_;
  s.elements = elements_;
  s.bytes = bytes_;
  s.error = !refused_.empty() ? refused_ : error_;
  s.server_version = server_version_;
  s.server_inconsistent = server_inconsistent_;
  s.server_error = server_error_;
  s.staged_bytes = staged_bytes_;
  return s;
}

std::vector<uint64_t> PushReceiver::Impl::Path() const {
  std::lock_guard lock(mu_);
  return PathLocked();
}

std::vector<uint64_t> PushReceiver::Impl::PathLocked() const {
  std::vector<uint64_t> path;
  if (inconsistent_ || !held_) return path;
  path.push_back(*held_);
  for (const Pending& p : pending_) {
    if (p.parent != path.back()) break;  // a stale push: ApplyPending drops it
    path.push_back(p.version);
  }
  return path;
}

std::optional<uint64_t> AgreedVersion(const std::vector<std::vector<uint64_t>>& paths) {
  if (paths.empty()) return std::nullopt;
  for (auto v = paths[0].rbegin(); v != paths[0].rend(); ++v) {
    bool everywhere = true;
    for (size_t r = 1; r < paths.size() && everywhere; ++r) {
      everywhere = std::find(paths[r].begin(), paths[r].end(), *v) != paths[r].end();
    }
    if (everywhere) return *v;
  }
  return std::nullopt;
}

Result<uint64_t> PushReceiver::Impl::ApplyAgreed(const std::vector<std::vector<uint64_t>>& paths) {
  const std::string what = "push receiver rank " + std::to_string(options_.rank) + " of server " +
                           (options_.server.empty() ? "(none)" : options_.server);
  if (paths.size() != static_cast<size_t>(options_.server_size)) {
    return InvalidArgument(what + ": " + std::to_string(paths.size()) + " paths for a server of " +
                           std::to_string(options_.server_size) + " ranks");
  }
  std::lock_guard apply(apply_mu_);
  const std::optional<uint64_t> agreed = AgreedVersion(paths);
  if (!agreed) {
    std::string text;
    for (size_t r = 0; r < paths.size(); ++r) {
      text += (r ? "; " : "") + std::string("rank ") + std::to_string(r) + " at";
      if (paths[r].empty()) text += " an unknown version";
      for (size_t k = 0; k < paths[r].size(); ++k) {
        text += (k ? " -> " : " ") + VersionName(paths[r][k]);
      }
    }
    {
      std::lock_guard lock(mu_);
      server_inconsistent_ = true;
      server_version_.reset();
      server_error_ = "the ranks hold no version in common (" + text + "): nothing applied";
    }
    ReportServer();
    return uint64_t{0};
  }
  {
    std::lock_guard lock(mu_);
    const std::vector<uint64_t> mine = PathLocked();
    if (std::find(mine.begin(), mine.end(), *agreed) == mine.end()) {
      return FailedPrecondition(what + ": the ranks agree on " + VersionName(*agreed) +
                                ", which is not on this rank's path: the paths given are not "
                                "the server's");
    }
  }
  ASSIGN_OR_RETURN(uint64_t n, ApplyPendingLocked(*agreed));
  {
    std::lock_guard lock(mu_);
    server_version_ = agreed;
    server_inconsistent_ = false;
    server_error_.clear();
  }
  ReportServer();
  return n;
}

std::optional<nlohmann::json> PushReceiver::Impl::ServerReportLocked() const {
  if (!server_version_ && !server_inconsistent_) return std::nullopt;
  return nlohmann::json{
      {"version", server_version_ ? nlohmann::json(*server_version_) : nlohmann::json(nullptr)},
      {"inconsistent", server_inconsistent_},
      {"why", server_error_}};
}

// Tells the push servers what the server's ranks agreed on, when it changed
// (a link that reconnects is told again at its welcome).
void PushReceiver::Impl::ReportServer() {
  std::optional<nlohmann::json> report;
  {
    std::lock_guard lock(mu_);
    report = ServerReportLocked();
    if (!report || report->dump() == server_reported_) return;
    server_reported_ = report->dump();
  }
  SendAll(Msg::kServer, *report);
}

// Every sender's link is up and welcomed.
bool PushReceiver::Impl::ConnectedLocked() const {
  if (links_.size() != parts_) return false;
  for (const auto& l : links_) {
    if (!l->welcomed) return false;
  }
  return true;
}

std::string PushReceiver::Impl::HeldText() const {
  if (inconsistent_) return "an inconsistent state";
  return held_ ? VersionName(*held_) : "an unknown version";
}

Status PushReceiver::Impl::CatchUp(Store& store, std::optional<uint64_t> version) {
  bool staged = false;
  {
    std::lock_guard lock(mu_);
    if (!version) version = behind_;
    if (!version) {
      return FailedPrecondition("catch-up: no version given and the server has not said one");
    }
    // A rank of a server that knows what it holds stages the catch-up: it
    // applies with the other ranks.
    staged = InServer() && !PathLocked().empty();
  }
  if (staged) {
    Status s = MoveTo(store, *version);
    if (s.code() != Code::kFailedPrecondition) return s;  // else not on one chain: copy it whole
  }
  std::lock_guard apply(apply_mu_);
  ASSIGN_OR_RETURN(auto v, store.GetVersion(*version));
  const std::string what = "catch-up to " + VersionName(*version) + " of receiver " +
                           LayoutText(options_.layout, options_.rank);
  ASSIGN_OR_RETURN(RankPlan rp, PlanOf(store, *v, what));
  const TransferPlan& plan = rp.plan;
  const std::optional<Fp8ReceiverPlan>& fp8 = rp.fp8;
  const std::vector<uint32_t>& own = rp.own;
  {
    std::lock_guard lock(mu_);
    inconsistent_ = true;
  }
  RETURN_IF_ERROR(fp8 ? FillFp8FromStore(store, v, plan, *fp8, own, what)
                      : FillFromStore(store, v, plan, own, what));
  {
    std::lock_guard lock(mu_);
    inconsistent_ = false;
    held_ = *version;
    // Pushes queued before the one onto this version are stale now; it and
    // those after it apply on top.
    while (!pending_.empty() && pending_.front().parent != *version) {
      staged_bytes_ -= std::min(staged_bytes_, pending_.front().Staged());
      pending_.pop_front();
    }
    if (pending_.empty()) expected_parent_ = *version;
    if (behind_ && *behind_ <= *version) behind_.reset();
  }
  SendAll(Msg::kHeld, {{"version", *version}});
  cv_.notify_all();
  return Status::Ok();
}

Result<PushReceiver::Impl::RankPlan> PushReceiver::Impl::PlanOf(Store& store, const Version& v,
                                                                const std::string& what) const {
  RankPlan rp;
  ASSIGN_OR_RETURN(PlanInputs in, PlanInputsOf(store, v));
  ASSIGN_OR_RETURN(rp.plan, MakeTransferPlan(in.canonical, in.geometry,
                                             ShardLayout{1, false, false}, options_.layout));
  if (options_.fp8) {
    auto made = MakeFp8ReceiverPlan(rp.plan, options_.rank, *options_.fp8);
    if (!made.ok()) return made.status().WithContext(what);
    rp.fp8 = std::move(made).value();
  }
  ASSIGN_OR_RETURN(
      rp.own,
      rp.fp8 ? push_internal::MatchFp8ReceiverTensors(rp.plan, *rp.fp8, plan_tensors_, what)
             : push_internal::MatchReceiverTensors(rp.plan, options_.rank, plan_tensors_, what));
  return rp;
}

// One receiver tensor at a time (a host copy of it when it lives on a
// device), its ops' boxes read from the store a band of rows at a time:
// memory is one receiver tensor and one band (push_catchup.h).
Status PushReceiver::Impl::FillFromStore(Store& store, const std::shared_ptr<const Version>& v,
                                         const TransferPlan& plan, const std::vector<uint32_t>& own,
                                         const std::string& what) {
  Materializer reader(&store);
  push_internal::BandCopier copier(reader, v, plan, options_.catch_up_band_bytes, what);
  std::vector<uint8_t> mirror;
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
      RETURN_IF_ERROR(copier.CopyOp(op, dst));
    }
    if (t.device >= 0) {
      RETURN_IF_ERROR(FromCuda(kernels::CudaCopyToDevice(t.data, mirror.data(), bytes), what));
    }
  }
  return Status::Ok();
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
  if (options.server_size < 1 || (options.server_size > 1 && options.server.empty())) {
    return InvalidArgument("push receiver: server_size " + std::to_string(options.server_size) +
                           (options.server.empty() ? " with no server name" : "") +
                           ": a server of one or more ranks, named when of several");
  }
  if (options.server_size > 1 && options.auto_apply) {
    return InvalidArgument("push receiver: auto_apply on a rank of server " + options.server +
                           " (" + std::to_string(options.server_size) +
                           " ranks): its ranks apply together (ApplyAgreed), never on their own");
  }
  if (options.fp8) {
    std::vector<PlanTensor> tensors;
    for (const PushTensor& t : options.tensors) tensors.push_back({t.name, t.dtype, t.shape});
    RETURN_IF_ERROR(push_internal::CheckFp8Tensors(tensors, *options.fp8, "push receiver"));
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

Status PushReceiver::MoveTo(Store& store, uint64_t version) {
  return impl_->MoveTo(store, version);
}

std::vector<uint64_t> PushReceiver::Path() const { return impl_->Path(); }

Result<uint64_t> PushReceiver::ApplyAgreed(const std::vector<std::vector<uint64_t>>& paths) {
  return impl_->ApplyAgreed(paths);
}

PushReceiverStatus PushReceiver::GetStatus() const { return impl_->GetStatus(); }

}  // namespace dte
