// DistPublisher: the AdamW-inverting publisher (sync/publish/publisher.h) run by
// every rank of a sharded trainer. Each rank hands over only the optimizer
// state it holds, as flat element ranges of Hugging Face tensors; the ranks
// agree, find the changed elements of their own ranges, route them to the
// rank that owns each tensor, and one version appears in the store, once,
// when every rank's part is in (docs/engine.md, "Distributed publish").
//
// One publish, on every rank, over the trainer's Transport (TCP or NCCL,
// sync/transport/transport.h):
//   1. Agreement: every rank's step, hyper-parameters, store and latest
//      version and the ranges it holds reach every rank (sizes, then
//      payloads). Every rank checks them identically, so they all fail with
//      the same error, naming the rank and what differs or is wrong, before
//      anything is written.
//   2. Ownership: each named tensor (and, for a policy anchor, every tensor)
//      gets one owner rank, by bytes, the same on every rank. An element held
//      by several ranks (replicas) is published by the lowest of them.
//   3. Detection: each rank runs the rigorous screen (docs/engine.md) on its
//      ranges, a chunk at a time, and keeps the candidates not proven
//      unchanged as (index, new BF16 bits): 6 bytes per entry. Ranges in
//      CUDA device memory are searched on their device (the fused detector
//      and the exact resolution, kernels/cuda.h); only the kept entries
//      leave it.
//   4. Routing: the entries go to their tensor's owner in two rounds (sizes,
//      then payloads).
//   5. Encoding: the owner reads its tensors' parent blocks (from this
//      host's snapshot of the parent when there is one, else from the
//      store), applies the entries, hashes blocks and tensor and encodes each
//      block as dtectl commit does, into its own blobs.
//   6. Commit: the owners send their records and blobs to rank 0, which
//      writes the block table and, last, the manifest, and tells every rank
//      the outcome. The version is byte for byte (on export and block for
//      block) the one the single-process Publisher or dtectl commit makes
//      from the same weights.
//
// Memory per rank: a chunk of its own state being screened, the entries of
// its ranges, the entries routed to the tensors it owns, and a chunk of
// blocks being encoded; no rank holds another rank's state or a whole
// tensor. Faults: a rank that dies or stalls makes every other rank's call
// fail within the transport's timeout, naming the peer and the step, with
// no version written (a failed transport stays broken: connect a new one
// to retry; the retry publishes the same version number). Blobs a failed
// publish wrote are removed by gc after its grace window.
//
// Thread-safety: not thread-safe; one DistPublisher per rank, used by one
// thread at a time.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "store/base/status.h"
#include "sync/publish/publisher.h"
#include "sync/push/changes.h"
#include "sync/push/push_server.h"
#include "sync/transport/transport.h"

