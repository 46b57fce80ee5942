#include "store/ops/stats.h"

#include <algorithm>
#include <cstring>
#include <set>
#include <tuple>

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
      std::string group;
      switch (by) {
        case StatsGroup::kTensor:
          group = t.name;
          break;
        case StatsGroup::kLayer: {
          auto layer = TensorLayer(t.name);
          group = layer ? std::to_string(*layer) : "-";
          break;
        }
        case StatsGroup::kKind:
          group = TensorKind(t.name);
          break;
        case StatsGroup::kLayerKind: {
          auto layer = TensorLayer(t.name);
          group = (layer ? std::to_string(*layer) : "-") + "/" + TensorKind(t.name);
          break;
        }
        case StatsGroup::kVersion:
          group = "all";
          break;
      }
      StatsRow& r = row_of(group);
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

}  // namespace

Result<std::vector<TensorDiff>> DiffVersions(Store& store, uint64_t a, uint64_t b) {
  ASSIGN_OR_RETURN(auto va, store.GetVersion(a));
  ASSIGN_OR_RETURN(auto vb, store.GetVersion(b));
  Materializer reader(&store);
  const VersionChain chain_a = reader.ChainOf(va), chain_b = reader.ChainOf(vb);
  struct Where {
    const FileEntry* file;
    const TensorEntry* tensor;
  };
  std::map<std::string, Where> in_b;
  for (const FileEntry& f : vb->manifest.files) {
    for (const TensorEntry& t : f.tensors) in_b[t.name] = {&f, &t};
  }
  const bool same_blocks = va->manifest.block_bytes == vb->manifest.block_bytes;
  std::vector<TensorDiff> out;
  std::vector<uint8_t> block_a, block_b;
  std::set<std::string> seen;
  for (const FileEntry& fa : va->manifest.files) {
    for (const TensorEntry& ta : fa.tensors) {
      seen.insert(ta.name);
      TensorDiff d;
      d.name = ta.name;
      d.dtype = ta.dtype;
      d.elements = ta.elements();
      auto it = in_b.find(ta.name);
      if (it == in_b.end()) {
        d.status = "only in A";
        out.push_back(std::move(d));
        continue;
      }
      const FileEntry& fb = *it->second.file;
      const TensorEntry& tb = *it->second.tensor;
      if (tb.dtype != ta.dtype || tb.shape != ta.shape || !same_blocks) {
        d.status = "layout differs";
        out.push_back(std::move(d));
        continue;
      }
      const int w = DTypeWidth(ta.dtype);
      d.floating = ta.dtype == DType::kBF16 || ta.dtype == DType::kF16 || ta.dtype == DType::kF32 ||
                   ta.dtype == DType::kF64;
      if (d.floating) d.ulps.assign(TensorDiff::kDiffBuckets + 1, 0);
      const uint64_t bb = va->manifest.block_bytes;
      for (uint32_t blk = 0; blk < ta.blocks; ++blk) {
        if (va->records[size_t{ta.first_block} + blk].hash ==
            vb->records[size_t{tb.first_block} + blk].hash) {
          continue;
        }
        d.blocks_read++;
        const uint64_t len = std::min<uint64_t>(bb, ta.bytes() - uint64_t{blk} * bb);
        block_a.resize(len);
        block_b.resize(len);
        RETURN_IF_ERROR(reader.ReadBlock(va, fa, ta, blk, block_a.data(), &chain_a));
        RETURN_IF_ERROR(reader.ReadBlock(vb, fb, tb, blk, block_b.data(), &chain_b));
        for (uint64_t k = 0; k + w <= len; k += w) {
          const uint64_t x = Load(&block_a[k], w), y = Load(&block_b[k], w);
          if (x == y) continue;
          d.differ++;
          if (!d.floating) continue;
          if (IsNan(x, ta.dtype) || IsNan(y, ta.dtype)) {
            d.nan++;
            continue;
          }
          const int64_t ox = Ordered(x, w), oy = Ordered(y, w);
          const uint64_t dist = ox > oy ? static_cast<uint64_t>(ox) - static_cast<uint64_t>(oy)
                                        : static_cast<uint64_t>(oy) - static_cast<uint64_t>(ox);
          if (dist == 0) continue;  // +0 and -0
          d.max_ulp = std::max(d.max_ulp, dist);
          int bucket = 0;
          while (bucket < TensorDiff::kDiffBuckets && (uint64_t{1} << bucket) < dist) ++bucket;
          d.ulps[bucket]++;
        }
      }
      d.status = d.differ ? "differs" : "same";
      out.push_back(std::move(d));
    }
  }
  for (const FileEntry& fb : vb->manifest.files) {
    for (const TensorEntry& tb : fb.tensors) {
      if (seen.count(tb.name)) continue;
      TensorDiff d;
      d.name = tb.name;
      d.dtype = tb.dtype;
      d.elements = tb.elements();
      d.status = "only in B";
      out.push_back(std::move(d));
    }
  }
  return out;
}

}  // namespace dte
