#include "store/fp8_view.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "store/safetensors.h"

namespace dte {
namespace {

using nlohmann::json;

struct Spec {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
};

uint64_t Bytes(const Spec& s) {
  uint64_t n = static_cast<uint64_t>(DTypeWidth(s.dtype));
  for (int64_t d : s.shape) n *= static_cast<uint64_t>(d);
  return n;
}

// A version with one safetensors file per entry of `files` (tensors laid
// out in order) plus config.json and the index; headers go to *src.
class ViewFixture {
 public:
  void AddShard(const std::string& name, const std::vector<Spec>& specs,
                std::map<std::string, std::string> metadata = {{"format", "pt"}}) {
    FileEntry f;
    f.name = name;
    f.safetensors = true;
    std::vector<TensorInfo> infos;
    uint64_t at = 0;
    for (const Spec& s : specs) {
      infos.push_back({s.name, s.dtype, s.shape, at, at + Bytes(s)});
      TensorEntry t;
      t.name = s.name;
      t.dtype = s.dtype;
      t.shape = s.shape;
      t.begin = at;
      t.end = at + Bytes(s);
      f.tensors.push_back(t);
      at = t.end;
    }
    const std::string header = BuildSafetensorsHeader(infos, metadata);
    f.header_size = header.size();
    f.size = header.size() + at;
    manifest.files.push_back(f);
    headers.push_back(header);
  }
  void AddRaw(const std::string& name, const std::string& content) {
    FileEntry f;
    f.name = name;
    f.size = content.size();
    manifest.files.push_back(f);
    headers.emplace_back();
    if (name == kConfigFile) config = content;
    if (name == kIndexFile) index = content;
  }
  Result<Fp8View> Build(const Fp8ViewOptions& options = {}) {
    manifest.version = 3;
    src.manifest = &manifest;
    src.headers = headers;
    src.config = config;
    src.index = index;
    return Fp8View::Build(src, options);
  }

