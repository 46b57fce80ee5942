// The push server's state (sync/push/push_server.h), shared by its three
// parts: push_server.cc (setup, the group, the latest version, status),
// push_io.cc (the I/O thread: accepts, the handshake, hellos, receipts and
// the queued frames) and push_round.cc (a push, one method per phase).
//
// The state is split by what guards it:
//   - the connections (conns_ and what a push round and the group share
//     with the I/O thread: the receipts awaited, the senders), guarded by
//     mu_ here, with cv_ for a push waiting on them;
//   - the latest version and the transfer plans made from it: PushPlans
//     (internal/push_plans.h), its own lock;
//   - the FP8 receivers' summaries between pushes: HeldFp8Summaries
//     (internal/held_fp8_summaries.h), its own lock;
//   - the events and the refusal count: PushEvents
//     (internal/push_events.h), its own lock.
//
// Thread-safety: one I/O thread owns the sockets; a push runs on its
// caller's thread and touches connections only under mu_. Lock order: mu_,
// then PushPlans's or PushEvents's lock (each a leaf: neither takes another
// lock); HeldFp8Summaries's lock is taken with no other held.
#pragma once

#include <poll.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "store/base/posix_file.h"
#include "store/base/thread_annotations.h"
#include "sync/push/internal/held_fp8_summaries.h"
#include "sync/push/internal/push_events.h"
#include "sync/push/internal/push_fp8_summary.h"
#include "sync/push/internal/push_plans.h"
#include "sync/push/internal/push_wire.h"
#include "sync/push/push_server.h"
#include "sync/transfer/fp8_plan.h"
#include "sync/transfer/plan_inputs.h"
#include "sync/transport/auth_handshake.h"

namespace dte {

namespace push_internal {

using Clock = std::chrono::steady_clock;
// A layout, a receiver rank of it and, for FP8 receivers, the push's
// variant of their FP8 options (0: none): the receivers that share messages.
using RankKey = std::tuple<LayoutKey, int, int>;

inline std::string Json(const nlohmann::json& j) { return j.dump(); }

}  // namespace push_internal

class PushServer::Impl {
 public:
  explicit Impl(PushServerOptions o) : options_(std::move(o)) {}
  ~Impl() { Stop(); }

  Status Start();
  void Stop();

  int port() const { return port_; }
  uint64_t expected() const { return options_.receivers; }
  uint64_t cache_bytes() const { return options_.cache_bytes; }
  std::string address() const;
  bool authenticated() const { return !secret_.empty(); }

  Status SetGroup(int part, int parts);
  Status SetSenders(const std::vector<std::string>& senders);
  std::pair<int, int> group() const;
  Status SetLatest(Store& store, const std::shared_ptr<const Version>& v);

  // push_round.cc.
  Result<PushReport> Push(Store& store, const std::shared_ptr<const Version>& v,
                          ChangesSource& changes);

  std::vector<PushReceiverInfo> Receivers() const EXCLUDES(mu_);
  std::vector<std::string> TakeEvents();
  uint64_t refused() const;
  // The version new receivers are told of; nullopt before the first.
  std::optional<uint64_t> latest() const {
    const std::shared_ptr<const Version> v = plans_.latest();
    return v ? std::optional<uint64_t>(v->manifest.version) : std::nullopt;
  }

 private:
  using Clock = push_internal::Clock;
  using LayoutKey = push_internal::LayoutKey;
  using RankKey = push_internal::RankKey;

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
    std::vector<PlanTensor> tensors;   // as the hello lists them
    std::optional<uint64_t> awaiting;  // version sent, receipt not yet confirmed
    // Plan receiver tensor -> index in `tensors`; for an FP8 receiver also
    // N + rt -> its scale tensor's (sync/push/internal/push_fp8.h).
    std::vector<uint32_t> plan_to_own;
    std::optional<Fp8ReceiverOptions> fp8;  // an FP8 receiver's options, as its hello said
    std::string fp8_key;                    // the same as JSON: receivers alike share messages
    std::optional<std::string> held_hello;  // until the senders are known (SetSenders)
    // With a job secret: the handshake, and the bytes read until it is done.
    std::optional<auth_internal::ServerHandshake> auth;
    std::string auth_in;
  };
  // One push's state, from its targets to its report (push_round.cc).
  struct Round;

