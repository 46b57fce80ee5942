#include "store/ops/stats.h"

#include <algorithm>
#include <cstring>
#include <set>
#include <tuple>

#include "store/changes.h"
#include "store/materialize.h"

namespace dte {
namespace {

bool Contains(const std::string& s, const char* part) { return s.find(part) != std::string::npos; }

// "12" of "model.layers.12.mlp..." style names: the digits after
// "layers." up to the next dot.
std::optional<uint64_t> LayerAfter(const std::string& name, const char* marker) {
  const size_t at = name.find(marker);
  if (at == std::string::npos) return std::nullopt;
  size_t i = at + std::strlen(marker), j = i;
  while (j < name.size() && name[j] >= '0' && name[j] <= '9') ++j;
  if (j == i || j - i > 9 || (j < name.size() && name[j] != '.')) return std::nullopt;
  return std::stoull(name.substr(i, j - i));
}

}  // namespace

std::optional<StatsGroup> ParseStatsGroup(const std::string& text) {
  if (text == "tensor") return StatsGroup::kTensor;
  if (text == "layer") return StatsGroup::kLayer;
  if (text == "kind") return StatsGroup::kKind;
  if (text == "layer-kind") return StatsGroup::kLayerKind;
  if (text == "version") return StatsGroup::kVersion;
  return std::nullopt;
}

std::string TensorKind(const std::string& name) {
  for (const char* proj : {"qkv_proj", "q_proj", "k_proj", "v_proj", "o_proj"}) {
    if (Contains(name, (std::string(".") + proj + ".").c_str())) return proj;
  }
  if (Contains(name, ".mlp.") || Contains(name, ".experts.") || Contains(name, "gate_proj") ||
      Contains(name, "up_proj") || Contains(name, "down_proj") || Contains(name, "gate_up_proj")) {
    return "mlp";
  }
  if (Contains(name, "norm")) return "norm";
  if (Contains(name, "embed_tokens") || Contains(name, "wte") || Contains(name, "embeddings")) {
    return "embedding";
  }
  if (Contains(name, "lm_head")) return "lm_head";
  return "other";
}

std::optional<uint64_t> TensorLayer(const std::string& name) {
  if (auto l = LayerAfter(name, "layers.")) return l;
  return LayerAfter(name, ".h.");  // GPT-2 style
}

namespace {

// The row a tensor counts in when grouped `by`.
std::string GroupOf(const std::string& name, StatsGroup by) {
  switch (by) {
    case StatsGroup::kTensor:
      return name;
    case StatsGroup::kLayer: {
      auto layer = TensorLayer(name);
      return layer ? std::to_string(*layer) : "-";
    }
    case StatsGroup::kKind:
      return TensorKind(name);
    case StatsGroup::kLayerKind: {
      auto layer = TensorLayer(name);
      return (layer ? std::to_string(*layer) : "-") + "/" + TensorKind(name);
    }
    case StatsGroup::kVersion:
      break;
  }
  return "all";
}

}  // namespace

Result<std::vector<StatsRow>> VersionStats(const Version& v, StatsGroup by) {
  const Manifest& m = v.manifest;
  std::vector<StatsRow> rows;
  std::map<std::string, size_t> index;  // group -> rows position
  auto row_of = [&](const std::string& group) -> StatsRow& {
    auto [it, fresh] = index.emplace(group, rows.size());
    if (fresh) {
      StatsRow r;
      r.version = m.version;
      r.stored_as = m.anchor() ? "anchor" : m.full ? "full" : "delta";
      r.version_stored_bytes = m.stats.stored_bytes;
      r.group = group;
      rows.push_back(r);
    }
    return rows[it->second];
  };
  for (const FileEntry& f : m.files) {
    for (const TensorEntry& t : f.tensors) {
      if (uint64_t{t.first_block} + t.blocks > v.records.size()) {
        return Corruption(VersionName(m.version) + ": tensor " + t.name + " has block records [" +
                          std::to_string(t.first_block) + ", " +
                          std::to_string(uint64_t{t.first_block} + t.blocks) +
                          ") past the block table's " + std::to_string(v.records.size()));
      }
      StatsRow& r = row_of(GroupOf(t.name, by));
      r.tensors++;
      r.elements += t.elements();
      r.changed += t.changed;
      r.dense_bytes += t.bytes();
      r.blocks += t.blocks;
      for (uint32_t b = 0; b < t.blocks; ++b) {
        const BlockRecord& rec = v.records[size_t{t.first_block} + b];
        if (rec.kind == BlockKind::kSame) continue;
        r.blocks_changed++;
        r.stored_bytes += rec.length;
      }
    }
  }
  if (by == StatsGroup::kLayer || by == StatsGroup::kLayerKind) {
    // Numerically by layer, tensors outside the layers last; then by kind.
    auto key = [](const std::string& g) {
      const std::string layer = g.substr(0, g.find('/'));
      const std::string kind = g.find('/') == std::string::npos ? "" : g.substr(g.find('/') + 1);
      return std::make_tuple(layer == "-", layer == "-" ? 0 : std::stoull(layer), kind);
    };
    std::stable_sort(rows.begin(), rows.end(), [&](const StatsRow& a, const StatsRow& b) {
      return key(a.group) < key(b.group);
    });
  } else if (by == StatsGroup::kKind) {
    std::sort(rows.begin(), rows.end(),
              [](const StatsRow& a, const StatsRow& b) { return a.group < b.group; });
  }
  return rows;
}

Result<VersionRange> ParseVersionRange(const std::string& text) {
  auto number = [&](const std::string& s) -> Result<uint64_t> {
    std::string digits = s.size() > 1 && s[0] == 'v' ? s.substr(1) : s;
    if (digits.empty() || digits.size() > 12 ||
        digits.find_first_not_of("0123456789") != std::string::npos) {
      return InvalidArgument("bad version range \"" + text +
                             "\" (A..B, A.., ..B or A; versions as numbers or vNNNNNNNN)");
    }
    return std::stoull(digits);
  };
  VersionRange r;
  const size_t dots = text.find("..");
  if (dots == std::string::npos) {
    ASSIGN_OR_RETURN(uint64_t v, number(text));
    r.first = r.last = v;
    return r;
  }
  const std::string a = text.substr(0, dots), b = text.substr(dots + 2);
  if (a.empty() && b.empty()) return number("").status();  // "..": the error naming the text
  if (!a.empty()) {
    ASSIGN_OR_RETURN(r.first, number(a));
  }
  if (!b.empty()) {
    ASSIGN_OR_RETURN(r.last, number(b));
  }
  if (r.first && r.last && *r.first > *r.last) {
    return InvalidArgument("bad version range \"" + text + "\": " + VersionName(*r.first) +
                           " comes after " + VersionName(*r.last));
  }
  return r;
}

Result<std::vector<std::pair<uint64_t, std::string>>> SelectVersions(
    const std::map<uint64_t, std::string>& listed, const VersionRange& range,
    const std::string& store_uri) {
  if (listed.empty()) return NotFound("store " + store_uri + " has no versions");
  for (const std::optional<uint64_t>& bound : {range.first, range.last}) {
    if (bound && !listed.count(*bound)) {
      return NotFound(VersionName(*bound) + " is not a version of store " + store_uri +
                      " (it has " + VersionName(listed.begin()->first) + " to " +
                      VersionName(listed.rbegin()->first) + ", " + std::to_string(listed.size()) +
                      " versions)");
    }
  }
  auto lo = range.first ? listed.lower_bound(*range.first) : listed.begin();
  auto hi = range.last ? listed.upper_bound(*range.last) : listed.end();
  return std::vector<std::pair<uint64_t, std::string>>(lo, hi);
}

namespace {

// The position of a float's bit pattern (width bytes) in value order, so
// that neighbouring values differ by one.
int64_t Ordered(uint64_t bits, int width) {
  const int sign_bit = 8 * width - 1;
  const uint64_t magnitude = bits & ((uint64_t{1} << sign_bit) - 1);
  const auto m = static_cast<int64_t>(magnitude);
  return (bits >> sign_bit) & 1 ? -m : m;
}

bool IsNan(uint64_t bits, DType t) {
  switch (t) {
    case DType::kBF16:
      return (bits & 0x7f80) == 0x7f80 && (bits & 0x7f);
    case DType::kF16:
      return (bits & 0x7c00) == 0x7c00 && (bits & 0x3ff);
    case DType::kF32:
      return (bits & 0x7f800000u) == 0x7f800000u && (bits & 0x7fffffu);
    default:  // kF64
      return (bits & 0x7ff0000000000000ull) == 0x7ff0000000000000ull && (bits & 0xfffffffffffffull);
  }
}

uint64_t Load(const uint8_t* p, int width) {
  uint64_t v = 0;
  std::memcpy(&v, p, width);  // little-endian hosts, as the safetensors data
  return v;
}

bool IsFloating(DType t) {
  return t == DType::kBF16 || t == DType::kF16 || t == DType::kF32 || t == DType::kF64;
}

// Adds the distance between the floating-point elements x and y (which
// differ in their bits) to d's buckets.
void CountUlps(uint64_t x, uint64_t y, DType dtype, int width, TensorDiff* d) {
  if (IsNan(x, dtype) || IsNan(y, dtype)) {
    d->nan++;
    return;
  }
  const int64_t ox = Ordered(x, width), oy = Ordered(y, width);
  const uint64_t dist = ox > oy ? static_cast<uint64_t>(ox) - static_cast<uint64_t>(oy)
                                : static_cast<uint64_t>(oy) - static_cast<uint64_t>(ox);
  if (dist == 0) return;  // +0 and -0
  d->max_ulp = std::max(d->max_ulp, dist);
  int bucket = 0;
  while (bucket < TensorDiff::kDiffBuckets && (uint64_t{1} << bucket) < dist) ++bucket;
  d->ulps[bucket]++;
}

TensorDiff Named(const TensorEntry& t, const char* status) {
  TensorDiff d;
  d.name = t.name;
  d.dtype = t.dtype;
  d.elements = t.elements();
  d.status = status;
  return d;
}

// Versions a and b read a block at a time: the blocks whose hashes differ
// are compared element by element (store/changes.h).
class BlockDiffer {
 public:
  BlockDiffer(Store& store, std::shared_ptr<const Version> a, std::shared_ptr<const Version> b)
      : reader_(&store),
        a_(std::move(a)),
        b_(std::move(b)),
        chain_a_(reader_.ChainOf(a_)),
        chain_b_(reader_.ChainOf(b_)) {}

