// Filesystem: the FUSE-free logic of dtefs — namespace, attributes, reads.
//
// The tree a mount shows:
//   /                     one directory per committed version, plus
//   /vNNNNNNNN/<file>     exactly the files of that version (read-only)
//   /latest               symlink to the newest version's directory
//   /live/<file>          the files of the live version, changed in place by
//                         live apply (sync/live/live.h)
//   /fp8/vNNNNNNNN/<file> every version as a block-scaled FP8 checkpoint
//                         (fs/fp8_reader.h), unless EnableFp8 was not called
//   /fp8/latest           symlink to the newest version's FP8 directory
//   /.dte/status          JSON: versions, counters, caches, snapshots, polling,
//                         prefetch, readahead, live apply, recent errors
//   /.dte/control         live apply's ioctls (sync/live/live_abi.h)
// Every operation returns a Status or Result; the FUSE adapter
// (fs/internal/) turns them into exactly one reply, and errno mapping lives
// in one place there. Refresh() and RefreshNew() list the store on the
// poller thread. A version leaves, and `latest` goes back, only once a read
// of its own manifest key finds it gone: a listing that lacks it changes
// nothing (fs/listing_guard.h). The version set in memory is only the listing (version ->
// manifest key) plus the newest version, parsed: manifests and block tables
// are loaded when a version is looked up, listed or opened, through the
// Store's bounded cache of parsed versions (then its RocksDB index, then
// the store), so memory and the cost of listing the root do not grow with
// the number of versions. New versions are checked as they arrive (the
// newest kMaxCheckedPerRefresh of one refresh; on the first refresh, of a
// mount, only the newest): one whose manifest or block table does not load
// is skipped and reported once, and `latest` is always a version that
// loaded. An older version that does not load fails its own lookups.
//
// Thread-safety: all methods may be called concurrently. Lock order: mu_
// before any lock inside InodeTable or BlockCache (never the reverse).
#pragma once

#include <atomic>
#include <cstdint>
#include <ctime>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "fs/dtefs_live_mount.h"
#include "fs/fp8_reader.h"
#include "fs/inode_table.h"
#include "fs/latency.h"
#include "fs/listing_guard.h"
#include "fs/read_path.h"
#include "store/base/thread_annotations.h"
#include "store/snapshot.h"
#include "store/store.h"
#include "sync/live/live.h"

namespace dte::fs {

class Prefetcher;

inline constexpr uint64_t kRootIno = 1;
inline constexpr uint64_t kLatestIno = 2;
inline constexpr uint64_t kDteDirIno = 3;
inline constexpr uint64_t kStatusIno = 4;
inline constexpr uint64_t kLiveDirIno = 5;
inline constexpr uint64_t kControlIno = 6;
inline constexpr uint64_t kFp8DirIno = 7;
inline constexpr uint64_t kFp8LatestIno = 8;
// The InodeTable "version" of live/ files.
inline constexpr uint64_t kLiveKey = UINT64_MAX - 1;
// The InodeTable "version" of fp8/vNNNNNNNN and its files: the version with
// this bit set (version numbers stay far below it).
inline constexpr uint64_t kFp8KeyBit = uint64_t{1} << 62;

enum class NodeType { kDirectory, kRegular, kSymlink };

struct NodeAttr {
  uint64_t ino = 0;
  NodeType type = NodeType::kRegular;
  uint64_t size = 0;
  int64_t mtime = 0;       // seconds since the epoch
  bool immutable = false;  // never changes while mounted: the kernel may cache it
};

struct DirEntry {
  std::string name;
  NodeAttr attr;
};

// An open file. Holds its version and the version's ancestors, so a version
// removed from the store (or rewritten by gc) keeps reading until the file
// is released.
// A live/ file (live) reads whatever version is live at each read.
// .dte/control (control) reads as empty; it is the handle receivers are
// registered under. An fp8/ file (fp8) reads its version's FP8 view.
struct OpenFile {
  std::shared_ptr<const Version> version;  // null for .dte files and live/ files
  std::shared_ptr<const Fp8Mounted> fp8;   // fp8/ files: the view, file_index its file
  VersionChain chain;                      // version first, then its parents
  uint32_t file_index = 0;
  bool live = false;
  bool control = false;
  std::string snapshot;  // .dte/status content as of open
};

class Filesystem {
 public:
  Filesystem(Store* store, uint64_t cache_bytes);
  Filesystem(const Filesystem&) = delete;
  Filesystem& operator=(const Filesystem&) = delete;