  // --- push_server.cc: connections and their plans ---------------------------
  void DropAllLocked(const std::string& why) REQUIRES(mu_);
  // Part 0 of several answers hellos only once it can name every sender.
  bool HoldHellosLocked() const REQUIRES(mu_) {
    return part_ == 0 && parts_ > 1 && senders_.empty();
  }
  // Hellos held until then are answered now.
  void AnswerHeldLocked() REQUIRES(mu_);
  void Wake();
  // Installs v in plans_; connections matched against plans it drops are
  // matched again.
  void InstallLocked(const std::shared_ptr<const Version>& v, PlanInputs in) REQUIRES(mu_);
  // The FP8 plan of an FP8 receiver's layout, rank and options.
  Result<const Fp8ReceiverPlan*> Fp8PlanLocked(const Conn& c, const TransferPlan& plan)
      REQUIRES(mu_);
  // Lines c's tensors up with the plan (c.plan_to_own): the plan's
  // receiver tensors, or an FP8 receiver's (with their scales).
  Status MatchLocked(Conn& c, const TransferPlan& plan, const std::string& what) REQUIRES(mu_);
  // MatchLocked against the latest version, unless c is matched already.
  Status FitsLatestLocked(Conn& c) REQUIRES(mu_);
  void DropLocked(Conn& c, const std::string& why) REQUIRES(mu_);
  // A connection that did not prove it knows the job secret: closed before
  // anything of it is read or anything sent to it but the handshake.
  void RefuseLocked(Conn& c, const std::string& why) REQUIRES(mu_);
  static void Log(const std::string& line);
  void SendLocked(Conn& c, std::string frame) REQUIRES(mu_) {
    c.out.push_back({std::make_shared<const std::string>(std::move(frame)), 0});
  }
  // One frame for several receivers, not copied.
  void SendLocked(Conn& c, const std::shared_ptr<const std::string>& frame) REQUIRES(mu_) {
    c.out.push_back({frame, 0});
  }
  static uint64_t QueuedBytes(const Conn& c);
  // The live connection `id` (hello done or not), or null.
  Conn* LiveLocked(uint64_t id) REQUIRES(mu_);

  // --- push_io.cc: the I/O thread ---------------------------------------------
  void Loop();
  // Drops connections past their hello deadline, closes finished ones, and
  // lists the rest for poll: returns poll's timeout.
  int PollSetLocked(std::vector<pollfd>* fds, std::vector<uint64_t>* ids) REQUIRES(mu_);
  void AcceptLocked() REQUIRES(mu_);
  void ServeLocked(Conn& c, short revents, char* buf, size_t buf_size) REQUIRES(mu_);
  void WriteOutLocked(Conn& c) REQUIRES(mu_);
  void ReadInLocked(Conn& c, char* buf, size_t buf_size) REQUIRES(mu_);
  // Bytes read from c: the handshake's first, then the protocol's frames.
  void OnBytesLocked(Conn& c, const char* data, size_t n) REQUIRES(mu_);
  void OnHello(Conn& c, const std::string& body) REQUIRES(mu_);
  void OnMessage(Conn& c, const push_internal::Parsed& m) REQUIRES(mu_);
  void OnReceived(Conn& c, std::optional<uint64_t> version) REQUIRES(mu_);
  void OnHeld(Conn& c, std::optional<uint64_t> version) REQUIRES(mu_);
  void OnServer(Conn& c, const nlohmann::json& j) REQUIRES(mu_);

  // --- push_round.cc: a push's phases, in order -------------------------------
  // Installs the version and picks the receivers that hold its parent
  // (the others are told to catch up).
  Status SelectTargets(Round& r);
  void TargetLocked(Round& r, uint64_t id, Conn& c) REQUIRES(mu_);
  void SendCounts(Round& r);
  Status SendData(Round& r);
  void WaitForQueuesLocked(Round& r) REQUIRES(mu_);
  void EndData(Round& r, const Status& streamed);
  void AwaitConfirmations(Round& r);
  void ReportTargetLocked(Round& r, uint64_t id) REQUIRES(mu_);
  // Queues a frame for every live target of `rk` (every target: null).
  void SendAllLocked(Round& r, const RankKey* rk, const std::shared_ptr<const std::string>& frame)
      REQUIRES(mu_);

  PushServerOptions options_;
  std::string secret_;  // the job secret; empty: none (loopback only)
  ScopedFd listen_, wake_;
  int port_ = 0;
  std::thread io_;
  std::atomic<bool> stop_{false};

  push_internal::PushPlans plans_;
  push_internal::PushEvents events_;
  // FP8 receivers' block summaries of the last version pushed
  // (push_fp8_summary.h): a push takes them and puts back its version's.
  push_internal::HeldFp8Summaries fp8_summaries_;

  // The connections' lock; everything below is guarded by it.
  mutable Mutex mu_;
  // A receipt arrived, a receiver was dropped, or a queue was written out.
  CondVar cv_;
  std::map<uint64_t, std::unique_ptr<Conn>> conns_ GUARDED_BY(mu_);
  uint64_t next_id_ GUARDED_BY(mu_) = 1;
  // Receivers dropped and closed while a push awaited them: id -> reason,
  // for that push's report (cleared by each push).
  std::map<uint64_t, std::string> gone_ GUARDED_BY(mu_);
  std::set<uint64_t> confirmed_ GUARDED_BY(mu_);  // receivers that confirmed the current push
  int part_ GUARDED_BY(mu_) = 0;                  // SetGroup
  int parts_ GUARDED_BY(mu_) = 1;
  // Every part's address, once known (SetSenders).
  std::vector<std::string> senders_ GUARDED_BY(mu_);
};

}  // namespace dte