  // Tensor ta of a against tb of b (same dtype, shape and block size).
  Status Diff(const FileEntry& fa, const TensorEntry& ta, const FileEntry& fb,
              const TensorEntry& tb, TensorDiff* d) {
    d->floating = IsFloating(ta.dtype);
    if (d->floating) d->ulps.assign(TensorDiff::kDiffBuckets + 1, 0);
    for (uint32_t blk = 0; blk < ta.blocks; ++blk) {
      if (a_->records[size_t{ta.first_block} + blk].hash ==
          b_->records[size_t{tb.first_block} + blk].hash) {
        continue;
      }
      d->blocks_read++;
      RETURN_IF_ERROR(DiffBlock(fa, ta, fb, tb, blk, d));
    }
    d->status = d->differ ? "differs" : "same";
    return Status::Ok();
  }

 private:
  Status DiffBlock(const FileEntry& fa, const TensorEntry& ta, const FileEntry& fb,
                   const TensorEntry& tb, uint32_t blk, TensorDiff* d) {
    const uint64_t bb = a_->manifest.block_bytes;
    const size_t len = static_cast<size_t>(std::min<uint64_t>(bb, ta.bytes() - uint64_t{blk} * bb));
    const int w = DTypeWidth(ta.dtype);
    block_a_.resize(len);
    block_b_.resize(len);
    RETURN_IF_ERROR(reader_.ReadBlock(a_, fa, ta, blk, block_a_.data(), &chain_a_));
    RETURN_IF_ERROR(reader_.ReadBlock(b_, fb, tb, blk, block_b_.data(), &chain_b_));
    differ_.clear();
    DifferingElements(block_a_.data(), block_b_.data(), len, w, &differ_);
    d->differ += differ_.size();
    if (!d->floating) return Status::Ok();
    for (uint32_t k : differ_) {
      const size_t at = size_t{k} * static_cast<size_t>(w);
      CountUlps(Load(&block_a_[at], w), Load(&block_b_[at], w), ta.dtype, w, d);
    }
    return Status::Ok();
  }

