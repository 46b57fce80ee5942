// The push server's FP8 change sets from block summaries
// (sync/push/internal/push_fp8_summary.h) against the change sets of the
// whole tensors (ComputeFp8Changes over both versions), bit for bit, after
// every step of random walks: small steps, the amax element raised and
// lowered, ties at the amax, blocks zeroed, scale-changing steps, entries
// without their old values, partial edge blocks, both rules. The rows the
// summaries do not ask for hold NaN, so a read of them would show.
#include "sync/push/internal/push_fp8_summary.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/fp8.h"

namespace dte::push_internal {
namespace {

constexpr uint16_t kNanBits = 0x7FC0;

uint16_t Bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>(u >> 16);
}

std::vector<uint16_t> RandomTensor(const kernels::Fp8Layout& l, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 0.05f);
  std::vector<uint16_t> x(l.num_elements());
  for (uint16_t& v : x) v = Bf16(normal(rng));
  return x;
}

// The changes from a to b (every differing element, plus `same` listed
// elements that did not change), old values exact except where `unknown`
// picks an entry (then known = 0 and its old value garbage).
TensorChanges ChangesOf(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b, double same,
                        double unknown, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> u(0, 1);
  TensorChanges c;
  c.name = "t";
  c.old_exact = true;
  bool any_unknown = false;
  for (uint64_t i = 0; i < a.size(); ++i) {
    if (a[i] == b[i] && u(rng) >= same) continue;
    const bool known = u(rng) >= unknown;
    any_unknown |= !known;
    const uint16_t was = known ? a[i] : static_cast<uint16_t>(rng());
    c.indices.push_back(i);
    c.values.insert(c.values.end(), {static_cast<uint8_t>(b[i]), static_cast<uint8_t>(b[i] >> 8)});
    c.old_values.insert(c.old_values.end(),
                        {static_cast<uint8_t>(was), static_cast<uint8_t>(was >> 8)});
    c.known.push_back(known);
  }
  if (!any_unknown) c.known.clear();
  return c;
}

// The flat indices of block b.
std::vector<uint64_t> BlockElements(const kernels::Fp8Layout& l, uint64_t b) {
  std::vector<uint64_t> out;
  const uint64_t r0 = (b / l.grid_cols()) * l.block_rows, c0 = (b % l.grid_cols()) * l.block_cols;
  for (uint64_t r = r0; r < std::min(r0 + l.block_rows, l.rows); ++r) {
    for (uint64_t c = c0; c < std::min(c0 + l.block_cols, l.cols); ++c)
      out.push_back(r * l.cols + c);
  }
  return out;
}

uint64_t AmaxAt(const std::vector<uint16_t>& x, const std::vector<uint64_t>& block) {
  uint64_t at = block[0];
  for (uint64_t i : block) {
    if ((x[i] & 0x7FFF) > (x[at] & 0x7FFF)) at = i;
  }
  return at;
}

// One random step of x (see the top).
std::vector<uint16_t> Step(const kernels::Fp8Layout& l, const std::vector<uint16_t>& x,
                           std::mt19937_64& rng) {
  std::vector<uint16_t> y = x;
  std::uniform_real_distribution<double> u(0, 1);
  for (uint16_t& v : y) {  // about 3% of elements move by a few ULPs
    if (u(rng) < 0.03) v ^= static_cast<uint16_t>(1 + rng() % 3);
  }
  const std::vector<uint64_t> block = BlockElements(l, rng() % l.num_blocks());
  const uint64_t top = AmaxAt(y, block);
  switch (rng() % 7) {
    case 0:  // the amax element up a little, or by 4x
      y[top] = static_cast<uint16_t>(y[top] + (rng() % 2 ? 1 : (2 << 7)));
      break;
    case 1:  // the amax element down to a small value
      y[top] = Bf16(0.001f);
      break;
    case 2:  // ties at the amax, of either sign
      for (int k = 0; k < 3; ++k) {
        y[block[rng() % block.size()]] =
            static_cast<uint16_t>((y[top] & 0x7FFF) | (rng() % 2) << 15);
      }
      break;
    case 3:  // the block zeroed (then filled again by later steps)
      for (uint64_t i : block) y[i] = static_cast<uint16_t>(rng() % 2 ? 0x8000 : 0);
      break;
    case 4:  // the block's top elements lowered below many others
      for (int k = 0; k < kFp8Top + 2; ++k) y[AmaxAt(y, block)] = Bf16(0.0001f);
      break;
    default:
      break;
  }
  return y;
}

