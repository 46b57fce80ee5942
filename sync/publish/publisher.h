// Publisher: commits new store versions straight from a trainer's AdamW
// state after each optimizer step, with no copy of the previous weights, on
// one rank or on every rank of a sharded trainer. A world of one rank (the
// default) is its simplest case: that rank holds every tensor it names.
//
// For each tensor the caller hands over theta_t (FP32 master weights after
// step t) and the moments m_t, v_t. The publisher reconstructs theta_{t-1}
// by inverting the AdamW update (kernels/adamw.h), casts both to BF16,
// compares bits and stores the changed elements as a sparse delta against
// the store's latest version, which must hold BF16(theta_{t-1}): the version
// this publisher committed for step t - 1, or the imported checkpoint.
// Block and tensor hashes are computed from BF16(theta_t), so the new version
// is byte-for-byte what `dtectl commit` of the same weights saved as
// safetensors would hold, and every reader verifies it. The math, its error
// analysis and how a change is never missed: docs/engine.md.
//
// One rank (PublishAdamW, PublishAdamWMcore, PublishWeights): tensors are
// processed one at a time (the "hf" converter's unit is one Hugging Face
// tensor; the "mcore" converter's is one sync/convert/convert.h unit,
// converted from the trainer's Megatron-Core shards) in chunks of a few
// MiB, so the memory a publish adds is bounded and flat in model size. A
// publish either commits a whole version or none: every argument is
// validated before anything is written, and the manifest, written last, is
// what makes a version exist.
//
// Several ranks (PublishRanges; PublishAdamW and PublishAdamWMcore of
// whole tensors, too, when the world has more than one rank): each rank
// hands over only the optimizer state it holds, as flat element ranges of
// Hugging Face tensors; the ranks agree, find the changed elements of their
// own ranges, route them to the rank that owns each tensor, and one version
// appears in the store, once, when every rank's part is in (docs/engine.md,
// "Distributed publish"). One publish, on every rank, over the group's
// exchange (a Transport: TCP, NCCL or the store, sync/transport/transport.h):
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
//      block) the one a world of one or dtectl commit makes from the same
//      weights.
// In a world of one these steps are local: no exchange is needed, nothing
// is sent, and the one rank's part stays where it is.
//
// Memory per rank: a chunk of its own state being screened, the entries of
// its ranges, the entries routed to the tensors it owns, and a chunk of
// blocks being encoded; no rank holds another rank's state or a whole
// tensor. Faults: a rank that dies or stalls makes every other rank's call
// fail within the exchange's timeout, naming the peer and the step, with no
// version written (a failed transport stays broken: set a new one with
// SetGroup to retry; the retry publishes the same version number). Blobs a
// failed publish wrote are removed by gc after its grace window.
//
// Thread-safety: not thread-safe; use one Publisher (one per rank) from one
// thread at a time. Several Publishers (in any processes) may target one
// store; a publish that loses the race for the next version, or finds that
// another writer committed since this one's last version, fails with
// AlreadyExists.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "kernels/adamw_math.h"
#include "store/base/status.h"
#include "store/dtype.h"
#include "store/ops/commit.h"
#include "store/write/anchor_policy.h"
#include "sync/convert/convert.h"
#include "sync/push/changes.h"
#include "sync/push/push_server.h"
#include "sync/transport/transport.h"

