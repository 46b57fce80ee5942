#include "fs/dtefs.h"

#include <fcntl.h>
#include <pthread.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <memory>
#include <thread>

#include "fs/filesystem.h"
#include "fs/internal/fuse_ops.h"
#include "fs/internal/live_worker.h"
#include "fs/log.h"
#include "fs/metrics.h"
#include "fs/prefetcher.h"
#include "fs/readahead.h"
#include "fs/snapshotter.h"
#include "sync/metrics/listen.h"

namespace dte::fs {
namespace {

// Options of mount(8) and fstab lines that the fuse3 mount helper passes on
// and that have no meaning for (or are overridden in) a read-only mount.
bool IgnoredMountOption(const std::string& o) {
  static const char* const kIgnored[] = {"rw",     "ro",     "dev",     "nodev",    "suid",
                                         "nosuid", "exec",   "noexec",  "auto",     "noauto",
                                         "user",   "nouser", "users",   "_netdev",  "nofail",
                                         "async",  "atime",  "noatime", "relatime", "defaults"};
  return std::find(std::begin(kIgnored), std::end(kIgnored), o) != std::end(kIgnored) ||
         o.rfind("x-", 0) == 0;
}

// A FUSE session with signal handlers; unmounted and destroyed with the object.
class Session {
 public:
  ~Session() {
    if (!se_) return;
    Unmount();
    fuse_session_destroy(se_);
  }

  // Restores the signal handlers and unmounts (if still mounted).
  void Unmount() {
    if (handlers_) fuse_remove_signal_handlers(se_);
    if (mounted_) fuse_session_unmount(se_);
    handlers_ = mounted_ = false;
  }

  Status Mount(const MountOptions& o, MountState* state) {
    std::vector<std::string> args = {"dtefs"};
    if (o.debug) args.push_back("-d");
    std::string joined;
    for (const std::string& opt : EffectiveMountOptions(o))
      joined += (joined.empty() ? "" : ",") + opt;
    args.insert(args.end(), {"-o", joined});
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    fuse_args fa = FUSE_ARGS_INIT(static_cast<int>(argv.size()), argv.data());
    const fuse_lowlevel_ops& ops = FilesystemOps();
    se_ = fuse_session_new(&fa, &ops, sizeof(ops), state);
    fuse_opt_free_args(&fa);
    if (!se_) return InvalidArgument("dtefs: bad mount options \"" + joined + "\"");
    if (fuse_set_signal_handlers(se_) != 0) return Internal("dtefs: cannot set signal handlers");
    handlers_ = true;
    if (fuse_session_mount(se_, o.mountpoint.c_str()) != 0) {
      return IOError("dtefs: cannot mount at " + o.mountpoint);
    }
    mounted_ = true;
    return Status::Ok();
  }

  fuse_session* get() { return se_; }

  Status Loop() {
    fuse_loop_config config = {};
    config.clone_fd = 0;
    config.max_idle_threads = 16;
    // 0: unmounted; > 0: the number of the signal (SIGTERM, SIGINT, SIGHUP)
    // that ended the loop, a normal shutdown too; < 0: -errno.
    int rc = fuse_session_loop_mt(se_, &config);
    return rc >= 0 ? Status::Ok() : ErrnoStatus("dtefs: request loop", -rc);
  }

 private:
  fuse_session* se_ = nullptr;
  bool handlers_ = false, mounted_ = false;
};

// Sets the mount's kernel readahead window to `kb` KiB (0: leaves it) and
// tells the Filesystem where to read back the value in effect. Not being
// root (or having no sysfs) is logged once and otherwise ignored.
void SetMountReadahead(Filesystem* fs, const std::string& mountpoint, uint32_t kb) {
  auto bdi = MountBdi(mountpoint);
  if (!bdi.ok()) {
    LogLine("dtefs: cannot find the readahead setting of " + mountpoint + ": " +
            bdi.status().message());
    return;
  }
  fs->SetReadaheadBdi(*bdi);
  if (kb == 0) return;
  Status s = WriteReadaheadKb(*bdi, kb);
  if (!s.ok()) {
    LogLine("dtefs: cannot set the readahead of " + mountpoint + " to " + std::to_string(kb) +
            " KiB (" + s.message() + "); the kernel's window stays");
  }
}

// Sets the mount's readahead on its own thread as soon as the first request
// arrives (see MountState), then releases the requests waiting for it.
//
// Thread-safety: owns one thread; construct and destroy from one thread,
// around the request loop.
class ReadaheadTuner {
 public:
  ReadaheadTuner(MountState* state, std::string mountpoint, uint32_t kb)
      : state_(state), mountpoint_(std::move(mountpoint)), kb_(kb) {
    state_->tuned = false;
    thread_ = std::thread([this] { Run(); });
  }
  ~ReadaheadTuner() {
    stop_ = true;
    state_->serving = true;
    state_->serving.notify_all();
    thread_.join();
  }

