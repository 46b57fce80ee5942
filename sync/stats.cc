#include "sync/stats.h"

#include <algorithm>
#include <cstring>

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
      r.anchor = m.anchor();
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
  if (by == StatsGroup::kLayer) {
    // Numerically, tensors outside the layers last.
    std::stable_sort(rows.begin(), rows.end(), [](const StatsRow& a, const StatsRow& b) {
      if (a.group == "-" || b.group == "-") return b.group == "-" && a.group != "-";
      return std::stoull(a.group) < std::stoull(b.group);
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

}  // namespace dte
