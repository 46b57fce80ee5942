// The libfuse low-level operations table of dtefs.
//
// One thin adapter per operation: it unpacks the request, calls the
// matching fs::Filesystem method, and sends exactly one reply. Status codes
// become errno values in ErrnoOf(), the only place that mapping happens.
//
// Thread-safety: the adapters run concurrently on libfuse's worker threads;
// they share only the Filesystem (itself thread-safe) reached through
// the MountState passed as userdata.
#pragma once

#define FUSE_USE_VERSION 34
#include <fuse_lowlevel.h>

#include <atomic>
#include <cstdint>
#include <memory>

#include "fs/filesystem.h"
#include "store/base/status.h"
#include "store/snapshot.h"
#include "store/store.h"

namespace dte::fs {

// The userdata of a dtefs session. The session exists (and is mounted)
// before the store is opened, since a daemon opens it after forking; fs is
// set before the request loop starts and outlives it. Members are destroyed
// in reverse order: fs before the snapshots its reads use, both before the
// store.
class LiveWorker;

struct MountState {
  std::unique_ptr<Store> store;
  std::unique_ptr<SnapshotSet> snapshots;  // null: no snapshots
  std::unique_ptr<Filesystem> fs;
  uint32_t readahead_kb = 0;  // asked for in INIT (0: the kernel's default)
  // The readahead handshake. The kernel holds every request until it has
  // processed the INIT reply, which lowers the mount's readahead window, and
  // a file takes the window in effect when it is opened. So the first
  // request sets `serving` and waits for `tuned`, which the thread that sets
  // the window (dtefs.cc) sets when it is done, before any file is opened.
  // `tuned` starts true: without that thread, requests do not wait.
  std::atomic<bool> serving{false};
  std::atomic<bool> tuned{true};
  // Runs live applies (null: DTE_IOC_APPLY fails with EBUSY); set before the
  // request loop starts.
  LiveWorker* live_worker = nullptr;
};

// The errno of a failed read of an open file: as ErrnoOf, except that a
// missing blob or parent version (NotFound) is an I/O error of that read,
// not ENOENT (the file itself exists and stays open).
int ReadErrnoOf(const Status& s);
const fuse_lowlevel_ops& FilesystemOps();

}  // namespace dte::fs