 private:
  void Run() {
    state_->serving.wait(false);
    if (!stop_) SetMountReadahead(state_->fs.get(), mountpoint_, kb_);
    state_->tuned = true;
    state_->tuned.notify_all();
  }

  MountState* const state_;
  const std::string mountpoint_;
  const uint32_t kb_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// Polls the store for new and removed versions until stopped, and wakes the
// snapshot worker and the prefetcher after each poll. Listing and loading
// manifests and block tables is slow metadata work, so it runs here and
// never on a request thread. A store that cannot be listed keeps the last
// good version set mounted; Filesystem::NotePoll reports it once.
//
// Thread-safety: owns one thread; construct and destroy from one thread.
class Poller {
 public:
  Poller(Filesystem* fs, uint32_t period_ms, Snapshotter* snapshots, Prefetcher* prefetcher)
      : fs_(fs),
        period_(std::chrono::milliseconds(period_ms)),
        snapshots_(snapshots),
        prefetcher_(prefetcher),
        thread_([this] { Run(); }) {}
  ~Poller() {
    stop_ = true;
    thread_.join();
  }

 private:
  void Run() {
    constexpr auto kTick = std::chrono::milliseconds(20);
    auto next = std::chrono::steady_clock::now() + period_;
    uint64_t since_full = 0;  // Serve listed everything just before
    while (!stop_) {
      std::this_thread::sleep_for(kTick);
      if (std::chrono::steady_clock::now() < next) continue;
      next = std::chrono::steady_clock::now() + period_;
      const bool full = ++since_full >= FullListEvery(fs_->VersionCount()) || fs_->StoreFailing();
      if (full) since_full = 0;
      fs_->NotePoll(full ? fs_->Refresh() : fs_->RefreshNew());
      if (snapshots_) snapshots_->Wake();
      if (prefetcher_) prefetcher_->Wake();
    }
  }

  Filesystem* const fs_;
  const std::chrono::milliseconds period_;
  Snapshotter* const snapshots_;
  Prefetcher* const prefetcher_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// Blocks SIGTERM, SIGINT and SIGHUP in this thread (and so in every thread
// it starts) until Release() or destruction. libfuse's handlers end the
// request loop by interrupting the wait of the thread that runs it, so that
// thread must be the one the signal is delivered to, not the poller's or
// the store's; libfuse's own workers block all signals.
//
// Thread-safety: belongs to the thread that created it.
class ShutdownSignalsBlocked {
 public:
  ShutdownSignalsBlocked() {
    sigemptyset(&set_);
    for (int sig : {SIGTERM, SIGINT, SIGHUP}) sigaddset(&set_, sig);
    pthread_sigmask(SIG_BLOCK, &set_, nullptr);
  }
  ~ShutdownSignalsBlocked() { Release(); }
  void Release() {
    if (blocked_) pthread_sigmask(SIG_UNBLOCK, &set_, nullptr);
    blocked_ = false;
  }