  Manifest manifest;
  std::vector<std::string> headers;
  std::optional<std::string> config, index;
  Fp8ViewSource src;
};

const std::vector<Spec> kShard1 = {
    {"model.embed_tokens.weight", DType::kBF16, {300, 64}},
    {"model.layers.0.input_layernorm.weight", DType::kBF16, {64}},
    {"model.layers.0.self_attn.q_proj.weight", DType::kBF16, {256, 192}},
    {"model.layers.0.self_attn.q_proj.bias", DType::kBF16, {256}},
    {"model.layers.0.mlp.down_proj.weight", DType::kBF16, {64, 130}},
};
const std::vector<Spec> kShard2 = {
    {"lm_head.weight", DType::kBF16, {300, 64}},
    {"model.norm.weight", DType::kF32, {64}},
};

// Options that also quantize partial blocks (Fp8Policy::quantize_partial_blocks):
// the fixture's q_proj (256 x 192) and down_proj (64 x 130) are not whole
// 128 x 128 blocks, and the tests of layout, parts and index use them to
// cover partial edge blocks, which the opt-in keeps available.
Fp8ViewOptions Partial() {
  Fp8ViewOptions o;
  o.policy.quantize_partial_blocks = true;
  return o;
}

ViewFixture Llama() {
  ViewFixture fx;
  fx.AddRaw(kConfigFile, R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 64,
                            "rms_norm_eps": 1e-06, "torch_dtype": "bfloat16"})");
  fx.AddShard("model-00001-of-00002.safetensors", kShard1);
  fx.AddShard("model-00002-of-00002.safetensors", kShard2);
  json index = {{"metadata", {{"total_size", 1}}}, {"weight_map", json::object()}};
  for (const Spec& s : kShard1) index["weight_map"][s.name] = "model-00001-of-00002.safetensors";
  for (const Spec& s : kShard2) index["weight_map"][s.name] = "model-00002-of-00002.safetensors";
  fx.AddRaw(kIndexFile, index.dump());
  fx.AddRaw("tokenizer.json", "{}");
  return fx;
}

TEST(Fp8View, QuantizedTensorsBecomeE4m3FollowedByTheirScales) {
  ViewFixture fx = Llama();
  Result<Fp8View> view = fx.Build(Partial());
  ASSERT_TRUE(view.ok()) << view.status().message();
  const Fp8ViewFile& f = view->files()[1];
  ASSERT_TRUE(f.changed);
  ASSERT_EQ(f.text.size() % 8, 0u);
  Result<SafetensorsHeader> h = ParseSafetensorsHeader(f.text.substr(8), f.size, f.name);
  ASSERT_TRUE(h.ok()) << h.status().message();
  EXPECT_EQ(h->metadata, (std::map<std::string, std::string>{{"format", "pt"}}));
  std::vector<std::string> names;
  for (const TensorInfo& t : h->tensors) names.push_back(t.name);
  EXPECT_EQ(names,
            (std::vector<std::string>{
                "model.embed_tokens.weight", "model.layers.0.input_layernorm.weight",
                "model.layers.0.self_attn.q_proj.weight",
                "model.layers.0.self_attn.q_proj.weight_scale_inv",
                "model.layers.0.self_attn.q_proj.bias", "model.layers.0.mlp.down_proj.weight",
                "model.layers.0.mlp.down_proj.weight_scale_inv"}));
  EXPECT_EQ(h->tensors[0].dtype, DType::kBF16);
  EXPECT_EQ(h->tensors[2].dtype, DType::kF8E4M3);
  EXPECT_EQ(h->tensors[2].shape, (std::vector<int64_t>{256, 192}));
  EXPECT_EQ(h->tensors[3].dtype, DType::kF32);
  EXPECT_EQ(h->tensors[3].shape, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(h->tensors[6].shape, (std::vector<int64_t>{1, 2}));  // 64 x 130: partial blocks
  EXPECT_EQ(h->tensors[2].bytes(), 256u * 192u);
  EXPECT_EQ(h->data_offset + h->data_size, f.size);
  ASSERT_EQ(view->tensors().size(), 2u);
  const Fp8Tensor& q = view->tensors()[0];
  EXPECT_EQ(q.weight_offset, h->data_offset + h->tensors[2].begin);
  EXPECT_EQ(q.scale_offset, h->data_offset + h->tensors[3].begin);
  EXPECT_EQ(q.source_offset,
            fx.manifest.files[1].header_size + fx.manifest.files[1].tensors[2].begin);
  EXPECT_EQ(q.block_row_count(), 2u);
  EXPECT_EQ(view->tensors()[1].RowsOf(0), 64u);
}

TEST(Fp8View, PartsCoverEachFileAndNameTheirSource) {
  ViewFixture fx = Llama();
  Result<Fp8View> view = fx.Build(Partial());
  ASSERT_TRUE(view.ok()) << view.status().message();
  const Fp8ViewFile& f = view->files()[1];
  const FileEntry& src = fx.manifest.files[1];
  const std::vector<Fp8Part>& p = f.parts;
  ASSERT_EQ(p.size(), 7u);  // header, copy (embed + norm), weight, scale, copy, weight, scale
  EXPECT_EQ(p[0].kind, Fp8PartKind::kText);
  EXPECT_EQ(p[0].size, f.text.size());
  EXPECT_EQ(p[1].kind, Fp8PartKind::kCopy);  // two adjacent tensors in one part
  EXPECT_EQ(p[1].source_offset, src.header_size);
  EXPECT_EQ(p[1].size, 300u * 64 * 2 + 64 * 2);
  EXPECT_EQ(p[2].kind, Fp8PartKind::kWeight);
  EXPECT_EQ(p[3].kind, Fp8PartKind::kScale);
  EXPECT_EQ(p[3].size, 4u * 4);
  EXPECT_EQ(p[4].source_offset, src.header_size + src.tensors[3].begin);
  EXPECT_EQ(p[6].tensor, 1u);
  uint64_t at = 0;
  for (const Fp8Part& part : p) {
    EXPECT_EQ(part.begin, at);
    at = part.end();
  }
  EXPECT_EQ(at, f.size);
  auto hit = view->PartsAt(1, p[2].begin + 5, p[3].size + p[2].size);
  ASSERT_EQ(hit.size(), 3u);
  EXPECT_EQ(hit[0].kind, Fp8PartKind::kWeight);
  EXPECT_EQ(hit[2].kind, Fp8PartKind::kCopy);
  EXPECT_EQ(view->PartsAt(1, f.size - 1, 1).size(), 1u);
  // Files with nothing to quantize are the source file, byte for byte.
  const Fp8ViewFile& other = view->files()[2];
  EXPECT_FALSE(other.changed);
  ASSERT_EQ(other.parts.size(), 1u);
  EXPECT_EQ(other.parts[0].kind, Fp8PartKind::kCopy);
  EXPECT_EQ(other.size, fx.manifest.files[2].size);
  EXPECT_FALSE(view->files()[4].changed);  // tokenizer.json
}

TEST(Fp8View, IndexGainsTheScalesAndTheNewTotalSize) {
  ViewFixture fx = Llama();
  Result<Fp8View> view = fx.Build(Partial());
  ASSERT_TRUE(view.ok()) << view.status().message();
  const Fp8ViewFile& f = view->files()[3];
  ASSERT_EQ(f.name, kIndexFile);
  json j = json::parse(f.text);
  EXPECT_EQ(j["weight_map"]["model.layers.0.self_attn.q_proj.weight_scale_inv"],
            "model-00001-of-00002.safetensors");
  EXPECT_EQ(j["weight_map"]["lm_head.weight"], "model-00002-of-00002.safetensors");
  EXPECT_EQ(j["weight_map"].size(), kShard1.size() + kShard2.size() + 2);
  uint64_t total = 0;
  for (int i : {1, 2}) {
    const Fp8ViewFile& s = view->files()[i];
    total += s.size - (s.changed ? s.text.size() : fx.manifest.files[i].header_size);
  }
  EXPECT_EQ(j["metadata"]["total_size"], total);
  EXPECT_EQ(f.size, f.text.size());
  EXPECT_EQ(f.text.back(), '\n');
}

TEST(Fp8View, ConfigGainsTheQuantizationConfig) {
  ViewFixture fx = Llama();
  Result<Fp8View> view = fx.Build();
  ASSERT_TRUE(view.ok()) << view.status().message();
  json j = json::parse(view->files()[0].text);
  EXPECT_EQ(j["hidden_size"], 64);
  EXPECT_EQ(j["rms_norm_eps"], 1e-06);
  // q_proj (256 x 192) and down_proj (64 x 130) are not whole 128 x 128
  // blocks: kept in BF16 and listed with the skipped modules.
  const std::vector<std::string> kept = {"lm_head", "model.embed_tokens",
                                         "model.layers.0.mlp.down_proj",
                                         "model.layers.0.self_attn.q_proj"};
  const json want = {{"quant_method", "fp8"},
                     {"fmt", "e4m3"},
                     {"activation_scheme", "dynamic"},
                     {"weight_block_size", {128, 128}},
                     {"modules_to_not_convert", kept}};
  EXPECT_EQ(j["quantization_config"], want);
  EXPECT_EQ(view->not_converted(), kept);
  EXPECT_TRUE(view->tensors().empty());
  EXPECT_EQ(
      json::parse(
          fx.Build(Partial())->files()[0].text)["quantization_config"]["modules_to_not_convert"],
      json({"lm_head", "model.embed_tokens"}));

  Fp8ViewOptions pow2;
  pow2.rule = kernels::Fp8ScaleRule::kPowerOfTwo;
  pow2.block_rows = 64;
  pow2.block_cols = 32;
  Result<Fp8View> v2 = fx.Build(pow2);
  ASSERT_TRUE(v2.ok()) << v2.status().message();
  json q = json::parse(v2->files()[0].text)["quantization_config"];
  EXPECT_EQ(q["scale_fmt"], "ue8m0");
  EXPECT_EQ(q["weight_block_size"], json({64, 32}));
  // 64 x 32 blocks divide q_proj, not down_proj's 130 columns.
  ASSERT_EQ(v2->tensors().size(), 1u);
  EXPECT_EQ(v2->tensors()[0].name, "model.layers.0.self_attn.q_proj.weight");
  EXPECT_EQ(v2->tensors()[0].layout.grid_rows(), 4u);
  EXPECT_EQ(v2->tensors()[0].layout.grid_cols(), 6u);
  EXPECT_EQ(q["modules_to_not_convert"],
            json({"lm_head", "model.embed_tokens", "model.layers.0.mlp.down_proj"}));
}

// Without a config.json the view has none either (it cannot make up a
// model's config): its safetensors files are quantized all the same, and
// the index, if any, is rewritten.
TEST(Fp8View, VersionWithoutConfigJsonIsViewedWithoutOne) {
  ViewFixture fx;
  fx.AddShard("model.safetensors", kShard1);
  fx.AddRaw("tokenizer.json", "{}");
  Result<Fp8View> view = fx.Build(Partial());
  ASSERT_TRUE(view.ok()) << view.status().message();
  ASSERT_EQ(view->files().size(), 2u);
  EXPECT_EQ(view->files()[0].name, "model.safetensors");
  EXPECT_TRUE(view->files()[0].changed);
  EXPECT_FALSE(view->files()[1].changed);
  EXPECT_EQ(view->tensors().size(), 2u);  // q_proj and down_proj
}

TEST(Fp8View, ConfigThatIsAlreadyQuantizedIsRefused) {
  ViewFixture fx;
  fx.AddRaw(kConfigFile, R"({"quantization_config": {"quant_method": "fp8"}})");
  fx.AddShard("model.safetensors", kShard1);
  Result<Fp8View> view = fx.Build();
  ASSERT_FALSE(view.ok());
  EXPECT_EQ(view.status().code(), Code::kInvalidArgument);
  EXPECT_NE(view.status().message().find("v00000003/config.json"), std::string::npos);
  EXPECT_NE(view.status().message().find("already has a quantization_config"), std::string::npos);
}

TEST(Fp8View, BadInputsAreRefusedNamingTheFile) {
  {
    ViewFixture fx;  // a scale name that is taken
    std::vector<Spec> specs = kShard1;
    specs.push_back({"model.layers.0.mlp.down_proj.weight_scale_inv", DType::kF32, {1, 2}});
    fx.AddShard("model.safetensors", specs);
    Result<Fp8View> view = fx.Build(Partial());
    ASSERT_FALSE(view.ok());
    EXPECT_NE(view.status().message().find("'model.layers.0.mlp.down_proj.weight_scale_inv' "
                                           "already exists"),
              std::string::npos)
        << view.status().message();
  }
  {
    ViewFixture fx = Llama();
    Fp8ViewOptions zero;
    zero.block_cols = 0;
    Result<Fp8View> view = fx.Build(zero);
    ASSERT_FALSE(view.ok());
    EXPECT_NE(view.status().message().find("block size 128 x 0"), std::string::npos);
  }
  {
    ViewFixture fx = Llama();
    fx.headers[1].resize(fx.headers[1].size() - 1);
    Result<Fp8View> view = fx.Build();
    ASSERT_FALSE(view.ok());
    EXPECT_NE(view.status().message().find("v00000003/model-00001-of-00002.safetensors"),
              std::string::npos);
  }
  {
    ViewFixture fx = Llama();
    fx.config = "[1, 2]";
    Result<Fp8View> view = fx.Build();
    ASSERT_FALSE(view.ok());
    EXPECT_NE(view.status().message().find("config.json: not a JSON object"), std::string::npos);
  }
}

TEST(Fp8View, FindRefusesTensorsThatAreNotQuantized) {
  ViewFixture fx;
  fx.AddShard("model.safetensors",
              {{"model.layers.0.mlp.experts.weight", DType::kBF16, {4, 64, 64}},
               {"model.layers.0.self_attn.o_proj.weight", DType::kBF16, {128, 128}},
               {"model.layers.0.mlp.up_proj.weight", DType::kBF16, {344, 128}}});
  Result<Fp8View> view = fx.Build();
  ASSERT_TRUE(view.ok()) << view.status().message();
  Result<const Fp8Tensor*> o = view->Find("model.layers.0.self_attn.o_proj.weight");
  ASSERT_TRUE(o.ok());
  EXPECT_EQ((*o)->scale_name, "model.layers.0.self_attn.o_proj.weight_scale_inv");
  Result<const Fp8Tensor*> e = view->Find("model.layers.0.mlp.experts.weight");
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), Code::kInvalidArgument);
  EXPECT_NE(e.status().message().find("not 2-D (shape [4, 64, 64])"), std::string::npos)
      << e.status().message();
  Result<const Fp8Tensor*> up = view->Find("model.layers.0.mlp.up_proj.weight");
  ASSERT_FALSE(up.ok());
  EXPECT_NE(up.status().message().find(
                "shape not a multiple of the block (shape [344, 128], block 128 x 128)"),
            std::string::npos)
      << up.status().message();
  EXPECT_EQ(view->Find("nope.weight").status().code(), Code::kNotFound);
  // A 3-D tensor is no module to list; a 2-D weight off the block is.
  EXPECT_EQ(view->not_converted(), std::vector<std::string>{"model.layers.0.mlp.up_proj"});
}