namespace dte {

namespace dist_internal {
struct Plan;
struct Detected;
struct Encoded;
class DeviceFinder;
}  // namespace dist_internal
namespace internal {
class BlobSink;
}  // namespace internal

// The optimizer state one rank holds of one Hugging Face tensor: elements
// [begin, end) of the tensor flattened in row-major order, as contiguous
// FP32 arrays of end - begin elements each. A whole tensor is [0, n); an
// FSDP2 Shard(0) piece is RowRange(); a flat-parameter or distributed-
// optimizer range is given as it is.
struct RangeState {
  // The Hugging Face tensor; with converter "mcore", the Megatron-Core
  // parameter, whose shard (name, tp_rank, ep_rank) the range is of.
  std::string name;
  int tp_rank = 0, ep_rank = 0;
  uint64_t begin = 0, end = 0;
  const float* param = nullptr;       // FP32 master weights after the step
  const float* exp_avg = nullptr;     // optimizer state["exp_avg"]
  const float* exp_avg_sq = nullptr;  // optimizer state["exp_avg_sq"]
  // -1: the three arrays are host memory. Otherwise they are memory of this
  // CUDA device, and the changes are found there (CudaAdamWFindChanges):
  // only the kept entries (10 bytes each) are copied to the host.
  int device = -1;
  std::optional<int64_t> state_step;
  // This range's param group's values, where they differ from AdamWStep's;
  // every range of one tensor must agree on them.
  std::optional<double> lr, weight_decay;
};

// The flat range of rows [row_begin, row_end) of a tensor of `shape`.
struct FlatRange {
  uint64_t begin = 0, end = 0;
};
FlatRange RowRange(const std::vector<int64_t>& shape, uint64_t row_begin, uint64_t row_end);

// The rows torch.chunk(world) gives rank `rank` of a dimension of `rows`
// (FSDP2's Shard(0)): chunks of ceil(rows / world), the last ones short or
// empty.
FlatRange ChunkRows(uint64_t rows, int rank, int world);

struct DistPublishStats {
  uint64_t entries_sent = 0;       // (index, bits) entries this rank routed, itself included
  uint64_t bytes_sent = 0;         // payload bytes this rank sent over the transport
  uint64_t bytes_received = 0;     // payload bytes it received
  uint64_t tensors_owned = 0;      // tensors this rank encoded
  uint64_t parent_bytes_read = 0;  // parent block bytes it read to encode them
  uint64_t messages_sent = 0;      // non-empty messages to other ranks
  // Pushing what it owns: tensors whose changes its push took from what it
  // kept while encoding, and tensors it read back from the store.
  uint64_t push_tensors_kept = 0;
  uint64_t push_tensors_read_back = 0;
  // Time of the detection phase (the fused screen on the host, or the
  // kernel and the copy of the kept entries from the device), of encoding
  // this rank's tensors, and from the parts' collection to the outcome
  // (rank 0's commit); and the bytes detection copied device to host.
  uint64_t detect_ns = 0;
  uint64_t encode_ns = 0;
  uint64_t commit_ns = 0;
  uint64_t detect_device_bytes = 0;
};

class DistPublisher {
 public:
  // Opens (creating if needed) the store, as Publisher::Open does. The
  // converter is "hf" (ranges of Hugging Face tensors) or "mcore" (ranges of
  // Megatron-Core shards, converted to Hugging Face coordinates element by
  // element); screen must be true.
  static Result<std::unique_ptr<DistPublisher>> Open(const PublisherOptions& options);
  ~DistPublisher();

  // Publishes the state after optimizer step h.step; every rank of
  // `transport` calls it with the same h. Returns the same committed version
  // on every rank, or an error on every rank (the transport's peer errors
  // name the rank that failed). The ranges of all ranks together must cover
  // each named tensor exactly; tensors no rank names are unchanged.
  Result<PublishResult> PublishAdamW(Transport& transport, const AdamWStep& h,
                                     const std::vector<RangeState>& ranges);

  // The anchor policy of the following publishes (the same on every rank);
  // InvalidArgument for a bad budget.
  Status SetAnchorPolicy(const AnchorPolicy& policy);
  const AnchorPolicy& anchor_policy() const { return options_.anchor_policy; }

  // After each committed version, push it to receivers (sync/push/push_server.h), its
  // changes read back from the store (StoreChanges); null: stop. Given on
  // rank 0 only, rank 0 pushes every tensor. Given on every rank, each rank
  // pushes the tensors it owned in that version, as part `rank` of
  // world_size (PushServer::SetGroup, set at each publish; rank 0's server
  // is told every rank's address, PushServer::address(), and names them to
  // receivers), so no rank reads or sends more than its share. Any other
  // mix fails the publish on every rank. The result's push and push_error
  // say what this rank's push did. Not owned; tells the server the store's
  // latest version.
  Status SetPush(PushServer* push);
  // Every rank together, after SetPush (or without a push server): tells
  // the ranks each other's push servers now, so that rank 0's server can
  // name them to receivers before the first publish (which otherwise does
  // it: receivers that connect to a rank 0 of several senders are answered
  // once it has). Fails on every rank for a mix SetPush refuses.
  Status SharePush(Transport& t);

