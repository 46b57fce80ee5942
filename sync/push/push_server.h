// Same-cluster push: a trainer delivers each published version's changed
// elements straight into the weights of registered receivers (the ranks of
// inference servers), remapped to each receiver's tensor-parallel, fused
// layout (sync/transfer/transfer_plan.h), over TCP. The store commit of the same
// step carries the same version number and bytes; the push is the fast
// path, the store the path every receiver can always fall back to.
//
// PushServer (trainer side) listens on an address. A PushReceiver connects
// and says which receiver rank and layout it is, the tensors it holds
// (names, dtypes, shapes in its layout) and the version they hold; the
// server checks them against the transfer plan of its latest version and
// answers with that version. After each publish, Push() sends every
// receiver that holds the parent version its part of the changes in two
// rounds, as sync/transfer/p2p.h does (round 1: the count of each plan op of that
// receiver with changes, with the receiver tensor it lands in; round 2:
// each such op's entries at receiver-local indices, encoded with the delta
// codec, sync/push/internal/push_wire.h, a batch of tensors at a time), and
// waits, bounded by the timeout, for each to confirm receipt. A receiver
// that fails, stalls past the timeout or answers with an error is dropped
// (its connection closed) and reported; the push still completes. A
// receiver that holds another version is told it is behind and catches up
// from the store (PushReceiver::CatchUp) before it is pushed to again.
//
// A push may come in parts from several servers (SetGroup: the ranks of a
// distributed publisher, each sending the tensors it owns). A receiver then
// connects to every part's server (part 0's welcome names them), and
// confirms a version to each only once every part of it is in and checked.
// Wire format and states: docs/push.md.
//
// Every connection starts with the job secret's handshake, both ways
// (sync/transport/auth_handshake.h) when the job has a secret: a connection
// that does not prove it knows it is refused, logged (stderr and the
// server's events, with the peer's address) and closed before its hello is
// read; a receiver sends nothing but the handshake to, and takes nothing
// from, a server that does not prove it. Without a secret the server
// listens on loopback only.
//
// An FP8 receiver (PushReceiverOptions::fp8) holds the tensors the FP8
// policy quantizes as E4M3 bytes and block scales (sync/transfer/fp8_plan.h).
// For each changed tensor it quantizes, the server reads the parent from the
// store, computes the FP8 change set once per block shape and scale rule,
// and sends each FP8 receiver the bytes and scales that changed in its
// layout (FP8 counts: each entry says whether it writes elements, E4M3
// bytes or scales). Receivers of the same FP8 options, layout and rank
// share messages; a split that does not fall on the blocks is refused.
//
// A receiver checks a whole push (every count against its tensor, every
// index in range, the parent against the version it holds) before it
// writes a byte; pushes are applied in version order; it always knows the
// version it holds, or that it is inconsistent (a catch-up failed part way).
//
// Thread-safety: PushServer: Push() from one thread at a time; Status()
// from any. PushReceiver: every method from any thread; tensors are written
// only by ApplyPending/WaitFor/CatchUp (or, with auto_apply, the receiver's
// own thread).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "store/base/status.h"
#include "sync/push/changes.h"
#include "sync/transfer/fp8_plan.h"
#include "sync/transfer/transfer_plan.h"