  // Brings the version set in line with the store (one full listing): loads
  // new versions and drops removed ones (ApplyListing). A version that fails
  // to load is logged once and skipped. Listings the store found damaged
  // and made again are logged and counted (.dte/status "listings").
  Status Refresh() EXCLUDES(mu_);
  // What Refresh does with its listing `listed` (version -> manifest key).
  // A shown version that `listed` lacks, or lists at an older revision,
  // stays unless a read of its own manifest key finds it gone
  // (ListingGuard), so `latest` goes back only after such a read.
  Status ApplyListing(std::map<uint64_t, std::string> listed) EXCLUDES(mu_);
  // Looks only for manifests whose keys sort after the newest one seen: one
  // request (PagedLister::ListAfter) on stores that have it, else a full
  // Refresh. Adds new versions and newer revisions; removals are noticed by
  // Refresh only. After a load that failed for a reason other than
  // corruption, the next call is a full Refresh.
  Status RefreshNew() EXCLUDES(mu_);
  // Records the outcome of one poll (a Refresh or RefreshNew) for
  // .dte/status. The first failure after a success is reported once (stderr
  // and errors); so is the recovery (stderr).
  void NotePoll(const Status& s) EXCLUDES(mu_);
  // True while the most recent poll failed (the store is unreachable).
  bool StoreFailing() EXCLUDES(mu_);
  // Polls noted so far.
  uint64_t PollCount() EXCLUDES(mu_);

  Result<NodeAttr> Lookup(uint64_t parent, std::string_view name) EXCLUDES(mu_);
  Result<NodeAttr> GetAttr(uint64_t ino) EXCLUDES(mu_);
  Result<std::vector<DirEntry>> ReadDir(uint64_t ino) EXCLUDES(mu_);
  Result<std::string> ReadLink(uint64_t ino) EXCLUDES(mu_);
  // `flags` are open(2) flags; anything but read-only access is refused.
  Result<std::unique_ptr<OpenFile>> Open(uint64_t ino, int flags) EXCLUDES(mu_);
  // Up to `len` bytes at `offset` into *out (short or empty at end of file).
  Status Read(const OpenFile& f, uint64_t offset, uint64_t len, std::string* out) EXCLUDES(mu_);
  // The same into dst, which has room for `len` bytes; returns the count
  // written.
  Result<size_t> Read(const OpenFile& f, uint64_t offset, uint64_t len, char* dst) EXCLUDES(mu_);
  // The same as pieces of cached blocks appended to *out (ReadPath::ReadPieces),
  // with no copy: the FUSE read handler replies with them. The Read
  // overloads copy these pieces, so every read takes this path. A live/
  // file reads `live_view` (a Live::ReadGuard's), or else the view live now.
  Status ReadPieces(const OpenFile& f, uint64_t offset, uint64_t len,
                    std::vector<ReadPath::Piece>* out,
                    std::shared_ptr<const live::LiveView> live_view = nullptr) EXCLUDES(mu_);

  std::string StatusJson() EXCLUDES(mu_);
  // How long reads took to materialize (fs/metrics.h).
  const LatencyHistogram& read_latency() const { return read_latency_; }

  // Live apply (sync/live/live.h). The live version at mount is `version` when set
  // (SetInitialLive, before the first Refresh), else the newest.
  live::Live& live() { return live_; }
  void SetInitialLive(std::optional<uint64_t> version) { initial_live_ = version; }
  // Makes `version` (nullopt: the newest) live.
  Result<dte_live_counts> ApplyLive(std::optional<uint64_t> version, live::PageCache* pages)
      EXCLUDES(mu_);
  // The two phases of an apply for control file `owner` (live::Live::Prepare
  // and Commit; docs/live.md, "Servers on several hosts").
  Result<dte_live_counts> PrepareLive(uint64_t owner, std::optional<uint64_t> version, uint32_t* id)
      EXCLUDES(mu_);
  Result<dte_live_counts> CommitLive(uint64_t owner, uint32_t id, live::PageCache* pages)
      EXCLUDES(mu_);
  dte_live_status LiveStatus() EXCLUDES(mu_);
  // Durations of the live applies that succeeded (fs/metrics.h).
  const LatencyHistogram& live_apply_latency() const { return live_apply_latency_; }
  // The inode of live file number `file`.
  uint64_t LiveIno(uint32_t file) { return inodes_.Intern(kLiveKey, file); }