namespace dte {

class PublishMetrics;
class Store;
namespace dist_internal {
struct Plan;
struct Detected;
struct Encoded;
class DeviceFinder;
}  // namespace dist_internal
namespace internal {
class BlobSink;
}  // namespace internal

// The trainer's Megatron-Core model and layout, for converter "mcore".
struct McoreConverter {
  ModelSpec spec;  // e.g. from ParseHfConfig of the checkpoint's config.json
  ParallelLayout layout;
};

// The ranks that publish one model together: this publisher is rank `rank`
// of `world`, and they talk over `exchange` (not owned; it must outlive the
// publishes that use it). A world of one (the default) needs no exchange.
struct PublishGroup {
  int rank = 0;
  int world = 1;
  Transport* exchange = nullptr;  // its rank() and size() must be rank and world
};

struct PublisherOptions {
  std::string store;      // local directory or s3://bucket/prefix
  std::string cache_dir;  // host-local index directory; empty: none
  // s3:// stores with a cache_dir: blob ranges read from the store, and the
  // blobs published, are kept on local disk up to this many bytes, read
  // and fetched in 4 MiB chunks (StoreOptions::blob_cache_bytes). A
  // distributed publisher's owners then read the parent blocks they
  // published the step before from disk. 0: no blob cache.
  uint64_t blob_cache_bytes = uint64_t{4} << 30;
  // "hf": PublishAdamW takes Hugging Face tensors. "mcore": `mcore` must be
  // set, and PublishAdamWMcore also takes sharded Megatron-Core state.
  std::string converter = "hf";
  std::optional<McoreConverter> mcore;
  // The fused detector also reports elements whose reconstruction lies this
  // many FP32 ulps from a BF16 rounding boundary (docs/engine.md).
  uint32_t margin_ulps = 16;
  // Find candidate elements with the rigorous screen (docs/engine.md), which
  // inverts only elements near a BF16 rounding boundary; false: run the
  // fused detector kernels::AdamWInvertDetect on every element. Both give
  // the same version. PublishRanges, and a world of several ranks, need
  // the screen.
  bool screen = true;
  // Which versions also carry a full table (store/write/anchor_policy.h), as for
  // dtectl commit.
  AnchorPolicy anchor_policy;
  // PublishWeights with a cache directory: leave a snapshot of the new
  // version when none of the last snapshot_every - 1 versions has one, as
  // CommitOptions::snapshot_every; keep the newest keep_snapshots.
  uint32_t snapshot_every = 8;
  uint32_t keep_snapshots = 3;
  // The ranks publishing together (SetGroup changes it).
  PublishGroup group;
};

// A caller-owned, C-contiguous array.
struct TensorRef {
  const void* data = nullptr;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
};

struct AdamWParamState {
  std::string name;                   // the tensor's name in the store (Hugging Face name for "hf")
  TensorRef param;                    // FP32 master weights after the step
  TensorRef exp_avg;                  // optimizer state["exp_avg"] after the step
  TensorRef exp_avg_sq;               // optimizer state["exp_avg_sq"] after the step
  std::optional<int64_t> state_step;  // optimizer state["step"], when known
  // This tensor's param group's values, where they differ from AdamWStep's.
  std::optional<double> lr, weight_decay;
};

// One Megatron-Core shard's optimizer state: parameter `key.name` as the
// rank (key.tp_rank, key.ep_rank) holds it (sync/convert/convert.h).
struct McoreAdamWShard {
  ShardKey key;
  TensorRef param;       // FP32 master weights of the shard after the step
  TensorRef exp_avg;     // optimizer state["exp_avg"] of the shard
  TensorRef exp_avg_sq;  // optimizer state["exp_avg_sq"] of the shard
  std::optional<int64_t> state_step;
  // The shard's param group's values, where they differ from AdamWStep's.
  // Every shard an HF tensor is converted from must agree on them.
  std::optional<double> lr, weight_decay;
};

struct AdamWStep {
  double lr = 1e-3;
  double beta1 = 0.9, beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
  int64_t step = 0;       // the optimizer's step count after the step (1 for the first)
  bool amsgrad = false;   // unsupported: rejected
  bool maximize = false;  // unsupported: rejected
  kernels::AdamWOrder order = kernels::AdamWOrder::kTorchCpu;
};

// One tensor's new weights, for PublishWeights.
struct WeightsTensor {
  std::string name;   // the tensor's name in the store (Hugging Face name)
  TensorRef weights;  // BF16, or F32 cast to BF16 (round to nearest even)
};

struct PublishResult {
  uint64_t version = 0;
  uint64_t parent = 0;
  uint64_t tensors = 0;          // tensors published from optimizer state
  uint64_t elements = 0;         // their elements
  uint64_t changed = 0;          // elements stored in the delta
  uint64_t flagged = 0;          // candidates the screen or fused detector reported
  uint64_t false_positives = 0;  // reported, then proven unchanged (not stored)
  uint64_t uncertain = 0;        // stored whole: old bits not provable; at most
                                 // this many stored elements may be unchanged
  uint64_t stored_bytes = 0;     // bytes of blobs the version added
  uint64_t state_bytes = 0;      // bytes of optimizer state (theta, m, v) or weights read
  uint64_t parent_bytes = 0;     // bytes of the parent version read (PublishWeights)
  bool from_weights = false;     // PublishWeights: the weights compared with the parent
  bool full_table = false;       // a policy anchor: the version also carries a full table
  uint64_t full_bytes = 0;       // its payload bytes (compressed)
  std::string anchor_reason;     // why it is a policy anchor ("" if it is not)
  std::string join_reason;       // why it got a join table ("" if it did not)
  bool join_table = false;       // ...and the join table was stored (else join_error says why)
  uint64_t join_bytes = 0;
  std::string join_error;
  // With a push server (Publisher::SetPush): what the push after the commit
  // did; push_error says why it did not run (the version is committed
  // either way, and receivers catch up from the store).
  std::optional<PushReport> push;
  std::string push_error;
};

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

// What the last publish did on this rank as a publish of ranges (Publisher::last_stats).
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

namespace internal {

// What opening a Publisher takes from its options: the conversion plan of converter "mcore" (empty
// for "hf"; InvalidArgument for another converter or "mcore" without a model), and the store,
// opened as dtectl opens it.
struct OpenedPublisher {
  std::vector<ConvertUnit> plan;
  std::unique_ptr<Store> store;
};
Result<OpenedPublisher> OpenPublisherParts(const PublisherOptions& options);

// Tells a publisher's push server the store's latest version (nothing for
// an empty store): Publisher::SetPush.
Status TellPushLatest(PushServer& push, Store& store);

// Pushes committed `version`: `changes` as the publisher collected them, or
// (null) read back from the store (ChangesFromStore). The version is
// committed either way, so a push that cannot run is reported in
// r->push_error, not failed.
void PushCommitted(PushServer& push, Store& store, uint64_t version,
                   const std::vector<TensorChanges>* changes, PublishResult* r);

}  // namespace internal

class Publisher {
 public:
  // Opens (creating if needed) the store, as dtectl does. InvalidArgument
  // for a group that is not rank < world, an exchange of another rank or
  // size, a world of several ranks without the screen, or a bad anchor
  // policy.
  static Result<std::unique_ptr<Publisher>> Open(const PublisherOptions& options);
  ~Publisher();