  // What the last PublishAdamW did on this rank.
  const DistPublishStats& last_stats() const { return stats_; }
  // What this rank's publishes did, as Prometheus metrics
  // (sync/publish/publish_metrics.h): to serve, push or read.
  PublishMetrics& metrics() { return *metrics_; }
  Store& store() { return *store_; }

 private:
  DistPublisher(PublisherOptions options, std::unique_ptr<Store> store);
  // One publish: the phases above, in order, each a method, the publish's
  // state passed between them (sync/publish/internal/dist_plan.h).
  Result<PublishResult> Run(Transport& transport, const AdamWStep& h,
                            const std::vector<RangeState>& ranges);
  // 1. Agreement (dist_publisher_agree.cc): the plan every rank derives;
  // the result when rank 0 committed this step already (a retry).
  Result<std::optional<PublishResult>> Agree(Transport& t, dist_internal::Plan& plan);
  std::string OwnHeader(const dist_internal::Plan& plan);  // EncodeHeader's bytes
  Status LoadParent(Transport& t, dist_internal::Plan& plan);
  Status ReadParent(dist_internal::Plan& plan);
  // 2. Ownership (dist_publisher_agree.cc).
  void AssignOwners(dist_internal::Plan& plan) const;
  // 3. Detection (dist_publisher_detect.cc).
  dist_internal::Detected Detect(const dist_internal::Plan& plan);
  Status DetectPieces(const dist_internal::Plan& plan, dist_internal::Detected& d);
  // 4. Routing: the entries each rank sent this one.
  Result<std::vector<std::string>> Route(Transport& t, const dist_internal::Plan& plan,
                                         dist_internal::Detected& d);
  // 5. Encoding (dist_publisher_encode.cc).
  void Encode(const dist_internal::Plan& plan, const dist_internal::Detected& d,
              std::vector<std::string>& routed, dist_internal::Encoded& e);
  Status EncodeOwned(const dist_internal::Plan& plan, dist_internal::Encoded& e);
  // 6. Commit (dist_publisher_commit.cc): the parts to rank 0, which
  // commits; every rank learns the outcome.
  Result<PublishResult> Commit(Transport& t, const dist_internal::Plan& plan,
                               const dist_internal::Detected& d, dist_internal::Encoded& e);
  Status CommitParts(const dist_internal::Plan& plan, const std::vector<std::string>& parts,
                     internal::BlobSink& sink, PublishResult* res);
  // The push of this and later publishes, from every rank's push server
  // address (empty: none): sets push_owned_ and the server's group.
  Status AgreePush(int rank, const std::vector<std::string>& senders, const std::string& what);

  PublisherOptions options_;
  std::vector<ConvertUnit> plan_;  // converter "mcore"
  std::unique_ptr<Store> store_;
  std::optional<int64_t> last_step_;
  std::optional<uint64_t> last_version_;
  DistPublishStats stats_;
  // When this rank sent its part to rank 0 in the last Run (stats_.commit_ns).
  std::optional<std::chrono::steady_clock::time_point> parts_sent_;
  PushServer* push_ = nullptr;
  bool push_owned_ = false;      // this publish: every rank pushes what it owns
  std::set<std::string> owned_;  // the tensors this rank owned in the last publish
  bool committed_before_ = false;
  // The changes of the tensors this rank encoded, kept for its push (up to
  // a bound; the rest are read back from the store), until it is done.
  std::map<std::string, TensorChanges> push_changes_;
  void PushOwned(PublishResult& out);  // the last publish found its step committed already
  // Device buffers for ranges in CUDA memory, kept between publishes.
  std::unique_ptr<dist_internal::DeviceFinder> device_;
  std::unique_ptr<PublishMetrics> metrics_;
};

}  // namespace dte