  // How many versions are shown.
  size_t VersionCount() EXCLUDES(mu_);
  // The versions currently shown: version -> manifest key (a copy).
  std::map<uint64_t, std::string> Versions() EXCLUDES(mu_);
  // The newest version shown; null if there is none.
  std::shared_ptr<const Version> Latest() EXCLUDES(mu_);
  // Version `version` as shown (parsed on demand); NotFound if it is not
  // shown, else the load's error (reported once per manifest key).
  Result<std::shared_ptr<const Version>> VersionOf(uint64_t version) EXCLUDES(mu_);
  Result<std::shared_ptr<const Version>> LiveTarget(std::optional<uint64_t> version) EXCLUDES(mu_);

  // New versions one refresh loads and checks before showing them (the
  // newest ones; older ones of a long listing are shown unchecked and
  // loaded when used). The first refresh checks only back to the newest
  // version that loads.
  static constexpr size_t kMaxCheckedPerRefresh = 64;

  // Reads start their chain walks from `snapshots` (not owned; must outlive
  // the Filesystem's reads), whose state .dte/status reports. Call before
  // serving requests.
  void SetSnapshots(SnapshotSet* snapshots);
  // The prefetcher whose progress .dte/status reports (not owned; null: none).
  void SetPrefetcher(const Prefetcher* prefetcher) { prefetcher_ = prefetcher; }
  // Shows fp8/ with views made with `options`. Call before serving requests.
  void EnableFp8(const Fp8ViewOptions& options);
  // Null unless EnableFp8 was called.
  Fp8Reader* fp8() { return fp8_.get(); }
  // The mount's bdi directory in sysfs, whose read_ahead_kb .dte/status reports.
  void SetReadaheadBdi(const std::string& bdi) EXCLUDES(mu_);
  // Logs a problem of background work (stderr and .dte/status errors).
  void ReportError(const std::string& message) EXCLUDES(mu_);

 private:
  // How many of `len` bytes at `offset` lie inside the file.
  // `live`: the live version, for a live/ file.
  static uint64_t ReadableBytes(const OpenFile& f, uint64_t offset, uint64_t len,
                                const Version* live);
  NodeAttr VersionDirAttr(const Version& v);
  NodeAttr FileAttr(const Version& v, uint32_t file);
  NodeAttr RootAttr() EXCLUDES(mu_);
  NodeAttr LiveFileAttr(const Version& v, uint32_t file) EXCLUDES(mu_);
  Result<std::vector<DirEntry>> RootEntries() EXCLUDES(mu_);
  // fp8/ (fs/filesystem_fp8.cc). IsFp8 says whether an inode lies in it.
  bool IsFp8(uint64_t ino);
  Result<NodeAttr> Fp8Lookup(uint64_t parent, std::string_view name) EXCLUDES(mu_);
  Result<NodeAttr> Fp8GetAttr(uint64_t ino) EXCLUDES(mu_);
  Result<std::vector<DirEntry>> Fp8ReadDir(uint64_t ino) EXCLUDES(mu_);
  Result<std::unique_ptr<OpenFile>> Fp8Open(uint64_t ino) EXCLUDES(mu_);
  Status Fp8ReadPieces(const OpenFile& f, uint64_t offset, uint64_t len,
                       std::vector<ReadPath::Piece>* out) EXCLUDES(mu_);
  // The view of fp8/vNNNNNNNN (built on first use; a refusal is reported once).
  Result<std::shared_ptr<const Fp8Mounted>> Fp8ViewOf(uint64_t version) EXCLUDES(mu_);
  NodeAttr Fp8DirAttr() EXCLUDES(mu_);
  void RecordError(const Version& v, uint32_t file, const Status& s) EXCLUDES(mu_);
  void PushErrorLocked(const std::string& message) REQUIRES(mu_);
  using VersionMap = std::map<uint64_t, std::string>;  // version -> manifest key
  // Shows `next`; `latest` is its newest version, loaded (null if empty).
  void Install(VersionMap next, std::shared_ptr<const Version> latest) EXCLUDES(mu_);
  // Puts the new keys of `listed` (those not in `current`) into *next, the
  // newest kMaxCheckedPerRefresh of them loaded and checked first (always
  // at least up to the newest that loads); a key that fails (logged once)
  // is left out, and `current`'s key for that version kept, if any. Returns
  // the newest version of *next, loaded; *complete is false if a load failed
  // for a reason other than corruption or absence (worth retrying).
  Result<std::shared_ptr<const Version>> Merge(const VersionMap& listed, const VersionMap& current,
                                               VersionMap* next, bool* complete) EXCLUDES(mu_);
  // Loads version `version` at `key`, reporting a failure once per key.
  Result<std::shared_ptr<const Version>> Load(uint64_t version, const std::string& key)
      EXCLUDES(mu_);

