#include "sync/publish/dist_publisher.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>
#include <utility>

#include "kernels/adamw.h"
#include "kernels/bf16_math.h"
#include "kernels/cuda.h"
#include "kernels/parallel.h"
#include "store/delta_codec.h"
#include "store/materialize.h"
#include "store/snapshot.h"
#include "store/store.h"
#include "store/write/blob_sink.h"
#include "store/write/version_writer.h"
#include "sync/convert/convert.h"
#include "sync/convert/internal/convert_matrix.h"
#include "sync/publish/internal/dist_header.h"
#include "sync/publish/internal/engine_screen.h"
#include "sync/publish/publish_metrics.h"

namespace dte {
namespace {

uint64_t NanosSince(std::chrono::steady_clock::time_point start) {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start)
          .count());
}

using json = nlohmann::json;

// Elements screened per call: 3 MiB of FP32 state per array, and 12 bytes
// per element of candidate buffers at most.
constexpr uint64_t kScreenChunk = uint64_t{1} << 18;
// Elements searched per call on a device: 192 MiB of FP32 state, and 160
// MiB of device buffers for the kept entries at most.
constexpr uint64_t kDeviceChunk = uint64_t{1} << 24;
// Blocks encoded in parallel by an owner, as dtectl commit does.
constexpr uint32_t kOwnerBlocksPerChunk = 16;

std::string StepWhat(const AdamWStep& h) { return "step " + std::to_string(h.step); }

// Little-endian fixed-width fields, for the messages between ranks.
class Writer {
 public:
  template <typename T>
  void Put(T v) {
    char b[sizeof(T)];
    std::memcpy(b, &v, sizeof(T));
    out_.append(b, sizeof(T));
  }
  void PutString(const std::string& s) {
    Put<uint64_t>(s.size());
    out_ += s;
  }
  void PutHash(const Hash128& h) {
    Put(h.high);
    Put(h.low);
  }
  void PutStatus(const Status& s) {
    Put<uint8_t>(static_cast<uint8_t>(s.code()));
    PutString(s.ok() ? std::string() : s.message());
  }
  void PutRecord(const BlockRecord& r) {
    Put<uint8_t>(static_cast<uint8_t>(r.kind));
    Put(r.offset);
    Put(r.length);
    Put(r.changed);
    Put(r.hash);
  }
  std::string& out() { return out_; }

 private:
  std::string out_;
};

class Reader {
 public:
  explicit Reader(std::string_view in) : in_(in) {}
  template <typename T>
  bool Get(T* v) {
    if (in_.size() < sizeof(T)) return false;
    std::memcpy(v, in_.data(), sizeof(T));
    in_.remove_prefix(sizeof(T));
    return true;
  }
  bool GetString(std::string* s) {
    uint64_t n = 0;
    if (!Get(&n) || in_.size() < n) return false;
    s->assign(in_.data(), n);
    in_.remove_prefix(n);
    return true;
  }
  bool GetHash(Hash128* h) { return Get(&h->high) && Get(&h->low); }
  bool GetStatus(Status* s) {
    uint8_t code = 0;
    std::string message;
    if (!Get(&code) || !GetString(&message)) return false;
    *s = code == 0 ? Status::Ok() : Status(static_cast<Code>(code), std::move(message));
    return true;
  }
  bool GetRecord(BlockRecord* r) {
    uint8_t kind = 0;
    if (!Get(&kind) || !Get(&r->offset) || !Get(&r->length) || !Get(&r->changed) ||
        !Get(&r->hash)) {
      return false;
    }
    r->kind = static_cast<BlockKind>(kind);
    return true;
  }
  bool Skip(size_t n) {
    if (in_.size() < n) return false;
    in_.remove_prefix(n);
    return true;
  }
  const char* data() const { return in_.data(); }
  bool done() const { return in_.empty(); }

 private:
  std::string_view in_;
};

// Every rank sends out[r] to rank r and gets in[r] from rank r: the sizes in
// one round, then the non-empty payloads in a second, so both ends always
// agree on every message's size.
Result<std::vector<std::string>> AllToAll(Transport& t, const std::vector<std::string>& out,
                                          const std::string& what, DistPublishStats* stats) {
  const int n = t.size();
  std::vector<uint64_t> sizes_out(n), sizes_in(n);
  std::vector<SendBuffer> sends;
  std::vector<RecvBuffer> recvs;
  for (int r = 0; r < n; ++r) {
    sizes_out[r] = out[r].size();
    sends.push_back({r, &sizes_out[r], sizeof(uint64_t)});
    recvs.push_back({r, &sizes_in[r], sizeof(uint64_t)});
  }
  RETURN_IF_ERROR(t.Exchange(sends, recvs).WithContext(what + " (sizes)"));
  std::vector<std::string> in(n);
  sends.clear();
  recvs.clear();
  for (int r = 0; r < n; ++r) {
    if (sizes_in[r] > (uint64_t{1} << 40)) {
      return Corruption(what + ": rank " + std::to_string(r) + " announced " +
                        std::to_string(sizes_in[r]) + " bytes");
    }
    in[r].resize(sizes_in[r]);
    if (!out[r].empty()) sends.push_back({r, out[r].data(), out[r].size()});
    if (!in[r].empty()) recvs.push_back({r, in[r].data(), in[r].size()});
    if (stats && r != t.rank()) {
      stats->bytes_sent += out[r].size();
      stats->bytes_received += in[r].size();
      stats->messages_sent += 1 + !out[r].empty();  // the size, then the payload
    }
  }
  RETURN_IF_ERROR(t.Exchange(sends, recvs).WithContext(what));
  return in;
}

// AllToAll for large payloads: this rank's message to itself is moved, not
// copied, and every outgoing message is freed once sent.
Result<std::vector<std::string>> AllToAllMove(Transport& t, std::vector<std::string> out,
                                              const std::string& what, DistPublishStats* stats) {
  const int me = t.rank();
  std::string mine = std::move(out[me]);
  out[me].clear();
  ASSIGN_OR_RETURN(auto in, AllToAll(t, out, what, stats));
  in[me] = std::move(mine);
  return in;
}

Result<std::vector<std::string>> AllGather(Transport& t, const std::string& mine,
                                           const std::string& what, DistPublishStats* stats) {
  return AllToAll(t, std::vector<std::string>(t.size(), mine), what, stats);
}

kernels::AdamWParams ParamsOf(const AdamWStep& h, std::optional<double> lr,
                              std::optional<double> wd) {
  kernels::AdamWParams p{h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, h.step, h.order};
  if (lr) p.lr = *lr;
  if (wd) p.weight_decay = *wd;
  return p;
}

// The header of the agreement (sync/publish/internal/dist_header.h).
using dist_internal::DecodeHeader;
using dist_internal::EncodeHeader;
using dist_internal::Header;

// Disjoint, sorted intervals of covered elements.
using Intervals = std::map<uint64_t, uint64_t>;  // begin -> end

// [begin, end) minus `covered`.
std::vector<FlatRange> Subtract(const Intervals& covered, uint64_t begin, uint64_t end) {
  std::vector<FlatRange> out;
  uint64_t at = begin;
  auto it = covered.upper_bound(begin);
  if (it != covered.begin()) --it;
  for (; it != covered.end() && it->first < end && at < end; ++it) {
    if (it->second <= at) continue;
    if (it->first > at) out.push_back({at, it->first});
    at = std::max(at, it->second);
  }
  if (at < end) out.push_back({at, end});
  return out;
}

void Cover(Intervals* covered, uint64_t begin, uint64_t end) {
  for (const FlatRange& piece : Subtract(*covered, begin, end)) {
    (*covered)[piece.begin] = piece.end;
  }
}

