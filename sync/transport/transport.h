// Point-to-point transport between the ranks of one job: the interface the
// two-round protocol (sync/transfer/p2p.h) runs on, a TCP implementation (separate
// processes, loopback or any reachable host) and an NCCL implementation.
//
// Exchange posts a group of sends and receives and waits for all of them,
// like an NCCL group of ncclSend/ncclRecv. Contract for callers:
//   - Messages between one ordered pair of ranks match in posting order: the
//     k-th send from a to b is the k-th receive by b from a, across the whole
//     life of the transport. Sizes must agree; the TCP transport checks and
//     fails with Corruption naming the peer when they do not.
//   - Every rank must post matching groups (same messages, any grouping the
//     pairwise order allows). A rank may send to itself.
//   - Every Exchange completes, fails naming a peer, or fails on the
//     transport's timeout; it never blocks longer. After a failure the
//     transport is broken and every later call returns the same error.
//   - Zero-byte messages are allowed.
//
// Rendezvous: every rank gets the same fresh directory (a temp dir on a
// shared or local filesystem); ranks publish their addresses there, and the
// NCCL transport its unique id. The directory must not be reused by a
// concurrent job.
//
// Thread-safety: a Transport is used by one thread at a time.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <span>
#include <string>

#include "store/base/status.h"

namespace dte {

struct SendBuffer {
  int peer = 0;
  const void* data = nullptr;
  size_t bytes = 0;
};

struct RecvBuffer {
  int peer = 0;
  void* data = nullptr;
  size_t bytes = 0;
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Runs every send and receive as one group; returns when all are done.
  // Buffers are borrowed until then. Errors name the peer (Unavailable for
  // a closed connection, DeadlineExceeded for a timeout, Aborted when a peer
  // aborted the exchange, Corruption for a size mismatch).
  virtual Status Exchange(std::span<const SendBuffer> sends, std::span<const RecvBuffer> recvs) = 0;
};

struct TransportOptions {
  int rank = 0;
  int size = 1;
  std::string rendezvous_dir;
  // Bound on each blocking step: connecting to all peers, and each Exchange.
  std::chrono::milliseconds timeout{60000};
  // The job secret the TCP transport's ranks prove to each other on every
  // connection (sync/transport/job_secret.h); empty: DTE_JOB_SECRET,
  // DTE_JOB_SECRET_FILE, else the rendezvous directory's secret file, which
  // rank 0 creates (mode 0600) when none of these gives one.
  std::string secret;
};

// Connects rank `rank` to every other rank over TCP (IPv4 loopback; each
// rank listens on an ephemeral port it publishes in the rendezvous
// directory). Returns once all size - 1 connections are up. Every
// connection starts with the job secret's handshake, both ways
// (sync/transport/auth_handshake.h), before a rank's hello: a connection
// that does not prove the secret is logged (stderr, with its address and
// why), closed and not counted as a rank; the ranks go on waiting for
// theirs.
Result<std::unique_ptr<Transport>> ConnectTcpTransport(const TransportOptions& options);

struct NcclTransportOptions {
  TransportOptions base;
  int device = 0;  // CUDA device of this rank
  // ncclSend/ncclRecv calls per ncclGroupStart/End. NCCL can hang when one
  // group holds tens of thousands of operations; chunks are cut in one
  // global message order so every rank's chunks line up (docs/transfer.md).
  size_t max_ops_per_group = 2048;
};

class ObjectStore;

// Ranks that share nothing but a store (a directory on shared storage, or an
// S3 bucket): every message is an object under `prefix` (a fresh prefix per
// job, for example "exchange/<run id>/", in the store's namespace), written
// by its sender and read, then deleted, by its receiver, which polls for it
// (every poll_interval) until the timeout. A rank whose Exchange fails
// writes `<prefix>abort-<rank>` with its reason; peers waiting on it fail
// naming it. Messages left by dead ranks are removed by gc after its grace
// window (docs/formats/store-layout.md, "exchange/"). `objects` must
// outlive the transport.
struct StoreTransportOptions {
  TransportOptions base;  // rank, size, timeout (rendezvous_dir unused)
  std::string prefix;
  std::chrono::milliseconds poll_interval{20};
};
Result<std::unique_ptr<Transport>> ConnectStoreTransport(ObjectStore* objects,
                                                         const StoreTransportOptions& options);

// An NCCL communicator over the same rendezvous (rank 0 publishes the unique
// id). Exchange takes host buffers and stages them through device memory.
// Built without NCCL, returns Unimplemented.
Result<std::unique_ptr<Transport>> ConnectNcclTransport(const NcclTransportOptions& options);

}  // namespace dte
