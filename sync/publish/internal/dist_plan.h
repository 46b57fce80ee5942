// The state of one ranged publish (sync/publish/publisher.h, PublishRanges),
// passed from phase to phase: what every rank derives, identically, from
// the agreement (Plan), what this rank's detection found and routes
// (Detected), and what it encoded for rank 0 (Encoded).
//
// Thread-safety: values for the one thread running the publish.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/adamw.h"
#include "kernels/cuda.h"
#include "store/manifest.h"
#include "store/store.h"
#include "store/write/anchor_policy.h"
#include "store/write/blob_sink.h"
#include "sync/convert/convert.h"
#include "sync/publish/internal/dist_header.h"
#include "sync/publish/internal/dist_wire.h"
#include "sync/publish/publisher.h"

namespace dte::dist_internal {

// Elements screened per call: 3 MiB of FP32 state per array, and 12 bytes
// per element of candidate buffers at most.
inline constexpr uint64_t kScreenChunk = uint64_t{1} << 18;
// Elements searched per call on a device: 192 MiB of FP32 state, and 160
// MiB of device buffers for the kept entries at most.
inline constexpr uint64_t kDeviceChunk = uint64_t{1} << 24;
// Blocks encoded in parallel by an owner, as dtectl commit does.
inline constexpr uint32_t kOwnerBlocksPerChunk = 16;

// h's hyper-parameters, with a param group's lr and weight decay where given.
kernels::AdamWParams ParamsOf(const AdamWStep& h, std::optional<double> lr,
                              std::optional<double> wd);

// What every rank derives, identically, from all ranks' headers; and this
// rank's own pieces of the targets.
struct Plan {
  Plan(const AdamWStep& h, const std::vector<RangeState>& ranges, const PublisherOptions& options,
       const std::vector<ConvertUnit>& units, int rank, int world)
      : h(h),
        ranges(ranges),
        options(options),
        units(units),
        rank(rank),
        world(world),
        at_step("step " + std::to_string(h.step)),
        mcore(options.converter == "mcore") {}

  // The publish.
  const AdamWStep& h;
  const std::vector<RangeState>& ranges;  // this rank's
  const PublisherOptions& options;
  const std::vector<ConvertUnit>& units;  // converter "mcore"
  const int rank, world;
  const std::string at_step;  // for errors
  const bool mcore;           // ranges name MCore shards, not the parent's tensors
  std::string store_uri;

  // 1. Agreement: every rank's header; the parent and its tensors.
  std::vector<Header> all;
  uint64_t latest = 0;
  std::shared_ptr<const Version> parent;
  AnchorDistance parent_distance;
  AnchorDistance join_distance;  // rank 0's (store/write/anchor_policy.h, JoinDistanceOf)
  struct Tensor {
    size_t file = 0, index = 0;
    const TensorEntry* entry = nullptr;
    bool named = false;
    int owner = -1;  // 2. Ownership
    std::optional<double> lr, wd;
  };
  std::vector<Tensor> tensors;  // the parent's, in manifest order
  std::map<std::string, size_t> ordinal;

  // What ranges name: the parent's tensors (converter "hf") or the plan's
  // MCore shards (converter "mcore").
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
  // The parts of targets this rank screens: its ranges less what lower
  // ranks hold too.
  struct Piece {
    size_t target = 0;
    FlatRange range;
    const RangeState* state = nullptr;
  };
  std::vector<Piece> pieces;

  // A policy anchor's full table, or a join table: built the same way (a
  // join table's blobs start with the join header).
  TableDecision tables;
  bool join = false;
  bool full = false;

  const Manifest& pm() const { return parent->manifest; }
};

// 3. Detection: the candidates of this rank's pieces not proven unchanged,
// in Hugging Face coordinates, for each owner. A failure (a device error)
// still lets the exchange run, and goes to rank 0 in this rank's part: no
// version is committed.
struct Detected {
  std::vector<EntryWriter> routed;  // per owner rank
  uint64_t flagged = 0, kept = 0;
  Status status;
};

// 5. Encoding: the routed entries stay in the received buffers (6 B each)
// until their tensor's turn; only the groups are indexed, and one tensor at
// a time is unpacked for encoding.
struct Group {
  int from;
  uint64_t base;
  std::string_view entries;  // as EntryWriter wrote them: u32 offset from base, u16 bits
};

// What this rank encoded of the tensors it owns, for its part; any error
// goes to rank 0 in the part.
struct Encoded {
  explicit Encoded(ObjectStore* objects) : sink(objects) {}
  internal::BlobSink sink;                                // rank 0 commits through it too
  std::map<size_t, std::vector<Group>> owned;             // tensor -> the groups routed to it
  std::vector<std::vector<BlockRecord>> recs, full_recs;  // per tensor of the parent
  std::vector<Hash128> hashes;
  std::vector<uint64_t> changed;
  std::optional<BlobRef> delta_blob, full_blob;
  uint64_t dropped = 0;  // routed entries whose bits equal the parent's
  Status status;
};

// Buffers on one CUDA device for finding the changes of ranges held there,
// a chunk of kDeviceChunk elements at a time; moved to another device when
// a range is on one.
class DeviceFinder {
 public:
  // Makes `dev` the thread's current device, with the buffers allocated on it.
  Status Prepare(int dev, const std::string& what);

  // The kept elements (kernels::AdamWFindChanges) of n <= kDeviceChunk
  // elements of device state, into host_idx() and host_bits(); returns how
  // many.
  Result<size_t> Find(const float* theta, const float* m, const float* v, size_t n,
                      const kernels::AdamWParams& p, uint32_t margin_ulps, const std::string& what);
  const std::vector<uint64_t>& host_idx() const { return host_idx_; }
  const std::vector<uint16_t>& host_bits() const { return host_bits_; }

 private:
  int device_ = -1;
  kernels::CudaBuffer workspace_, idx_, bits_, count_;
  size_t workspace_bytes_ = 0;
  std::vector<uint64_t> host_idx_;
  std::vector<uint16_t> host_bits_;
};

}  // namespace dte::dist_internal
