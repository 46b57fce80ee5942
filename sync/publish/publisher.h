// Publisher: commits a new store version straight from a trainer's AdamW
// state after an optimizer step, with no copy of the previous weights.
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
// Tensors are processed one at a time (the "hf" converter's unit is one
// Hugging Face tensor; the "mcore" converter's is one sync/convert/convert.h unit,
// converted from the trainer's Megatron-Core shards) in chunks of a few
// MiB, so the memory a publish adds is bounded and flat in model size. A publish either commits a
// whole version or none: every argument is validated before anything is written, and the manifest,
// written last, is what makes a version exist.
//
// Thread-safety: not thread-safe; use one Publisher from one thread at a
// time. Several Publishers (in any processes) may target one store; a
// publish that loses the race for the next version, or finds that another
// writer committed since this one's last version, fails with AlreadyExists.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
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

namespace dte {

class PublishMetrics;
class Store;

// The trainer's Megatron-Core model and layout, for converter "mcore".
struct McoreConverter {
  ModelSpec spec;  // e.g. from ParseHfConfig of the checkpoint's config.json
  ParallelLayout layout;
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
  // the same version.
  bool screen = true;
  // Which versions also carry a full table (store/write/anchor_policy.h), as for
  // dtectl commit.
  AnchorPolicy anchor_policy;
  // PublishWeights with a cache directory: leave a snapshot of the new
  // version when none of the last snapshot_every - 1 versions has one, as
  // CommitOptions::snapshot_every; keep the newest keep_snapshots.
  uint32_t snapshot_every = 8;
  uint32_t keep_snapshots = 3;
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

namespace internal {

// What opening a publisher (Publisher or DistPublisher) takes from its
// options: the conversion plan of converter "mcore" (empty for "hf";
// InvalidArgument for another converter or "mcore" without a model), and
// the store, opened as dtectl opens it.
struct OpenedPublisher {
  std::vector<ConvertUnit> plan;
  std::unique_ptr<Store> store;
};
Result<OpenedPublisher> OpenPublisherParts(const PublisherOptions& options);

// Tells a publisher's push server the store's latest version (nothing for
// an empty store): SetPush of Publisher and DistPublisher.
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
  // Opens (creating if needed) the store, as dtectl does.
  static Result<std::unique_ptr<Publisher>> Open(const PublisherOptions& options);
  ~Publisher();

  // Commits a Hugging Face checkpoint directory (the trainer's initial
  // weights in BF16) as a new version, through CommitDirectory.
  Result<CommitResult> ImportCheckpoint(const std::string& dir);

  // The anchor policy of the following publishes (PublisherOptions'
  // anchor_policy); InvalidArgument for a bad budget.
  Status SetAnchorPolicy(const AnchorPolicy& policy);
  const AnchorPolicy& anchor_policy() const { return options_.anchor_policy; }

  // Publishes the BF16 state after optimizer step `h.step`. Every tensor
  // named must exist in the latest version as BF16 with the same shape;
  // tensors not named are unchanged. Rejected, naming the tensor or field,
  // before anything is written: amsgrad or maximize, invalid
  // hyperparameters, a state_step other than h.step, a step that does not
  // follow the one this publisher published last, state that is not FP32,
  // shape mismatches, unknown or repeated names, a store whose latest
  // version is not the one this publisher committed last.
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
  // from its shards, which must agree.
  Result<PublishResult> PublishAdamWMcore(const AdamWStep& h,
                                          const std::vector<McoreAdamWShard>& shards);

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
  // F32, and the store checks of PublishAdamW.
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

  // After each successful publish, push its changed elements to the
  // server's receivers (sync/push/push_server.h); null: stop. Not owned; tells the
  // server the store's latest version.
  Status SetPush(PushServer* push);

  Store& store() { return *store_; }
  // What this publisher's publishes did, as Prometheus metrics
  // (sync/publish/publish_metrics.h): to serve, push or read.
  PublishMetrics& metrics() { return *metrics_; }
  // The step of the last successful PublishAdamW, if any.
  std::optional<int64_t> last_step() const { return last_step_; }

 private:
  Publisher(PublisherOptions options, std::unique_ptr<Store> store);

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
};

}  // namespace dte
