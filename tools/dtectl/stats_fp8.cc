#include "tools/dtectl/stats_fp8.h"

#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>

#include "store/ops/fp8_stats.h"
#include "tools/dtectl/progress.h"

namespace dte::cli {
namespace {

using nlohmann::json;

int Fail(const Status& s) {
  std::cerr << "dtectl stats: error: " << s.message() << "\n";
  return s.code() == Code::kCorruption ? 4 : 1;
}

double Ratio(uint64_t part, uint64_t whole) {
  return whole ? static_cast<double>(part) / static_cast<double>(whole) : 0.0;
}

std::string StoredAs(const Manifest& m) {
  return m.anchor() ? "anchor" : m.full ? "full" : "delta";
}

json RuleJson(const Fp8RuleCounts& r, const Fp8TensorCounts& c) {
  return json{{"bytes_changed", r.bytes_changed},
              {"scales_changed", r.scales_changed},
              {"scales_changed_fraction", Ratio(r.scales_changed, c.blocks)},
              {"ratio", Ratio(r.bytes_changed, c.bf16_changed)},
              {"step_bytes", r.step_bytes()},
              {"step_ratio", Ratio(r.step_bytes(), c.bf16_step_bytes())}};
}

json CountsJson(const Fp8TensorCounts& c) {
  return json{{"tensors", c.tensors},
              {"elements", c.elements},
              {"blocks", c.blocks},
              {"bf16_changed", c.bf16_changed},
              {"bf16_step_bytes", c.bf16_step_bytes()},
              {"plain", RuleJson(c.plain, c)},
              {"pow2", RuleJson(c.pow2, c)}};
}

// Prints the rows as a table, one JSON document or CSV. JSON:
// {"block_rows", "block_cols", "rows": [...], "total": {...}}; Close ends
// the document also after an error.
class Fp8Printer {
 public:
  Fp8Printer(const Common& c, const StatsArgs& a)
      : json_(c.json), csv_(a.csv), block_(a.fp8_block) {}

  void Header() {
    if (json_) {
      std::printf("{\"block_rows\": %llu, \"block_cols\": %llu, \"rows\": [",
                  static_cast<unsigned long long>(block_), static_cast<unsigned long long>(block_));
    } else if (csv_) {
      std::printf(
          "version,kind,group,tensors,elements,blocks,bf16_changed,plain_bytes_changed,"
          "plain_scales_changed,plain_ratio,pow2_bytes_changed,pow2_scales_changed,pow2_ratio,"
          "bf16_step_bytes,plain_step_bytes,pow2_step_bytes\n");
    } else {
      std::printf("%-10s %-6s %-44s %11s %10s %10s %11s %6s %10s %11s %6s %9s %9s %9s\n", "VERSION",
                  "KIND", "GROUP", "ELEMENTS", "BF16_CHG", "PLAIN_FP8", "PLAIN_SCALE", "RATIO",
                  "POW2_FP8", "POW2_SCALE", "RATIO", "BF16_STEP", "PLAIN_STP", "POW2_STP");
    }
  }

  void Anchor(uint64_t version) {
    if (json_) {
      Json(json{{"version", version}, {"kind", "anchor"}, {"group", nullptr}});
    } else if (csv_) {
      std::printf("%llu,anchor,,,,,,,,,,,,,,\n", static_cast<unsigned long long>(version));
    } else {
      std::printf("%-10s %-6s %s\n", VersionName(version).c_str(), "anchor",
                  "(no parent: not counted)");
    }
  }

  void Row(uint64_t version, const std::string& kind, const Fp8TensorCounts& c) {
    if (json_) {
      json j = CountsJson(c);
      j["version"] = version;
      j["kind"] = kind;
      j["group"] = c.name;
      Json(j);
    } else {
      Line(VersionName(version), std::to_string(version), kind, c);
    }
  }

  void Total(const Fp8TensorCounts& c, uint64_t versions, uint64_t anchors) {
    if (json_) {
      json j = CountsJson(c);
      j["versions"] = versions;
      j["anchors"] = anchors;
      std::printf("\n], \"total\": %s}\n", j.dump().c_str());
      closed_ = true;
    } else {
      Line("total", "total", "", c);
    }
  }