  Materializer reader_;
  std::shared_ptr<const Version> a_, b_;
  const VersionChain chain_a_, chain_b_;
  std::vector<uint8_t> block_a_, block_b_;
  std::vector<uint32_t> differ_;
};

}  // namespace

Result<std::vector<TensorDiff>> DiffVersions(Store& store, uint64_t a, uint64_t b) {
  ASSIGN_OR_RETURN(auto va, store.GetVersion(a));
  ASSIGN_OR_RETURN(auto vb, store.GetVersion(b));
  BlockDiffer differ(store, va, vb);
  const bool same_blocks = va->manifest.block_bytes == vb->manifest.block_bytes;
  std::vector<TensorDiff> out;
  for (const FileEntry& fa : va->manifest.files) {
    for (const TensorEntry& ta : fa.tensors) {
      auto in_b = vb->manifest.FindTensor(ta.name);
      if (!in_b) {
        out.push_back(Named(ta, "only in A"));
        continue;
      }
      const TensorEntry& tb = *in_b->tensor;
      if (tb.dtype != ta.dtype || tb.shape != ta.shape || !same_blocks) {
        out.push_back(Named(ta, "layout differs"));
        continue;
      }
      TensorDiff d = Named(ta, "");
      RETURN_IF_ERROR(differ.Diff(fa, ta, *in_b->file, tb, &d));
      out.push_back(std::move(d));
    }
  }
  for (const FileEntry& fb : vb->manifest.files) {
    for (const TensorEntry& tb : fb.tensors) {
      if (!va->manifest.FindTensor(tb.name)) out.push_back(Named(tb, "only in B"));
    }
  }
  return out;
}

}  // namespace dte