  Store* const store_;
  ReadPath reader_;
  InodeTable inodes_;
  DtefsLiveMount live_mount_{&reader_};
  live::Live live_{store_, &live_mount_};
  LatencyHistogram live_apply_latency_;  // of the applies that succeeded
  std::unique_ptr<Fp8Reader> fp8_;       // set before serving, then constant
  ListingGuard guard_{[this](uint64_t version, const std::string& key) {
    return store_->ManifestExists(version, key);
  }};
  const int64_t mount_time_ = static_cast<int64_t>(std::time(nullptr));
  std::optional<uint64_t> initial_live_;
  std::atomic<uint64_t> bytes_served_{0}, reads_{0}, read_errors_{0};
  LatencyHistogram read_latency_;  // of ReadPieces: materializing a read's bytes
  std::atomic<SnapshotSet*> snapshots_{nullptr};
  std::atomic<const Prefetcher*> prefetcher_{nullptr};

  Mutex mu_;
  VersionMap versions_ GUARDED_BY(mu_);
  std::shared_ptr<const Version> latest_ GUARDED_BY(mu_);  // versions_'s newest, loaded
  std::optional<uint64_t> max_shown_ GUARDED_BY(mu_);      // the newest version ever shown
  int64_t root_mtime_ GUARDED_BY(mu_) = 0;
  std::set<std::pair<uint64_t, uint32_t>> logged_ GUARDED_BY(mu_);  // (version, file)
  std::set<std::string> failed_keys_ GUARDED_BY(mu_);               // manifests that did not load
  std::deque<std::string> errors_ GUARDED_BY(mu_);                  // most recent last
  std::string readahead_bdi_ GUARDED_BY(mu_);
  // Polling: the greatest manifest key listed ("" forces a full listing).
  std::string newest_key_ GUARDED_BY(mu_);
  uint64_t polls_ GUARDED_BY(mu_) = 0;
  uint64_t full_polls_ GUARDED_BY(mu_) = 0;  // Refresh calls (full listings)
  uint64_t failed_polls_ GUARDED_BY(mu_) = 0;
  int64_t failing_since_ GUARDED_BY(mu_) = 0;  // seconds since the epoch; 0: not failing
  std::string poll_error_ GUARDED_BY(mu_);     // of the most recent failed poll
};

// The error of every operation that would modify the mount. Its code is
// kUnimplemented, which the FUSE adapter maps to EROFS: the only operations
// this filesystem leaves unimplemented are the ones that would modify it.
Status ReadOnlyError(const std::string& what);

// The errno value a request that failed with `s` replies with (the one
// place Status codes become errno values; ReadOnlyError's kUnimplemented is
// EROFS).
int ErrnoOf(const Status& s);

// The errno a live apply or registration failure is reported with: as
// ErrnoOf, except that a refused caller is not permitted (EPERM) and a
// missing capability is EOPNOTSUPP.
int LiveErrno(const Status& s);

// Seconds since the epoch of an RFC 3339 UTC time ("2026-11-22T01:02:03Z");
// 0 if it does not parse.
int64_t ParseRfc3339(const std::string& text);

}  // namespace dte::fs
