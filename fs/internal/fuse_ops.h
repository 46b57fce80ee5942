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

#include <memory>

#include "fs/filesystem.h"
#include "store/status.h"
#include "store/store.h"

namespace dte::fs {

// The userdata of a dtefs session. The session exists (and is mounted)
// before the store is opened, since a daemon opens it after forking; fs is
// set before the request loop starts and outlives it.
struct MountState {
  std::unique_ptr<Store> store;
  std::unique_ptr<Filesystem> fs;
};

int ErrnoOf(const Status& s);
const fuse_lowlevel_ops& FilesystemOps();

}  // namespace dte::fs
