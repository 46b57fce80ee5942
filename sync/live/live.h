// Live: the live copy of a dtefs mount and live apply (docs/live.md).
//
// MOUNT/live/ shows the files of one version, the live version, whose
// contents change in place when an apply makes another version live. An
// apply (Apply) of target version T over live version L:
//   1. checks that T has L's layout (the same files of the same sizes, and
//      the same tensors, dtypes, shapes and offsets);
//   2. finds the changed set, block by block (only blocks whose content
//      hash differs between L and T): along the chain between L and T
//      (either direction) the entries of the versions' sparse records,
//      read from their delta blobs, each blob checked against its content
//      hash first, are composed into one list per block: element indices
//      with the wrapping difference to add to the live value (negated when
//      going back) or, for elements a record stores whole, the value. No
//      block of either version is materialized. A block with a dense record
//      on the way, a set element to undo (going back), or L and T not on
//      one chain is instead read from both versions (each checked against
//      its block hash) and compared element by element, the values taken
//      from T ("compared blocks");
//   3. only then writes: every registered receiver buffer in place
//      (remapped through the engine's transfer plan for the receiver's
//      layout, every index bounds-checked against the buffer; a difference
//      is added to the element the buffer holds, which is L's), then
//      switches the live view (new reads of live/ serve T), waits for reads
//      of L still in flight, and replaces the page-cache pages of live/
//      that hold changed bytes and are resident (PageCache) with T's bytes:
//      changed elements, and whole headers and other files whose content
//      differs.
// Anything failing in steps 1-2 leaves every target untouched.
//
// Receivers are registered per owner (an open .dte/control file): all
// buffers of one owner share a layout, and Drop(owner) forgets them (the
// file was released: the process exited or closed it).
//
// A receiver may be a rank of an inference server (docs/live.md,
// "Servers"): an apply is refused before anything is written while a
// registered server lacks a rank, and writes the ranks of servers first;
// if writing one fails, the ranks written before it are written back to
// the live version (differences subtracted, values set whole restored
// from the old values read before the write), the failed rank is dropped
// and the apply fails with nothing switched.
//
// A server whose ranks register on several mounts (several hosts) is
// moved by a two-phase apply a coordinator drives over its mounts
// (docs/live.md, "Servers on several hosts"): Prepare runs steps 1-2 and
// holds their result for the control file that asked, without the
// completeness check (no mount sees the whole server; the coordinator checks
// the union of what each prepare reports); Commit runs step 3 on it, first
// checking that the servers' registered ranks are the ones Prepare saw;
// Abort, or closing that control file (Drop), forgets it. While an apply is
// prepared no other apply runs and no buffer registers (both Busy).
//
// An FP8 receiver (docs/live.md, "FP8 receivers") holds some tensors as
// block-scaled E4M3 bytes and their scales (sync/transfer/fp8_plan.h). For
// them step 2 also computes, per quantized tensor that changed, its FP8
// change set between L and T (kernels::Fp8ChangesAt over the changed
// elements, on the BF16 content of the touched FP8 block rows), and step 3
// writes only the E4M3 bytes and scales that changed.
//
// The apply reads versions, and reports, through a LiveMount
// (sync/live/live_mount.h), which the mount implements. The implementation
// is one file per concern, FP8 receivers' part of each in a *_fp8.cc
// beside it: live.cc (Apply, the view, status), live_changes.cc and
// live_changes_fp8.cc (steps 1-2), live_scatter.cc, live_writes.cc and
// live_scatter_fp8.cc (receiver buffers), live_pages.cc (the page cache),
// live_registry.cc and live_registry_fp8.cc (receivers).
//
// Thread-safety: all methods may be called concurrently; applies are
// serialized (a second one fails with Busy). Reads of live/ hold a
// ReadGuard for as long as their reply is being written.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "store/base/status.h"
#include "store/base/thread_annotations.h"
#include "store/store.h"
#include "sync/live/live_abi.h"
#include "sync/live/live_mount.h"
#include "sync/live/page_cache.h"
#include "sync/transfer/fp8_plan.h"
#include "sync/transfer/transfer_plan.h"

namespace dte::live {

// The version live/ shows, with its chain (reads and applies use it even
// after the version left the store).
struct LiveView {
  std::shared_ptr<const Version> version;
  VersionChain chain;
  mutable std::atomic<int64_t> readers{0};  // Live::ReadGuard objects on this view
};

// What the page-cache step of the last apply did (.dte/status, "live" ->
// "last_pages"; docs/live.md). Times are summed over the threads.
struct LivePageStats {
  uint64_t patched_pages = 0;    // fetched from the page cache, patched and stored back
  uint64_t read_path_pages = 0;  // stored from the read path (headers, other files, fallbacks)
  uint64_t skipped_pages = 0;    // found evicted when fetched: not stored
  uint64_t refreshed_pages = 0;  // patched pages a concurrent read refilled: stored again
  uint64_t fetches = 0, stores = 0;
  uint64_t fetch_ns = 0, patch_ns = 0, store_ns = 0, read_ns = 0;
  uint64_t resident_ns = 0;  // finding the resident pages
};

class Live {
 public:
  Live(Store* store, LiveMount* mount);
  ~Live();
  Live(const Live&) = delete;
  Live& operator=(const Live&) = delete;