// Changed elements bound for one owner: groups of entries of one tensor
// within 2^32 elements of the group's base.
class EntryWriter {
 public:
  void Add(uint32_t tensor, uint64_t index, uint16_t bits) {
    const uint64_t base = index & ~uint64_t{0xFFFFFFFF};
    if (count_at_ == std::string::npos || tensor != tensor_ || base != base_) {
      Close();
      tensor_ = tensor;
      base_ = base;
      w_.Put(tensor);
      w_.Put(base);
      count_at_ = w_.out().size();
      w_.Put<uint32_t>(0);
    }
    w_.Put(static_cast<uint32_t>(index - base));
    w_.Put(bits);
    count_++;
  }
  std::string Finish() {
    Close();
    return std::move(w_.out());
  }

 private:
  void Close() {
    if (count_at_ != std::string::npos) std::memcpy(&w_.out()[count_at_], &count_, 4);
    count_at_ = std::string::npos;
    count_ = 0;
  }
  Writer w_;
  uint32_t tensor_ = 0;
  uint64_t base_ = 0;
  size_t count_at_ = std::string::npos;
  uint32_t count_ = 0;
};

// A run of consecutive elements of a range's target that are consecutive
// elements of one parent tensor too.
struct Segment {
  uint64_t from = 0, len = 0;  // in the target (tensor or MCore shard)
  size_t tensor = 0;           // the parent tensor
  uint64_t to = 0;             // its first element there
};

}  // namespace

FlatRange RowRange(const std::vector<int64_t>& shape, uint64_t row_begin, uint64_t row_end) {
  uint64_t row = 1;
  for (size_t d = 1; d < shape.size(); ++d) row *= static_cast<uint64_t>(shape[d]);
  return {row_begin * row, row_end * row};
}

FlatRange ChunkRows(uint64_t rows, int rank, int world) {
  const uint64_t chunk = world > 0 ? (rows + world - 1) / world : rows;
  const uint64_t begin = std::min(rows, chunk * static_cast<uint64_t>(rank));
  return {begin, std::min(rows, begin + chunk)};
}

// What every rank derives, identically, from all ranks' headers.
struct DistPublisher::Plan {
  uint64_t latest = 0;
  std::shared_ptr<const Version> parent;
  struct Tensor {
    size_t file = 0, index = 0;
    const TensorEntry* entry = nullptr;
    bool named = false;
    int owner = -1;
    std::optional<double> lr, wd;
  };
  std::vector<Tensor> tensors;  // the parent's, in manifest order
  std::map<std::string, size_t> ordinal;
  AnchorDistance parent_distance;
  AnchorDistance join_distance;  // rank 0's (store/write/anchor_policy.h, JoinDistanceOf)
  std::string anchor_reason;
  std::string join_reason;
};

DistPublisher::DistPublisher(PublisherOptions options, std::unique_ptr<Store> store)
    : options_(std::move(options)),
      store_(std::move(store)),
      metrics_(std::make_unique<PublishMetrics>()) {}

DistPublisher::~DistPublisher() = default;

// Buffers on one CUDA device for finding the changes of ranges held there,
// a chunk of kDeviceChunk elements at a time; moved to another device when
// a range is on one.
struct DistPublisher::DeviceFinder {
  int device = -1;
  kernels::CudaBuffer workspace, idx, bits, count;
  size_t workspace_bytes = 0;
  std::vector<uint64_t> host_idx;
  std::vector<uint16_t> host_bits;

  static Status Failed(const std::string& what, const kernels::CudaStatus& st) {
    return Internal(what + ": " + st.message);
  }

  // Makes `dev` the thread's current device, with the buffers allocated on it.
  Status Prepare(int dev, const std::string& what) {
    const std::string on = what + ": CUDA device " + std::to_string(dev);
    if (kernels::CudaStatus st = kernels::CudaSetDevice(dev); !st.ok()) return Failed(on, st);
    if (device == dev) return Status::Ok();
    device = -1;
    size_t ws = 0;
    if (kernels::CudaStatus st = kernels::CudaAdamWFindChangesWorkspaceBytes(kDeviceChunk, &ws);
        !st.ok()) {
      return Failed(on, st);
    }
    for (auto [buf, bytes] : {std::pair{&workspace, ws}, std::pair{&idx, kDeviceChunk * 8},
                              std::pair{&bits, kDeviceChunk * 2}, std::pair{&count, size_t{8}}}) {
      if (kernels::CudaStatus st = buf->Allocate(bytes); !st.ok()) return Failed(on, st);
    }
    workspace_bytes = ws;
    device = dev;
    return Status::Ok();
  }

  // The kept elements (kernels::AdamWFindChanges) of n <= kDeviceChunk
  // elements of device state, into host_idx and host_bits; returns how many.
  Result<size_t> Find(const float* theta, const float* m, const float* v, size_t n,
                      const kernels::AdamWParams& p, uint32_t margin_ulps,
                      const std::string& what) {
    auto* d_idx = static_cast<uint64_t*>(idx.data());
    auto* d_bits = static_cast<uint16_t*>(bits.data());
    auto* d_count = static_cast<uint64_t*>(count.data());
    if (kernels::CudaStatus st =
            kernels::CudaAdamWFindChanges(workspace.data(), workspace_bytes, theta, m, v, n, p,
                                          margin_ulps, d_idx, d_bits, d_count, nullptr);
        !st.ok()) {
      return Failed(what, st);
    }
    uint64_t kept = 0;
    if (kernels::CudaStatus st = kernels::CudaCopyToHost(&kept, d_count, sizeof kept); !st.ok()) {
      return Failed(what, st);
    }
    host_idx.resize(kept);
    host_bits.resize(kept);
    if (kernels::CudaStatus st = kernels::CudaCopyToHost(host_idx.data(), d_idx, kept * 8);
        !st.ok()) {
      return Failed(what, st);
    }
    if (kernels::CudaStatus st = kernels::CudaCopyToHost(host_bits.data(), d_bits, kept * 2);
        !st.ok()) {
      return Failed(what, st);
    }
    return static_cast<size_t>(kept);
  }
};

Result<std::unique_ptr<DistPublisher>> DistPublisher::Open(const PublisherOptions& options) {
  if (!options.screen) {
    return InvalidArgument("the distributed publisher finds changes with the screen (screen=true)");
  }
  RETURN_IF_ERROR(CheckAnchorPolicy(options.anchor_policy));
  ASSIGN_OR_RETURN(auto parts, internal::OpenPublisherParts(options));
  std::unique_ptr<DistPublisher> p(new DistPublisher(options, std::move(parts.store)));
  p->plan_ = std::move(parts.plan);
  return p;
}

Status DistPublisher::SetAnchorPolicy(const AnchorPolicy& policy) {
  RETURN_IF_ERROR(CheckAnchorPolicy(policy));
  options_.anchor_policy = policy;
  return Status::Ok();
}

Result<PublishResult> DistPublisher::PublishAdamW(Transport& transport, const AdamWStep& h,
                                                  const std::vector<RangeState>& ranges) {
  stats_ = DistPublishStats{};
  parts_sent_.reset();
  auto r = metrics_->Record(h.step, [&]() -> Result<PublishResult> {
    auto ran = Run(transport, h, ranges);
    if (parts_sent_) stats_.commit_ns = NanosSince(*parts_sent_);
    if (!ran.ok()) {
      push_changes_.clear();  // nothing committed: nothing to push
      return ran.status();
    }
    PublishResult out = std::move(ran).value();
    last_step_ = h.step;
    last_version_ = out.version;
    if (push_ && committed_before_) {
      // Pushed when it was committed (or missed: receivers catch up); this
      // attempt knows no owners, so it does not push again.
      out.push_error = "not pushed again: " + VersionName(out.version) +
                       " was committed by an earlier attempt of this step";
    } else if (push_ && push_owned_) {
      // Every rank pushes the tensors it owned (encoded) in this version:
      // the changes it kept while encoding, the rest read back.
      PushOwned(out);
    } else if (push_ && transport.rank() == 0) {
      internal::PushCommitted(*push_, *store_, out.version, /*changes=*/nullptr, &out);
    }
    return out;
  });
  metrics_->Routed(stats_);
  return r;
}