namespace dte {

class Store;
struct Version;

struct PushServerOptions {
  std::string address = "127.0.0.1:0";  // HOST:PORT to listen on; port 0: any free port
  // The job secret every connection must prove it knows before its hello
  // is read (sync/transport/job_secret.h); empty: DTE_JOB_SECRET, DTE_JOB_SECRET_FILE,
  // else rendezvous_dir's secret file. Without one the server listens on
  // loopback only (Start refuses any other address).
  std::string secret;
  std::string rendezvous_dir;
  // The host receivers reach this server at (address()); empty: the listen
  // host, or this machine's host name when it listens on every interface.
  std::string advertise;
  // Receiver ranks expected (an inference fleet's TP ranks; 0: not said):
  // each push reports how many of them it did not reach (PushReport::missing).
  uint64_t receivers = 0;
  // Bound on each push (sending to every receiver and their confirmations)
  // and on a new connection's hello.
  std::chrono::milliseconds timeout{30000};
  // The most bytes of round 2 queued for one receiver before a push waits
  // for it to take them.
  uint64_t queue_bytes = uint64_t{64} << 20;
  // A push packs consecutive tensors of about this many changed entries
  // together (their pieces in parallel).
  uint64_t batch_entries = uint64_t{1} << 22;
  // Round 1 packs the data of round 2 too while what it kept stays under
  // this many bytes (about 1.2 per changed BF16 element and distinct
  // receiver layout and rank); the rest of the changes are read and packed
  // again in round 2. A distributed publisher's rank that pushes what it
  // owns also keeps up to this many bytes of the changes it encodes (12 per
  // element) for its push, and reads the rest back from the store.
  uint64_t cache_bytes = uint64_t{256} << 20;
  // FP8 receivers: the most bytes of block summaries the server holds, the
  // last pushed version's and a push's new ones together (40 per block of
  // each quantized tensor and block shape and rule: about 1.6 GB for 671B
  // parameters at 128 x 128, 40 per element at 1 x 1; docs/push.md "FP8
  // receivers"). A tensor whose summary does not fit is read whole.
  uint64_t fp8_summary_bytes = uint64_t{4} << 30;
};

// One receiver as the server sees it.
struct PushReceiverInfo {
  uint64_t id = 0;  // connection number, unique for the server's life
  int rank = 0;
  ShardLayout layout;
  std::optional<Fp8ReceiverOptions> fp8;  // an FP8 receiver's options
  std::optional<uint64_t> version;        // what it holds or was sent; nullopt: unknown
  bool behind = false;                    // told to catch up
  uint64_t pushes = 0, elements = 0, bytes = 0;
  // The inference server it is a rank of (its hello; empty: none), and
  // what it last reported of that server: the version the server's ranks
  // agreed on and applied, or that they hold none in common.
  std::string server;
  int server_size = 1;
  std::optional<uint64_t> server_version;
  bool server_inconsistent = false;
  std::string server_error;
};

// An inference server as its connected ranks report it (docs/push.md
// "Servers").
struct PushServerGroup {
  std::string name;
  int size = 0;            // ranks it has (the ranks' hellos)
  std::vector<int> ranks;  // connected ranks, increasing
  bool complete = false;   // every rank of 0 .. size-1 is connected
  // The version its ranks agreed on and applied (the lowest any connected
  // rank reported; nullopt before every one reported); staleness: the
  // server's latest version minus it.
  std::optional<uint64_t> version;
  std::optional<uint64_t> staleness;
  bool inconsistent = false;  // a rank reported its ranks hold no version in common
  std::string error;          // why
};

struct PushReport {
  uint64_t version = 0;
  uint64_t pushed = 0;    // receivers that confirmed the push
  uint64_t behind = 0;    // receivers told to catch up instead
  uint64_t elements = 0;  // elements sent, over all receivers
  uint64_t bytes = 0;     // bytes sent, both rounds, over all receivers
  double seconds = 0;
  double pack_seconds = 0;           // of which remapping and encoding every receiver's messages
  std::vector<std::string> dropped;  // one line per receiver dropped, with the reason
  uint64_t missing = 0;              // options' receivers that did not confirm this push
  // FP8 receivers' change sets: parent tensors read from the store whole,
  // and the bytes of parent tensors read in all (both passes; docs/push.md
  // "FP8 receivers").
  uint64_t fp8_parent_reads = 0;
  uint64_t fp8_parent_bytes = 0;
};

// {"version", "pushed", "behind", "missing", "elements", "bytes", "seconds",
// "pack_seconds", "dropped": [...], "fp8_parent_reads", "fp8_parent_bytes"}
std::string PushReportJson(const PushReport& r);

class PushServer {
 public:
  static Result<std::unique_ptr<PushServer>> Start(const PushServerOptions& options);
  ~PushServer();

  // The port it listens on (the bound one when options asked for port 0).
  int port() const;
  // HOST:PORT receivers reach it at (options' advertise and the port).
  std::string address() const;

  // Pushes from several senders (a distributed publisher whose every rank
  // pushes the tensors it owns): this server sends part `part` of `parts`
  // of each push. Part 0's server is the one receivers are given; with
  // parts > 1 it answers their hellos only once SetSenders has named every
  // part's address, which its welcome hands them, and they connect to each.
  // Default: part 0 of 1.
  Status SetGroup(int part, int parts);
  // Every part's address (index = part; senders.size() = parts).
  Status SetSenders(const std::vector<std::string>& senders);
  int part() const;
  int parts() const;
  uint64_t cache_bytes() const;

  // Makes `v` the version new receivers are checked against and told of
  // (done by Push; a publisher calls it once at open with its latest).
  Status SetLatest(Store& store, const std::shared_ptr<const Version>& v);

  // Sends `changes` (canonical tensors of v; tensors not named are
  // unchanged) to every receiver holding v's parent. Never fails for a
  // receiver's fault: those are dropped and listed in the report. Fails
  // (InvalidArgument naming the tensor) only for changes that do not fit v.
  Result<PushReport> Push(Store& store, const std::shared_ptr<const Version>& v,
                          const std::vector<TensorChanges>& changes);
  // The same from a source read a batch of consecutive tensors at a time
  // (batch_entries; read twice past options' cache_bytes); round 2 is sent
  // a batch at a time, each receiver's queue kept under queue_bytes (a slow
  // receiver makes the push wait for it, up to the timeout), so the
  // server's memory is bounded whatever the version's size.
  Result<PushReport> Push(Store& store, const std::shared_ptr<const Version>& v,
                          ChangesSource& changes);

  std::vector<PushReceiverInfo> Receivers() const;
  // The inference servers receivers said they are ranks of, by name.
  std::vector<PushServerGroup> Servers() const;
  // Lines about receivers refused or dropped, oldest first (the newest
  // 1000), taken.
  std::vector<std::string> TakeEvents();
  // Connections refused because they did not prove they know the job
  // secret (no handshake, a wrong proof, none within the timeout).
  uint64_t refused() const;
  // {"port", "address", "authenticated" (whether it has a job secret),
  // "refused", "part", "parts", "expected" (options' receivers),
  // "receivers": [{"id", "rank", "tp", "fuse_qkv", "fuse_gate_up", "fp8"
  // (null, or {"block", "scale_rule", "skip_modules", "skip_substrings"}), "version"
  // (null: unknown), "behind", "pushes", "elements", "bytes", "server",
  // "server_size"}], "servers": [{"name", "size", "ranks", "complete",
  // "version", "staleness", "inconsistent", "error"}], "events":
  // [...]} (the events are taken; with take_events false, "events" is
  // empty and they stay for a later call).
  std::string StatusJson(bool take_events = true);

  class Impl;

 private:
  explicit PushServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace dte
