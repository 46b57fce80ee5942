// Micro-benchmark of the delta block codec on synthetic BF16 optimizer steps.
//
// For change densities of about 0.5%, 1.5% and 5% it prints encode and
// decode throughput (GB/s of block data per second of thread CPU time) and stored bytes per
// changed element, next to the AReaL-DTE wire format (int32 index + bf16
// value, zstd level 3 over the concatenation) measured in the same run, and
// the CPU time per changed element of EncodeSparseEntries alone ("entries
// ns": the publisher engine's encoder call, given the changes and old bits).
//
// Usage: codec_bench [rows [cols]]   (default 4096 x 2048 BF16 = 16 MiB)
#include <time.h>
#include <zstd.h>  // the baseline format is plain zstd

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/change_detect.h"
#include "store/delta_codec.h"

namespace {

constexpr size_t kBlock = 256 * 1024;
constexpr double kLrPerDensity = 5e-7 / 0.0156;  // measured: lr 5e-7 changes ~1.56%

uint16_t ToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

// FP32 master weights ~ N(0, 0.02); each step moves them along a persistent
// momentum direction scaled per row (lognormal, so some rows change much
// more), with weight decay; the stored weights are their BF16 rounding.
class Training {
 public:
  Training(size_t rows, size_t cols, double lr) : cols_(cols), lr_(float(lr)), rng_(7) {
    std::normal_distribution<float> weight(0, 0.02f), mom(0, 0.23f);
    std::lognormal_distribution<float> row(0, 0.7f);
    master_.resize(rows * cols);
    momentum_.resize(rows * cols);
    bf16_.resize(rows * cols);
    for (auto& w : master_) w = weight(rng_);
    for (auto& m : momentum_) m = mom(rng_);
    for (size_t r = 0; r < rows; ++r) row_scale_.push_back(row(rng_));
    for (size_t i = 0; i < bf16_.size(); ++i) bf16_[i] = ToBf16(master_[i]);
  }
  void Step() {
    std::normal_distribution<float> noise(0, 1);
    for (size_t i = 0; i < master_.size(); ++i) {
      momentum_[i] = 0.9f * momentum_[i] + 0.1f * noise(rng_);
      master_[i] -= lr_ * (row_scale_[i / cols_] * momentum_[i] / 0.35f + 0.01f * master_[i]);
      bf16_[i] = ToBf16(master_[i]);
    }
  }
  const std::vector<uint16_t>& bf16() const { return bf16_; }

