// The push receiver's state (sync/push/push_receiver.h), shared by its
// three parts: push_receiver.cc (setup, waiting, status and the catch-up
// from the store), push_receiver_link.cc (a thread per sender: connect,
// hello, welcome and the frames of each push) and push_receiver_apply.cc
// (a push checked, its parts joined into one version, and applied).
//
// Thread-safety: mu_ guards the state below it; apply_mu_ serializes
// writes into the tensors (taken before mu_, never inside it); a link's
// send_mu guards its socket's writes and replacement.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "kernels/cuda.h"
#include "store/base/posix_file.h"
#include "store/changes.h"
#include "store/materialize.h"
#include "sync/push/internal/push_fp8.h"
#include "sync/push/internal/push_wire.h"
#include "sync/push/push_receiver.h"
#include "sync/transfer/transfer_plan.h"

namespace dte {
namespace push_internal {

// One push, checked and decoded: per segment (an op has one or more) the
// own tensor and its entries.
struct Pending {
  uint64_t version = 0, parent = 0;
  struct Segment {
    uint32_t tensor;
    size_t op;  // which op of the push it belongs to, times 3, plus its EntryKind
    push_internal::OpEntries entries;
  };
  std::vector<Segment> segments;
  uint64_t elements = 0;
  uint64_t bytes = 0;  // elements times their width
  // What it holds in memory while staged (indices, values, set flags).
  uint64_t Staged() const {
    uint64_t n = 0;
    for (const Segment& s : segments)
      n += s.entries.idx.size() * 8 + s.entries.vals.size() + s.entries.sets.size();
    return n;
  }
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

}  // namespace push_internal

class PushReceiver::Impl {
 public:
  using Pending = push_internal::Pending;
  using Link = push_internal::Link;
  using Assembly = push_internal::Assembly;

  explicit Impl(PushReceiverOptions o);
  ~Impl();

  void Start();
  Result<uint64_t> ApplyPending();
  Status WaitFor(uint64_t version, std::chrono::milliseconds timeout);

  Status CatchUp(Store& store, std::optional<uint64_t> version);
  Status MoveTo(Store& store, uint64_t version);
  std::vector<uint64_t> Path() const;
  Result<uint64_t> ApplyAgreed(const std::vector<std::vector<uint64_t>>& paths);

  PushReceiverStatus GetStatus() const;

 private:
  // --- push_receiver.cc -------------------------------------------------------
  // Every sender's link is up and welcomed.
  bool ConnectedLocked() const;
  std::string HeldText() const;
  Status FillFromStore(Store& store, const std::shared_ptr<const Version>& v,
                       const TransferPlan& plan, const std::vector<uint32_t>& own,
                       const std::string& what);

  // --- push_receiver_fp8.cc ---------------------------------------------------
  // The catch-up of an FP8 receiver: each op's box read and quantized a
  // band of rows at a time, its bytes and scales copied into the
  // receiver's tensors, other tensors as FillFromStore does.
  Status FillFp8FromStore(Store& store, const std::shared_ptr<const Version>& v,
                          const TransferPlan& plan, const Fp8ReceiverPlan& fp8,
                          const std::vector<uint32_t>& own, const std::string& what);
  // Checks an entry of round 1 against the tensor it names: its kind
  // fits what the tensor holds.
  Status CheckEntryKind(const push_internal::CountsMsg& c, size_t k, const std::string& what) const;

  // This rank's transfer plan of version v, its FP8 plan (an FP8
  // receiver's) and its own tensors lined up with the plan's (a catch-up's
  // and a move's); `what` prefixes errors.
  struct RankPlan {
    TransferPlan plan;
    std::optional<Fp8ReceiverPlan> fp8;
    std::vector<uint32_t> own;
  };
  Result<RankPlan> PlanOf(Store& store, const Version& v, const std::string& what) const;
  bool InServer() const { return options_.server_size > 1; }
  // The server message for what the server's ranks last agreed on; nullopt
  // before the first ApplyAgreed. mu_ held.
  std::optional<nlohmann::json> ServerReportLocked() const;
  void ReportServer();
  std::vector<uint64_t> PathLocked() const;

