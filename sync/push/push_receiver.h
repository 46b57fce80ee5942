// The receiving end of a same-cluster push (sync/push/push_server.h): a
// receiver rank of an inference server, holding its tensors in its own
// tensor-parallel, fused layout, connected to the push server(s), applying
// each checked push in version order or catching up from the store.
// Wire format and states: docs/push.md.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "store/base/status.h"
#include "store/dtype.h"
#include "sync/transfer/fp8_plan.h"
#include "sync/transfer/transfer_plan.h"

namespace dte {

class Store;

// One tensor a receiver holds, in its layout (row-major): in host memory,
// or with device >= 0 in that CUDA device's memory (data is a device
// pointer; pushes are written with the CUDA remap-and-apply kernel).
struct PushTensor {
  std::string name;
  DType dtype = DType::kBF16;
  std::vector<uint64_t> shape;
  void* data = nullptr;
  int device = -1;
};

struct PushReceiverOptions {
  std::string address;  // the server's HOST:PORT
  // The job secret (PushServerOptions::secret; empty: from the
  // environment): the receiver proves it knows it to each server, and
  // takes nothing from a server that does not prove the same.
  std::string secret;
  int rank = 0;  // receiver rank in `layout` (its tensor-parallel rank)
  ShardLayout layout;
  std::vector<PushTensor> tensors;
  std::optional<uint64_t> version;  // what the tensors hold now; nullopt: unknown
  // Apply pushes on the receiver's own thread as they arrive; otherwise
  // they wait (received, checked) until ApplyPending or WaitFor.
  bool auto_apply = false;
  std::chrono::milliseconds timeout{30000};  // bound on each receive once a push starts
  // After a lost connection, reconnect every this long (doubling up to 8x).
  std::chrono::milliseconds reconnect{200};
  // An FP8 receiver (docs/push.md "FP8 receivers"): the tensors the
  // policy quantizes (sync/transfer/fp8_plan.h) are held as F8_E4M3 bytes
  // plus an F32 "<module>.weight_scale_inv" per tensor, blocks of
  // block_rows x block_cols, scales by `rule`; pushes write the bytes and
  // scales that changed, a catch-up the quantized version. Every TP split
  // of an FP8 tensor must fall on block boundaries (else the server refuses
  // the receiver, naming the tensor, the split and the block). nullopt:
  // every tensor as the version holds it.
  std::optional<Fp8ReceiverOptions> fp8;
  // A catch-up reads each canonical tensor's rows that this rank holds a
  // band of about this many bytes at a time (at least one row; for an FP8
  // tensor whole block rows): its memory is one band, whatever the model.
  uint64_t catch_up_band_bytes = uint64_t{16} << 20;
  // The inference server this receiver is a rank of, and that server's
  // ranks (docs/push.md "Servers"). A rank of a server of several applies
  // only versions every rank of it has staged: ApplyAgreed with every
  // rank's Path(), never ApplyPending or auto_apply. Empty: a receiver on
  // its own (server_size 1).
  std::string server;
  int server_size = 1;
  // The most bytes of pushes and moves staged (received, checked, not
  // applied): about 11 per changed element. A push past it is refused (the
  // receiver is dropped and catches up once it applied what it holds).
  uint64_t stage_bytes = uint64_t{4} << 30;
};

struct PushReceiverStatus {
  std::optional<uint64_t> version;  // held; nullopt: unknown or inconsistent
  bool inconsistent = false;        // a catch-up failed part way: reload
  bool connected = false;
  std::optional<uint64_t> behind;  // the server's version when told to catch up
  uint64_t pending = 0;            // pushes received, not applied yet
  uint64_t pushes = 0;             // pushes applied
  uint64_t elements = 0;           // elements written by pushes (FP8 bytes and scales included)
  uint64_t bytes = 0;              // bytes those elements hold
  std::string error;               // the last error (a refused hello, a bad push, a lost link)
  // A rank of a server: the version its ranks last agreed on and applied
  // (the same on every rank once ApplyAgreed returned), or that they hold
  // no version in common (inconsistent, with the reason in server_error).
  std::optional<uint64_t> server_version;
  bool server_inconsistent = false;
  std::string server_error;
  uint64_t staged_bytes = 0;  // of the pending pushes and moves
};

// The version a server's ranks apply, given each rank's Path(): the
// furthest along the first path that is on every path; nullopt when there
// is none (the ranks hold different versions and have staged nothing that
// joins them, or a rank's version is unknown). Every rank computes it from
// the same paths and gets the same answer.
std::optional<uint64_t> AgreedVersion(const std::vector<std::vector<uint64_t>>& paths);

class PushReceiver {
 public:
  // Checks the tensors and starts the receiver's thread, which connects
  // (and reconnects) to the server. Returns at once.
  static Result<std::unique_ptr<PushReceiver>> Open(const PushReceiverOptions& options);
  ~PushReceiver();

  // Applies every push (and move) staged so far, in order. Returns how
  // many. FailedPrecondition on a rank of a server of several (ApplyAgreed).
  Result<uint64_t> ApplyPending();
  // Applies pushes as they arrive until the held version is >= `version`.
  // Fails with DeadlineExceeded on timeout, FailedPrecondition when the
  // server says this receiver is behind, having missed pushes (catch up
  // first; Python raises dte.MissedPushes), or the refusal.
  // On a rank of a server: waits until `version` is on Path() (staged), and
  // applies nothing.
  Status WaitFor(uint64_t version, std::chrono::milliseconds timeout);
  // Copies `version` (default: the one the server said it is at) from the
  // store into the tensors, then tells the server. While it copies, and if
  // it fails, the receiver is inconsistent.
  // On a rank of a server that holds a known version, the catch-up is
  // staged as MoveTo does (the changed elements, applied with its server);
  // otherwise copied into the tensors at once.
  Status CatchUp(Store& store, std::optional<uint64_t> version);

  // Stages the move from the last version held or staged to `version`,
  // either direction along one chain of the store: per version stepped
  // over, the elements it changed, read from the store's deltas (going
  // back, the parent's values). Nothing is written until it is applied
  // (ApplyPending, or ApplyAgreed on a rank of a server). FailedPrecondition
  // when the version held is unknown or the two are not on one chain (catch
  // up whole then); Unimplemented for an FP8 receiver.
  Status MoveTo(Store& store, uint64_t version);

  // The versions this receiver can be at without the store: the one it
  // holds, then each staged version in apply order. Empty when the held
  // version is unknown or inconsistent.
  std::vector<uint64_t> Path() const;
  // On a rank of a server: applies up to AgreedVersion(paths), where paths
  // holds every rank's Path() (gathered among the server's ranks, the same
  // list on each), and tells the push server. With no agreed version, the
  // server is inconsistent: nothing is written, the status says why, and
  // 0 is returned. FailedPrecondition when the agreed version is not on
  // this rank's own path (paths did not include it).
  Result<uint64_t> ApplyAgreed(const std::vector<std::vector<uint64_t>>& paths);

  PushReceiverStatus GetStatus() const;

  class Impl;

 private:
  explicit PushReceiver(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace dte