void ExpectSameChanges(const Fp8Changes& want, const Fp8Changes& got, const std::string& at) {
  EXPECT_EQ(got.set.byte_index, want.set.byte_index) << at;
  EXPECT_EQ(got.set.byte_value, want.set.byte_value) << at;
  EXPECT_EQ(got.set.scale_index, want.set.scale_index) << at;
  ASSERT_EQ(got.set.scale_value.size(), want.set.scale_value.size()) << at;
  for (size_t k = 0; k < want.set.scale_value.size(); ++k) {
    EXPECT_EQ(kernels::FloatBits(got.set.scale_value[k]),
              kernels::FloatBits(want.set.scale_value[k]))
        << at;
  }
  EXPECT_EQ(got.set.blocks_touched, want.set.blocks_touched) << at;
  EXPECT_EQ(got.old_bytes, want.old_bytes) << at;
  ASSERT_EQ(got.old_scales.size(), want.old_scales.size()) << at;
  for (size_t k = 0; k < want.old_scales.size(); ++k) {
    EXPECT_EQ(kernels::FloatBits(got.old_scales[k]), kernels::FloatBits(want.old_scales[k])) << at;
  }
}

// Every block's list holds its elements' magnitudes, the rest are at most
// the bound, and the block's amax is known (a step reads the blocks whose
// summary loses it) and right.
void ExpectDescribes(const Fp8Summary& s, const std::vector<uint16_t>& x, const std::string& at) {
  const kernels::Fp8Layout& l = s.layout;
  for (uint64_t b = 0; b < l.num_blocks(); ++b) {
    const Fp8BlockTop& t = s.blocks[b];
    const std::vector<uint64_t> block = BlockElements(l, b);
    std::vector<uint8_t> listed(block.size(), 0);
    for (int j = 0; j < t.n; ++j) {
      const uint64_t r = t.at[j] / l.block_cols, c = t.at[j] % l.block_cols;
      const uint64_t i = block[0] + r * l.cols + c;
      ASSERT_EQ(x[i] & 0x7FFF, t.mag[j]) << at << " block " << b;
      ASSERT_TRUE(j == 0 || t.mag[j - 1] >= t.mag[j]) << at << " block " << b;
      listed[std::find(block.begin(), block.end(), i) - block.begin()] = 1;
    }
    for (size_t k = 0; k < block.size(); ++k) {
      ASSERT_TRUE(listed[k] || (x[block[k]] & 0x7FFF) <= t.bound) << at << " block " << b;
    }
    ASSERT_TRUE(t.Amax()) << at << " block " << b;
    ASSERT_EQ(*t.Amax(), x[AmaxAt(x, block)] & 0x7FFF) << at << " block " << b;
  }
}

// The stepped change set of parent -> child from `s` (rows it does not
// read hold NaN), its next summary into *s; returns the blocks it read.
size_t Stepped(Fp8Summary* s, const std::vector<uint16_t>& parent, const TensorChanges& c,
               Fp8Changes* got, Status* status) {
  Fp8StepPlan plan;
  PlanFp8Step(*s, c, &plan);
  std::vector<uint8_t> rows;
  MarkFp8Rows(s->layout, plan, &rows);
  const uint64_t cols = s->layout.cols;
  Fp8Versions v{std::vector<uint16_t>(parent.size(), kNanBits),
                std::vector<uint16_t>(parent.size(), kNanBits)};
  for (uint64_t r = 0; r < rows.size(); ++r) {
    if (rows[r]) std::copy_n(parent.begin() + r * cols, cols, v.parent.begin() + r * cols);
  }
  Fp8ChildRows(cols, rows, c, &v);
  Fp8Summary next;
  *status = FinishFp8Step(*s, plan, v, c, c.name, got, &next);
  if (status->ok()) *s = std::move(next);
  return std::count(plan.read.begin(), plan.read.end(), 1);
}

class Fp8SummaryWalk : public ::testing::TestWithParam<kernels::Fp8ScaleRule> {};

TEST_P(Fp8SummaryWalk, SteppedChangeSetsEqualTheWholeTensorsAfterEveryStep) {
  const kernels::Fp8Layout l{12, 20, 5, 7, GetParam()};  // partial edge blocks
  std::mt19937_64 rng(7);
  std::vector<uint16_t> x = RandomTensor(l, rng);
  Fp8Summary s = SummarizeFp8(l, x.data());
  size_t read = 0, touched = 0;
  for (int step = 0; step < 400; ++step) {
    const std::string at = "step " + std::to_string(step);
    const std::vector<uint16_t> y = Step(l, x, rng);
    TensorChanges c = ChangesOf(x, y, 0.01, step % 5 == 0 ? 0.05 : 0.0, rng);
    if (step % 37 == 0) c.old_exact = false;  // differences over a base: every block read
    Fp8Versions whole{x, y};
    Fp8Changes want, got;
    ASSERT_TRUE(ComputeFp8Changes(l, whole, c, c.name, &want).ok()) << at;
    Status st;
    read += Stepped(&s, x, c, &got, &st);
    ASSERT_TRUE(st.ok()) << at << ": " << st.message();
    touched += want.set.blocks_touched;
    ExpectSameChanges(want, got, at);
    ExpectDescribes(s, y, at);
    if (HasFatalFailure()) return;
    if (step % 50 == 49) s = SummarizeFp8(l, y.data());  // as after a fallback
    x = y;
  }
  EXPECT_LT(read, touched);  // some blocks were decided without the parent
}