  // The ranks of the following publishes (PublisherOptions::group), for
  // example a new exchange after one failed; refused as Open refuses it.
  Status SetGroup(const PublishGroup& group);
  const PublishGroup& group() const { return options_.group; }

  // Commits a Hugging Face checkpoint directory (the trainer's initial
  // weights in BF16) as a new version, through CommitDirectory. A world of
  // one only: the ranks of a larger one start from a version imported
  // before they publish.
  Result<CommitResult> ImportCheckpoint(const std::string& dir);

  // The anchor policy of the following publishes (PublisherOptions'
  // anchor_policy; the same on every rank); InvalidArgument for a bad
  // budget.
  Status SetAnchorPolicy(const AnchorPolicy& policy);
  const AnchorPolicy& anchor_policy() const { return options_.anchor_policy; }

  // Publishes the BF16 state after optimizer step `h.step`. Every tensor
  // named must exist in the latest version as BF16 with the same shape;
  // tensors not named are unchanged. Rejected, naming the tensor or field,
  // before anything is written: amsgrad or maximize, invalid
  // hyperparameters, a state_step other than h.step, a step that does not
  // follow the one this publisher published last, state that is not FP32,
  // shape mismatches, unknown or repeated names, a store whose latest
  // version is not the one this publisher committed last. In a world of
  // several ranks each tensor given is this rank's whole copy of it (a
  // replica): PublishRanges of [0, elements) ranges.
  Result<PublishResult> PublishAdamW(const AdamWStep& h,
                                     const std::vector<AdamWParamState>& params);

  // Publishes from sharded Megatron-Core state (converter "mcore"). The
  // shards are converted to Hugging Face tensors one converter unit at a
  // time (theta, m and v alike: the inversion is elementwise, so it runs on
  // the converted tensors), and each unit's tensors go through the same
  // per-tensor path as PublishAdamW: the version is byte-for-byte the one
  // PublishAdamW of the converted state makes. Extra memory is three times
  // the largest unit in FP32. A unit none of whose shards are given is
  // unchanged; a unit given in part is rejected. Also rejected, naming the
  // shard and its ranks, before anything is written: shards the plan does
  // not have or given twice, state that is not FP32 or of the wrong shape,
  // and the PublishAdamW rejections. An HF tensor takes lr / weight_decay
  // from its shards, which must agree. In a world of several ranks each
  // shard given is whole on this rank: PublishRanges of its elements.
  Result<PublishResult> PublishAdamWMcore(const AdamWStep& h,
                                          const std::vector<McoreAdamWShard>& shards);