  // --- push_receiver_move.cc --------------------------------------------------
  // The pushes that lead from `from` to `to` along one chain of the store,
  // one per version stepped over, built from its deltas for this rank.
  Result<std::vector<Pending>> StepsFromStore(Store& store, uint64_t from, uint64_t to);
  // One step: version `to`, a child or the parent of `from`.
  Result<Pending> StepFromStore(Store& store, const std::shared_ptr<const Version>& from,
                                const std::shared_ptr<const Version>& to);
  // An FP8 tensor's part of a step: the bytes and scales that differ.
  Status StageFp8Tensor(Materializer& reader, const std::shared_ptr<const Version>& parent,
                        bool forward, const Fp8ReceiverPlan& fp8, size_t c, const PlanTensor& ct,
                        const TensorChanges& tc, const std::vector<uint32_t>& own, Pending* step,
                        const std::string& what);
  // Queues staged steps after the last version held or staged (`tail`,
  // checked again: Aborted when a push came in between); mu_ held.
  Status QueueStepsLocked(std::optional<uint64_t> tail, std::vector<Pending> steps);

  // --- push_receiver_apply.cc -------------------------------------------------
  // Writes queued pushes in order, every one, or (upto) until the version
  // held is *upto; apply_mu_ held.
  Result<uint64_t> ApplyPendingLocked(std::optional<uint64_t> upto = std::nullopt);
  static Status FromCuda(const kernels::CudaStatus& s, const std::string& what);
  // Writes one segment's entries into a tensor in device memory: indices,
  // values and set flags copied over, then the remap-and-apply kernel with
  // an identity plan over the whole tensor.
  static Status ApplyOnDevice(const push_internal::OpEntries& e, const PushTensor& t,
                              uint64_t numel);
  // Checks and decodes a push against the tensors; Corruption naming what
  // is wrong. Nothing is written here.
  Result<Pending> Check(const push_internal::CountsMsg& c, const std::string& data);
  // A part of a push arrived on `link`, checked: queue the version once
  // every part is in. Corruption when it does not fit.
  Status OnPart(Link& link, const push_internal::CountsMsg& counts, Pending part);
  Result<Pending> JoinPartsLocked();

  // --- push_receiver_link.cc --------------------------------------------------
  void Run(const std::shared_ptr<Link>& link);
  // One link's connection: hello, then pushes until it fails or stops.
  Status Session(const std::shared_ptr<Link>& link);
  void SendHello(Link& link);
  Status OnPush(Link& link, int fd, const push_internal::Parsed& counts, const std::string& who);
  Status OnWelcome(Link& link, nlohmann::json& j, const std::string& who);
  Status CheckWelcomePartLocked(Link& link, nlohmann::json& j, const std::string& who);
  // The primary's welcome named these senders: links to the others.
  void SetSendersLocked(const std::vector<std::string>& senders);
  void Send(Link& l, push_internal::Msg type, const nlohmann::json& j);
  // To every sender welcomed.
  void SendAll(push_internal::Msg type, const nlohmann::json& j);
  // Forgets a version whose parts are not all in (a sender's link failed,
  // or a part was refused): it can never be confirmed, so every other
  // sender is told (and drops this receiver, which reconnects and catches
  // up). Returns the links to tell; mu_ held.
  std::vector<std::shared_ptr<Link>> LoseAssemblyLocked(const Link& failed, const std::string& why);

  PushReceiverOptions options_;
  std::vector<uint64_t> numel_;
  std::vector<PlanTensor> plan_tensors_;
  std::vector<push_internal::EntryKind> kinds_;  // what each tensor holds
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
  uint64_t pushes_ = 0, elements_ = 0, bytes_ = 0;
  uint64_t staged_bytes_ = 0;  // pending_'s Staged() summed
  // A rank of a server: what its ranks last agreed (ApplyAgreed).
  std::optional<uint64_t> server_version_;
  bool server_inconsistent_ = false;
  std::string server_error_;
  std::string server_reported_;  // the last server message sent to every sender
};

}  // namespace dte
