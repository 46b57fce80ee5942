// Committing a Hugging Face checkpoint directory as a new store version.
//
// The directory is scanned and validated first; nothing is written to the
// store until every header, the shard index and every file size check out.
// Then blobs are written (durable on return), the block table, and last the
// manifest, created exclusively: the version exists exactly when its
// manifest does. A publisher that loses a race for the version number gets
// AlreadyExists naming the version. A version is a sparse delta against the
// latest version when its tensor layout matches, otherwise an anchor; the
// anchor policy (CommitOptions::anchor_policy) adds a full table to some
// deltas. The parent's blocks come from its snapshot in the cache directory
// when one is there (else from the store, walking at most to the nearest
// self-contained version), and the commit leaves a snapshot of the new
// version for the next one; a commit without a cache directory, or whose
// snapshot cannot be written, still commits.
//
// Thread-safety: CommitDirectory may run concurrently with readers and with
// other publishers (in this or other processes) on the same store.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "store/base/status.h"
#include "store/write/anchor_policy.h"

namespace dte {

class Store;

struct CommitOptions {
  std::optional<uint64_t> version;  // default: latest + 1, or 0 for an empty store
  bool force_anchor = false;        // store full weights even if a delta is possible
  // When a delta also carries a full table (store/write/anchor_policy.h).
  AnchorPolicy anchor_policy;
  // Leave a materialized snapshot of the new version in the store's cache
  // directory (store/snapshot.h) and read the parent's blocks from its
  // snapshot when there is one; keep at most this many snapshots there,
  // the newest. 0: none written (an existing parent snapshot is still read).
  uint32_t keep_snapshots = 3;
  // Which versions get one: a version stored whole (an anchor, or one with
  // a full or join table), and a delta whose chain has no snapshot on this
  // host within the last snapshot_every - 1 versions, so a parent is read
  // from a snapshot plus at most that many deltas (in a run of plain
  // deltas, the versions dtefs's --snapshot-every picks). 1: every version.
  uint32_t snapshot_every = 8;
  // Called with (bytes done, bytes total) as files are processed.
  std::function<void(uint64_t, uint64_t)> progress;
};

struct CommitResult {
  uint64_t version = 0;
  std::optional<uint64_t> parent;
  std::string anchor_reason;  // why a version became an anchor or policy anchor ("" for a delta)
  bool full_table = false;    // a delta that also carries a full table (a policy anchor)
  uint64_t full_bytes = 0;    // the full table's payload bytes (compressed)
  std::string join_reason;    // why a join table was built ("" for none)
  bool join_table = false;    // ...and was stored (else join_error says why not)
  uint64_t join_bytes = 0;
  std::string join_error;
  uint64_t parent_snapshot_blocks = 0;  // parent blocks read from a snapshot
  std::string snapshot;                 // the new version's snapshot file, or why none was left
  uint64_t tensors = 0;
  uint64_t elements = 0;
  uint64_t changed_elements = 0;
  uint64_t stored_bytes = 0;  // bytes of blobs this version added
  uint64_t dense_bytes = 0;   // bytes of all tensor data of the version
  uint64_t input_bytes = 0;   // bytes of all files read from the directory
};

Result<CommitResult> CommitDirectory(Store& store, const std::string& dir,
                                     const CommitOptions& options);

}  // namespace dte