  // Publishes the state after optimizer step h.step from the ranges this
  // rank holds; every rank of the group calls it with the same h. Returns
  // the same committed version on every rank, or an error on every rank
  // (the exchange's peer errors name the rank that failed). The ranges of
  // all ranks together must cover each named tensor exactly; tensors no
  // rank names are unchanged. A world of one needs no exchange: its one
  // rank's ranges (host or device memory) cover each tensor it names.
  Result<PublishResult> PublishRanges(const AdamWStep& h, const std::vector<RangeState>& ranges);

  // Publishes new BF16 weights from any optimizer (or none): each tensor
  // given is compared, block by block, with the latest version's, read
  // from this host's snapshots (PublisherOptions::cache_dir) plus the
  // deltas since, else from the store, and only its changed elements are
  // stored, their old values exact (sync/publish/internal/weights_encoder.h).
  // Tensors not given are unchanged. The version is byte-for-byte the one
  // `dtectl commit` of the same weights saved as safetensors makes. With a
  // cache directory it also leaves a snapshot of the new version every
  // PublisherOptions::snapshot_every versions, so the next publish reads
  // its parent from a snapshot plus a bounded number of deltas. Memory: two
  // chunks of 16 blocks, whatever the model size. `step`, when given, must
  // follow the last step this publisher published. Rejected, naming the
  // tensor, before anything is written: unknown or repeated names, a store
  // tensor that is not BF16, a shape mismatch, weights that are not BF16 or
  // F32, and the store checks of PublishAdamW. A world of one only (one
  // rank holds or gathers the full weights).
  Result<PublishResult> PublishWeights(std::optional<int64_t> step,
                                       const std::vector<WeightsTensor>& tensors);
  // PublishWeights one tensor at a time, for callers that hold one tensor
  // at a time (weights copied from a GPU, gathered shards): BeginWeights,
  // then AddWeights per tensor (each checked, then encoded; its array may
  // be freed on return), then CommitWeights. A failed AddWeights, or a
  // BeginWeights before CommitWeights, drops the version being built:
  // nothing is written to the store until CommitWeights.
  Status BeginWeights(std::optional<int64_t> step);
  Status AddWeights(const WeightsTensor& tensor);
  Result<PublishResult> CommitWeights();

  // After each committed version, push it to receivers
  // (sync/push/push_server.h); null: stop. Not owned; tells the server the
  // store's latest version. In a world of one, the publisher pushes the
  // changes it found. In a larger one: given on rank 0 only, rank 0 pushes
  // every tensor, its changes read back from the store (StoreChanges);
  // given on every rank, each rank pushes the tensors it owned in that
  // version, as part `rank` of world (PushServer::SetGroup, set at each
  // publish; rank 0's server is told every rank's address,
  // PushServer::address(), and names them to receivers), so no rank reads
  // or sends more than its share. Any other mix fails the publish on every
  // rank. The result's push and push_error say what this rank's push did.
  Status SetPush(PushServer* push);
  // Every rank together, after SetPush (or without a push server): tells
  // the ranks each other's push servers now, so that rank 0's server can
  // name them to receivers before the first publish (which otherwise does
  // it: receivers that connect to a rank 0 of several senders are answered
  // once it has). Fails on every rank for a mix SetPush refuses. Local in
  // a world of one.
  Status SharePush();

  Store& store() { return *store_; }
  // What this publisher's publishes did, as Prometheus metrics
  // (sync/publish/publish_metrics.h): to serve, push or read.
  PublishMetrics& metrics() { return *metrics_; }
  // What the last publish did on this rank as a publish of ranges (zeros
  // for whole tensors or weights in a world of one, which route nothing).
  const DistPublishStats& last_stats() const { return stats_; }
  // The step of the last successful publish, if any.
  std::optional<int64_t> last_step() const { return last_step_; }

 private:
  Publisher(PublisherOptions options, std::unique_ptr<Store> store);

