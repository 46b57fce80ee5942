// Publishing from sharded Megatron-Core state: the same versions, byte for
// byte, as publishing the Hugging Face state, for dense GQA and MoE models
// under TP and EP; per-group hyperparameters carried through the conversion;
// rejections that name the shard and its ranks.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "kernels/adamw.h"
#include "kernels/bf16.h"
#include "store/ops/export.h"
#include "store/store.h"
#include "sync/convert/convert.h"
#include "sync/publish/publisher.h"
#include "tests/testutil/adamw_state.h"
#include "tests/testutil/checkpoint.h"
#include "tests/testutil/convert_fixtures.h"
#include "tests/testutil/memory_store.h"
#include "tests/testutil/ranks.h"
#include "tests/testutil/same_version.h"

namespace dte {
namespace {

// Norms are their own param group, without weight decay and with a larger
// learning rate (so they change); everything else decays. The MCore names
// of norms all contain "norm" too.
bool IsNorm(const std::string& name) { return name.find("norm") != std::string::npos; }

kernels::AdamWParams Params(int64_t step, bool norm) {
  kernels::AdamWParams p;
  p.lr = norm ? 1e-3 : 3e-5;
  p.beta1 = 0.9;
  p.beta2 = 0.95;
  p.eps = 1e-8;
  p.weight_decay = norm ? 0.0 : 0.1;
  p.step = step;
  return p;
}

AdamWStep StepOf(int64_t step) { return test::AdamWStepOf(Params(step, false)); }

// The FP32 optimizer state of one HF tensor.
struct HfState {
  std::vector<int64_t> shape;
  std::vector<float> theta, m, v;
};

TensorData AsTensor(const std::vector<int64_t>& shape, const std::vector<float>& x) {
  TensorData t{DType::kF32, shape, std::string(x.size() * 4, '\0')};
  std::memcpy(t.data.data(), x.data(), t.data.size());
  return t;
}

class McorePublish {
 public:
  McorePublish(const ModelSpec& spec, const ParallelLayout& layout, const std::string& root)
      : spec_(spec), layout_(layout), root_(root) {
    auto plan = PlanConversion(spec, layout);
    EXPECT_TRUE(plan.ok()) << plan.status().message();
    if (plan.ok()) plan_ = std::move(plan).value();
    uint64_t seed = 1;
    for (const ConvertUnit& unit : plan_) {
      for (const PlannedTensor& t : unit.tensors) {
        HfState& s = hf_[t.name];
        hf_order_.push_back(t.name);
        s.shape = t.shape;
        std::mt19937_64 rng(seed++);
        std::normal_distribution<float> w(0.0f, 0.02f);
        s.theta.resize(t.elements());
        s.m.assign(t.elements(), 0.0f);
        s.v.assign(t.elements(), 0.0f);
        for (float& x : s.theta) x = IsNorm(t.name) ? 1.0f + w(rng) : w(rng);
      }
    }
  }

  // The BF16 checkpoint of the current weights.
  std::string WriteCheckpoint(const std::string& name) const {
    test::TestCheckpoint c;
    c.raw_files["config.json"] = "{\"model_type\": \"" + spec_.model_type + "\"}\n";
    test::TestSafetensors f{"model.safetensors", {}, {{"format", "pt"}}};
    for (const auto& [name, s] : hf_) {
      test::TestTensor t{name, DType::kBF16, s.shape, std::string(s.theta.size() * 2, '\0')};
      kernels::CastFp32ToBf16(s.theta.data(), reinterpret_cast<uint16_t*>(t.data.data()),
                              s.theta.size());
      f.tensors.push_back(t);
    }
    c.safetensors.push_back(f);
    const std::string dir = root_ + "/" + name;
    Status st = test::WriteCheckpoint(c, dir);
    EXPECT_TRUE(st.ok()) << st.message();
    return dir;
  }

