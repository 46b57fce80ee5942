#include "sync/publisher.h"

#include <map>
#include <utility>

#include "kernels/adamw.h"
#include "store/store.h"
#include "sync/internal/blob_sink.h"
#include "sync/internal/engine_encoder.h"
#include "sync/internal/engine_version.h"

namespace dte {
namespace {

std::string ShapeString(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

struct TensorAt {
  size_t file = 0, tensor = 0;
};

// The kernel parameters of one tensor: the step's, with its group's lr and
// weight decay.
kernels::AdamWParams ParamsFor(const AdamWStep& h, const AdamWParamState* s) {
  kernels::AdamWParams p{h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, h.step, h.order};
  if (s != nullptr && s->lr) p.lr = *s->lr;
  if (s != nullptr && s->weight_decay) p.weight_decay = *s->weight_decay;
  return p;
}

Status CheckHyper(const AdamWStep& h, const AdamWParamState* s) {
  if (h.amsgrad) return InvalidArgument("AdamW amsgrad=True is not supported by the publisher");
  if (h.maximize) return InvalidArgument("AdamW maximize=True is not supported by the publisher");
  std::string error = kernels::AdamWParamsError(ParamsFor(h, s));
  if (error.empty()) return Status::Ok();
  return InvalidArgument(s != nullptr ? "tensor " + s->name + ": " + error : error);
}

// One optimizer-state array of `what` for tensor `name` must be FP32 with
// the store tensor's shape.
Status CheckState(const std::string& name, const char* what, const TensorRef& r,
                  const TensorEntry& t) {
  if (r.dtype != DType::kF32) {
    return InvalidArgument("tensor " + name + ": " + what + " is " + DTypeName(r.dtype) +
                           "; the publisher needs FP32 master weights and moments");
  }
  if (r.shape != t.shape) {
    return InvalidArgument("tensor " + name + ": " + what + " has shape " + ShapeString(r.shape) +
                           " but the store's tensor has shape " + ShapeString(t.shape));
  }
  if (r.data == nullptr && t.elements() > 0) {
    return InvalidArgument("tensor " + name + ": " + what + " has no data");
  }
  return Status::Ok();
}

Status CheckParam(const AdamWParamState& s, const AdamWStep& h, const TensorEntry& t) {
  if (t.dtype != DType::kBF16) {
    return InvalidArgument("tensor " + s.name + " is " + DTypeName(t.dtype) +
                           " in the store; the publisher writes BF16 tensors only");
  }
  if (s.state_step && *s.state_step != h.step) {
    return InvalidArgument("tensor " + s.name + ": optimizer state step " +
                           std::to_string(*s.state_step) + " does not match the published step " +
                           std::to_string(h.step));
  }
  RETURN_IF_ERROR(CheckHyper(h, &s));
  RETURN_IF_ERROR(CheckState(s.name, "param", s.param, t));
  RETURN_IF_ERROR(CheckState(s.name, "exp_avg", s.exp_avg, t));
  return CheckState(s.name, "exp_avg_sq", s.exp_avg_sq, t);
}

}  // namespace

Publisher::Publisher(PublisherOptions options, std::unique_ptr<Store> store)
    : options_(std::move(options)), store_(std::move(store)) {}

Publisher::~Publisher() = default;

Result<std::unique_ptr<Publisher>> Publisher::Open(const PublisherOptions& options) {
  if (options.converter != "hf") {
    return InvalidArgument("converter \"" + options.converter +
                           "\" is not supported by the publisher (supported: hf)");
  }
  StoreOptions o;
  o.uri = options.store;
  o.cache_dir = options.cache_dir;
  o.create = true;
  o.index_optional = true;  // as dtectl: work from the store if another process holds the index
  ASSIGN_OR_RETURN(auto store, Store::Open(o));
  return std::unique_ptr<Publisher>(new Publisher(options, std::move(store)));
}

Result<CommitResult> Publisher::ImportCheckpoint(const std::string& dir) {
  ASSIGN_OR_RETURN(CommitResult r, CommitDirectory(*store_, dir, CommitOptions{}));
  last_version_ = r.version;
  last_step_.reset();
  return r;
}

Result<PublishResult> Publisher::PublishAdamW(const AdamWStep& h,
                                              const std::vector<AdamWParamState>& params) {
  RETURN_IF_ERROR(CheckHyper(h, nullptr));
  if (last_step_ && h.step != *last_step_ + 1) {
    return InvalidArgument("step " + std::to_string(h.step) + " does not follow step " +
                           std::to_string(*last_step_) +
                           ", the last one published: the store's latest version must hold the "
                           "weights from right before this step");
  }
  ASSIGN_OR_RETURN(auto latest, store_->Latest());
  if (!latest) {
    return NotFound("store " + store_->uri() +
                    " has no version to publish a delta against; import the initial checkpoint "
                    "first");
  }
  if (last_version_ && *latest != *last_version_) {
    return InvalidArgument("the latest version of store " + store_->uri() + " is " +
                           VersionName(*latest) + ", not " + VersionName(*last_version_) +
                           " which this publisher committed last: another writer changed it");
  }
  ASSIGN_OR_RETURN(auto parent, store_->GetVersion(*latest));
  const Manifest& pm = parent->manifest;
  std::map<std::string, TensorAt> where;
  for (size_t f = 0; f < pm.files.size(); ++f) {
    for (size_t t = 0; t < pm.files[f].tensors.size(); ++t) {
      where[pm.files[f].tensors[t].name] = {f, t};
    }
  }
  std::vector<std::pair<TensorAt, const AdamWParamState*>> work;
  std::map<std::string, bool> seen;
  for (const auto& s : params) {
    auto it = where.find(s.name);
    if (it == where.end()) {
      return InvalidArgument("tensor " + s.name + " is not in " + VersionName(*latest) +
                             " of store " + store_->uri());
    }
    if (seen[s.name]) return InvalidArgument("tensor " + s.name + " is given twice");
    seen[s.name] = true;
    RETURN_IF_ERROR(CheckParam(s, h, pm.files[it->second.file].tensors[it->second.tensor]));
    work.push_back({it->second, &s});
  }

  // The new version: the parent's files and blocks, every block unchanged
  // until a published tensor overwrites its records.
  Manifest m;
  m.version = *latest + 1;
  m.parent = *latest;
  m.created = NowRfc3339();
  m.block_bytes = pm.block_bytes;
  m.files = pm.files;
  std::vector<BlockRecord> records = parent->records;
  for (auto& rec : records) rec = BlockRecord{BlockKind::kSame, 0, 0, 0, 0, rec.hash};
  for (auto& f : m.files) {
    for (auto& t : f.tensors) t.changed = 0;
  }

  internal::BlobSink sink(&store_->objects());
  ASSIGN_OR_RETURN(auto spool, sink.NewSpool());
  internal::EngineEncoder encoder(m.block_bytes, options_.margin_ulps, options_.screen);
  internal::EngineCounts counts;
  PublishResult r;
  for (const auto& [at, s] : work) {
    TensorEntry& t = m.files[at.file].tensors[at.tensor];
    encoder.SetParams(ParamsFor(h, s));
    RETURN_IF_ERROR(encoder
                        .EncodeTensor(static_cast<const float*>(s->param.data),
                                      static_cast<const float*>(s->exp_avg.data),
                                      static_cast<const float*>(s->exp_avg_sq.data), &t,
                                      records.data() + t.first_block, spool.get(), 0, &counts)
                        .WithContext("tensor " + s->name));
    r.tensors++;
    r.elements += t.elements();
  }
  if (spool->size() > 0) {
    ASSIGN_OR_RETURN(BlobRef delta, sink.Finish(std::move(spool)));
    m.blobs.push_back(delta);
  }
  RETURN_IF_ERROR(internal::PublishVersion(store_.get(), &sink, &m, records, latest));
  last_version_ = m.version;
  last_step_ = h.step;
  r.version = m.version;
  r.parent = *latest;
  r.changed = counts.changed;
  r.flagged = counts.flagged;
  r.false_positives = counts.false_positives;
  r.uncertain = counts.uncertain;
  r.stored_bytes = m.stats.stored_bytes;
  r.state_bytes = r.elements * 3 * sizeof(float);
  return r;
}

}  // namespace dte
