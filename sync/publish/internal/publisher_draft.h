// Publisher::Draft: a version being built by a Publisher
// (sync/publish/publisher.h), shared by its AdamW, Megatron-Core and
// weights paths.
//
// Thread-safety: one per publish, used by one thread.
#pragma once

#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "store/materialize.h"
#include "store/snapshot.h"
#include "store/store.h"
#include "store/write/anchor_policy.h"
#include "store/write/blob_sink.h"
#include "store/write/version_writer.h"
#include "sync/publish/internal/engine_encoder.h"
#include "sync/publish/internal/weights_encoder.h"
#include "sync/publish/publisher.h"

namespace dte {

// Where a tensor is in a manifest: file and tensor index.
struct TensorAt {
  size_t file = 0, tensor = 0;
};

// A version being built: the parent's layout and block table, with the
// records of every tensor encoded so far replaced, and the delta spool.
class Publisher::Draft {
 public:
  Draft(const PublisherOptions& o, Store* store, uint64_t latest,
        std::shared_ptr<const Version> parent)
      : store_uri_(store->uri()),
        latest_(latest),
        parent_(std::move(parent)),
        sink_(&store->objects()),
        encoder_(parent_->manifest.block_bytes, o.margin_ulps, o.screen) {
    const Manifest& pm = parent_->manifest;
    // The new version: the parent's files and blocks, every block unchanged
    // until a published tensor overwrites its records.
    m_.version = latest + 1;
    m_.parent = latest;
    m_.created = NowRfc3339();
    m_.block_bytes = pm.block_bytes;
    m_.files = pm.files;
    records_ = parent_->records;
    for (auto& rec : records_) rec = BlockRecord{BlockKind::kSame, 0, 0, 0, 0, rec.hash};
    for (auto& f : m_.files) {
      for (auto& t : f.tensors) t.changed = 0;
    }
  }

  // The parent's tensor `name`, once per publish.
  Result<TensorAt> Claim(const std::string& name) {
    auto at = parent_->manifest.FindTensor(name);
    if (!at) {
      return InvalidArgument("tensor " + name + " is not in " + VersionName(latest_) +
                             " of store " + store_uri_);
    }
    if (!claimed_.insert(name).second) return InvalidArgument("tensor " + name + " is given twice");
    return TensorAt{at->file_index, at->tensor_index};
  }
  const TensorEntry& Entry(TensorAt at) const {
    return parent_->manifest.files[at.file].tensors[at.tensor];
  }

  // Encodes tensor `at` from its AdamW state (EngineEncoder).
  Status Encode(TensorAt at, const AdamWStep& h, const AdamWParamState& s);
  // Encodes tensor `at` from its new weights and the parent's bytes
  // (WeightsEncoder; StartWeights first).
  Status EncodeWeights(TensorAt at, const WeightsTensor& w);
  // Sets up the weights path: the parent's reader over this host's
  // snapshots, and the new version's snapshot when one is due.
  void StartWeights(Store* store, uint32_t snapshot_every);
  // After the version exists: the new version's snapshot, if one was
  // written, is published (its unclaimed tensors copied from the parent).
  void FinishWeightsSnapshot(uint32_t keep);

  std::string store_uri_;
  uint64_t latest_;
  std::shared_ptr<const Version> parent_;
  std::set<std::string> claimed_;
  Manifest m_;
  std::vector<BlockRecord> records_;
  internal::BlobSink sink_;
  std::unique_ptr<internal::Spool> spool_;
  internal::EngineEncoder encoder_;
  TableDecision tables_;  // a policy anchor, a join table, or neither
  std::unique_ptr<internal::FullTableBuilder> full_;
  internal::EngineCounts counts_;
  PublishResult r_;
  bool collect_changes_ = false;        // for a push
  std::vector<TensorChanges> changes_;  // per published tensor
  // The weights path (PublishWeights).
  std::unique_ptr<SnapshotSet> snapshots_;
  std::unique_ptr<Materializer> reader_;
  std::unique_ptr<SnapshotWriter> snapshot_;
  std::unique_ptr<internal::WeightsEncoder> weights_;
};

}  // namespace dte
