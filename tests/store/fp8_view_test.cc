#include "store/fp8_view.h"

#include <gtest/gtest.h>

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
  Result<Fp8View> view = fx.Build();
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
  Result<Fp8View> view = fx.Build();
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
  Result<Fp8View> view = fx.Build();
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
  const json want = {{"quant_method", "fp8"},
                     {"fmt", "e4m3"},
                     {"activation_scheme", "dynamic"},
                     {"weight_block_size", {128, 128}},
                     {"modules_to_not_convert", {"lm_head", "model.embed_tokens"}}};
  EXPECT_EQ(j["quantization_config"], want);
  EXPECT_EQ(view->not_converted(), (std::vector<std::string>{"lm_head", "model.embed_tokens"}));

  Fp8ViewOptions pow2;
  pow2.rule = kernels::Fp8ScaleRule::kPowerOfTwo;
  pow2.block_rows = 64;
  pow2.block_cols = 32;
  Result<Fp8View> v2 = fx.Build(pow2);
  ASSERT_TRUE(v2.ok()) << v2.status().message();
  json q = json::parse(v2->files()[0].text)["quantization_config"];
  EXPECT_EQ(q["scale_fmt"], "ue8m0");
  EXPECT_EQ(q["weight_block_size"], json({64, 32}));
  EXPECT_EQ(v2->tensors()[0].layout.grid_rows(), 4u);
  EXPECT_EQ(v2->tensors()[0].layout.grid_cols(), 6u);
}

// Without a config.json the view has none either (it cannot make up a
// model's config): its safetensors files are quantized all the same, and
// the index, if any, is rewritten.
TEST(Fp8View, VersionWithoutConfigJsonIsViewedWithoutOne) {
  ViewFixture fx;
  fx.AddShard("model.safetensors", kShard1);
  fx.AddRaw("tokenizer.json", "{}");
  Result<Fp8View> view = fx.Build();
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
    Result<Fp8View> view = fx.Build();
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
               {"model.layers.0.self_attn.o_proj.weight", DType::kBF16, {64, 64}}});
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
  EXPECT_EQ(view->Find("nope.weight").status().code(), Code::kNotFound);
  EXPECT_TRUE(view->not_converted().empty());  // a 3-D tensor is no module to list
}

}  // namespace
}  // namespace dte