  // One AdamW step of every tensor, with fresh moments.
  void Step(int64_t step) {
    uint64_t seed = 1000 * static_cast<uint64_t>(step);
    for (auto& [name, s] : hf_) {
      std::mt19937_64 rng(seed++);
      std::normal_distribution<float> g(0.0f, 1e-3f);
      for (size_t i = 0; i < s.m.size(); ++i) {
        s.m[i] = 0.5f * s.m[i] + g(rng);
        s.v[i] = s.m[i] * s.m[i] * (1.0f + std::abs(g(rng)) * 1e3f) + 1e-12f;
      }
      std::vector<float> prev = s.theta;
      kernels::AdamWForward(prev.data(), s.m.data(), s.v.data(), prev.size(),
                            Params(step, IsNorm(name)), s.theta.data());
    }
  }

  // In plan order, the order the MCore path encodes in, so that both
  // versions' delta blobs hold the same bytes.
  std::vector<AdamWParamState> HfParams() const {
    std::vector<AdamWParamState> out;
    for (const std::string& name : hf_order_) {
      const HfState& s = hf_.at(name);
      AdamWParamState p;
      p.name = name;
      p.param = {s.theta.data(), DType::kF32, s.shape};
      p.exp_avg = {s.m.data(), DType::kF32, s.shape};
      p.exp_avg_sq = {s.v.data(), DType::kF32, s.shape};
      if (IsNorm(name)) {
        p.lr = 1e-3;
        p.weight_decay = 0.0;
      }
      out.push_back(std::move(p));
    }
    return out;
  }

  // Shards theta, m and v with the inverse converter into sharded_.
  void Shard() {
    for (int which = 0; which < 3; ++which) {
      std::map<std::string, TensorData> hf;
      for (const auto& [name, s] : hf_) {
        hf[name] = AsTensor(s.shape, which == 0 ? s.theta : which == 1 ? s.m : s.v);
      }
      auto sharded = ShardHfState(plan_, hf);
      ASSERT_TRUE(sharded.ok()) << sharded.status().message();
      sharded_[which] = std::move(sharded).value();
    }
  }

  std::vector<McoreAdamWShard> McoreParams(int64_t step) const {
    std::vector<McoreAdamWShard> out;
    for (const auto& [key, theta] : sharded_[0]) {
      McoreAdamWShard s;
      s.key = key;
      s.param = {theta.data.data(), theta.dtype, theta.shape};
      const TensorData& m = sharded_[1].at(key);
      const TensorData& v = sharded_[2].at(key);
      s.exp_avg = {m.data.data(), m.dtype, m.shape};
      s.exp_avg_sq = {v.data.data(), v.dtype, v.shape};
      s.state_step = step;
      if (IsNorm(key.name)) {
        s.lr = 1e-3;
        s.weight_decay = 0.0;
      }
      out.push_back(std::move(s));
    }
    return out;
  }

  std::unique_ptr<Publisher> Open(const std::string& name, bool mcore) const {
    PublisherOptions o;
    o.store = root_ + "/" + name;
    if (mcore) {
      o.converter = "mcore";
      o.mcore = McoreConverter{spec_, layout_};
    }
    auto p = Publisher::Open(o);
    EXPECT_TRUE(p.ok()) << p.status().message();
    return p.ok() ? std::move(p).value() : nullptr;
  }

  const std::vector<ConvertUnit>& plan() const { return plan_; }
  const McoreState& sharded(int which) const { return sharded_[which]; }