  // Makes v live if nothing is (the first version a mount sees).
  void InitIfUnset(const std::shared_ptr<const Version>& v) EXCLUDES(view_mu_);
  // The live view; null before any version was live.
  std::shared_ptr<const LiveView> View() EXCLUDES(view_mu_);

  // Held by a read of a live/ file from before it picks the view until its
  // reply is written, so an apply knows when no read of the old version is
  // left in flight. The read uses view(). Each view counts its guards; an
  // apply waits for the old view's count to reach zero after the switch
  // (new reads take the new view, so the wait is bounded however busy the
  // readers are).
  class ReadGuard {
   public:
    explicit ReadGuard(Live* live);
    ~ReadGuard();
    ReadGuard(const ReadGuard&) = delete;
    ReadGuard& operator=(const ReadGuard&) = delete;
    // Null before any version is live.
    const std::shared_ptr<const LiveView>& view() const { return view_; }

   private:
    std::shared_ptr<const LiveView> view_;
  };

  // Called by a read of live/ file `file`, bytes [offset, offset + len),
  // served from `view`, before its reply is written: while an apply replaces
  // pages of that view, it refreshes the pages such reads may have filled
  // (docs/live.md, "The page cache"). Two atomic loads when no apply runs.
  void NoteRead(const LiveView* view, uint32_t file, uint64_t offset, uint64_t len)
      EXCLUDES(noted_mu_);

  // The changed set of an apply (sync/live/internal/live_changes.h).
  struct BlockChange;
  struct Changes;
  // The FP8 change sets of an apply for one block size and scale rule
  // (sync/live/internal/live_fp8.h).
  struct Fp8Sets;
  // What writing an FP8 receiver's host buffers back needs
  // (sync/live/internal/live_fp8.h).
  struct Fp8Undo;

  // Registers one buffer for `owner`, on behalf of a process of user `uid`.
  // Checks the layout against the live version (the name exists for that
  // layout and rank, dtype and shape match), the owner's earlier layout and
  // FP8 options, and for host buffers the /dev/shm object (a regular file of
  // uid, or any for root, large enough). An F8_E4M3 buffer or a scale buffer
  // ("<module>.weight_scale_inv", F32) is checked against the receiver's
  // FP8 plan (MakeFp8ReceiverPlan: block-aligned splits, quantized 2-D
  // tensors, scale grid shapes). Returns the buffer id.
  Result<uint64_t> Register(uint64_t owner, uid_t uid, const dte_live_register& r)
      EXCLUDES(receivers_mu_, view_mu_);
  // Which tensors FP8 receivers hold in FP8 (store/fp8_policy.h): the
  // mount's FP8 view policy, so a receiver loaded from MOUNT/fp8 registers
  // the tensors it has. Applies to registrations made after the call.
  void SetFp8Policy(Fp8Policy policy) EXCLUDES(receivers_mu_);
  // The inference servers whose ranks registered here (docs/live.md,
  // "Servers"), by name.
  struct Server {
    std::string name;
    int size = 1;
    std::vector<int> ranks;  // registered, increasing
    bool complete = false;   // every rank 0 .. size-1 registered
    uint64_t version = 0;    // the live version, which their buffers hold
  };
  std::vector<Server> Servers() EXCLUDES(receivers_mu_, view_mu_);
  // Drops buffer `id` of owner (0: all of them).
  Status Unregister(uint64_t owner, uint64_t id) EXCLUDES(receivers_mu_);
  // Forgets every buffer of owner.
  void Drop(uint64_t owner) EXCLUDES(receivers_mu_);

  // Makes `target` live (see the top of this file). Busy if another apply is
  // running. `pages` may be null (no page cache to update).
  Result<dte_live_counts> Apply(const std::shared_ptr<const Version>& target, PageCache* pages)
      EXCLUDES(receivers_mu_, view_mu_, status_mu_);

