// Publisher::PublishWeights: a version from new weights compared with the
// parent's (sync/publish/publisher.h).

#include <algorithm>
#include <utility>

#include "store/dtype.h"
#include "sync/publish/internal/publisher_draft.h"
#include "sync/publish/publish_metrics.h"
#include "sync/publish/publisher.h"

namespace dte {
namespace {

// The weights of store tensor t: BF16 or F32, t's shape, with data.
Status CheckWeights(const WeightsTensor& w, const TensorEntry& t) {
  if (t.dtype != DType::kBF16) {
    return InvalidArgument("tensor " + w.name + " is " + DTypeName(t.dtype) +
                           " in the store; the publisher writes BF16 tensors only");
  }
  if (w.weights.dtype != DType::kBF16 && w.weights.dtype != DType::kF32) {
    return InvalidArgument("tensor " + w.name + ": weights are " + DTypeName(w.weights.dtype) +
                           "; publish_weights takes BF16 or F32");
  }
  if (w.weights.shape != t.shape) {
    return InvalidArgument("tensor " + w.name + ": weights have shape " +
                           ShapeString(w.weights.shape) + " but the store's tensor has shape " +
                           ShapeString(t.shape));
  }
  if (w.weights.data == nullptr && t.elements() > 0) {
    return InvalidArgument("tensor " + w.name + ": weights have no data");
  }
  return Status::Ok();
}

}  // namespace

void Publisher::Draft::StartWeights(Store* store, uint32_t snapshot_every) {
  snapshots_ = OpenStoreSnapshots(*store);
  reader_ = std::make_unique<Materializer>(store);
  reader_->SetBase(snapshots_.get());
  weights_ = std::make_unique<internal::WeightsEncoder>(reader_.get(), parent_, m_.block_bytes);
  weights_->SetFull(full_.get());
  if (!snapshots_) return;  // no cache directory: no snapshot
  // A version stored whole always gets one (the next reads start there).
  if (!full_ && snapshot_every > 1 &&
      !SnapshotNotDue(*store, *snapshots_, parent_, snapshot_every).empty()) {
    return;
  }
  auto writer = snapshots_->Begin(m_.version, m_.block_bytes, SnapshotSet::SnapshotSize(m_),
                                  SnapshotPages::kKeep);
  if (writer.ok()) snapshot_ = std::move(writer).value();
  weights_->SetSnapshot(snapshot_.get());
}

Status Publisher::Draft::EncodeWeights(TensorAt at, const WeightsTensor& w) {
  TensorEntry& t = m_.files[at.file].tensors[at.tensor];
  if (collect_changes_) {
    changes_.emplace_back();
    changes_.back().name = w.name;
    weights_->SetChanges(&changes_.back());
  }
  internal::WeightsInput in{w.weights.data, w.weights.dtype};
  RETURN_IF_ERROR(weights_->EncodeTensor(in, parent_->manifest.files[at.file], Entry(at), &t,
                                         records_.data() + t.first_block, spool_.get(), 0));
  weights_->SetChanges(nullptr);
  counts_.changed += t.changed;
  r_.tensors++;
  r_.elements += t.elements();
  r_.state_bytes += t.elements() * DTypeWidth(w.weights.dtype);
  return Status::Ok();
}

void Publisher::Draft::FinishWeightsSnapshot(uint32_t keep) {
  if (!snapshot_ || !weights_->snapshot_error().ok()) return;
  // The tensors this publish did not name are the parent's.
  std::vector<uint8_t> block(m_.block_bytes);
  for (const FileEntry& f : parent_->manifest.files) {
    for (const TensorEntry& t : f.tensors) {
      if (claimed_.count(t.name)) continue;
      for (uint32_t b = 0; b < t.blocks; ++b) {
        const uint64_t len = std::min(m_.block_bytes, t.bytes() - uint64_t{b} * m_.block_bytes);
        if (!reader_->ReadBlock(parent_, f, t, b, block.data()).ok()) return;
        if (!snapshot_->Write(size_t{t.first_block} + b, block.data(), len).ok()) return;
      }
    }
  }
  Version v;
  v.manifest = m_;
  v.records = records_;
  if (snapshot_->Publish(v).ok()) snapshots_->KeepNewest(keep);
  snapshot_.reset();
}

Status Publisher::BeginWeights(std::optional<int64_t> step) {
  weights_draft_.reset();
  stats_ = DistPublishStats{};  // nothing ranged
  RETURN_IF_ERROR(NeedOneRank("publishing weights",
                              "publish from one rank, which holds or gathers the full weights "
                              "one tensor at a time"));
  auto d = Begin(step);
  if (!d.ok()) {
    metrics_->Failed(0);  // a publish that was refused: nothing committed
    return d.status();
  }
  weights_draft_ = std::move(d).value();
  weights_draft_->StartWeights(store_.get(), options_.snapshot_every);
  weights_step_ = step;
  return Status::Ok();
}

Status Publisher::AddWeights(const WeightsTensor& w) {
  if (!weights_draft_) return FailedPrecondition("AddWeights before BeginWeights");
  Draft& d = *weights_draft_;
  Status s = [&]() -> Status {
    ASSIGN_OR_RETURN(TensorAt at, d.Claim(w.name));
    RETURN_IF_ERROR(CheckWeights(w, d.Entry(at)));
    return d.EncodeWeights(at, w);
  }();
  if (!s.ok()) {
    weights_draft_.reset();
    metrics_->Failed(0);
  }
  return s;
}

Result<PublishResult> Publisher::CommitWeights() {
  if (!weights_draft_) return FailedPrecondition("CommitWeights before BeginWeights");
  std::unique_ptr<Draft> d = std::move(weights_draft_);
  return metrics_->Record(weights_step_.value_or(0), [&]() -> Result<PublishResult> {
    ASSIGN_OR_RETURN(PublishResult r, Finish(weights_step_, *d));
    d->FinishWeightsSnapshot(options_.keep_snapshots);
    return r;
  });
}

Result<PublishResult> Publisher::PublishWeights(std::optional<int64_t> step,
                                                const std::vector<WeightsTensor>& tensors) {
  RETURN_IF_ERROR(BeginWeights(step));
  for (const WeightsTensor& w : tensors) RETURN_IF_ERROR(AddWeights(w));
  return CommitWeights();
}

}  // namespace dte