 private:
  ModelSpec spec_;
  ParallelLayout layout_;
  std::string root_;
  std::vector<ConvertUnit> plan_;
  std::map<std::string, HfState> hf_;
  std::vector<std::string> hf_order_;
  McoreState sharded_[3];
};

std::string ReadAll(const std::string& path) {
  auto r = test::ReadFileBytes(path);
  EXPECT_TRUE(r.ok()) << r.status().message();
  return r.ok() ? *r : "";
}

struct Case {
  const char* name;
  ModelSpec spec;
  int tp, ep;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name << " tp " << c.tp << " ep " << c.ep; }

std::vector<Case> Cases() {
  std::vector<Case> cases;
  for (int tp : {1, 2}) {
    cases.push_back({"LlamaGqa2", test::TinyLlama(8, 4), tp, 1});
    cases.push_back({"Qwen3Gqa4", test::TinyQwen3(16, 4), tp, 1});
    for (int ep : {1, 2}) cases.push_back({"Qwen3MoeGqa2", test::TinyQwen3Moe(8, 4), tp, ep});
  }
  return cases;
}

class PublisherMcore : public testing::TestWithParam<Case> {
 protected:
  test::ScopedTempDir tmp_;
};

TEST_P(PublisherMcore, VersionsEqualPublishingTheHfState) {
  ParallelLayout layout;
  layout.tp = GetParam().tp;
  layout.ep = GetParam().ep;
  McorePublish model(GetParam().spec, layout, tmp_.path());
  auto hf = model.Open("hf", false);
  auto mc = model.Open("mcore", true);
  ASSERT_TRUE(hf && mc);
  ASSERT_TRUE(hf->ImportCheckpoint(model.WriteCheckpoint("init")).ok());
  ASSERT_TRUE(mc->ImportCheckpoint(model.WriteCheckpoint("init2")).ok());
  for (int64_t step = 1; step <= 3; ++step) {
    model.Step(step);
    model.Shard();
    auto a = hf->PublishAdamW(StepOf(step), model.HfParams());
    ASSERT_TRUE(a.ok()) << a.status().message();
    auto b = mc->PublishAdamWMcore(StepOf(step), model.McoreParams(step));
    ASSERT_TRUE(b.ok()) << b.status().message();
    EXPECT_EQ(b->version, a->version);
    EXPECT_EQ(b->tensors, a->tensors);
    EXPECT_EQ(b->elements, a->elements);
    EXPECT_EQ(b->changed, a->changed);
    EXPECT_EQ(b->flagged, a->flagged);
    EXPECT_EQ(b->stored_bytes, a->stored_bytes);
    EXPECT_GT(a->changed, a->elements / 100);

    test::ExpectSameVersion(hf->store(), a->version, mc->store(), b->version);
    // The same delta bytes.
    auto va = hf->store().GetVersion(a->version);
    auto vb = mc->store().GetVersion(b->version);
    ASSERT_TRUE(va.ok() && vb.ok());
    ASSERT_EQ((*va)->manifest.blobs.size(), (*vb)->manifest.blobs.size());
    for (size_t k = 0; k < (*va)->manifest.blobs.size(); ++k) {
      EXPECT_EQ((*va)->manifest.blobs[k].hash, (*vb)->manifest.blobs[k].hash);
    }

    const std::string out_a = tmp_.path() + "/export_hf" + std::to_string(step);
    const std::string out_b = tmp_.path() + "/export_mcore" + std::to_string(step);
    ASSERT_TRUE(ExportVersion(hf->store(), a->version, out_a, nullptr).ok());
    auto exported = ExportVersion(mc->store(), b->version, out_b, nullptr);
    ASSERT_TRUE(exported.ok()) << exported.status().message();
    EXPECT_EQ(ReadAll(out_b + "/model.safetensors"), ReadAll(out_a + "/model.safetensors"));
    // ... which holds the trainer's weights.
    EXPECT_EQ(ReadAll(out_b + "/model.safetensors"),
              ReadAll(model.WriteCheckpoint("now" + std::to_string(step)) + "/model.safetensors"));
  }
}

INSTANTIATE_TEST_SUITE_P(Specs, PublisherMcore, testing::ValuesIn(Cases()),
                         [](const testing::TestParamInfo<Case>& info) {
                           return std::string(info.param.name) + "Tp" +
                                  std::to_string(info.param.tp) + "Ep" +
                                  std::to_string(info.param.ep);
                         });

// Distributed publishing from MCore shards: a shard as one rank holds it
// (`as`: a replica names its own TP or EP rank), the plan's shard whose state
// it is (`of`), and the flat range of it the rank holds.
struct HeldShard {
  ShardKey as, of;
  uint64_t begin = 0, end = 0;
};
using Holdings = std::function<std::vector<HeldShard>(const McorePublish&, int rank)>;

uint64_t Elements(const TensorData& t) {
  uint64_t n = 1;
  for (int64_t d : t.shape) n *= static_cast<uint64_t>(d);
  return n;
}

// The shards TP rank `tp` and EP rank `ep` hold whole: its own, and replicas
// of those the plan takes from TP or EP rank 0 (norms, dense layers).
std::vector<HeldShard> RankShards(const McorePublish& model, int tp, int ep) {
  const McoreState& state = model.sharded(0);
  std::vector<HeldShard> out;
  for (const auto& [key, t] : state) {
    ShardKey as = key;
    if (key.tp_rank != tp) {
      if (key.tp_rank != 0 || state.count({key.name, tp, key.ep_rank})) continue;
      as.tp_rank = tp;
    }
    if (key.ep_rank != ep) {
      if (key.ep_rank != 0 || state.count({key.name, key.tp_rank, ep})) continue;
      as.ep_rank = ep;
    }
    out.push_back({as, key, 0, Elements(t)});
  }
  return out;
}

// Cuts the concatenation of `whole` into `parts` ranges, across shard
// boundaries, and keeps range `part`: Megatron's distributed optimizer.
std::vector<HeldShard> FlatPart(const std::vector<HeldShard>& whole, int part, int parts) {
  uint64_t total = 0;
  for (const auto& h : whole) total += h.end;
  const uint64_t per = (total + parts - 1) / parts;
  const uint64_t lo = std::min(total, per * part), hi = std::min(total, lo + per);
  std::vector<HeldShard> out;
  uint64_t at = 0;
  for (const auto& h : whole) {
    const uint64_t b = std::max(lo, at), e = std::min(hi, at + h.end);
    if (b < e) out.push_back({h.as, h.of, b - at, e - at});
    at += h.end;
  }
  return out;
}

// The pipeline stage (of 2) an MCore parameter lives on.
int StageOf(const std::string& name, int64_t layers) {
  const size_t at = name.find("layers.");
  if (at != std::string::npos) return std::stoll(name.substr(at + 7)) < (layers + 1) / 2 ? 0 : 1;
  return name.find("embedding") != std::string::npos ? 0 : 1;
}

std::vector<RangeState> RangesOf(const McorePublish& model, const std::vector<HeldShard>& held,
                                 int64_t step) {
  std::vector<RangeState> out;
  for (const HeldShard& h : held) {
    RangeState r;
    r.name = h.as.name;
    r.tp_rank = h.as.tp_rank;
    r.ep_rank = h.as.ep_rank;
    r.begin = h.begin;
    r.end = h.end;
    r.param = reinterpret_cast<const float*>(model.sharded(0).at(h.of).data.data()) + h.begin;
    r.exp_avg = reinterpret_cast<const float*>(model.sharded(1).at(h.of).data.data()) + h.begin;
    r.exp_avg_sq = reinterpret_cast<const float*>(model.sharded(2).at(h.of).data.data()) + h.begin;
    r.state_step = step;
    if (IsNorm(h.as.name)) {
      r.lr = 1e-3;
      r.weight_decay = 0.0;
    }
    out.push_back(std::move(r));
  }
  return out;
}

// `world` ranks holding what `holdings` gives them publish the versions the
// single-process publisher makes from the HF state, block for block.
void ExpectDistributedEqualsHf(const ModelSpec& spec, const ParallelLayout& layout, int world,
                               const Holdings& holdings, const std::string& root) {
  McorePublish model(spec, layout, root);
  auto hf = model.Open("hf", false);
  auto init = model.Open("dist", true);
  ASSERT_TRUE(hf && init);
  ASSERT_TRUE(hf->ImportCheckpoint(model.WriteCheckpoint("init")).ok());
  ASSERT_TRUE(init->ImportCheckpoint(model.WriteCheckpoint("init2")).ok());
  std::vector<std::unique_ptr<Publisher>> pubs;
  for (int r = 0; r < world; ++r) {
    PublisherOptions o;
    o.store = root + "/dist";
    o.converter = "mcore";
    o.mcore = McoreConverter{spec, layout};
    o.group = {r, world, nullptr};
    auto p = Publisher::Open(o);
    ASSERT_TRUE(p.ok()) << p.status().message();
    pubs.push_back(std::move(p).value());
  }
  for (int64_t step = 1; step <= 2; ++step) {
    model.Step(step);
    model.Shard();
    auto a = hf->PublishAdamW(StepOf(step), model.HfParams());
    ASSERT_TRUE(a.ok()) << a.status().message();
    std::vector<Result<PublishResult>> results(world, Internal("not run"));
    test::RunRanks(world, root, std::chrono::milliseconds(20000), [&](int rank, Transport* t) {
      ASSERT_NE(t, nullptr);
      results[rank] = test::PublishOver(*pubs[rank], *t, StepOf(step),
                                        RangesOf(model, holdings(model, rank), step));
    });
    for (int rank = 0; rank < world; ++rank) {
      ASSERT_TRUE(results[rank].ok())
          << "rank " << rank << ": " << results[rank].status().message();
      EXPECT_EQ(results[rank]->version, a->version);
      EXPECT_EQ(results[rank]->changed, a->changed);
      EXPECT_EQ(results[rank]->tensors, a->tensors);
    }
    test::ExpectSameVersion(hf->store(), pubs[0]->store(), a->version);
    const std::string out = root + "/export_dist" + std::to_string(step);
    ASSERT_TRUE(ExportVersion(pubs[0]->store(), a->version, out, nullptr).ok());
    EXPECT_EQ(ReadAll(out + "/model.safetensors"),
              ReadAll(model.WriteCheckpoint("now" + std::to_string(step)) + "/model.safetensors"));
  }
}

class PublisherRanksMcore : public testing::Test {
 protected:
  test::ScopedTempDir tmp_;
};

// TP 2 x DP 2 with the distributed optimizer: each DP rank holds a flat
// range of its TP rank's shards, cut across shard boundaries; norms are on
// every TP rank.
TEST_F(PublisherRanksMcore, Tp2Dp2WithTheDistributedOptimizer) {
  ParallelLayout layout;
  layout.tp = 2;
  ExpectDistributedEqualsHf(
      test::TinyQwen3(16, 4), layout, 4,
      [](const McorePublish& model, int rank) {
        return FlatPart(RankShards(model, rank % 2, 0), rank / 2, 2);
      },
      tmp_.path());
}

// TP 2 x PP 2: each pipeline stage holds its own layers.
TEST_F(PublisherRanksMcore, Tp2Pp2StagesHoldTheirLayers) {
  ParallelLayout layout;
  layout.tp = 2;
  const ModelSpec spec = test::TinyLlama(8, 4);
  ExpectDistributedEqualsHf(
      spec, layout, 4,
      [&](const McorePublish& model, int rank) {
        std::vector<HeldShard> out;
        for (const auto& h : RankShards(model, rank % 2, 0)) {
          if (StageOf(h.as.name, spec.num_layers) == rank / 2) out.push_back(h);
        }
        return out;
      },
      tmp_.path());
}

// EP 2 for an MoE model: each rank holds its experts and a replica of the
// dense parameters.
TEST_F(PublisherRanksMcore, Ep2ExpertsOnTheirRanks) {
  ParallelLayout layout;
  layout.ep = 2;
  ExpectDistributedEqualsHf(
      test::TinyQwen3Moe(8, 4), layout, 2,
      [](const McorePublish& model, int rank) { return RankShards(model, 0, rank); }, tmp_.path());
}

// A unit given in part (one TP rank missing) fails every rank, naming it.
TEST_F(PublisherRanksMcore, AUnitGivenInPartFailsEveryRank) {
  ParallelLayout layout;
  layout.tp = 2;
  McorePublish model(test::TinyLlama(8, 4), layout, tmp_.path());
  auto init = model.Open("dist", true);
  ASSERT_TRUE(init && init->ImportCheckpoint(model.WriteCheckpoint("init")).ok());
  model.Step(1);
  model.Shard();
  std::vector<std::unique_ptr<Publisher>> pubs;
  for (int r = 0; r < 2; ++r) {
    PublisherOptions o;
    o.store = tmp_.path() + "/dist";
    o.converter = "mcore";
    o.mcore = McoreConverter{test::TinyLlama(8, 4), layout};
    o.group = {r, 2, nullptr};
    pubs.push_back(std::move(Publisher::Open(o)).value());
  }
  std::vector<Status> st(2);
  test::RunRanks(2, tmp_.path(), std::chrono::milliseconds(20000), [&](int rank, Transport* t) {
    ASSERT_NE(t, nullptr);
    auto held = RankShards(model, rank, 0);
    if (rank == 1) {
      std::erase_if(held, [](const HeldShard& h) {
        return h.as.name.find("layers.1.self_attention.linear_qkv.weight") != std::string::npos;
      });
    }
    st[rank] = test::PublishOver(*pubs[rank], *t, StepOf(1), RangesOf(model, held, 1)).status();
  });
  for (const Status& s : st) {
    EXPECT_FALSE(s.ok());
    EXPECT_NE(s.message().find("layers.1.self_attention.linear_qkv.weight (tp rank 1, ep rank 0)"
                               " is held by no rank"),
              std::string::npos)
        << s.message();
  }
  auto latest = pubs[0]->store().Latest();
  ASSERT_TRUE(latest.ok() && latest->has_value());
  EXPECT_EQ(**latest, 0u);
}

// The rejection tests share one TP 2 / EP 2 MoE model at step 1.
class PublisherMcoreErrors : public testing::Test {
 protected:
  void SetUp() override {
    ParallelLayout layout;
    layout.tp = 2;
    layout.ep = 2;
    model_ = std::make_unique<McorePublish>(test::TinyQwen3Moe(8, 4), layout, tmp_.path());
    pub_ = model_->Open("mcore", true);
    ASSERT_TRUE(pub_);
    ASSERT_TRUE(pub_->ImportCheckpoint(model_->WriteCheckpoint("init")).ok());
    model_->Step(1);
    model_->Shard();
    shards_ = model_->McoreParams(1);
  }

