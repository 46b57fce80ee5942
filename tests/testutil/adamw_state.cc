#include "tests/testutil/adamw_state.h"

#include <cmath>
#include <random>

#include "kernels/bf16.h"

namespace dte::test {

AdamWTensorState RandomAdamWState(const std::string& name, std::vector<int64_t> shape,
                                  uint64_t seed) {
  AdamWTensorState s{name, std::move(shape), {}, {}, {}, {}};
  size_t n = 1;
  for (int64_t d : s.shape) n *= static_cast<size_t>(d);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> w(0.0f, 0.02f), g(0.0f, 1e-3f);
  s.prev.resize(n);
  s.m.resize(n);
  s.v.resize(n);
  for (size_t i = 0; i < n; ++i) {
    s.prev[i] = w(rng);
    s.m[i] = g(rng);
    s.v[i] = s.m[i] * s.m[i] * (1.0f + std::abs(g(rng)) * 1e3f) + 1e-12f;
  }
  return s;
}

void AdamWStepState(AdamWTensorState* s, const kernels::AdamWParams& p, uint64_t seed) {
  if (!s->theta.empty()) s->prev = s->theta;
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> g(0.0f, 1e-3f);
  for (size_t i = 0; i < s->m.size(); ++i) {
    s->m[i] = 0.5f * s->m[i] + g(rng);
    s->v[i] = s->m[i] * s->m[i] * (1.0f + std::abs(g(rng)) * 1e3f) + 1e-12f;
  }
  s->theta.resize(s->prev.size());
  kernels::AdamWForward(s->prev.data(), s->m.data(), s->v.data(), s->prev.size(), p,
                        s->theta.data());
}

AdamWStep AdamWStepOf(const kernels::AdamWParams& p) {
  AdamWStep h;
  h.lr = p.lr;
  h.beta1 = p.beta1;
  h.beta2 = p.beta2;
  h.eps = p.eps;
  h.weight_decay = p.weight_decay;
  h.step = p.step;
  h.order = p.order;
  return h;
}

TestTensor Bf16TensorOf(const std::string& name, const std::vector<int64_t>& shape,
                        const std::vector<float>& x) {
  TestTensor t{name, DType::kBF16, shape, std::string(x.size() * 2, '\0')};
  kernels::CastFp32ToBf16(x.data(), reinterpret_cast<uint16_t*>(t.data.data()), x.size());
  return t;
}

TestCheckpoint AdamWCheckpoint(const std::vector<AdamWTensorState>& states,
                               const std::vector<TestTensor>& others) {
  TestCheckpoint c;
  c.raw_files["config.json"] = "{\"model_type\": \"llama\"}\n";
  TestSafetensors f{"model.safetensors", {}, {{"format", "pt"}}};
  for (const auto& s : states) f.tensors.push_back(Bf16TensorOf(s.name, s.shape, s.theta));
  for (const auto& t : others) f.tensors.push_back(t);
  c.safetensors.push_back(f);
  return c;
}

}  // namespace dte::test
