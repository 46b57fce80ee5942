#include "kernels/change_detect.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "kernels/internal/change_scan.h"
#include "kernels/parallel.h"

namespace dte::kernels {
namespace {

// Raw element buffers of a given width, compared byte-wise.
struct Pair {
  int width;
  size_t n;
  std::vector<uint8_t> old_bytes, new_bytes;
};

// Random old data; each element changed (some bits flipped) with
// probability `density`.
Pair RandomPair(int width, size_t n, double density, uint32_t seed) {
  std::mt19937_64 rng(seed);
  Pair p{width, n, std::vector<uint8_t>(n * width), {}};
  for (auto& b : p.old_bytes) b = static_cast<uint8_t>(rng());
  p.new_bytes = p.old_bytes;
  std::bernoulli_distribution change(density);
  for (size_t i = 0; i < n; ++i) {
    if (!change(rng)) continue;
    // Flip one random bit so changes sit in every byte position of the lane.
    const uint64_t bit = rng() % (8 * width);
    p.new_bytes[i * width + bit / 8] ^= static_cast<uint8_t>(1u << (bit % 8));
  }
  return p;
}

// The obvious byte-wise reference.
std::vector<uint64_t> ReferenceIndices(const Pair& p) {
  std::vector<uint64_t> idx;
  for (size_t i = 0; i < p.n; ++i) {
    if (std::memcmp(&p.old_bytes[i * p.width], &p.new_bytes[i * p.width], p.width) != 0) {
      idx.push_back(i);
    }
  }
  return idx;
}

// Checks serial, parallel and count forms against the reference, values too.
void ExpectAllFormsMatchReference(const Pair& p, const uint8_t* old_data, const uint8_t* new_data) {
  const std::vector<uint64_t> want = ReferenceIndices(p);
  SCOPED_TRACE("width=" + std::to_string(p.width) + " n=" + std::to_string(p.n));
  EXPECT_EQ(CountChanges(old_data, new_data, p.n, p.width), want.size());
  EXPECT_EQ(CountChangesParallel(old_data, new_data, p.n, p.width), want.size());

  std::vector<uint32_t> idx32(p.n);
  std::vector<uint8_t> vals32(p.n * p.width);
  const size_t k32 = DetectChanges(old_data, new_data, p.n, p.width, idx32.data(), vals32.data());
  std::vector<uint64_t> idx64(p.n);
  std::vector<uint8_t> vals64(p.n * p.width);
  const size_t k64 =
      DetectChangesParallel(old_data, new_data, p.n, p.width, idx64.data(), vals64.data());
  ASSERT_EQ(k32, want.size());
  ASSERT_EQ(k64, want.size());
  for (size_t k = 0; k < want.size(); ++k) {
    ASSERT_EQ(idx32[k], want[k]) << "k=" << k;
    ASSERT_EQ(idx64[k], want[k]) << "k=" << k;
    ASSERT_EQ(std::memcmp(&vals32[k * p.width], new_data + want[k] * p.width, p.width), 0);
    ASSERT_EQ(std::memcmp(&vals64[k * p.width], new_data + want[k] * p.width, p.width), 0);
  }
}

TEST(ChangeDetect, AllFormsMatchReferenceOnRandomDataForEveryWidthSizeAndDensity) {
  for (int width : {1, 2, 4, 8}) {
    for (size_t n : {0, 1, 63, 64, 65, 1000, 65536 + 3, 300001}) {
      for (double density : {0.0, 0.015, 0.5, 1.0}) {
        const Pair p = RandomPair(width, n, density, static_cast<uint32_t>(n * 31 + width));
        ExpectAllFormsMatchReference(p, p.old_bytes.data(), p.new_bytes.data());
      }
    }
  }
}

TEST(ChangeDetect, ParallelMatchesReferenceOnHundredsOfChunks) {
  // 256 full compaction chunks of 2^16 elements plus a ragged tail.
  const Pair p = RandomPair(1, (size_t{1} << 24) + 777, 0.015, 7);
  ExpectAllFormsMatchReference(p, p.old_bytes.data(), p.new_bytes.data());
}

TEST(ChangeDetect, ResultsDoNotDependOnThreadCount) {
  const Pair p = RandomPair(2, 1 << 20, 0.015, 11);
  std::vector<uint64_t> first;
  for (size_t threads : {1, 2, 5}) {
    SetNumThreads(threads);
    std::vector<uint64_t> idx(p.n);
    std::vector<uint16_t> vals(p.n);
    idx.resize(DetectChangesParallel(p.old_bytes.data(), p.new_bytes.data(), p.n, 2, idx.data(),
                                     vals.data()));
    if (first.empty()) first = idx;
    EXPECT_EQ(idx, first) << "threads=" << threads;
  }
  SetNumThreads(0);
  EXPECT_EQ(first, ReferenceIndices(p));
}

TEST(ChangeDetect, WorksOnMisalignedBuffers) {
  for (int width : {2, 4, 8}) {
    const Pair p = RandomPair(width, 5000, 0.1, 3);
    // Copy into buffers offset by one byte from any natural alignment.
    std::vector<uint8_t> a(p.old_bytes.size() + 1), b(p.new_bytes.size() + 1);
    std::memcpy(a.data() + 1, p.old_bytes.data(), p.old_bytes.size());
    std::memcpy(b.data() + 1, p.new_bytes.data(), p.new_bytes.size());
    ExpectAllFormsMatchReference(p, a.data() + 1, b.data() + 1);
  }
}

// The portable mask is what non-x86 builds run; check it against the one this
// build uses so both stay correct.
TEST(ChangeDetect, PortableBlockMaskMatchesPlatformMask) {
  std::mt19937_64 rng(17);
  for (int width : {1, 2, 4, 8}) {
    for (int trial = 0; trial < 2000; ++trial) {
      std::vector<uint8_t> a(64 * width), b;
      for (auto& x : a) x = static_cast<uint8_t>(rng());
      b = a;
      const int flips = static_cast<int>(rng() % 8);
      for (int f = 0; f < flips; ++f) b[rng() % b.size()] ^= static_cast<uint8_t>(1 + rng() % 255);
      uint64_t want = 0;
      for (int j = 0; j < 64; ++j) {
        want |= uint64_t{std::memcmp(&a[j * width], &b[j * width], width) != 0} << j;
      }
      const uint64_t portable = DispatchWidth(
          width, [&](auto w) { return internal::DiffMask64Portable<w.value>(a.data(), b.data()); });
      const uint64_t platform = DispatchWidth(
          width, [&](auto w) { return internal::DiffMask64<w.value>(a.data(), b.data()); });
      ASSERT_EQ(portable, want) << "width=" << width;
      ASSERT_EQ(platform, want) << "width=" << width;
    }
  }
}

TEST(ChangeDetect, ComparesBitsSoSignedZerosAndNanPayloadsCount) {
  // BF16: +0 vs -0, two NaN payloads, NaN sign, identical NaNs, inf vs NaN.
  const std::vector<uint16_t> a = {0x0000, 0x7FC0, 0x7FC0, 0x7FC1, 0x7F80, 0x3F80};
  const std::vector<uint16_t> b = {0x8000, 0x7FC1, 0xFFC0, 0x7FC1, 0x7FC0, 0x3F80};
  std::vector<uint32_t> idx(a.size());
  std::vector<uint16_t> vals(a.size());
  ASSERT_EQ(DetectChanges(a.data(), b.data(), a.size(), 2, idx.data(), vals.data()), 4u);
  EXPECT_EQ(idx, (std::vector<uint32_t>{0, 1, 2, 4, 0, 0}));
  EXPECT_EQ(vals[0], 0x8000);
  EXPECT_EQ(vals[1], 0x7FC1);
  EXPECT_EQ(vals[2], 0xFFC0);
  EXPECT_EQ(vals[3], 0x7FC0);

  // F32 and F64 signed zeros and NaN payloads, as raw bit patterns.
  const std::vector<uint32_t> f32a = {0x00000000u, 0x7FC00000u, 0x7FC00001u};
  const std::vector<uint32_t> f32b = {0x80000000u, 0x7FC00001u, 0x7FC00001u};
  EXPECT_EQ(CountChanges(f32a.data(), f32b.data(), 3, 4), 2u);
  const std::vector<uint64_t> f64a = {0x0ull, 0x7FF8000000000000ull, 0x7FF8000000000001ull};
  const std::vector<uint64_t> f64b = {0x8000000000000000ull, 0x7FF8000000000001ull,
                                      0x7FF8000000000001ull};
  EXPECT_EQ(CountChanges(f64a.data(), f64b.data(), 3, 8), 2u);
  EXPECT_EQ(CountChangesParallel(f64a.data(), f64b.data(), 3, 8), 2u);
}

TEST(ChangeDetect, ScatterOfDetectedChangesRebuildsNewData) {
  for (int width : {1, 2, 4, 8}) {
    const Pair p = RandomPair(width, 70000, 0.02, 5);
    std::vector<uint32_t> idx(p.n);
    std::vector<uint8_t> vals(p.n * width);
    const size_t k =
        DetectChanges(p.old_bytes.data(), p.new_bytes.data(), p.n, width, idx.data(), vals.data());
    std::vector<uint8_t> rebuilt = p.old_bytes;
    Scatter(rebuilt.data(), width, idx.data(), vals.data(), k);
    EXPECT_EQ(rebuilt, p.new_bytes) << "width=" << width;

    std::vector<uint8_t> gathered(k * width);
    Gather(p.new_bytes.data(), width, idx.data(), k, gathered.data());
    EXPECT_EQ(std::memcmp(gathered.data(), vals.data(), k * width), 0) << "width=" << width;
  }
}

TEST(ChangeDetect, ParallelScatterOfDetectedChangesRebuildsNewData) {
  for (int width : {1, 2, 4, 8}) {
    const Pair p = RandomPair(width, 300000, 0.3, 9);
    std::vector<uint64_t> idx(p.n);
    std::vector<uint8_t> vals(p.n * width);
    const size_t k = DetectChangesParallel(p.old_bytes.data(), p.new_bytes.data(), p.n, width,
                                           idx.data(), vals.data());
    ASSERT_GT(k, 0u);
    std::vector<uint8_t> rebuilt = p.old_bytes;
    ScatterParallel(rebuilt.data(), width, idx.data(), vals.data(), k);
    EXPECT_EQ(rebuilt, p.new_bytes) << "width=" << width;
  }
}

}  // namespace
}  // namespace dte::kernels