// The shapes of a model whose MLP width (344) is not a multiple of the
// block, and a one-row weight, under 128 x 128 and 8 x 32 blocks: a weight
// that is not whole blocks stays BF16 (its bytes the source's, unchanged),
// its module is listed in modules_to_not_convert, and it has no scales.
const std::vector<Spec> kOffBlock = {
    {"model.layers.0.mlp.up_proj.weight", DType::kBF16, {344, 128}},
    {"model.layers.0.mlp.down_proj.weight", DType::kBF16, {128, 344}},
    {"model.layers.0.self_attn.o_proj.weight", DType::kBF16, {256, 256}},
    {"model.layers.0.self_attn.k_proj.weight", DType::kBF16, {1, 128}},
};

class Fp8ViewBlocks : public ::testing::TestWithParam<std::pair<uint64_t, uint64_t>> {};

TEST_P(Fp8ViewBlocks, WeightsOffTheBlockStayBf16AndAreListed) {
  const auto [rows, cols] = GetParam();
  ViewFixture fx;
  fx.AddRaw(kConfigFile, R"({"architectures": ["LlamaForCausalLM"]})");
  fx.AddShard("model.safetensors", kOffBlock);
  Fp8ViewOptions o;
  o.block_rows = rows;
  o.block_cols = cols;
  Result<Fp8View> view = fx.Build(o);
  ASSERT_TRUE(view.ok()) << view.status().message();
  // 8 x 32 blocks divide 344 rows (43 blocks) but not 344 columns.
  const bool up = rows == 8;
  std::vector<std::string> quantized = {"model.layers.0.self_attn.o_proj.weight"};
  std::vector<std::string> listed = {"model.layers.0.mlp.down_proj",
                                     "model.layers.0.self_attn.k_proj"};
  if (up) {
    quantized.insert(quantized.begin(), "model.layers.0.mlp.up_proj.weight");
  } else {
    listed.insert(listed.begin() + 1, "model.layers.0.mlp.up_proj");  // sorted
  }
  std::vector<std::string> got;
  for (const Fp8Tensor& t : view->tensors()) got.push_back(t.name);
  EXPECT_EQ(got, quantized);
  EXPECT_EQ(view->not_converted(), listed);
  const json q = json::parse(view->files()[0].text)["quantization_config"];
  EXPECT_EQ(q["modules_to_not_convert"], json(listed));
  EXPECT_EQ(q["weight_block_size"], json({rows, cols}));

  const Fp8ViewFile& f = view->files()[1];
  Result<SafetensorsHeader> h = ParseSafetensorsHeader(f.text.substr(8), f.size, f.name);
  ASSERT_TRUE(h.ok()) << h.status().message();
  const FileEntry& src = fx.manifest.files[1];
  for (size_t k = 0; k < src.tensors.size(); ++k) {
    const TensorEntry& t = src.tensors[k];
    auto info = std::find_if(h->tensors.begin(), h->tensors.end(),
                             [&](const TensorInfo& i) { return i.name == t.name; });
    ASSERT_NE(info, h->tensors.end()) << t.name;
    EXPECT_EQ(info->shape, t.shape) << t.name;
    const bool fp8 = std::find(got.begin(), got.end(), t.name) != got.end();
    const bool has_scales =
        std::any_of(h->tensors.begin(), h->tensors.end(),
                    [&](const TensorInfo& i) { return i.name == t.name + kScaleSuffix; });
    EXPECT_EQ(has_scales, fp8) << t.name;
    EXPECT_EQ(info->dtype, fp8 ? DType::kF8E4M3 : DType::kBF16) << t.name;
    if (fp8) continue;
    // A kept tensor's bytes are the source file's, copied unchanged.
    auto parts = view->PartsAt(1, h->data_offset + info->begin, info->bytes());
    ASSERT_EQ(parts.size(), 1u) << t.name;
    EXPECT_EQ(parts[0].kind, Fp8PartKind::kCopy) << t.name;
    const uint64_t skip = h->data_offset + info->begin - parts[0].begin;
    EXPECT_EQ(parts[0].source_offset + skip, src.header_size + t.begin) << t.name;
    EXPECT_GE(parts[0].end(), h->data_offset + info->end) << t.name;
    auto why = view->Find(t.name);
    ASSERT_FALSE(why.ok());
    EXPECT_NE(why.status().message().find("shape not a multiple of the block"), std::string::npos)
        << why.status().message();
  }
}

INSTANTIATE_TEST_SUITE_P(Blocks, Fp8ViewBlocks,
                         ::testing::Values(std::pair<uint64_t, uint64_t>{128, 128},
                                           std::pair<uint64_t, uint64_t>{8, 32}));

}  // namespace
}  // namespace dte