  void Close() {
    if (json_ && !closed_) std::printf("\n]}\n");
    closed_ = true;
  }

 private:
  void Json(const json& j) {
    std::printf("%s\n%s", first_ ? "" : ",", j.dump().c_str());
    first_ = false;
  }

  void Line(const std::string& name, const std::string& number, const std::string& kind,
            const Fp8TensorCounts& c) {
    if (csv_) {
      std::printf("%s,%s,%s,%llu,%llu,%llu,%llu,%llu,%llu,%.9g,%llu,%llu,%.9g,%llu,%llu,%llu\n",
                  number.c_str(), kind.c_str(), c.name.c_str(), U(c.tensors), U(c.elements),
                  U(c.blocks), U(c.bf16_changed), U(c.plain.bytes_changed),
                  U(c.plain.scales_changed), Ratio(c.plain.bytes_changed, c.bf16_changed),
                  U(c.pow2.bytes_changed), U(c.pow2.scales_changed),
                  Ratio(c.pow2.bytes_changed, c.bf16_changed), U(c.bf16_step_bytes()),
                  U(c.plain.step_bytes()), U(c.pow2.step_bytes()));
      return;
    }
    std::printf("%-10s %-6s %-44s %11llu %10llu %10llu %11s %6.3f %10llu %11s %6.3f %9s %9s %9s\n",
                name.c_str(), kind.c_str(), c.name.c_str(), U(c.elements), U(c.bf16_changed),
                U(c.plain.bytes_changed), Scales(c.plain, c).c_str(),
                Ratio(c.plain.bytes_changed, c.bf16_changed), U(c.pow2.bytes_changed),
                Scales(c.pow2, c).c_str(), Ratio(c.pow2.bytes_changed, c.bf16_changed),
                HumanBytes(static_cast<double>(c.bf16_step_bytes())).c_str(),
                HumanBytes(static_cast<double>(c.plain.step_bytes())).c_str(),
                HumanBytes(static_cast<double>(c.pow2.step_bytes())).c_str());
  }

  static unsigned long long U(uint64_t x) { return static_cast<unsigned long long>(x); }

  // "changed/blocks".
  static std::string Scales(const Fp8RuleCounts& r, const Fp8TensorCounts& c) {
    return std::to_string(r.scales_changed) + "/" + std::to_string(c.blocks);
  }

  bool json_, csv_;
  uint64_t block_;
  bool first_ = true;
  bool closed_ = false;
};

}  // namespace

int RunStatsFp8(const Common& c, const StatsArgs& a, Store& store,
                const std::vector<std::pair<uint64_t, std::string>>& selected) {
  Fp8StatsOptions options;
  options.block_rows = options.block_cols = a.fp8_block;
  Fp8StatsReader reader(store, options);
  Fp8Printer out(c, a);
  out.Header();
  Fp8TensorCounts total;
  total.name = "total";
  uint64_t versions = 0, anchors = 0;
  for (const auto& [num, key] : selected) {
    auto v = store.GetVersionAt(num, key);
    if (!v.ok()) return out.Close(), Fail(v.status());
    if (!(*v)->manifest.parent) {
      out.Anchor(num);
      ++anchors;
      continue;
    }
    const std::string kind = StoredAs((*v)->manifest);
    const uint64_t version = num;  // a lambda may not capture a structured binding (C++20)
    Fp8TensorCounts sum;
    sum.name = "all";
    Status s = reader.CountVersion(*v, [&](const Fp8TensorCounts& t) {
      sum.Add(t);
      if (a.by == "tensor") out.Row(version, kind, t);
      return Status::Ok();
    });
    if (!s.ok()) return out.Close(), Fail(s);
    if (a.by != "tensor") out.Row(num, kind, sum);
    total.Add(sum);
    ++versions;
  }
  out.Total(total, versions, anchors);
  out.Close();
  return 0;
}

}  // namespace dte::cli
