#include "sync/live/live.h"

#include <chrono>
#include <cstdio>
#include <ctime>
#include <optional>
#include <string>
#include <thread>

#include "sync/live/internal/live_changes.h"
#include "sync/live/internal/live_fp8.h"

// The apply's orchestration and the live view. Its steps live beside it:
// live_changes.cc (layout check, changed set), live_scatter.cc (receiver
// buffers), live_pages.cc (the page cache of live/) and live_registry.cc
// (receivers), each with its FP8 part in a *_fp8.cc.
namespace dte::live {
namespace {

using internal::Clock;
using internal::Nanos;

}  // namespace

void Live::InitIfUnset(const std::shared_ptr<const Version>& v) {
  if (!v) return;
  {
    MutexLock lock(&view_mu_);
    if (view_) return;
  }
  auto view = std::make_shared<LiveView>();
  view->version = v;
  view->chain = mount_->ChainOf(v);
  MutexLock lock(&view_mu_);
  if (!view_) view_ = std::move(view);
}

Live::ReadGuard::ReadGuard(Live* live) {
  MutexLock lock(&live->view_mu_);  // no guard joins a view once it is switched out
  view_ = live->view_;
  if (view_) view_->readers.fetch_add(1, std::memory_order_relaxed);
}

Live::ReadGuard::~ReadGuard() {
  if (view_) view_->readers.fetch_sub(1, std::memory_order_release);
}

std::shared_ptr<const LiveView> Live::View() {
  MutexLock lock(&view_mu_);
  return view_;
}

void Live::RecordFailure(const dte::Status& s) {
  MutexLock lock(&status_mu_);
  failed_applies_++;
  last_error_ = mount_->Errno(s);
  last_message_ = s.message();
}

// Steps 1-2 of an apply, kept between Prepare and Commit.
struct Live::Staged {
  uint64_t owner = 0;  // Prepare's control file
  uint32_t id = 0;
  Clock::time_point start;
  dte_live_counts counts = {};
  std::shared_ptr<const LiveView> from, to;
  std::vector<Changes> changes;
  std::vector<Fp8Sets> fp8;
  std::vector<Server> servers;  // the registered ranks at Prepare
};

Live::Live(Store* store, LiveMount* mount) : store_(store), mount_(mount) {}
Live::~Live() = default;

Result<std::unique_ptr<Live::Staged>> Live::Stage(const std::shared_ptr<const Version>& target,
                                                  bool whole_servers) {
  auto st = std::make_unique<Staged>();
  st->start = Clock::now();
  dte_live_counts& counts = st->counts;
  st->from = View();
  if (!st->from) return NotFound("the mount has no live version yet");
  counts.from_version = st->from->version->manifest.version;
  counts.to_version = target->manifest.version;
  const std::string refused =
      "apply of " + VersionName(counts.to_version) + " refused, live state unchanged";
  {
    // Checked again in Scatter, under the same lock as the writes (a rank
    // may leave meanwhile); here it spares the decode.
    MutexLock lock(&receivers_mu_);
    if (whole_servers) {
      if (dte::Status s = ServersComplete(); !s.ok()) return s.WithContext(refused);
    }
    st->servers = ServersLocked();
  }
  RETURN_IF_ERROR(CheckLayout(*st->from->version, *target));

  auto to = std::make_shared<LiveView>();
  to->version = target;
  to->chain = mount_->ChainOf(target);
  st->to = to;
  auto changes = ChangedSet(*st->from, *to, &counts);
  if (!changes.ok()) return changes.status().WithContext(refused);
  st->changes = std::move(changes).value();
  auto fp8 = Fp8ChangedSets(*st->from, *to, st->changes);
  if (!fp8.ok()) return fp8.status().WithContext(refused);
  st->fp8 = std::move(fp8).value();
  counts.decode_ns = Nanos(st->start);
  return st;
}

Result<dte_live_counts> Live::Finish(Staged* st, PageCache* pages,
                                     const std::vector<Server>* expect) {
  struct Reset {
    std::atomic<bool>* flag;
    ~Reset() { *flag = false; }
  } reset{&applying_};
  dte_live_counts counts = st->counts;
  auto fail = [&](dte::Status s) -> Result<dte_live_counts> {
    RecordFailure(s);
    return s;
  };
  // Nothing has been written so far. From here on the apply completes.
  Clock::time_point t = Clock::now();
  if (dte::Status s = Scatter(*st->to->version, st->changes, st->fp8, &counts, expect); !s.ok()) {
    return fail(s);
  }
  counts.scatter_ns = Nanos(t);

  t = Clock::now();
  const std::shared_ptr<const LiveView>& from = st->from;
  const std::shared_ptr<const LiveView>& to = st->to;
  // Reads of the new view are noted from the switch on (PushPages).
  if (pages) WatchReads(to.get());
  {
    MutexLock lock(&view_mu_);
    view_ = to;
  }
  // Reads that picked the old view before the switch have replied once this
  // returns; every page they filled is resident now and replaced below.
  while (from->readers.load(std::memory_order_acquire) > 0) {
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  LivePageStats page_stats;
  if (pages) {
    dte::Status s = PushPages(*from, *to, st->changes, pages, &counts.pages, &page_stats);
    if (!s.ok()) {
      return fail(s.WithContext("live apply of " + VersionName(counts.to_version) +
                                ": replacing cached pages"));
    }
  }
  counts.pagecache_ns = Nanos(t);
  counts.elapsed_ns = Nanos(st->start);
  MutexLock lock(&status_mu_);
  applies_++;
  last_apply_time_ = static_cast<int64_t>(std::time(nullptr));
  last_error_ = 0;
  last_message_.clear();
  last_ = counts;
  last_pages_ = page_stats;
  return counts;
}

namespace {

dte::Status Busy(const std::optional<Live::PreparedInfo>& held) {
  if (!held) return Unavailable("another live apply is running");
  return Unavailable("another live apply is running: apply " + std::to_string(held->id) + " of " +
                     VersionName(held->to_version) +
                     " is prepared (committed, aborted or dropped when its control file closes)");
}

}  // namespace

Result<std::unique_ptr<Live::Staged>> Live::Begin(const std::shared_ptr<const Version>& target,
                                                  bool whole_servers) {
  if (applying_.exchange(true)) return Busy(Prepared());
  auto st = Stage(target, whole_servers);
  if (!st.ok()) {
    applying_ = false;
    RecordFailure(st.status());
  }
  return st;
}

Result<dte_live_counts> Live::Apply(const std::shared_ptr<const Version>& target,
                                    PageCache* pages) {
  ASSIGN_OR_RETURN(std::unique_ptr<Staged> st, Begin(target, true));
  return Finish(st.get(), pages, nullptr);
}

Result<dte_live_counts> Live::Prepare(uint64_t owner, const std::shared_ptr<const Version>& target,
                                      uint32_t* id) {
  auto st = Begin(target, false);
  if (!st.ok()) return st.status();
  (*st)->owner = owner;
  const dte_live_counts counts = (*st)->counts;
  MutexLock lock(&prepared_mu_);
  (*st)->id = next_prepared_id_++;
  if (next_prepared_id_ == 0) next_prepared_id_ = 1;
  *id = (*st)->id;
  prepared_ = std::move(st).value();
  mount_->Log("dtefs: live apply " + std::to_string(*id) + " of " + VersionName(counts.to_version) +
              " prepared");
  return counts;
}

Result<std::unique_ptr<Live::Staged>> Live::TakePrepared(uint64_t owner, uint32_t id,
                                                         const char* what) {
  MutexLock lock(&prepared_mu_);
  if (!prepared_ || prepared_->id != id || prepared_->owner != owner) {
    return FailedPrecondition(std::string(what) + " of live apply " + std::to_string(id) +
                              ": no such apply is prepared through this control file" +
                              (prepared_ ? " (apply " + std::to_string(prepared_->id) + " of " +
                                               VersionName(prepared_->counts.to_version) + " is)"
                                         : ""));
  }
  return std::move(prepared_);
}

Result<dte_live_counts> Live::Commit(uint64_t owner, uint32_t id, PageCache* pages) {
  ASSIGN_OR_RETURN(std::unique_ptr<Staged> st, TakePrepared(owner, id, "commit"));
  return Finish(st.get(), pages, &st->servers);
}

Status Live::Abort(uint64_t owner, uint32_t id) {
  ASSIGN_OR_RETURN(std::unique_ptr<Staged> st, TakePrepared(owner, id, "abort"));
  mount_->Log("dtefs: live apply " + std::to_string(id) + " of " +
              VersionName(st->counts.to_version) + " aborted");
  applying_ = false;
  return Status::Ok();
}

std::optional<Live::PreparedInfo> Live::Prepared() {
  MutexLock lock(&prepared_mu_);
  if (!prepared_) return std::nullopt;
  PreparedInfo info;
  info.id = prepared_->id;
  info.from_version = prepared_->counts.from_version;
  info.to_version = prepared_->counts.to_version;
  info.servers = prepared_->servers;
  for (Server& s : info.servers) s.version = info.from_version;
  return info;
}

LivePageStats Live::LastPageStats() {
  MutexLock lock(&status_mu_);
  return last_pages_;
}

dte_live_status Live::GetStatus() {
  dte_live_status st = {};
  st.abi_version = DTE_LIVE_ABI_VERSION;
  st.applying = applying_ ? 1 : 0;
  if (std::optional<PreparedInfo> p = Prepared()) st.prepared = p->id;
  std::shared_ptr<const LiveView> view = View();
  st.live_version = view ? view->version->manifest.version : DTE_LIVE_LATEST;
  st.latest_version = DTE_LIVE_LATEST;
  {
    MutexLock lock(&receivers_mu_);
    st.receivers = receivers_.size();
    for (const auto& [owner, rc] : receivers_) st.buffers += rc.buffers.size();
  }
  MutexLock lock(&status_mu_);
  st.applies = applies_;
  st.failed_applies = failed_applies_;
  st.last_apply_time = last_apply_time_;
  st.last_error = last_error_;
  st.last = last_;
  std::snprintf(st.last_message, sizeof st.last_message, "%s", last_message_.c_str());
  return st;
}

}  // namespace dte::live