// Pushes: from rank 0 alone (it reads each version back), or from every
// rank, each the tensors it owns (receivers connect to all of them).
Status DistPublisher::AgreePush(int rank, const std::vector<std::string>& senders,
                                const std::string& what) {
  const int world = static_cast<int>(senders.size());
  const auto with = std::count_if(senders.begin(), senders.end(),
                                  [](const std::string& a) { return !a.empty(); });
  if (with > 0 && senders[0].empty()) {
    const int r = static_cast<int>(
        std::find_if(senders.begin(), senders.end(), [](auto& a) { return !a.empty(); }) -
        senders.begin());
    return InvalidArgument(what + "rank " + std::to_string(r) +
                           " has a push group and rank 0 has none: give push= on every rank "
                           "(each pushes the tensors it owns) or on rank 0 only");
  }
  if (with > 1 && with < world) {
    const int r = static_cast<int>(std::find(senders.begin(), senders.end(), std::string()) -
                                   senders.begin());
    return InvalidArgument(what + "rank " + std::to_string(r) +
                           " has no push group and other ranks have one: give push= on every "
                           "rank (each pushes the tensors it owns) or on rank 0 only");
  }
  push_owned_ = false;
  if (!push_) return Status::Ok();
  push_owned_ = with == world && world > 1;
  RETURN_IF_ERROR(push_owned_ ? push_->SetGroup(rank, world) : push_->SetGroup(0, 1));
  if (push_owned_ && rank == 0) RETURN_IF_ERROR(push_->SetSenders(senders));
  return Status::Ok();
}

Status DistPublisher::SharePush(Transport& t) {
  ASSIGN_OR_RETURN(auto senders, AllGather(t, push_ ? push_->address() : std::string(),
                                           "sharing the push servers' addresses", &stats_));
  return AgreePush(t.rank(), senders, "");
}

namespace {

// The changes of the tensors a rank owned: those it kept while encoding,
// the others read back from the store.
class OwnedChanges : public ChangesSource {
 public:
  OwnedChanges(const std::set<std::string>& owned, const std::map<std::string, TensorChanges>& kept,
               std::unique_ptr<ChangesSource> store)
      : owned_(owned), kept_(kept), store_(std::move(store)) {
    for (const std::string& name : owned_) {
      if (!kept_.count(name) && store_->MayChange(name)) stable_ = false;
    }
  }
  bool MayChange(const std::string& name) const override {
    if (!owned_.count(name)) return false;
    auto it = kept_.find(name);
    return it != kept_.end() ? !it->second.indices.empty() : store_->MayChange(name);
  }
  Result<const TensorChanges*> Read(const std::string& name) override {
    auto it = kept_.find(name);
    if (it != kept_.end()) return &it->second;
    return store_->Read(name);
  }
  bool Stable() const override { return stable_; }

 private:
  const std::set<std::string>& owned_;
  const std::map<std::string, TensorChanges>& kept_;
  std::unique_ptr<ChangesSource> store_;
  bool stable_ = true;
};

}  // namespace

void DistPublisher::PushOwned(PublishResult& out) {
  auto pushed = [&]() -> Result<PushReport> {
    ASSIGN_OR_RETURN(auto v, store_->GetVersion(out.version));
    ASSIGN_OR_RETURN(auto read_back, StoreChanges(*store_, v));
    for (const std::string& name : owned_) {
      auto it = push_changes_.find(name);
      if (it != push_changes_.end()) {
        stats_.push_tensors_kept += !it->second.indices.empty();
      } else {
        stats_.push_tensors_read_back += read_back->MayChange(name);
      }
    }
    OwnedChanges mine(owned_, push_changes_, std::move(read_back));
    return push_->Push(*store_, v, mine);
  }();
  if (pushed.ok()) {
    out.push = std::move(pushed).value();
  } else {
    out.push_error = pushed.status().message();
  }
  push_changes_.clear();
}

Status DistPublisher::SetPush(PushServer* push) {
  push_ = push;
  return push_ ? internal::TellPushLatest(*push_, *store_) : Status::Ok();
}