  // The two phases of an apply (see the top of this file). Prepare fills
  // *id (never 0) and returns the counts of steps 1-2; it refuses (Busy)
  // while another apply runs or is prepared. Commit and Abort take the id
  // from the same owner; any other is FailedPrecondition.
  Result<dte_live_counts> Prepare(uint64_t owner, const std::shared_ptr<const Version>& target,
                                  uint32_t* id) EXCLUDES(receivers_mu_, view_mu_, status_mu_);
  Result<dte_live_counts> Commit(uint64_t owner, uint32_t id, PageCache* pages)
      EXCLUDES(receivers_mu_, view_mu_, status_mu_);
  Status Abort(uint64_t owner, uint32_t id);
  // The prepared apply, if one is held (.dte/status, "live" -> "prepared").
  struct PreparedInfo {
    uint32_t id = 0;
    uint64_t from_version = 0, to_version = 0;
    std::vector<Server> servers;  // the registered ranks Prepare saw; version: from_version
  };
  std::optional<PreparedInfo> Prepared() EXCLUDES(prepared_mu_);

  // Counts a failed apply (also one refused before it reached Apply).
  void RecordFailure(const dte::Status& s) EXCLUDES(status_mu_);

  // For DTE_IOC_STATUS and .dte/status (latest_version is filled by the
  // caller).
  dte_live_status GetStatus() EXCLUDES(receivers_mu_, view_mu_, status_mu_);
  // The page-cache step of the last successful apply.
  LivePageStats LastPageStats() EXCLUDES(status_mu_);

 private:
  // A registered buffer: host memory mapped from /dev/shm, or device memory
  // opened from a CUDA IPC handle.
  struct Buffer {
    uint64_t id = 0;
    std::string name;
    uint32_t receiver_tensor = 0;  // index into the plan's receiver_tensors[rank]
    // What the buffer holds of that tensor: its elements as the layout has
    // them, or (FP8 receivers) its E4M3 bytes or its block scales.
    enum class Role : uint8_t { kElements, kFp8Bytes, kFp8Scales };
    Role role = Role::kElements;
    int width = 0;
    uint64_t elements = 0;
    uint32_t kind = DTE_LIVE_HOST_SHM;
    void* map = nullptr;  // host: the (page-aligned) mapping, CUDA: the opened allocation ...
    size_t map_len = 0;
    uint8_t* data = nullptr;  // ... and the tensor's first byte in it (at the caller's offset)
    Buffer() = default;
    Buffer(const Buffer&) = delete;
    Buffer& operator=(const Buffer&) = delete;
    ~Buffer();
  };
  struct Receiver {
    ShardLayout layout;
    int rank = 0;  // also its rank in `server`
    uid_t uid = 0;
    // The inference server it is a rank of (docs/live.md, "Servers"); empty:
    // none (server_size 1).
    std::string server;
    int server_size = 1;
    uint32_t fp8_block = 0, fp8_rule = 0;        // as registered (dte_live_register)
    std::shared_ptr<const Fp8ReceiverPlan> fp8;  // made by its first FP8 buffer
    std::vector<std::unique_ptr<Buffer>> buffers;
  };
  struct Plan {
    TransferPlan plan;
    std::vector<std::vector<uint32_t>> ops_by_canonical;  // indices into plan.ops
  };
  // Steps 1-2 of an apply (the changed set and its FP8 sets), held between
  // the two phases; defined in live.cc.
  struct Staged;
  // Steps 1-2 into a Staged, with the server check when `whole_servers`.
  Result<std::unique_ptr<Staged>> Stage(const std::shared_ptr<const Version>& target,
                                        bool whole_servers)
      EXCLUDES(receivers_mu_, view_mu_, status_mu_);
  // Claims applying_ (Busy if taken) and stages; a failure releases it and
  // is counted.
  Result<std::unique_ptr<Staged>> Begin(const std::shared_ptr<const Version>& target,
                                        bool whole_servers)
      EXCLUDES(receivers_mu_, view_mu_, status_mu_, prepared_mu_);
  // Step 3 on it (`expect`: the servers' ranks must be these; null: every
  // server complete), the switch and the page cache. Clears applying_.
  Result<dte_live_counts> Finish(Staged* staged, PageCache* pages,
                                 const std::vector<Server>* expect)
      EXCLUDES(receivers_mu_, view_mu_, status_mu_);
  // Takes the prepared apply if owner holds id (FailedPrecondition otherwise).
  Result<std::unique_ptr<Staged>> TakePrepared(uint64_t owner, uint32_t id, const char* what)
      EXCLUDES(prepared_mu_);
  Status CheckLayout(const Version& from, const Version& to);
  // Fills counts->entries, blocks and compared_blocks.
  Result<std::vector<Changes>> ChangedSet(const LiveView& from, const LiveView& to,
                                          dte_live_counts* counts);
  Result<const Plan*> PlanFor(const Version& v, const ShardLayout& layout) REQUIRES(receivers_mu_);
  // A registration's server against the owner's earlier registrations and
  // the other ranks of that server: the same size, a rank nobody else has.
  Status CheckServer(uint64_t owner, const std::string& server, int size, int rank,
                     const std::string& what) REQUIRES(receivers_mu_);
  // The registered servers (version unset), and FailedPrecondition naming
  // the first that lacks a rank.
  std::vector<Server> ServersLocked() REQUIRES(receivers_mu_);
  Status ServersComplete() REQUIRES(receivers_mu_);
  Status Scatter(const Version& v, const std::vector<Changes>& changes,
                 const std::vector<Fp8Sets>& fp8, dte_live_counts* counts,
                 const std::vector<Server>* expect) EXCLUDES(receivers_mu_);
  // Null when the registered servers' sizes and ranks are `expect`'s, else
  // Aborted naming the first that changed.
  Status ServersAre(const std::vector<Server>& expect) REQUIRES(receivers_mu_);
  // What a registration's buffer holds (live_registry_fp8.cc for FP8 ones).
  struct BufferSpec {
    uint32_t receiver_tensor = 0;
    Buffer::Role role = Buffer::Role::kElements;
    int width = 0;
    uint64_t elements = 0;
  };
  Result<BufferSpec> Spec(const dte_live_register& r, const std::string& name, const Plan& plan,
                          std::shared_ptr<const Fp8ReceiverPlan>* fp8, const std::string& what,
                          uint64_t live) REQUIRES(receivers_mu_);
  // An FP8 buffer's spec against the receiver's FP8 plan *fp8, made first
  // when null.
  Result<BufferSpec> Fp8Spec(const dte_live_register& r, const std::string& name, const Plan& plan,
                             std::shared_ptr<const Fp8ReceiverPlan>* fp8, const std::string& what)
      REQUIRES(receivers_mu_);
  // Writes the FP8 change sets into rc's FP8 buffers (live_scatter_fp8.cc);
  // false when a write failed. Adds the bytes (E4M3 bytes and 4 per scale)
  // and the buffers written. With `log`, what the host buffers held where
  // they are written is kept in it; with `undo` too, that is written back
  // instead (Fp8Undo).
  static bool WriteFp8(const Receiver& rc, const std::vector<Fp8Sets>& sets, uint64_t* bytes,
                       uint64_t* buffers, Fp8Undo* log = nullptr, bool undo = false);
  // The FP8 change sets the registered FP8 receivers need (live_changes_fp8.cc).
  Result<std::vector<Fp8Sets>> Fp8ChangedSets(const LiveView& from, const LiveView& to,
                                              const std::vector<Changes>& changes)
      EXCLUDES(receivers_mu_);
  // Step 6 (live_pages.cc).
  Status PushPages(const LiveView& from, const LiveView& to, const std::vector<Changes>& changes,
                   PageCache* pages, uint64_t* pushed, LivePageStats* stats) EXCLUDES(noted_mu_);
  struct NotedRead {
    uint32_t file;
    uint64_t offset, len;
  };
  void WatchReads(const LiveView* view) EXCLUDES(noted_mu_);
  std::vector<NotedRead> StopWatchingReads() EXCLUDES(noted_mu_);