  // One rank, whole tensors (publisher_whole.cc).
  class Draft;
  struct McoreWork;
  Result<PublishResult> PublishHf(const AdamWStep& h, const std::vector<AdamWParamState>& params);
  Result<PublishResult> PublishMcore(const AdamWStep& h,
                                     const std::vector<McoreAdamWShard>& shards);
  Result<std::unique_ptr<Draft>> Begin(std::optional<int64_t> step);
  Result<std::vector<McoreWork>> PlanMcore(const AdamWStep& h,
                                           const std::map<ShardKey, const McoreAdamWShard*>& given,
                                           Draft& draft);
  Result<PublishResult> Finish(std::optional<int64_t> step, Draft& draft);
  Status FillUnclaimedFull(Draft& draft);
  // Refuses a call that needs a world of one (`what` names it, `instead`
  // says what to do).
  Status NeedOneRank(const std::string& what, const std::string& instead) const;

  // Ranges, on every rank of the group: the phases above, in order, each a
  // method, the publish's state passed between them
  // (sync/publish/internal/dist_plan.h).
  Result<Transport*> Exchange();  // the group's, or a world of one's own
  Result<PublishResult> Run(Transport& transport, const AdamWStep& h,
                            const std::vector<RangeState>& ranges);
  // 1. Agreement (publisher_agree.cc): the plan every rank derives;
  // the result when rank 0 committed this step already (a retry).
  Result<std::optional<PublishResult>> Agree(Transport& t, dist_internal::Plan& plan);
  std::string OwnHeader(const dist_internal::Plan& plan);  // EncodeHeader's bytes
  Status LoadParent(Transport& t, dist_internal::Plan& plan);
  Status ReadParent(dist_internal::Plan& plan);
  // 2. Ownership (publisher_agree.cc).
  void AssignOwners(dist_internal::Plan& plan) const;
  // 3. Detection (publisher_detect.cc).
  dist_internal::Detected Detect(const dist_internal::Plan& plan);
  Status DetectPieces(const dist_internal::Plan& plan, dist_internal::Detected& d);
  // 4. Routing: the entries each rank sent this one.
  Result<std::vector<std::string>> Route(Transport& t, const dist_internal::Plan& plan,
                                         dist_internal::Detected& d);
  // 5. Encoding (publisher_encode.cc).
  void Encode(const dist_internal::Plan& plan, const dist_internal::Detected& d,
              std::vector<std::string>& routed, dist_internal::Encoded& e);
  Status EncodeOwned(const dist_internal::Plan& plan, dist_internal::Encoded& e);
  // 6. Commit (publisher_commit.cc): the parts to rank 0, which
  // commits; every rank learns the outcome.
  Result<PublishResult> Commit(Transport& t, const dist_internal::Plan& plan,
                               const dist_internal::Detected& d, dist_internal::Encoded& e);
  Status CommitParts(const dist_internal::Plan& plan, const std::vector<std::string>& parts,
                     internal::BlobSink& sink, PublishResult* res);
  // The push (publisher_push.cc) of this and later publishes, from every
  // rank's push server address (empty: none): sets push_owned_ and the
  // server's group.
  Status AgreePush(int rank, const std::vector<std::string>& senders, const std::string& what);
  void PushRanges(Transport& t, PublishResult& out);  // after a ranged publish
  void PushOwned(PublishResult& out);                 // the tensors this rank owned

  PublisherOptions options_;
  std::vector<ConvertUnit> plan_;  // converter "mcore"
  std::unique_ptr<Store> store_;
  std::optional<int64_t> last_step_;
  std::optional<uint64_t> last_version_;  // committed by this publisher
  PushServer* push_ = nullptr;
  std::unique_ptr<PublishMetrics> metrics_;
  // A version being built by BeginWeights / AddWeights, and its step.
  std::unique_ptr<Draft> weights_draft_;
  std::optional<int64_t> weights_step_;

  // Ranged publishes.
  std::unique_ptr<Transport> solo_;  // a world of one's exchange when the group has none
  DistPublishStats stats_;
  // When this rank sent its part to rank 0 in the last Run (stats_.commit_ns).
  std::optional<std::chrono::steady_clock::time_point> parts_sent_;
  bool push_owned_ = false;      // this publish: every rank pushes what it owns
  std::set<std::string> owned_;  // the tensors this rank owned in the last publish
  bool committed_before_ = false;
  // The changes of the tensors this rank encoded, kept for its push (up to
  // a bound; the rest are read back from the store), until it is done.
  std::map<std::string, TensorChanges> push_changes_;
  // Device buffers for ranges in CUDA memory, kept between publishes.
  std::unique_ptr<dist_internal::DeviceFinder> device_;
};

}  // namespace dte
