#include "tests/testutil/model_series.h"

namespace dte::test {
namespace {

TestCheckpoint FirstStep() {
  TestCheckpoint c;
  c.safetensors.push_back({ModelSeries::kShard1,
                           {Bf16Tensor("model.norm", {300}, 1),
                            Bf16Tensor("model.embed", {1024, 300}, 2)},  // 2.3 blocks
                           {{"format", "pt"}}});
  TestTensor scale{"scale", DType::kF32, {4}, RandomBytes(16, 3)};
  c.safetensors.push_back({ModelSeries::kShard2,
                           {scale, Bf16Tensor("lm_head", {700, 256}, 4)},  // 1.4 blocks
                           {{"format", "pt"}}});
  std::string index = "{\"metadata\": {}, \"weight_map\": {";
  for (const auto& f : c.safetensors) {
    for (const auto& t : f.tensors) index += "\"" + t.name + "\": \"" + f.name + "\", ";
  }
  index.resize(index.size() - 2);
  c.raw_files["model.safetensors.index.json"] = index + "}}\n";
  return c;
}

std::map<std::string, std::string> FilesOf(const TestCheckpoint& c) {
  std::map<std::string, std::string> out = c.raw_files;
  for (const auto& f : c.safetensors) out[f.name] = SafetensorsBytes(f);
  return out;
}

}  // namespace

ModelSeries::ModelSeries(uint64_t steps) {
  TestCheckpoint c = FirstStep();
  for (uint64_t step = 0; step < steps; ++step) {
    if (step > 0) {
      PerturbElements(&c.tensor("model.embed").data, 2, 200, 100 * step);
      PerturbElements(&c.tensor("model.norm").data, 2, 3, 100 * step + 1);
      if (step % 2 == 0) PerturbElements(&c.tensor("lm_head").data, 2, 50, 100 * step + 2);
    }
    c.raw_files["config.json"] = "{\"step\": " + std::to_string(step) + "}\n";
    checkpoints_.push_back(c);
    files_.push_back(FilesOf(c));
  }
}

Status ModelSeries::Write(uint64_t step, const std::string& dir) const {
  return WriteCheckpoint(checkpoint(step), dir);
}

}  // namespace dte::test
