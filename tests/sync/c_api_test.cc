// The C ABI: handles, error codes and messages, a publish read back.
#include "sync/capi/c_api.h"

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "kernels/adamw.h"
#include "kernels/bf16.h"
#include "tests/testutil/checkpoint.h"
#include "tests/testutil/memory_store.h"

namespace dte {
namespace {

constexpr int64_t kRows = 64, kCols = 33;
constexpr size_t kN = kRows * kCols;

class CApiTest : public ::testing::Test {
 protected:
  void SetUp() override {
    prev_.resize(kN);
    m_.resize(kN);
    v_.resize(kN);
    theta_.resize(kN);
    for (size_t i = 0; i < kN; ++i) {
      prev_[i] = 0.01f * std::sin(static_cast<float>(i));
      m_[i] = 1e-3f * std::cos(static_cast<float>(3 * i));
      v_[i] = m_[i] * m_[i] + 1e-9f;
    }
    kernels::AdamWParams p;
    p.lr = 1e-4;
    p.step = 1;
    kernels::AdamWForward(prev_.data(), m_.data(), v_.data(), kN, p, theta_.data());
    test::TestCheckpoint c;
    test::TestSafetensors f{"model.safetensors", {}, {}};
    f.tensors.push_back(Bf16("w", prev_));
    c.safetensors.push_back(f);
    ckpt_ = tmp_.path() + "/ckpt";
    ASSERT_TRUE(test::WriteCheckpoint(c, ckpt_).ok());
    store_ = tmp_.path() + "/store";
  }

  static test::TestTensor Bf16(const std::string& name, const std::vector<float>& x) {
    test::TestTensor t{name, DType::kBF16, {kRows, kCols}, std::string(x.size() * 2, '\0')};
    kernels::CastFp32ToBf16(x.data(), reinterpret_cast<uint16_t*>(t.data.data()), x.size());
    return t;
  }

  dte_adamw_param Param(const char* name) const {
    dte_array a{theta_.data(), DTE_DTYPE_F32, 2, shape_};
    dte_array m{m_.data(), DTE_DTYPE_F32, 2, shape_};
    dte_array v{v_.data(), DTE_DTYPE_F32, 2, shape_};
    return dte_adamw_param{name, a, m, v, 1, NAN, NAN};
  }

  static dte_adamw_step Step() {
    return dte_adamw_step{1e-4, 0.9, 0.999, 1e-8, 1e-2, 1, 0, 0, DTE_ORDER_TORCH_CPU};
  }

  test::ScopedTempDir tmp_;
  std::string ckpt_, store_;
  std::vector<float> prev_, m_, v_, theta_;
  int64_t shape_[2] = {kRows, kCols};
};

TEST_F(CApiTest, PublishThenReadBack) {
  dte_publisher* pub = nullptr;
  ASSERT_EQ(dte_publisher_open(store_.c_str(), nullptr, nullptr, &pub), DTE_OK) << dte_last_error();
  uint64_t version = 99;
  ASSERT_EQ(dte_publisher_import(pub, ckpt_.c_str(), &version), DTE_OK) << dte_last_error();
  EXPECT_EQ(version, 0u);
  const dte_adamw_step step = Step();
  const dte_adamw_param param = Param("w");
  dte_publish_result r{};
  ASSERT_EQ(dte_publisher_publish_adamw(pub, &step, &param, 1, &r), DTE_OK) << dte_last_error();
  EXPECT_EQ(r.version, 1u);
  EXPECT_EQ(r.parent, 0u);
  EXPECT_EQ(r.elements, kN);
  EXPECT_EQ(r.state_bytes, 12 * kN);
  EXPECT_GT(r.changed, 0u);
  dte_publisher_close(pub);

  dte_store* s = nullptr;
  ASSERT_EQ(dte_store_open(store_.c_str(), "", &s), DTE_OK) << dte_last_error();
  int has = 0;
  uint64_t latest = 0;
  ASSERT_EQ(dte_store_latest(s, &has, &latest), DTE_OK);
  EXPECT_EQ(has, 1);
  EXPECT_EQ(latest, 1u);
  std::string got(kN * 2, '\0');
  ASSERT_EQ(dte_store_read_tensor(s, 1, "w", got.data(), got.size()), DTE_OK) << dte_last_error();
  EXPECT_EQ(got, Bf16("w", theta_).data);
  ASSERT_EQ(dte_store_read_tensor(s, 0, "w", got.data(), got.size()), DTE_OK);
  EXPECT_EQ(got, Bf16("w", prev_).data);
  EXPECT_EQ(dte_store_read_tensor(s, 1, "w", got.data(), 7), DTE_INVALID_ARGUMENT);
  EXPECT_EQ(dte_store_read_tensor(s, 1, "nope", got.data(), got.size()), DTE_NOT_FOUND);
  EXPECT_NE(std::string(dte_last_error()).find("tensor nope"), std::string::npos);
  EXPECT_EQ(dte_store_read_tensor(s, 5, "w", got.data(), got.size()), DTE_NOT_FOUND);
  dte_store_close(s);
}

TEST_F(CApiTest, ErrorsCarryCodesAndMessages) {
  dte_publisher* pub = nullptr;
  EXPECT_EQ(dte_publisher_open(nullptr, nullptr, nullptr, &pub), DTE_INVALID_ARGUMENT);
  EXPECT_EQ(dte_publisher_open(store_.c_str(), nullptr, "mcore-unknown", &pub),
            DTE_INVALID_ARGUMENT);
  EXPECT_NE(std::string(dte_last_error()).find("mcore-unknown"), std::string::npos);
  ASSERT_EQ(dte_publisher_open(store_.c_str(), nullptr, "hf", &pub), DTE_OK);
  const dte_adamw_step step = Step();
  dte_adamw_param param = Param("w");
  dte_publish_result r{};
  EXPECT_EQ(dte_publisher_publish_adamw(pub, &step, &param, 1, &r), DTE_FAILED_PRECONDITION);
  EXPECT_NE(std::string(dte_last_error()).find("import"), std::string::npos);
  ASSERT_EQ(dte_publisher_import(pub, ckpt_.c_str(), nullptr), DTE_OK);
  param.exp_avg.dtype = DTE_DTYPE_F16;
  EXPECT_EQ(dte_publisher_publish_adamw(pub, &step, &param, 1, &r), DTE_INVALID_ARGUMENT);
  EXPECT_NE(std::string(dte_last_error()).find("tensor w: exp_avg is F16"), std::string::npos)
      << dte_last_error();
  param = Param("w");
  param.weight_decay = 1e9;  // leaves no positive decay factor
  EXPECT_EQ(dte_publisher_publish_adamw(pub, &step, &param, 1, &r), DTE_INVALID_ARGUMENT);
  dte_adamw_step bad = Step();
  bad.order = 17;
  EXPECT_EQ(dte_publisher_publish_adamw(pub, &bad, &param, 1, &r), DTE_INVALID_ARGUMENT);
  bad.order = DTE_ORDER_TORCH_CUDA_FUSED_FP32 + 1;  // one past the last order
  EXPECT_EQ(dte_publisher_publish_adamw(pub, &bad, &param, 1, &r), DTE_INVALID_ARGUMENT);
  EXPECT_NE(std::string(dte_last_error()).find("unknown AdamW order 5"), std::string::npos);
  EXPECT_EQ(dte_publisher_import(pub, (tmp_.path() + "/missing").c_str(), nullptr), DTE_NOT_FOUND);
  dte_publisher_close(pub);
}

}  // namespace
}  // namespace dte
