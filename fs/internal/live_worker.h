// LiveWorker: runs live applies for the DTE_IOC_APPLY handler, off the FUSE
// request threads.
//
// The ioctl handler hands the request over (Submit) and returns without
// replying; the worker thread runs Filesystem::ApplyLive and then replies.
// Page-cache notifications (fuse_lowlevel_notify_store) are sent from this
// thread and the worker threads it starts, never from inside a request
// handler: the kernel may hold locks
// while it waits for a handler's reply, and a notification needing one of
// them would deadlock. Residency comes from mincore(2) on a mapping of
// MOUNT/live/<file>, opened by this thread through the mount itself (the
// request threads answer those lookups and opens).
//
// Thread-safety: Submit may be called from any thread; one apply at a time
// (a second Submit while one is queued or running is refused).
#pragma once

#define FUSE_USE_VERSION 34
#include <fuse_lowlevel.h>

#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "fs/filesystem.h"

namespace dte::fs {

class LiveWorker {
 public:
  LiveWorker(Filesystem* fs, fuse_session* se, std::string mountpoint);
  ~LiveWorker();  // finishes the apply in progress, if any
  LiveWorker(const LiveWorker&) = delete;
  LiveWorker& operator=(const LiveWorker&) = delete;

  // One DTE_IOC_APPLY request: an apply, or the prepare or commit phase of
  // one (flags, DTE_LIVE_APPLY_*) for control file `owner`.
  struct Request {
    fuse_req_t req = nullptr;
    uint32_t flags = 0;
    std::optional<uint64_t> version;  // nullopt: the newest
    uint64_t owner = 0;
    uint32_t prepared = 0;  // COMMIT: the prepared apply's id
  };
  // Queues a request whose reply goes to r.req. False (nothing queued) if
  // one is queued or running.
  bool Submit(const Request& r);

 private:
  void Run();

  Filesystem* const fs_;
  fuse_session* const se_;
  const std::string mountpoint_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  bool busy_ = false;
  Request req_;
  std::thread thread_;
};

// Fails a live ioctl with errno `err`: -err as the result, and *out (any
// struct of sync/live/live_abi.h with error and message) with the message. The
// kernel copies the struct out even though the command fails, so the caller
// gets the message along with errno.
template <typename T>
void ReplyLiveError(fuse_req_t req, int err, T* out, const std::string& message) {
  out->abi_version = DTE_LIVE_ABI_VERSION;
  out->error = err;
  std::snprintf(out->message, sizeof out->message, "%s", message.c_str());
  fuse_reply_ioctl(req, -err, out, sizeof *out);
}

// Replies to a DTE_IOC_APPLY request: the counts (and a prepare's id) on
// success, else -errno with the message in the struct.
void ReplyApply(fuse_req_t req, const Result<dte_live_counts>& r, uint32_t prepared = 0);

}  // namespace dte::fs