 private:
  sigset_t set_;
  bool blocked_ = true;
};

Result<std::unique_ptr<Store>> OpenStore(const MountOptions& o, bool with_index) {
  StoreOptions so;
  so.uri = o.store;
  so.cache_dir = with_index ? o.cache_dir : "";
  so.index_optional = true;
  so.blob_cache_bytes = o.blob_cache_bytes;
  so.blob_chunk_bytes = o.blob_chunk_bytes;
  // The mount cannot start without a listing: a store that cannot be
  // reached now is listed again with backoff (Store::ListVersions) until
  // the first listing is in; the poller then retries on its own schedule.
  so.patient_listing = true;
  return Store::Open(so);
}

// The prefetcher, when asked for and possible (else logged): null otherwise.
std::unique_ptr<Prefetcher> StartPrefetcher(const MountOptions& o, MountState* state) {
  const bool remote = o.store.starts_with("s3://");
  if (remote && !state->store->blob_cache()) {
    const char* why = o.blob_cache_bytes == 0 ? "--blob-cache-size 0" : "no usable cache index";
    LogLine(std::string("dtefs: running without a blob cache (") + why +
            "): every read goes to the store" +
            (o.prefetch_latest ? ", and nothing is prefetched" : ""));
  }
  if (!o.prefetch_latest) return nullptr;
  if (!remote) {
    LogLine("dtefs: --prefetch applies to s3:// stores only; ignored");
    return nullptr;
  }
  if (!state->store->blob_cache()) return nullptr;
  auto prefetcher = std::make_unique<Prefetcher>(
      state->store.get(), state->fs.get(), state->store->blob_cache(), state->snapshots.get());
  state->fs->SetPrefetcher(prefetcher.get());
  return prefetcher;
}

// The snapshot set in the store's cache directory; null when snapshots are
// off, there is no cache directory, or it cannot be opened (logged).
std::unique_ptr<SnapshotSet> OpenSnapshots(const MountOptions& o, const Store& store) {
  if (o.snapshot_every == 0 || o.max_snapshots == 0 || store.CachePath().empty()) return nullptr;
  auto set = SnapshotSet::Open(store.CachePath() + "/snapshots");
  if (!set.ok()) {
    LogLine("dtefs: running without snapshots: " + set.status().message());
    return nullptr;
  }
  return std::move(set).value();
}

// The mount point with symlinks resolved, as /proc/self/mountinfo will list
// it. Resolved before mounting: afterwards that would send requests to this
// very daemon.
std::string CanonicalMountpoint(const std::string& path) {
  std::error_code ec;
  auto canonical = std::filesystem::canonical(path, ec);
  return ec ? path : canonical.string();
}

// The log file dtefs appends its messages to once mounted: o.log_file, or
// for a daemon (whose stderr is /dev/null) <cache_dir>/dtefs.log; -1 for
// none (stderr stays). Opened before mounting, so a path under the mount
// point does not send a request to this very daemon, and an explicit
// --log-file that cannot be opened is an error the caller sees. Never
// follows a symlink, and only a regular file this user owns is used: the
// default cache directory may be a predictable one under /tmp.
Result<int> OpenLog(const MountOptions& o) {
  std::string path = o.log_file;
  if (path.empty() && !o.foreground && !o.cache_dir.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(o.cache_dir, ec);  // else open says why
    path = o.cache_dir + "/dtefs.log";
  }
  if (path.empty()) return -1;
  const int fd = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0640);
  std::string why = fd < 0 ? std::strerror(errno) : "";
  struct stat st {};
  if (fd >= 0 && (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != ::geteuid())) {
    ::close(fd);
    why = "not a regular file of this user";
  } else if (fd >= 0) {
    return fd;
  }
  const std::string message = "dtefs: cannot open log file " + path + ": " + why;
  if (!o.log_file.empty()) return InvalidArgument(message);
  LogLine(message + " (the daemon will log nowhere)");
  return -1;
}

// Sends stderr to the log file opened by OpenLog (if any; closes it) and
// starts it with the time, pid, store and mount point.
void AdoptLog(int fd, const MountOptions& o, const std::string& mountpoint) {
  if (fd < 0) return;
  ::dup2(fd, STDERR_FILENO);
  ::close(fd);
  char when[32] = "";
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  if (::gmtime_r(&now, &tm)) std::strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%SZ", &tm);
  LogLine("dtefs: " + std::string(when) + " pid " + std::to_string(::getpid()) + " serving " +
          o.store + " on " + mountpoint);
}

}  // namespace

std::vector<std::string> EffectiveMountOptions(const MountOptions& options) {
  // The store is the mount's source (findmnt, /proc/mounts); libfuse splits
  // options at commas, so those and backslashes are escaped.
  std::string fsname = "fsname=";
  for (char c : options.store.empty() ? std::string("dtefs") : options.store) {
    if (c == ',' || c == '\\') fsname += '\\';
    fsname += c;
  }
  std::vector<std::string> out = {"ro", fsname, "subtype=dtefs", "max_read=1048576"};
  for (const std::string& o : options.fuse_options) {
    if (!o.empty() && !IgnoredMountOption(o)) out.push_back(o);
  }
  return out;
}

namespace {

// The store and --live-version, checked before mounting so errors reach the
// caller's terminal. Without the index: RocksDB's threads would not survive
// the daemon fork.
Status CheckStore(const MountOptions& o) {
  ASSIGN_OR_RETURN(auto probe, OpenStore(o, false));
  ASSIGN_OR_RETURN(auto versions, probe->ListVersions());
  if (o.live_version && !versions.count(*o.live_version)) {
    return NotFound("dtefs: --live-version " + std::to_string(*o.live_version) + ": " +
                    VersionName(*o.live_version) + " is not in the store");
  }
  return Status::Ok();
}

// Mounts, daemonizes (unless --foreground) and moves the log to its file.
Status MountAndDaemonize(const MountOptions& o, const std::string& mountpoint, Session* session,
                         MountState* state) {
  ASSIGN_OR_RETURN(const int log_fd, OpenLog(o));
  if (Status m = session->Mount(o, state); !m.ok()) {
    if (log_fd >= 0) ::close(log_fd);
    return m;
  }
  if (fuse_daemonize(o.foreground ? 1 : 0) != 0) {
    if (log_fd >= 0) ::close(log_fd);
    return Internal("dtefs: cannot daemonize");
  }
  AdoptLog(log_fd, o, mountpoint);
  return Status::Ok();
}

// The store (with its index: after daemonizing), snapshots and the
// Filesystem with its first listing and live version.
Status LoadFilesystem(const MountOptions& o, MountState* state) {
  ASSIGN_OR_RETURN(state->store, OpenStore(o, true));
  state->snapshots = OpenSnapshots(o, *state->store);
  state->fs = std::make_unique<Filesystem>(state->store.get(), o.cache_bytes);
  state->fs->SetSnapshots(state->snapshots.get());
  state->fs->SetInitialLive(o.live_version);
  if (o.fp8) state->fs->EnableFp8(o.fp8_view);
  RETURN_IF_ERROR(state->fs->Refresh());
  state->store->SetPatientListing(false);
  if (o.live_version && !state->fs->live().View()) {
    return NotFound("dtefs: --live-version " + std::to_string(*o.live_version) + ": " +
                    VersionName(*o.live_version) + " is not in the store");
  }
  return Status::Ok();
}

// The metrics endpoint of --metrics-address (null without one). After
// daemonizing: its threads would not survive the fork.
Result<std::unique_ptr<MetricsServer>> StartMetrics(const MountOptions& o, Filesystem* fs) {
  if (o.metrics_address.empty()) return std::unique_ptr<MetricsServer>();
  const std::string address = MetricsListenAddress(o.metrics_address);
  ASSIGN_OR_RETURN(std::unique_ptr<MetricsServer> metrics, MetricsServer::Start(address, fs));
  LogLine("dtefs: metrics at http://" + address.substr(0, address.rfind(':')) + ":" +
          std::to_string(metrics->port()) + "/metrics");
  return metrics;
}

}  // namespace

Status Serve(const MountOptions& o) {
  RETURN_IF_ERROR(CheckStore(o));
  const std::string mountpoint = CanonicalMountpoint(o.mountpoint);
  Session session;
  MountState state;  // requests only reach it once the loop runs
  state.readahead_kb = o.readahead_kb;
  RETURN_IF_ERROR(MountAndDaemonize(o, mountpoint, &session, &state));
  Status s;
  {
    ShutdownSignalsBlocked blocked;  // a signal now stays pending until Release()
    RETURN_IF_ERROR(LoadFilesystem(o, &state));
    // Stopped at the end of this block, before the Filesystem it reads.
    ASSIGN_OR_RETURN(std::unique_ptr<MetricsServer> metrics, StartMetrics(o, state.fs.get()));
    // Stopped after the request loop, before the Filesystem it applies to.
    LiveWorker live_worker(state.fs.get(), session.get(), mountpoint);
    state.live_worker = &live_worker;
    std::unique_ptr<Snapshotter> snapshotter;  // stopped after the poller that wakes it
    if (state.snapshots) {
      snapshotter =
          std::make_unique<Snapshotter>(state.store.get(), state.fs.get(), state.snapshots.get(),
                                        SnapshotPolicy{o.snapshot_every, o.max_snapshots});
    }
    std::unique_ptr<Prefetcher> prefetcher = StartPrefetcher(o, &state);
    Poller poller(state.fs.get(), o.poll_ms, snapshotter.get(), prefetcher.get());
    ReadaheadTuner tuner(&state, mountpoint, o.readahead_kb);
    blocked.Release();
    s = session.Loop();
    // Unmount before stopping the workers, which may be waiting out the
    // retries of a store that does not answer: no request waits meanwhile.
    session.Unmount();
    state.fs->SetPrefetcher(nullptr);  // the prefetcher goes before the Filesystem
    state.live_worker = nullptr;
  }
  session.Unmount();  // before the store closes, so no request waits on it
  return s;
}

}  // namespace dte::fs
