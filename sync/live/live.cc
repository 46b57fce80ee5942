#include "sync/live/live.h"

#include <chrono>
#include <cstdio>
#include <ctime>
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

Live::~Live() = default;

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

Result<dte_live_counts> Live::Apply(const std::shared_ptr<const Version>& target,
                                    PageCache* pages) {
  if (applying_.exchange(true)) return Unavailable("another live apply is running");
  struct Reset {
    std::atomic<bool>* flag;
    ~Reset() { *flag = false; }
  } reset{&applying_};
  const Clock::time_point start = Clock::now();
  dte_live_counts counts = {};
  std::shared_ptr<const LiveView> from = View();
  auto fail = [&](dte::Status s) -> Result<dte_live_counts> {
    RecordFailure(s);
    return s;
  };
  if (!from) return fail(NotFound("the mount has no live version yet"));
  counts.from_version = from->version->manifest.version;
  counts.to_version = target->manifest.version;
  {
    // Checked again in Scatter, under the same lock as the writes (a rank
    // may leave meanwhile); here it spares the decode.
    MutexLock lock(&receivers_mu_);
    if (dte::Status s = ServersComplete(); !s.ok()) {
      return fail(s.WithContext("apply of " + VersionName(counts.to_version) +
                                " refused, live state unchanged"));
    }
  }
  if (dte::Status s = CheckLayout(*from->version, *target); !s.ok()) return fail(s);

  auto to = std::make_shared<LiveView>();
  to->version = target;
  to->chain = mount_->ChainOf(target);
  auto changes = ChangedSet(*from, *to, &counts);
  if (!changes.ok()) {
    return fail(changes.status().WithContext("apply of " + VersionName(counts.to_version) +
                                             " refused, live state unchanged"));
  }
  auto fp8 = Fp8ChangedSets(*from, *to, *changes);
  if (!fp8.ok()) {
    return fail(fp8.status().WithContext("apply of " + VersionName(counts.to_version) +
                                         " refused, live state unchanged"));
  }
  counts.decode_ns = Nanos(start);

  // Nothing has been written so far. From here on the apply completes.
  Clock::time_point t = Clock::now();
  if (dte::Status s = Scatter(*target, *changes, *fp8, &counts); !s.ok()) return fail(s);
  counts.scatter_ns = Nanos(t);

  t = Clock::now();
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
    dte::Status s = PushPages(*from, *to, *changes, pages, &counts.pages, &page_stats);
    if (!s.ok()) {
      return fail(s.WithContext("live apply of " + VersionName(counts.to_version) +
                                ": replacing cached pages"));
    }
  }
  counts.pagecache_ns = Nanos(t);
  counts.elapsed_ns = Nanos(start);
  MutexLock lock(&status_mu_);
  applies_++;
  last_apply_time_ = static_cast<int64_t>(std::time(nullptr));
  last_error_ = 0;
  last_message_.clear();
  last_ = counts;
  last_pages_ = page_stats;
  return counts;
}

LivePageStats Live::LastPageStats() {
  MutexLock lock(&status_mu_);
  return last_pages_;
}

dte_live_status Live::GetStatus() {
  dte_live_status st = {};
  st.abi_version = DTE_LIVE_ABI_VERSION;
  st.applying = applying_ ? 1 : 0;
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
