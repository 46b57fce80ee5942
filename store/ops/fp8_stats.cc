#include "store/ops/fp8_stats.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "kernels/parallel.h"
#include "store/changes.h"
#include "store/materialize.h"
#include "store/snapshot.h"

namespace dte {
namespace {

// The counts of a tensor whose every element, byte and scale a receiver
// must write: one the parent does not hold in the same dtype and shape.
Fp8TensorCounts WhollyChanged(const std::string& name, const kernels::Fp8Layout& l) {
  Fp8TensorCounts c;
  c.name = name;
  c.tensors = 1;
  c.elements = l.num_elements();
  c.blocks = l.num_blocks();
  c.bf16_changed = c.elements;
  c.plain = {c.elements, c.blocks};
  c.pow2 = c.plain;
  return c;
}

kernels::Fp8Layout LayoutOf(const Fp8StatsOptions& o, uint64_t rows, uint64_t cols) {
  kernels::Fp8Layout l;
  l.rows = rows;
  l.cols = cols;
  l.block_rows = o.block_rows;
  l.block_cols = o.block_cols;
  return l;
}

bool SameLayout(const TensorEntry& a, const TensorEntry& b) {
  return a.dtype == b.dtype && a.shape == b.shape;
}

}  // namespace

void Fp8TensorCounts::Add(const Fp8TensorCounts& o) {
  tensors += o.tensors;
  elements += o.elements;
  blocks += o.blocks;
  bf16_changed += o.bf16_changed;
  plain.bytes_changed += o.plain.bytes_changed;
  plain.scales_changed += o.plain.scales_changed;
  pow2.bytes_changed += o.pow2.bytes_changed;
  pow2.scales_changed += o.pow2.scales_changed;
}

Result<Fp8TensorCounts> CountFp8Changes(const Fp8StatsOptions& options, std::string_view name,
                                        uint64_t rows, uint64_t cols, const uint16_t* parent,
                                        const uint16_t* child,
                                        std::span<const uint64_t> candidates) {
  kernels::Fp8Layout l = LayoutOf(options, rows, cols);
  if (std::string e = kernels::Fp8LayoutError(l); !e.empty()) {
    return InvalidArgument("tensor '" + std::string(name) + "': " + e);
  }
  Fp8TensorCounts c;
  c.name = std::string(name);
  c.tensors = 1;
  c.elements = l.num_elements();
  c.blocks = l.num_blocks();
  std::vector<uint64_t> changed;
  for (uint64_t i : candidates) {
    if (i < c.elements && parent[i] != child[i]) changed.push_back(i);
  }
  c.bf16_changed = changed.size();
  if (changed.empty()) return c;
  kernels::Fp8ChangeSet set;
  for (auto [rule, counts] : {std::pair{kernels::Fp8ScaleRule::kPlain, &c.plain},
                              std::pair{kernels::Fp8ScaleRule::kPowerOfTwo, &c.pow2}}) {
    l.rule = rule;
    std::string e =
        kernels::Fp8ChangesAt(l, parent, child, changed.data(), changed.size(), name, &set);
    if (!e.empty()) return InvalidArgument(e);
    counts->bytes_changed = set.byte_index.size();
    counts->scales_changed = set.scale_index.size();
  }
  return c;
}

Fp8StatsReader::Fp8StatsReader(Store& store, Fp8StatsOptions options)
    : store_(store),
      options_(std::move(options)),
      snapshots_(OpenStoreSnapshots(store)),
      reader_(std::make_unique<Materializer>(&store)) {
  reader_->SetBase(snapshots_.get());
}

Fp8StatsReader::~Fp8StatsReader() = default;

// Every block of the tensor, materialized in parallel into *out.
Status Fp8StatsReader::ReadTensor(const std::shared_ptr<const Version>& v, const FileEntry& file,
                                  const TensorEntry& tensor, std::vector<uint16_t>* out) {
  out->resize(tensor.bytes() / 2);
  auto* dst = reinterpret_cast<uint8_t*>(out->data());
  const uint64_t bb = v->manifest.block_bytes;
  std::vector<Status> errors(tensor.blocks);
  kernels::ParallelFor(tensor.blocks, 1, [&](size_t begin, size_t end) {
    for (size_t b = begin; b < end; ++b) {
      errors[b] = reader_->ReadBlock(v, file, tensor, static_cast<uint32_t>(b), dst + b * bb);
    }
  });
  for (const Status& s : errors) RETURN_IF_ERROR(s);
  return Status::Ok();
}

Status Fp8StatsReader::CountVersion(const std::shared_ptr<const Version>& v,
                                    const std::function<Status(const Fp8TensorCounts&)>& sink) {
  if (options_.block_rows == 0 || options_.block_cols == 0) {
    return InvalidArgument("FP8 block sizes must be at least 1");
  }
  ASSIGN_OR_RETURN(auto changes, VersionChangesReader::Open(store_, v));
  ASSIGN_OR_RETURN(auto parent, store_.GetVersion(*v->manifest.parent));
  const std::string vname = VersionName(v->manifest.version);
  for (const FileEntry& f : v->manifest.files) {
    for (const TensorEntry& t : f.tensors) {
      if (!QuantizeAsFp8(options_.policy, {options_.block_rows, options_.block_cols}, t.name,
                         t.dtype, t.shape)) {
        continue;
      }
      const auto rows = static_cast<uint64_t>(t.shape[0]), cols = static_cast<uint64_t>(t.shape[1]);
      auto at = parent->manifest.FindTensor(t.name);
      if (!at || !SameLayout(*at->tensor, t)) {
        RETURN_IF_ERROR(sink(WhollyChanged(t.name, LayoutOf(options_, rows, cols))));
        continue;
      }
      std::vector<uint64_t> none;
      const std::vector<uint64_t>* candidates = &none;
      if (changes->MayChange(t.name)) {
        ASSIGN_OR_RETURN(const TensorChanges* tc, changes->Read(t.name));
        candidates = &tc->indices;
      }
      if (!candidates->empty()) {
        RETURN_IF_ERROR(ReadTensor(parent, *at->file, *at->tensor, &parent_));
        RETURN_IF_ERROR(ReadTensor(v, f, t, &child_));
      }
      auto counts =
          CountFp8Changes(options_, t.name, rows, cols, parent_.data(), child_.data(), *candidates);
      if (!counts.ok()) return counts.status().WithContext(vname);
      RETURN_IF_ERROR(sink(*counts));
    }
  }
  return Status::Ok();
}

}  // namespace dte