Result<PublishResult> DistPublisher::Run(Transport& t, const AdamWStep& h,
                                         const std::vector<RangeState>& ranges) {
  const int rank = t.rank(), world = t.size();
  const std::string at_step = StepWhat(h);

  // 1. Agreement.
  Header mine;
  mine.fields = {{"step", h.step},
                 {"lr", h.lr},
                 {"beta1", h.beta1},
                 {"beta2", h.beta2},
                 {"eps", h.eps},
                 {"weight_decay", h.weight_decay},
                 {"amsgrad", h.amsgrad},
                 {"maximize", h.maximize},
                 {"order", static_cast<int>(h.order)},
                 {"store", store_->store_id()},
                 {"world_size", world},
                 {"anchor_budget", options_.anchor_policy.budget},
                 {"anchor_every", options_.anchor_policy.every},
                 {"converter", options_.converter}};
  if (options_.mcore) {
    const McoreConverter& c = *options_.mcore;
    mine.fields["mcore"] =
        json::array({c.spec.model_type, c.spec.num_layers, c.spec.hidden, c.layout.tp, c.layout.ep,
                     c.layout.expert_tp(), c.layout.vocab_divisible_by,
                     static_cast<int>(c.layout.norms), static_cast<int>(c.layout.experts)});
  }
  mine.last_version = last_version_;
  mine.last_step = last_step_;
  if (push_) mine.push = push_->address();
  owned_.clear();
  push_changes_.clear();
  push_owned_ = false;
  committed_before_ = false;
  for (const auto& r : ranges) {
    mine.ranges.push_back(
        {r.name, r.tp_rank, r.ep_rank, r.begin, r.end, r.state_step, r.lr, r.weight_decay});
  }
  if (h.amsgrad) {
    mine.error = "AdamW amsgrad=True is not supported by the publisher";
  } else if (h.maximize) {
    mine.error = "AdamW maximize=True is not supported by the publisher";
  } else if (std::string e = kernels::AdamWParamsError(ParamsOf(h, {}, {})); !e.empty()) {
    mine.error = e;
  } else if (last_step_ && h.step != *last_step_ + 1 && h.step != *last_step_) {
    mine.error = at_step + " does not follow step " + std::to_string(*last_step_) +
                 ", the last one this rank published";
  }
  if (mine.error.empty() && rank == 0) {
    // A latest other than the one this rank committed is believed only once
    // the manifests confirm it (a damaged listing is listed again).
    auto latest = last_version_ ? store_->ConfirmedLatest(*last_version_) : store_->Latest();
    if (!latest.ok()) {
      mine.error = latest.status().message();
    } else if (!*latest) {
      mine.error = "store " + store_->uri() +
                   " has no version to publish a delta against; import the initial checkpoint "
                   "first";
    } else {
      mine.latest = **latest;
    }
  }
  ASSIGN_OR_RETURN(
      auto texts, AllGather(t, EncodeHeader(mine), at_step + ": agreeing on the publish", &stats_));
  std::vector<Header> all;
  for (int r = 0; r < world; ++r) {
    ASSIGN_OR_RETURN(Header hr, DecodeHeader(texts[r], r));
    all.push_back(std::move(hr));
  }
  for (int r = 0; r < world; ++r) {
    if (!all[r].error.empty()) {
      return InvalidArgument(at_step + ": rank " + std::to_string(r) + ": " + all[r].error);
    }
  }
  for (int r = 1; r < world; ++r) {
    for (const auto& [key, value] : all[0].fields.items()) {
      const json& other = all[r].fields.contains(key) ? all[r].fields.at(key) : json(nullptr);
      if (other != value) {
        return InvalidArgument(at_step + ": rank " + std::to_string(r) +
                               " disagrees with rank 0 on " + key + ": " + other.dump() +
                               " against " + value.dump());
      }
    }
  }
  {
    std::vector<std::string> senders;
    for (int r = 0; r < world; ++r) senders.push_back(all[r].push);
    RETURN_IF_ERROR(AgreePush(rank, senders, at_step + ": "));
  }
  Plan plan;
  if (all[0].last_step && *all[0].last_step == h.step && all[0].last_version) {
    // Rank 0 committed this step, and the ranks that did not learn it (one
    // failed while the outcome was sent) retry: the version is there.
    ASSIGN_OR_RETURN(auto v, store_->GetVersion(*all[0].last_version));
    PublishResult res;
    res.version = v->manifest.version;
    res.parent = v->manifest.parent.value_or(0);
    res.changed = v->manifest.stats.changed_elements;
    res.stored_bytes = v->manifest.stats.stored_bytes;
    res.full_table = v->manifest.full.has_value();
    committed_before_ = true;
    return res;
  }
  for (int r = 1; r < world; ++r) {
    if (all[r].last_step && *all[r].last_step == h.step) {
      return InvalidArgument(at_step + ": rank " + std::to_string(r) + " published it already" +
                             ", but rank 0 did not: was rank 0 restarted?");
    }
  }
  plan.latest = *all[0].latest;
  for (int r = 0; r < world; ++r) {
    if (all[r].last_version && *all[r].last_version != plan.latest) {
      return AlreadyExists(at_step + ": the latest version of store " + store_->uri() + " is " +
                           VersionName(plan.latest) + ", not " + VersionName(*all[r].last_version) +
                           " which rank " + std::to_string(r) +
                           " published last: another writer changed it");
    }
  }
  {
    // The parent and its distance from the last full table, on every rank:
    // one rank that cannot read them fails them all.
    Status loaded = [&]() -> Status {
      // Ranges in device memory: the device and its buffers, checked here so
      // that a rank without them fails every rank before anything is routed.
      for (const RangeState& r : ranges) {
        if (r.device < 0 || r.end == r.begin) continue;
        if (!device_) device_ = std::make_unique<DeviceFinder>();
        RETURN_IF_ERROR(device_->Prepare(r.device, "tensor " + r.name + " (state on the GPU)"));
      }
      ASSIGN_OR_RETURN(plan.parent, store_->GetVersion(plan.latest));
      ASSIGN_OR_RETURN(plan.parent_distance, DistanceOf(*store_, plan.parent));
      if (rank == 0) {
        ASSIGN_OR_RETURN(plan.join_distance,
                         JoinDistanceOf(*store_, plan.parent, plan.parent_distance));
      }
      return Status::Ok();
    }();
    Writer w;
    w.PutStatus(loaded);
    w.Put<uint64_t>(plan.join_distance.versions);
    w.Put<uint64_t>(plan.join_distance.bytes);
    ASSIGN_OR_RETURN(auto states, AllGather(t, w.out(), at_step + ": reading the parent", &stats_));
    for (int r = 0; r < world; ++r) {
      Reader rd(states[r]);
      Status s;
      AnchorDistance jd;
      if (!rd.GetStatus(&s) || !rd.Get(&jd.versions) || !rd.Get(&jd.bytes))
        return Corruption(at_step + ": rank " + std::to_string(r) + " sent a malformed status");
      RETURN_IF_ERROR(s.WithContext(at_step + ": rank " + std::to_string(r)));
      // Whether this version gets a join table is rank 0's call, so every
      // rank plans the same full table.
      if (r == 0) plan.join_distance = jd;
    }
  }
  const Manifest& pm = plan.parent->manifest;
  for (size_t f = 0; f < pm.files.size(); ++f) {
    for (size_t i = 0; i < pm.files[f].tensors.size(); ++i) {
      plan.ordinal[pm.files[f].tensors[i].name] = plan.tensors.size();
      plan.tensors.push_back({f, i, &pm.files[f].tensors[i], false, -1, {}, {}});
    }
  }

  // What ranges name: the parent's tensors (converter "hf") or the plan's
  // MCore shards (converter "mcore").
  const bool mcore = options_.converter == "mcore";
  struct Target {
    std::string what;  // for errors
    uint64_t elements = 0;
    size_t tensor = 0;           // "hf": the parent tensor
    size_t unit = 0, shard = 0;  // "mcore": the plan's unit and shard
    bool named = false;
    std::optional<double> lr, wd;
  };
  std::vector<Target> targets;
  std::map<ShardKey, size_t> shard_target;
  if (mcore) {
    for (size_t u = 0; u < plan_.size(); ++u) {
      for (size_t k = 0; k < plan_[u].shards.size(); ++k) {
        const PlannedShard& ps = plan_[u].shards[k];
        shard_target[ps.key] = targets.size();
        targets.push_back(
            {"MCore shard " + ps.key.ToString(), ps.elements(), 0, u, k, false, {}, {}});
      }
    }
  } else {
    for (size_t ti = 0; ti < plan.tensors.size(); ++ti) {
      targets.push_back({"tensor " + plan.tensors[ti].entry->name,
                         plan.tensors[ti].entry->elements(),
                         ti,
                         0,
                         0,
                         false,
                         {},
                         {}});
    }
  }
  // The target a range names; a replica (a norm on every TP rank, a dense
  // tensor on every EP rank) names the shard the plan takes from rank 0.
  auto target_of = [&](const Header::Range& x, const std::string& who) -> Result<size_t> {
    if (!mcore) {
      auto it = plan.ordinal.find(x.name);
      if (it == plan.ordinal.end()) {
        return InvalidArgument(who + "tensor " + x.name + " is not in " + VersionName(plan.latest) +
                               " of store " + store_->uri());
      }
      const TensorEntry& te = *plan.tensors[it->second].entry;
      if (te.dtype != DType::kBF16) {
        return InvalidArgument(who + "tensor " + x.name + " is " + DTypeName(te.dtype) +
                               " in the store; the publisher writes BF16 tensors only");
      }
      return it->second;
    }
    for (const ShardKey& key : {ShardKey{x.name, x.tp, x.ep}, ShardKey{x.name, 0, x.ep},
                                ShardKey{x.name, x.tp, 0}, ShardKey{x.name, 0, 0}}) {
      auto it = shard_target.find(key);
      if (it != shard_target.end()) return it->second;
    }
    return InvalidArgument(who + "MCore shard " + ShardKey{x.name, x.tp, x.ep}.ToString() +
                           " is not part of the " + options_.mcore->spec.model_type +
                           " model with tp " + std::to_string(options_.mcore->layout.tp) + ", ep " +
                           std::to_string(options_.mcore->layout.ep));
  };

  // Every range of every rank, checked; coverage; replicas to their lowest
  // holder.
  struct Held {
    int rank;
    size_t index;  // into all[rank].ranges
  };
  std::vector<std::vector<Held>> held(targets.size());
  for (int r = 0; r < world; ++r) {
    for (size_t k = 0; k < all[r].ranges.size(); ++k) {
      const Header::Range& x = all[r].ranges[k];
      const std::string rank_who = at_step + ": rank " + std::to_string(r) + ": ";
      ASSIGN_OR_RETURN(size_t ti, target_of(x, rank_who));
      const std::string who = rank_who + targets[ti].what;
      if (x.begin > x.end || x.end > targets[ti].elements) {
        return InvalidArgument(who + ": elements [" + std::to_string(x.begin) + ", " +
                               std::to_string(x.end) + ") are not a range of its " +
                               std::to_string(targets[ti].elements) + " elements");
      }
      if (x.state_step && *x.state_step != h.step) {
        return InvalidArgument(who + ": optimizer state step " + std::to_string(*x.state_step) +
                               " does not match the published step " + std::to_string(h.step));
      }
      std::string e = kernels::AdamWParamsError(ParamsOf(h, x.lr, x.wd));
      if (!e.empty()) return InvalidArgument(who + ": " + e);
      held[ti].push_back({r, k});
    }
  }
  struct Piece {
    size_t target = 0;
    FlatRange range;
    const RangeState* state = nullptr;
  };
  std::vector<Piece> pieces;  // this rank's
  for (size_t ti = 0; ti < targets.size(); ++ti) {
    if (held[ti].empty()) continue;
    Target& tg = targets[ti];
    tg.named = true;
    const Header::Range& first = all[held[ti][0].rank].ranges[held[ti][0].index];
    tg.lr = first.lr;
    tg.wd = first.wd;
    Intervals covered;
    int cur_rank = -1;
    Intervals rank_own;  // the current rank's ranges, which must not overlap
    Intervals below;     // covered by lower ranks
    for (const Held& hd : held[ti]) {
      const Header::Range& x = all[hd.rank].ranges[hd.index];
      const std::string who = at_step + ": " + tg.what;
      if (x.lr != tg.lr || x.wd != tg.wd) {
        return InvalidArgument(who + ": ranks " + std::to_string(held[ti][0].rank) + " and " +
                               std::to_string(hd.rank) +
                               " give it different param-group lr or weight_decay");
      }
      if (hd.rank != cur_rank) {
        for (const auto& [b, e] : rank_own) Cover(&below, b, e);
        rank_own.clear();
        cur_rank = hd.rank;
      }
      if (x.begin == x.end) continue;
      auto fresh = Subtract(rank_own, x.begin, x.end);
      if (fresh.size() != 1 || fresh[0].begin != x.begin || fresh[0].end != x.end) {
        return InvalidArgument(who + ": rank " + std::to_string(hd.rank) +
                               " gives some of elements [" + std::to_string(x.begin) + ", " +
                               std::to_string(x.end) + ") twice");
      }
      rank_own[x.begin] = x.end;
      Cover(&covered, x.begin, x.end);
      if (hd.rank == rank) {
        for (const FlatRange& piece : Subtract(below, x.begin, x.end)) {
          pieces.push_back({ti, piece, &ranges[hd.index]});
        }
      }
    }
    auto gaps = Subtract(covered, 0, tg.elements);
    if (!gaps.empty()) {
      return InvalidArgument(at_step + ": " + tg.what + ": elements [" +
                             std::to_string(gaps[0].begin) + ", " + std::to_string(gaps[0].end) +
                             ") are held by no rank; the ranks' ranges must cover every tensor "
                             "they name");
    }
  }
  // The parent tensors published, and their param groups.
  if (!mcore) {
    for (const Target& tg : targets) {
      Plan::Tensor& pt = plan.tensors[tg.tensor];
      pt.named = tg.named;
      pt.lr = tg.lr;
      pt.wd = tg.wd;
    }
  } else {
    size_t next = 0;  // targets are in plan order
    for (const ConvertUnit& unit : plan_) {
      const Target* given = nullptr;
      const Target* missing = nullptr;
      for (size_t k = 0; k < unit.shards.size(); ++k) {
        const Target& tg = targets[next + k];
        (tg.named ? given : missing) = &tg;
      }
      const size_t first = next;
      next += unit.shards.size();
      if (!given) continue;
      if (missing) {
        return InvalidArgument(at_step + ": " + unit.label + ": " + missing->what +
                               " is held by no rank, but " + given->what +
                               " is; give all shards of a unit or none");
      }
      std::vector<const Target*> from(unit.tensors.size(), nullptr);
      for (const BlockCopy& c : unit.copies) {
        const Target& tg = targets[first + c.shard];
        const Target*& f = from[c.tensor];
        if (f == nullptr) {
          f = &tg;
        } else if (f->lr != tg.lr || f->wd != tg.wd) {
          return InvalidArgument(at_step + ": tensor " + unit.tensors[c.tensor].name + ": " +
                                 f->what + " and " + tg.what +
                                 " have different param-group lr or weight_decay");
        }
      }
      for (size_t k = 0; k < unit.tensors.size(); ++k) {
        const PlannedTensor& p = unit.tensors[k];
        auto it = plan.ordinal.find(p.name);
        if (it == plan.ordinal.end()) {
          return InvalidArgument(at_step + ": tensor " + p.name + " is not in " +
                                 VersionName(plan.latest) + " of store " + store_->uri());
        }
        Plan::Tensor& pt = plan.tensors[it->second];
        if (pt.entry->dtype != DType::kBF16 || pt.entry->shape != p.shape) {
          return InvalidArgument(at_step + ": tensor " + p.name + " is " +
                                 DTypeName(pt.entry->dtype) + " " + ShapeString(pt.entry->shape) +
                                 " in the store; the layout converts to BF16 " +
                                 ShapeString(p.shape));
        }
        pt.named = true;
        if (from[k]) {
          pt.lr = from[k]->lr;
          pt.wd = from[k]->wd;
        }
      }
    }
  }
  for (const Piece& p : pieces) {
    const RangeState& s = *p.state;
    if (s.end > s.begin && (!s.param || !s.exp_avg || !s.exp_avg_sq)) {
      return InvalidArgument(at_step + ": " + targets[p.target].what + ": a range of " +
                             std::to_string(s.end - s.begin) + " elements without data");
    }
  }
  const TableDecision tables = DecideTables(options_.anchor_policy, plan.parent_distance,
                                            plan.join_distance, pm.stats.dense_bytes);
  plan.anchor_reason = tables.anchor_reason;
  plan.join_reason = tables.join_reason;
  // A policy anchor's full table, or a join table: built the same way (a
  // join table's blobs start with the join header).
  const bool join = !plan.join_reason.empty();
  const bool full = !plan.anchor_reason.empty() || join;

  // 2. Ownership: largest first, to the least loaded rank.
  {
    std::vector<size_t> order;
    for (size_t ti = 0; ti < plan.tensors.size(); ++ti) {
      if (plan.tensors[ti].named || full) order.push_back(ti);
    }
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      return plan.tensors[a].entry->bytes() > plan.tensors[b].entry->bytes();
    });
    std::vector<uint64_t> load(world, 0);
    for (size_t ti : order) {
      int best = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
      plan.tensors[ti].owner = best;
      load[best] += plan.tensors[ti].entry->bytes() + 1;
    }
  }

  // 3. Detection: the candidates of this rank's pieces not proven unchanged,
  // in Hugging Face coordinates, as groups (tensor u32, base u64, count u32)
  // of (offset u32, bits u16) for each owner.
  // A failure here (a device error) still lets the exchange run, and goes
  // to rank 0 in this rank's part: no version is committed.
  std::vector<EntryWriter> routed(world);
  uint64_t flagged = 0, kept = 0;
  const auto detect_start = std::chrono::steady_clock::now();
  const Status detected = [&]() -> Status {
    std::vector<uint64_t> idx(kScreenChunk + internal::kScreenSlack);
    std::vector<uint32_t> old(kScreenChunk + internal::kScreenSlack);
    std::vector<Segment> segments;
    for (const Piece& p : pieces) {
      const RangeState& s = *p.state;
      const Target& tg = targets[p.target];
      segments.clear();
      if (!mcore) {
        segments.push_back({0, tg.elements, tg.tensor, 0});
      } else {
        const ConvertUnit& unit = plan_[tg.unit];
        const int64_t shard_cols = internal::MatrixCols(unit.shards[tg.shard].shape);
        for (const BlockCopy& c : unit.copies) {
          if (c.shard != tg.shard) continue;
          const size_t tensor = plan.ordinal.at(unit.tensors[c.tensor].name);
          const int64_t tensor_cols = internal::MatrixCols(unit.tensors[c.tensor].shape);
          for (int64_t r = 0; r < c.rows; ++r) {
            const uint64_t from =
                static_cast<uint64_t>((c.shard_row + r) * shard_cols + c.shard_col);
            const uint64_t to =
                static_cast<uint64_t>((c.tensor_row + r) * tensor_cols + c.tensor_col);
            const uint64_t len = static_cast<uint64_t>(c.cols);
            Segment* last = segments.empty() ? nullptr : &segments.back();
            if (last && last->tensor == tensor && last->from + last->len == from &&
                last->to + last->len == to) {
              last->len += len;  // rows that stay contiguous on both sides
            } else {
              segments.push_back({from, len, tensor, to});
            }
          }
        }
        std::sort(segments.begin(), segments.end(),
                  [](const Segment& a, const Segment& b) { return a.from < b.from; });
      }
      const kernels::AdamWParams params = ParamsOf(h, tg.lr, tg.wd);
      const internal::ScreenScalars scalars =
          internal::MakeScreenScalars(kernels::MakeAdamWScalars(params));
      size_t seg = 0;
      // Entry k of a chunk starting at element `base`: its index in the
      // chunk and its new bits.
      auto route = [&](uint64_t base, size_t count, const auto& index_of, const auto& bits_of) {
        for (size_t k = 0; k < count; ++k) {
          const uint64_t i = base + index_of(k);
          while (seg < segments.size() && segments[seg].from + segments[seg].len <= i) ++seg;
          if (seg == segments.size() || i < segments[seg].from) continue;  // padding: no tensor
          const Segment& sg = segments[seg];
          routed[plan.tensors[sg.tensor].owner].Add(static_cast<uint32_t>(sg.tensor),
                                                    sg.to + (i - sg.from), bits_of(k));
          kept++;
        }
      };
      if (s.device >= 0) {
        // On the device: only the kept entries come back.
        const std::string what =
            at_step + ": " + tg.what + " (state on CUDA device " + std::to_string(s.device) + ")";
        RETURN_IF_ERROR(device_->Prepare(s.device, what));
        for (uint64_t base = p.range.begin; base < p.range.end; base += kDeviceChunk) {
          const uint64_t n = std::min(kDeviceChunk, p.range.end - base);
          const uint64_t off = base - s.begin;
          ASSIGN_OR_RETURN(size_t count,
                           device_->Find(s.param + off, s.exp_avg + off, s.exp_avg_sq + off, n,
                                         params, options_.margin_ulps, what));
          flagged += count;
          stats_.detect_device_bytes += sizeof(uint64_t) + count * (sizeof(uint64_t) + 2);
          const DeviceFinder& d = *device_;
          route(
              base, count, [&](size_t k) { return d.host_idx[k]; },
              [&](size_t k) { return d.host_bits[k]; });
        }
        continue;
      }
      for (uint64_t base = p.range.begin; base < p.range.end; base += kScreenChunk) {
        const uint64_t n = std::min(kScreenChunk, p.range.end - base);
        const uint64_t off = base - s.begin;
        internal::ScreenCounts c = internal::ScreenCandidates(
            s.param + off, s.exp_avg + off, s.exp_avg_sq + off, n, scalars, idx.data(), old.data());
        flagged += c.flagged;
        route(
            base, c.kept, [&](size_t k) { return idx[k]; },
            [&](size_t k) { return kernels::Fp32ToBf16Bits(s.param[off + idx[k]]); });
      }
    }
    return Status::Ok();
  }();
  stats_.entries_sent = kept;
  stats_.detect_ns = NanosSince(detect_start);

  // 4. Routing.
  std::vector<std::string> out(world);
  for (int r = 0; r < world; ++r) out[r] = routed[r].Finish();
  routed.clear();
  ASSIGN_OR_RETURN(
      auto in, AllToAllMove(t, std::move(out), at_step + ": routing changed elements", &stats_));

  // 5. Encoding this rank's tensors; any error goes to rank 0 in the part.
  const auto encode_start = std::chrono::steady_clock::now();
  // The routed entries stay in the received buffers (6 B each) until their
  // tensor's turn; only the groups are indexed here, and one tensor at a
  // time is unpacked for encoding.
  struct Group {
    int from;
    uint64_t base;
    std::string_view entries;  // as EntryWriter wrote them: u32 offset from base, u16 bits
  };
  struct OwnedTensor {
    std::vector<Group> groups;
  };
  std::map<size_t, OwnedTensor> owned;
  for (size_t ti = 0; ti < plan.tensors.size(); ++ti) {
    if (plan.tensors[ti].owner != rank) continue;
    owned[ti] = OwnedTensor{};
    owned_.insert(plan.tensors[ti].entry->name);
  }
  stats_.tensors_owned = owned.size();
  Status part_status = detected;
  constexpr size_t kEntryBytes = sizeof(uint32_t) + sizeof(uint16_t);
  for (int r = 0; r < world && part_status.ok(); ++r) {
    Reader rd(in[r]);
    while (!rd.done()) {
      uint32_t ti = 0, count = 0;
      uint64_t base = 0;
      if (!rd.Get(&ti) || !rd.Get(&base) || !rd.Get(&count) || !owned.count(ti)) {
        part_status = Corruption("rank " + std::to_string(r) +
                                 " routed changed elements this rank does not own");
        break;
      }
      const char* at = rd.data();
      const size_t bytes = size_t{count} * kEntryBytes;
      if (!rd.Skip(bytes)) {
        part_status = Corruption("rank " + std::to_string(r) +
                                 " routed a truncated group of entries of tensor " +
                                 plan.tensors[ti].entry->name);
        break;
      }
      owned[ti].groups.push_back({r, base, std::string_view(at, bytes)});
    }
  }
  // A tensor's entries as (element << 16 | bits), sorted by element.
  auto unpack = [&](size_t ti, const OwnedTensor& ot, std::vector<uint64_t>* entries) -> Status {
    const TensorEntry& te = *plan.tensors[ti].entry;
    const uint64_t elements = te.elements();
    if (elements >= uint64_t{1} << 48) {
      return InvalidArgument("tensor " + te.name + " has more than 2^48 elements");
    }
    size_t total = 0;
    for (const Group& g : ot.groups) total += g.entries.size() / kEntryBytes;
    entries->clear();
    entries->reserve(total);
    for (const Group& g : ot.groups) {
      Reader rd(g.entries);
      uint32_t offset = 0;
      uint16_t bits = 0;
      while (rd.Get(&offset) && rd.Get(&bits)) {
        if (g.base + offset >= elements) {
          return Corruption("rank " + std::to_string(g.from) +
                            " routed an out-of-range entry of tensor " + te.name);
        }
        entries->push_back((g.base + offset) << 16 | bits);
      }
    }
    std::sort(entries->begin(), entries->end());
    for (size_t k = 1; k < entries->size(); ++k) {
      if ((*entries)[k] >> 16 == (*entries)[k - 1] >> 16) {
        return Corruption("element " + std::to_string((*entries)[k] >> 16) + " of tensor " +
                          te.name + " was routed twice");
      }
    }
    return Status::Ok();
  };

  internal::BlobSink sink(&store_->objects());
  Writer part;
  uint64_t dropped = 0;
  std::optional<BlobRef> delta_blob, full_blob;
  std::vector<std::vector<BlockRecord>> recs(plan.tensors.size()), full_recs(plan.tensors.size());
  std::vector<Hash128> hashes(plan.tensors.size());
  std::vector<uint64_t> changed(plan.tensors.size(), 0);
  if (part_status.ok()) {
    part_status = [&]() -> Status {
      ASSIGN_OR_RETURN(auto spool, sink.NewSpool());
      std::unique_ptr<internal::Spool> full_spool;
      if (full) {
        ASSIGN_OR_RETURN(full_spool, sink.NewSpool());
        if (join) {
          const std::string header = JoinBlobHeader(plan.latest + 1, static_cast<uint32_t>(rank));
          RETURN_IF_ERROR(full_spool->Append(header.data(), header.size()));
        }
      }
      Materializer reader(store_.get());
      std::unique_ptr<SnapshotSet> snapshots = OpenStoreSnapshots(*store_);
      reader.SetBase(snapshots.get());
      const uint64_t bb = pm.block_bytes;
      std::vector<uint8_t> old_chunk, new_chunk;
      std::vector<EncodedBlock> enc, full_enc;
      std::vector<uint64_t> entries;
      uint64_t kept_bytes = 0;
      for (auto& [ti, ot] : owned) {
        const Plan::Tensor& pt = plan.tensors[ti];
        const TensorEntry& te = *pt.entry;
        const FileEntry& fe = pm.files[pt.file];
        const int width = DTypeWidth(te.dtype);
        RETURN_IF_ERROR(unpack(ti, ot, &entries));
        // For this rank's push: the elements that differ from the parent,
        // with both values, block by block, up to the push server's
        // cache_bytes (12 bytes per element); the other tensors' changes
        // are read back from the store.
        TensorChanges* keep = nullptr;
        if (push_owned_ && pt.named && width == 2 && kept_bytes < push_->cache_bytes()) {
          keep = &push_changes_[te.name];
          keep->name = te.name;
        }
        std::vector<std::vector<uint64_t>> keep_idx;
        std::vector<std::vector<uint16_t>> keep_new, keep_old;
        recs[ti].resize(te.blocks);
        if (full) full_recs[ti].resize(te.blocks);
        Hasher128 hasher;
        const uint64_t per_block = bb / width;
        for (uint32_t first = 0; first < te.blocks; first += kOwnerBlocksPerChunk) {
          const uint32_t count = std::min(kOwnerBlocksPerChunk, te.blocks - first);
          auto blen = [&](uint32_t b) {
            return std::min<uint64_t>(bb, te.bytes() - uint64_t{b} * bb);
          };
          old_chunk.resize(size_t{count} * bb);
          new_chunk.resize(size_t{count} * bb);
          enc.assign(count, EncodedBlock{});
          full_enc.assign(count, EncodedBlock{});
          std::vector<Status> errors(count);
          if (keep) {
            keep_idx.assign(count, {});
            keep_new.assign(count, {});
            keep_old.assign(count, {});
          }
          kernels::ParallelFor(count, 1, [&](size_t lo, size_t hi) {
            thread_local CodecScratch scratch;
            for (size_t i = lo; i < hi; ++i) {
              const uint32_t b = first + static_cast<uint32_t>(i);
              uint8_t* o = old_chunk.data() + i * bb;
              uint8_t* nw = new_chunk.data() + i * bb;
              errors[i] = reader.ReadBlock(plan.parent, fe, te, b, o);
              if (!errors[i].ok()) continue;
              std::memcpy(nw, o, blen(b));
              if (pt.named) {
                const uint64_t lo_e = uint64_t{b} * per_block, hi_e = lo_e + blen(b) / width;
                auto it = std::lower_bound(entries.begin(), entries.end(), lo_e << 16);
                for (; it != entries.end() && (*it >> 16) < hi_e; ++it) {
                  const uint16_t bits = static_cast<uint16_t>(*it & 0xFFFF);
                  const uint64_t at = ((*it >> 16) - lo_e) * 2;
                  if (keep) {
                    uint16_t was;
                    std::memcpy(&was, o + at, 2);
                    if (was != bits) {
                      keep_idx[i].push_back(*it >> 16);
                      keep_new[i].push_back(bits);
                      keep_old[i].push_back(was);
                    }
                  }
                  std::memcpy(nw + at, &bits, 2);
                }
                enc[i] = EncodeBlock(o, nw, blen(b), width, &scratch);
              }
              if (full) {
                full_enc[i] = internal::EncodeFullTableBlock(join, nw, blen(b), width, &scratch);
              }
            }
          });
          for (const auto& e : errors) RETURN_IF_ERROR(e);
          for (size_t i = 0; keep && i < count; ++i) {
            keep->indices.insert(keep->indices.end(), keep_idx[i].begin(), keep_idx[i].end());
            const auto* nb = reinterpret_cast<const uint8_t*>(keep_new[i].data());
            const auto* ob = reinterpret_cast<const uint8_t*>(keep_old[i].data());
            keep->values.insert(keep->values.end(), nb, nb + keep_new[i].size() * 2);
            keep->old_values.insert(keep->old_values.end(), ob, ob + keep_old[i].size() * 2);
          }
          stats_.parent_bytes_read +=
              std::min<uint64_t>(uint64_t{count} * bb, te.bytes() - uint64_t{first} * bb);
          for (uint32_t i = 0; i < count; ++i) {
            const uint32_t b = first + i;
            const size_t r = te.first_block + b;
            if (pt.named) {
              hasher.Update(new_chunk.data() + size_t{i} * bb, blen(b));
              BlockRecord& rec = recs[ti][b];
              RETURN_IF_ERROR(internal::AppendEncodedBlock(enc[i], 0, spool.get(), &rec));
              rec.hash = rec.kind == BlockKind::kSame
                             ? plan.parent->records[r].hash
                             : HashBlock(new_chunk.data() + size_t{i} * bb, blen(b));
              changed[ti] += rec.changed;
            } else {
              recs[ti][b] = BlockRecord{BlockKind::kSame, 0, 0, 0, 0, plan.parent->records[r].hash};
            }
            if (full) {
              RETURN_IF_ERROR(internal::AppendEncodedBlock(full_enc[i], 0, full_spool.get(),
                                                           &full_recs[ti][b]));
            }
          }
        }
        if (keep) kept_bytes += keep->indices.size() * 12;
        hashes[ti] = pt.named ? hasher.Finish() : te.hash;
        if (pt.named) {
          // Routed entries whose bits equal the parent's: the screen could
          // not prove them unchanged, the parent's bytes do.
          dropped += entries.size() - std::min<uint64_t>(entries.size(), changed[ti]);
        }
        entries.clear();
      }
      if (spool->size() > 0) {
        ASSIGN_OR_RETURN(delta_blob, sink.Finish(std::move(spool)));
      }
      if (full_spool && full_spool->size() > 0) {
        ASSIGN_OR_RETURN(full_blob, sink.Finish(std::move(full_spool)));
      }
      return Status::Ok();
    }();
  }

  in.clear();
  stats_.encode_ns = NanosSince(encode_start);

  // 6. Parts to rank 0.
  parts_sent_ = std::chrono::steady_clock::now();
  part.PutStatus(part_status);
  part.Put<uint64_t>(flagged);
  part.Put<uint64_t>(kept);
  part.Put<uint64_t>(dropped);
  for (const auto* b : {&delta_blob, &full_blob}) {
    part.Put<uint8_t>(b->has_value());
    if (b->has_value()) {
      part.PutHash((*b)->hash);
      part.Put<uint64_t>((*b)->size);
      part.Put<uint8_t>((*b)->added);
    }
  }
  if (part_status.ok()) {
    part.Put<uint64_t>(owned.size());
    for (const auto& [ti, ot] : owned) {
      part.Put<uint32_t>(static_cast<uint32_t>(ti));
      part.PutHash(hashes[ti]);
      part.Put<uint64_t>(changed[ti]);
      for (const BlockRecord& rec : recs[ti]) part.PutRecord(rec);
      for (const BlockRecord& rec : full_recs[ti]) part.PutRecord(rec);
    }
  }
  {
    std::vector<std::string> to(world);
    to[0] = std::move(part.out());
    ASSIGN_OR_RETURN(in, AllToAll(t, to, at_step + ": collecting the parts", &stats_));
  }

  // 7. Rank 0 commits; every rank learns the outcome.
  Writer outcome;
  if (rank == 0) {
    PublishResult res;
    Status s = [&]() -> Status {
      Manifest m;
      m.version = plan.latest + 1;
      m.parent = plan.latest;
      m.created = NowRfc3339();
      m.block_bytes = pm.block_bytes;
      m.files = pm.files;
      for (auto& f : m.files) {
        for (auto& te : f.tensors) te.changed = 0;
      }
      std::vector<BlockRecord> records = plan.parent->records;
      for (auto& rec : records) rec = BlockRecord{BlockKind::kSame, 0, 0, 0, 0, rec.hash};
      std::vector<BlockRecord> full_records(full ? records.size() : 0);
      std::vector<char> full_done(full_records.size(), 0);
      FullTable ft;
      uint64_t uncertain_dropped = 0;
      for (int r = 0; r < world; ++r) {
        Reader rd(in[r]);
        const std::string bad =
            at_step + ": the part of rank " + std::to_string(r) + " is malformed";
        Status failed;
        uint64_t fl = 0, kp = 0, dr = 0;
        if (!rd.GetStatus(&failed) || !rd.Get(&fl) || !rd.Get(&kp) || !rd.Get(&dr)) {
          return Corruption(bad);
        }
        if (!failed.ok()) return failed.WithContext(at_step + ": rank " + std::to_string(r));
        res.flagged += fl;
        res.false_positives += fl - kp;
        uncertain_dropped += dr;
        std::optional<uint32_t> blob_at[2];
        for (int k = 0; k < 2; ++k) {
          uint8_t present = 0;
          if (!rd.Get(&present)) return Corruption(bad);
          if (!present) continue;
          BlobRef ref;
          uint8_t added = 0;
          if (!rd.GetHash(&ref.hash) || !rd.Get(&ref.size) || !rd.Get(&added)) {
            return Corruption(bad);
          }
          ref.added = added != 0;
          sink.Include(ref);
          auto& blobs = k == 0 ? m.blobs : ft.blobs;
          blob_at[k] = static_cast<uint32_t>(blobs.size());
          blobs.push_back(ref);
        }
        uint64_t n = 0;
        if (!rd.Get(&n)) return Corruption(bad);
        for (uint64_t k = 0; k < n; ++k) {
          uint32_t ti = 0;
          Hash128 hash;
          uint64_t ch = 0;
          if (!rd.Get(&ti) || ti >= plan.tensors.size() || plan.tensors[ti].owner != r ||
              !rd.GetHash(&hash) || !rd.Get(&ch)) {
            return Corruption(bad);
          }
          const Plan::Tensor& pt = plan.tensors[ti];
          TensorEntry& te = m.files[pt.file].tensors[pt.index];
          te.hash = hash;
          te.changed = ch;
          for (int pass = 0; pass < (full ? 2 : 1); ++pass) {
            for (uint32_t b = 0; b < te.blocks; ++b) {
              BlockRecord rec;
              if (!rd.GetRecord(&rec)) return Corruption(bad);
              const bool payload = rec.kind != BlockKind::kSame;
              if (payload && !blob_at[pass]) return Corruption(bad);
              if (payload) rec.blob = *blob_at[pass];
              if (pass == 0) {
                records[te.first_block + b] = rec;
              } else {
                full_records[te.first_block + b] = rec;
                full_done[te.first_block + b] = 1;
              }
            }
          }
          if (pt.named) res.tensors++, res.elements += te.elements();
        }
        if (!rd.done()) return Corruption(bad);
      }
      if (full) {
        for (size_t r = 0; r < full_records.size(); ++r) {
          if (!full_done[r])
            return Internal(at_step + ": no rank wrote full record " + std::to_string(r));
          full_records[r].hash = records[r].hash;
        }
        ASSIGN_OR_RETURN(ft.block_table,
                         sink.PutBytes(join ? JoinBlobHeader(m.version, kJoinTablePart) +
                                                  EncodeBlockTable(full_records)
                                            : EncodeBlockTable(full_records)));
        m.full = std::move(ft);
      }
      static const std::vector<BlockRecord> kNone;
      internal::JoinOutcome join_out;
      RETURN_IF_ERROR(internal::PublishVersion(store_.get(), &sink, &m, records,
                                               full ? full_records : kNone, plan.parent_distance,
                                               plan.latest, join, &join_out));
      // Committed: a retry of this step, after a rank missed the outcome,
      // returns this version (above).
      last_step_ = h.step;
      last_version_ = m.version;
      res.version = m.version;
      res.parent = plan.latest;
      res.changed = m.stats.changed_elements;
      res.false_positives += uncertain_dropped;
      res.stored_bytes = m.stats.stored_bytes;
      res.state_bytes = res.elements * 3 * sizeof(float);
      res.full_table = full && !join;
      res.anchor_reason = plan.anchor_reason;
      if (res.full_table) {
        for (const auto& b : m.full->blobs) res.full_bytes += b.size;
      }
      res.join_reason = plan.join_reason;
      res.join_table = join_out.written;
      res.join_bytes = join_out.bytes;
      res.join_error = join_out.error;
      return Status::Ok();
    }();
    outcome.PutStatus(s);
    outcome.Put(res.version);
    outcome.Put(res.parent);
    outcome.Put(res.tensors);
    outcome.Put(res.elements);
    outcome.Put(res.changed);
    outcome.Put(res.flagged);
    outcome.Put(res.false_positives);
    outcome.Put(res.stored_bytes);
    outcome.Put(res.state_bytes);
    outcome.Put(res.full_bytes);
    outcome.Put<uint8_t>(res.full_table);
    outcome.PutString(res.anchor_reason);
    outcome.PutString(res.join_reason);
    outcome.Put<uint8_t>(res.join_table);
    outcome.Put(res.join_bytes);
    outcome.PutString(res.join_error);
  }
  {
    std::vector<std::string> to(world);
    if (rank == 0) to.assign(world, outcome.out());
    ASSIGN_OR_RETURN(in, AllToAll(t, to, at_step + ": learning the outcome", &stats_));
  }
  Reader rd(in[0]);
  Status failed;
  PublishResult res;
  uint8_t full_table = 0, join_table = 0;
  if (!rd.GetStatus(&failed) || !rd.Get(&res.version) || !rd.Get(&res.parent) ||
      !rd.Get(&res.tensors) || !rd.Get(&res.elements) || !rd.Get(&res.changed) ||
      !rd.Get(&res.flagged) || !rd.Get(&res.false_positives) || !rd.Get(&res.stored_bytes) ||
      !rd.Get(&res.state_bytes) || !rd.Get(&res.full_bytes) || !rd.Get(&full_table) ||
      !rd.GetString(&res.anchor_reason) || !rd.GetString(&res.join_reason) ||
      !rd.Get(&join_table) || !rd.Get(&res.join_bytes) || !rd.GetString(&res.join_error)) {
    return Corruption(at_step + ": rank 0's outcome is malformed");
  }
  RETURN_IF_ERROR(failed);
  res.full_table = full_table != 0;
  res.join_table = join_table != 0;
  if (rank != 0) {
    // Learn the new version now: a listing cached by this rank's store must
    // not make its next publish see a stale latest.
    store_->GetVersion(res.version).status().IgnoreError();
  }
  return res;
}

}  // namespace dte