 private:
  size_t cols_;
  float lr_;
  std::mt19937_64 rng_;
  std::vector<float> master_, momentum_, row_scale_;
  std::vector<uint16_t> bf16_;
};

// CPU time of this thread, so that other load on the machine does not count.
double ThreadSeconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

// Runs f() repeatedly for at least ~0.3 s of CPU; returns seconds per call.
template <typename F>
double TimePerCall(F&& f) {
  f();  // warm up scratch buffers and zstd contexts
  int calls = 0;
  double start = ThreadSeconds();
  do {
    f();
    ++calls;
  } while (ThreadSeconds() - start < 0.3);
  return (ThreadSeconds() - start) / calls;
}

struct Measured {
  size_t bytes = 0;
  double encode_s = 0, decode_s = 0;
  double entries_s = 0;  // EncodeSparseEntries alone, on the changes found beforehand
};

Measured MeasureCodec(const uint8_t* old, const uint8_t* now, size_t len, bool* ok) {
  dte::CodecScratch scratch;
  std::vector<dte::EncodedBlock> blocks;
  Measured m;
  m.encode_s = TimePerCall([&] {
    blocks.clear();
    for (size_t off = 0; off < len; off += kBlock) {
      blocks.push_back(dte::EncodeBlock(old + off, now + off, kBlock, 2, &scratch));
    }
  });
  std::vector<uint8_t> patched(old, old + len);
  for (size_t b = 0; b < blocks.size(); ++b) {
    m.bytes += blocks[b].payload.size();
    *ok &= dte::DecodeBlock(blocks[b].kind, blocks[b].payload, 2, patched.data() + b * kBlock,
                            kBlock, &scratch, "bench block")
               .ok();
  }
  *ok &= std::memcmp(patched.data(), now, len) == 0;
  // The publisher engine's call: changes already found, old bits all known.
  std::vector<std::vector<uint32_t>> idx(len / kBlock);
  std::vector<std::vector<uint8_t>> new_vals(len / kBlock), old_vals(len / kBlock);
  for (size_t b = 0; b < idx.size(); ++b) {
    idx[b].resize(kBlock / 2);
    new_vals[b].resize(kBlock);
    idx[b].resize(dte::kernels::DetectChanges(old + b * kBlock, now + b * kBlock, kBlock / 2, 2,
                                              idx[b].data(), new_vals[b].data()));
    old_vals[b].resize(kBlock);
    dte::kernels::Gather(old + b * kBlock, 2, idx[b].data(), idx[b].size(), old_vals[b].data());
  }
  const std::vector<uint8_t> known(kBlock / 2, 1);
  auto encode_entries = [&](size_t b) {
    return dte::EncodeSparseEntries(idx[b].data(), new_vals[b].data(), old_vals[b].data(),
                                    known.data(), static_cast<uint32_t>(idx[b].size()), 2,
                                    &scratch);
  };
  for (size_t b = 0; b < idx.size(); ++b) {
    if (blocks[b].kind == dte::BlockKind::kSparse) *ok &= encode_entries(b) == blocks[b].payload;
  }
  m.entries_s = TimePerCall([&] {
    for (size_t b = 0; b < idx.size(); ++b) {
      if (!idx[b].empty()) encode_entries(b);
    }
  });
  // Re-applying a delta costs the same whatever the bytes underneath.
  m.decode_s = TimePerCall([&] {
    for (size_t b = 0; b < blocks.size(); ++b) {
      dte::Status s = dte::DecodeBlock(blocks[b].kind, blocks[b].payload, 2,
                                       patched.data() + b * kBlock, kBlock, &scratch, "bench");
      s.IgnoreError();
    }
  });
  return m;
}

// AReaL-DTE: detect, int32 indices then bf16 values, zstd level 3; decode is
// decompress plus scatter.
Measured MeasureBaseline(const uint16_t* old, const uint16_t* now, size_t n, bool* ok) {
  std::vector<uint32_t> idx(n);
  std::vector<uint16_t> vals(n);
  std::string packed, frame;
  ZSTD_CCtx* cctx = ZSTD_createCCtx();
  ZSTD_DCtx* dctx = ZSTD_createDCtx();
  size_t count = 0;
  Measured m;
  m.encode_s = TimePerCall([&] {
    count = dte::kernels::DetectChanges(old, now, n, 2, idx.data(), vals.data());
    packed.assign(reinterpret_cast<const char*>(idx.data()), count * 4);
    packed.append(reinterpret_cast<const char*>(vals.data()), count * 2);
    frame.resize(ZSTD_compressBound(packed.size()));
    frame.resize(
        ZSTD_compressCCtx(cctx, frame.data(), frame.size(), packed.data(), packed.size(), 3));
  });
  m.bytes = frame.size();
  std::vector<uint16_t> patched(old, old + n);
  m.decode_s = TimePerCall([&] {
    size_t got =
        ZSTD_decompressDCtx(dctx, packed.data(), packed.size(), frame.data(), frame.size());
    *ok &= got == count * 6;
    auto* index = reinterpret_cast<const uint32_t*>(packed.data());
    dte::kernels::Scatter(patched.data(), 2, index, packed.data() + count * 4, count);
  });
  *ok &= std::memcmp(patched.data(), now, n * 2) == 0;
  ZSTD_freeCCtx(cctx);
  ZSTD_freeDCtx(dctx);
  return m;
}

bool RunDensity(size_t rows, size_t cols, double target) {
  Training t(rows, cols, kLrPerDensity * target);
  t.Step();  // leave the initial state
  std::vector<uint16_t> old = t.bf16();
  t.Step();
  const std::vector<uint16_t>& now = t.bf16();
  size_t n = now.size(), len = n * 2;
  size_t changed = dte::kernels::CountChanges(old.data(), now.data(), n, 2);
  bool ok = true;
  Measured ours = MeasureCodec(reinterpret_cast<const uint8_t*>(old.data()),
                               reinterpret_cast<const uint8_t*>(now.data()), len, &ok);
  Measured base = MeasureBaseline(old.data(), now.data(), n, &ok);
  double gb = len / 1e9, per = double(ours.bytes) / changed,
         base_per = double(base.bytes) / changed;
  std::printf("%5.2f%% %8.3f %8.3f %6.2fx %9.2f %9.2f %10.2f %8.2f %9.2f %9.2f %s\n",
              100.0 * changed / n, per, base_per, base_per / per, gb / ours.encode_s,
              gb / base.encode_s, 1e9 * ours.entries_s / changed,
              1e6 * ours.decode_s / (len / kBlock), gb / ours.decode_s, gb / base.decode_s,
              ok ? "ok" : "MISMATCH");
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  size_t rows = argc > 1 ? std::strtoul(argv[1], nullptr, 10) : 4096;
  size_t cols = argc > 2 ? std::strtoul(argv[2], nullptr, 10) : 2048;
  if (rows == 0 || cols == 0 || rows * cols * 2 % kBlock != 0) {
    std::fprintf(stderr, "codec_bench: rows * cols * 2 must be a positive multiple of %zu\n",
                 kBlock);
    return 2;
  }
  std::printf(
      "BF16 %zu x %zu (%zu blocks of 256 KiB), one thread; GB/s of block data per CPU second\n",
      rows, cols, rows * cols * 2 / kBlock);
  std::printf("%6s %8s %8s %7s %9s %9s %10s %8s %9s %9s\n", "dens", "B/chg", "areal", "ratio",
              "enc GB/s", "areal enc", "entries ns", "dec us/b", "dec GB/s", "areal dec");
  bool ok = true;
  for (double density : {0.005, 0.015, 0.05}) ok &= RunDensity(rows, cols, density);
  return ok ? 0 : 1;
}