INSTANTIATE_TEST_SUITE_P(Rules, Fp8SummaryWalk,
                         ::testing::Values(kernels::Fp8ScaleRule::kPlain,
                                           kernels::Fp8ScaleRule::kPowerOfTwo));

TEST(Fp8Summary, SmallStepsReadOnlyBlocksWhoseAmaxMoved) {
  // 2% of elements move by one ULP, as at RL learning rates.
  const kernels::Fp8Layout l{256, 384, 128, 128, kernels::Fp8ScaleRule::kPlain};
  std::mt19937_64 rng(3);
  std::vector<uint16_t> x = RandomTensor(l, rng);
  Fp8Summary s = SummarizeFp8(l, x.data());
  std::uniform_real_distribution<double> u(0, 1);
  for (int step = 0; step < 3; ++step) {
    std::vector<uint16_t> y = x;
    for (uint16_t& v : y) {
      if (u(rng) < 0.02) v = static_cast<uint16_t>(v + (rng() % 2 ? 1 : -1));
    }
    const TensorChanges c = ChangesOf(x, y, 0, 0, rng);
    Fp8Versions whole{x, y};
    Fp8Changes want, got;
    ASSERT_TRUE(ComputeFp8Changes(l, whole, c, c.name, &want).ok());
    Status st;
    const size_t read = Stepped(&s, x, c, &got, &st);
    ASSERT_TRUE(st.ok()) << st.message();
    ExpectSameChanges(want, got, "step " + std::to_string(step));
    // A block is read when its amax element moved (2% each), never all.
    EXPECT_LE(read, 1u) << "of " << l.num_blocks() << " blocks";
    x = y;
  }
}

TEST(Fp8Summary, NonFiniteValuesAreRefusedAsOverTheWholeTensors) {
  const kernels::Fp8Layout l{12, 20, 5, 7, kernels::Fp8ScaleRule::kPlain};
  std::mt19937_64 rng(5);
  std::vector<uint16_t> x = RandomTensor(l, rng);
  x[3] = 0x7F80;  // +inf in the parent's block 0, which the first step leaves alone
  Fp8Summary s = SummarizeFp8(l, x.data());
  for (uint64_t touch : {uint64_t{200}, uint64_t{2}}) {  // a new NaN in block 6, then block 0's inf
    std::vector<uint16_t> y = x;
    y[touch] = touch == 2 ? static_cast<uint16_t>(y[touch] ^ 1) : kNanBits;
    const TensorChanges c = ChangesOf(x, y, 0, 0, rng);
    Fp8Versions whole{x, y};
    Fp8Changes want, got;
    const Status full = ComputeFp8Changes(l, whole, c, "model.w", &want);
    ASSERT_FALSE(full.ok());
    Fp8StepPlan plan;
    PlanFp8Step(s, c, &plan);
    std::vector<uint8_t> rows;
    MarkFp8Rows(l, plan, &rows);
    Fp8Versions v{x, std::vector<uint16_t>(x.size(), kNanBits)};
    Fp8ChildRows(l.cols, rows, c, &v);
    Fp8Summary next;
    const Status st = FinishFp8Step(s, plan, v, c, "model.w", &got, &next);
    EXPECT_EQ(st.message(), full.message());
    EXPECT_NE(st.message().find("model.w"), std::string::npos) << st.message();
  }
}

TEST(Fp8Summary, ApplyKeepsTheLargestAndRaisesTheBound) {
  Fp8BlockTop t;
  for (uint32_t k = 0; k < 10; ++k) t.Apply(k, static_cast<uint16_t>(100 + k));
  EXPECT_EQ(t.n, kFp8Top);
  EXPECT_EQ(t.mag[0], 109);
  EXPECT_EQ(t.bound, 103);                          // 100..103 dropped
  for (uint32_t k = 9; k >= 4; --k) t.Apply(k, 1);  // every listed element falls
  EXPECT_EQ(t.n, 0);
  EXPECT_FALSE(t.Amax());  // only "at most 103" is known
  t.Apply(0, 200);
  ASSERT_TRUE(t.Amax());
  EXPECT_EQ(*t.Amax(), 200);
}

}  // namespace
}  // namespace dte::push_internal