  // Publishing shards_ fails with a message naming every one of `words`,
  // and leaves the store at version 0.
  void ExpectRejected(const std::vector<std::string>& words) {
    auto r = pub_->PublishAdamWMcore(StepOf(1), shards_);
    ASSERT_FALSE(r.ok());
    for (const auto& w : words) EXPECT_NE(r.status().message().find(w), std::string::npos) << w;
    auto latest = pub_->store().Latest();
    ASSERT_TRUE(latest.ok() && latest->has_value());
    EXPECT_EQ(**latest, 0u);
  }

  McoreAdamWShard& Find(const std::string& name, int tp, int ep) {
    for (auto& s : shards_) {
      if (s.key == ShardKey{name, tp, ep}) return s;
    }
    ADD_FAILURE() << "no shard " << name;
    return shards_[0];
  }

  test::ScopedTempDir tmp_;
  std::unique_ptr<McorePublish> model_;
  std::unique_ptr<Publisher> pub_;
  std::vector<McoreAdamWShard> shards_;
};

const char kQkv[] = "decoder.layers.0.self_attention.linear_qkv.weight";

TEST_F(PublisherMcoreErrors, AcceptsTheUnmodifiedShards) {
  auto r = pub_->PublishAdamWMcore(StepOf(1), shards_);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->version, 1u);
}

TEST_F(PublisherMcoreErrors, UnitGivenInPartNamesTheMissingShard) {
  std::erase_if(shards_, [](const McoreAdamWShard& s) { return s.key == ShardKey{kQkv, 1, 0}; });
  ExpectRejected({"layer 0 attention", kQkv, "tp rank 1", "missing"});
}

TEST_F(PublisherMcoreErrors, UnitsNotGivenStayUnchanged) {
  std::erase_if(shards_, [](const McoreAdamWShard& s) {
    return s.key.name.find("decoder.layers.0.") == std::string::npos;
  });
  auto r = pub_->PublishAdamWMcore(StepOf(1), shards_);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_GT(r->changed, 0u);
  for (const ConvertUnit& unit : model_->plan()) {
    const bool layer0 = unit.label.rfind("layer 0 ", 0) == 0;
    for (const PlannedShard& s : unit.shards) {
      EXPECT_EQ(layer0, s.key.name.find("decoder.layers.0.") == 0) << s.key.ToString();
    }
  }
  auto v = pub_->store().GetVersion(1);
  ASSERT_TRUE(v.ok());
  for (const auto& t : (*v)->manifest.files[0].tensors) {
    if (t.name.find("model.layers.0.") != 0) {
      EXPECT_EQ(t.changed, 0u) << t.name;
    }
  }
}

TEST_F(PublisherMcoreErrors, WrongShapeNamesShardRanksAndShapes) {
  auto& s = Find(kQkv, 1, 0);
  s.exp_avg.shape[0] -= 1;
  ExpectRejected({kQkv, "tp rank 1", "exp_avg", "has shape"});
}

TEST_F(PublisherMcoreErrors, NonFp32StateIsRejected) {
  Find("decoder.final_layernorm.weight", 0, 0).exp_avg_sq.dtype = DType::kBF16;
  ExpectRejected({"decoder.final_layernorm.weight", "exp_avg_sq", "FP32"});
}

TEST_F(PublisherMcoreErrors, UnknownAndRepeatedShardsAreRejected) {
  McoreAdamWShard extra = Find(kQkv, 1, 0);
  extra.key.tp_rank = 2;
  shards_.push_back(extra);
  ExpectRejected({kQkv, "tp rank 2", "not part of"});
  shards_.back().key.tp_rank = 1;
  ExpectRejected({kQkv, "tp rank 1", "given twice"});
}

TEST_F(PublisherMcoreErrors, StateStepMustMatch) {
  Find(kQkv, 0, 0).state_step = 7;
  ExpectRejected({kQkv, "tp rank 0", "step 7"});
}

TEST_F(PublisherMcoreErrors, ShardsOfOneTensorMustShareTheirGroup) {
  Find(kQkv, 1, 0).lr = 1e-4;
  ExpectRejected({"model.layers.0.self_attn.q_proj.weight", kQkv, "different"});
}

TEST_F(PublisherMcoreErrors, HfPublisherRefusesMcoreState) {
  auto hf = model_->Open("hf", false);
  ASSERT_TRUE(hf);
  ASSERT_TRUE(hf->ImportCheckpoint(model_->WriteCheckpoint("init2")).ok());
  auto r = hf->PublishAdamWMcore(StepOf(1), shards_);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("converter \"mcore\""), std::string::npos);
}

TEST(PublisherMcoreOpen, RejectsMissingSpecAndBadLayout) {
  test::ScopedTempDir tmp;
  PublisherOptions o;
  o.store = tmp.path() + "/s";
  o.converter = "mcore";
  EXPECT_FALSE(Publisher::Open(o).ok());
  ParallelLayout layout;
  layout.tp = 8;  // 4 KV heads cannot be split over 8 ranks
  o.mcore = McoreConverter{test::TinyLlama(8, 4), layout};
  auto p = Publisher::Open(o);
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("8"), std::string::npos);
}

}  // namespace
}  // namespace dte