  Store* const store_;
  LiveMount* const mount_;

  Mutex view_mu_;
  std::shared_ptr<const LiveView> view_ GUARDED_BY(view_mu_);

  std::atomic<bool> applying_{false};  // an apply runs or is prepared

  Mutex prepared_mu_;
  std::unique_ptr<Staged> prepared_ GUARDED_BY(prepared_mu_);
  uint32_t next_prepared_id_ GUARDED_BY(prepared_mu_) = 1;

  // Reads of the view an apply is replacing pages for (NoteRead).
  std::atomic<const LiveView*> watched_{nullptr};
  Mutex noted_mu_;
  std::vector<NotedRead> noted_ GUARDED_BY(noted_mu_);

  Mutex receivers_mu_;
  std::map<uint64_t, Receiver> receivers_ GUARDED_BY(receivers_mu_);  // by owner
  uint64_t next_buffer_id_ GUARDED_BY(receivers_mu_) = 1;
  Fp8Policy fp8_policy_ GUARDED_BY(receivers_mu_);
  // Plans by (tp, fuse_qkv, fuse_gate_up). Every version an apply accepts
  // has the layout of the first live version, so they stay valid.
  std::map<std::tuple<int, bool, bool>, Plan> plans_ GUARDED_BY(receivers_mu_);

  Mutex status_mu_;
  uint64_t applies_ GUARDED_BY(status_mu_) = 0;
  uint64_t failed_applies_ GUARDED_BY(status_mu_) = 0;
  int64_t last_apply_time_ GUARDED_BY(status_mu_) = 0;
  int32_t last_error_ GUARDED_BY(status_mu_) = 0;
  std::string last_message_ GUARDED_BY(status_mu_);
  dte_live_counts last_ GUARDED_BY(status_mu_) = {};
  LivePageStats last_pages_ GUARDED_BY(status_mu_);
};

}  // namespace dte::live
