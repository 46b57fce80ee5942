// Benchmark of the AdamW-inverting publisher's CPU engine.
//
//   engine_bench kernel ELEMENTS [DUMP_DIR]
//     Synthesizes one real AdamW step on ELEMENTS FP32 weights (theta_{t-1}
//     ~ N(0, 0.02), moments, lr chosen so ~2% of BF16 weights change), then
//     measures in the same run: this machine's memory-read bandwidth (sums
//     over theta, m and v on the engine's thread pool, the best of a scalar
//     and, where the CPU has it, an AVX2 read loop), the fused detector
//     kernels::AdamWInvertDetect (inverse + cast + compare + compaction), the
//     engine's rigorous screen alone, and the whole per-tensor engine (BF16
//     cast, block and tensor hashes, candidates, exact old bits, delta
//     encoding into a spool file) with the screen and with the fused
//     detector, all in bytes of optimizer state (theta, m, v: 12 B/element)
//     read per second of wall time. With DUMP_DIR it writes theta.f32, m.f32,
//     v.f32 and params.json there, so tools/bench/engine_bench.py can time a
//     PyTorch implementation of the same steps on the same data. With the
//     environment variable DTE_BENCH_ENGINE_ONLY set it skips the fused
//     detector and runs only the default engine, 20 times: for profiling
//     (`perf record`).
//
//   engine_bench import STORE ELEMENTS TENSORS
//   engine_bench publish STORE ELEMENTS TENSORS
//     End to end: `import` stores BF16(theta_{t-1}) of a model of TENSORS
//     equal tensors as version 0 of the local store STORE (created); then
//     `publish`, in a fresh process holding only the trainer's state, times
//     Publisher::PublishAdamW of one step and reports its peak memory on top
//     of that state: the resident set right before the publish, and its
//     high-water mark during it (VmHWM, reset right before).
//
// Output: one JSON object on stdout.
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "kernels/adamw.h"
#include "kernels/bf16.h"
#include "kernels/parallel.h"
#include "store/store.h"
#include "store/write/blob_sink.h"
#include "sync/publish/internal/engine_encoder.h"
#include "sync/publish/internal/engine_screen.h"
#include "sync/publish/publisher.h"
#include "tools/bench/adamw_synth.h"

namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point a) {
  return std::chrono::duration<double>(Clock::now() - a).count();
}

using dte::bench::Synthesize;
dte::kernels::AdamWParams Params() { return dte::bench::SynthParams(); }

// The sum of q[b, e) with 64-bit scalar loads (what the compiler makes of
// them for baseline x86-64).
uint64_t SumWords(const uint64_t* q, size_t b, size_t e) {
  uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  size_t i = b;
  for (; i + 3 < e; i += 4) {
    s0 += q[i];
    s1 += q[i + 1];
    s2 += q[i + 2];
    s3 += q[i + 3];
  }
  return s0 + s1 + s2 + s3;
}

#if defined(__x86_64__)
// The same with 256-bit loads, four independent sums: on this machine's
// 2-core EPYC it reads ~15% faster than SumWords.
__attribute__((target("avx2"))) uint64_t SumWordsAvx2(const uint64_t* q, size_t b, size_t e) {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  size_t i = b;
  for (; i + 16 <= e; i += 16) {
    a0 = _mm256_add_epi64(a0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + i)));
    a1 = _mm256_add_epi64(a1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + i + 4)));
    a2 = _mm256_add_epi64(a2, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + i + 8)));
    a3 = _mm256_add_epi64(a3, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + i + 12)));
  }
  a0 = _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3));
  uint64_t lanes[4];
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(lanes), a0);
  return lanes[0] + lanes[1] + lanes[2] + lanes[3] + SumWords(q, i, e);
}
#endif

// This machine's memory-read bandwidth over the n floats at a, in bytes/s:
// the best of `reps` sums on the kernels thread pool (the engine's threads),
// with each read kernel the CPU supports.
double ReadBandwidth(const float* a, size_t n, int reps) {
  using Sum = uint64_t (*)(const uint64_t*, size_t, size_t);
  std::vector<Sum> kernels{SumWords};
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx2")) kernels.push_back(SumWordsAvx2);
#endif
  double best = 0;
  for (Sum sum : kernels) {
    for (int r = 0; r < reps; ++r) {
      std::atomic<uint64_t> sink{0};
      auto t0 = Clock::now();
      dte::kernels::ParallelFor(n / 4, 1 << 18, [&](size_t b, size_t e) {
        sink.fetch_add(sum(reinterpret_cast<const uint64_t*>(a), 2 * b, 2 * e),
                       std::memory_order_relaxed);
      });
      const double s = Seconds(t0);
      best = std::max(best, static_cast<double>(n / 4) * 16 / s);
      if (sink.load() == 42) std::fputs("", stderr);  // keep the loads
    }
  }
  return best;
}

int Kernel(size_t n, const char* dump) {
  std::vector<float> theta(n), m(n), v(n);
  Synthesize(1, 0, n, theta.data(), m.data(), v.data(), nullptr);
  const double state = 12.0 * static_cast<double>(n);
  // Bandwidth over the same 12n bytes: theta, m and v one after another.
  double bw = 0;
  for (const auto* a : {&theta, &m, &v}) bw += 1.0 / ReadBandwidth(a->data(), n, 5);
  bw = 3.0 / bw;
  std::vector<uint64_t> idx(n);
  std::vector<uint16_t> bits(n);
  dte::kernels::AdamWDetectOptions o;
  o.report_near_boundary = true;
  o.margin_ulps = 16;
  double best_detect = 1e30;
  size_t flagged = 0;
  for (int r = 0; r < (std::getenv("DTE_BENCH_ENGINE_ONLY") ? 0 : 5); ++r) {
    auto t0 = Clock::now();
    flagged = dte::kernels::AdamWInvertDetect(theta.data(), m.data(), v.data(), n, Params(), o,
                                              idx.data(), bits.data())
                  .count;
    best_detect = std::min(best_detect, Seconds(t0));
  }
  double best_screen = 1e30;
  dte::internal::ScreenCounts screened;
  const auto sc = dte::internal::MakeScreenScalars(dte::kernels::MakeAdamWScalars(Params()));
  std::vector<uint32_t> old(n + dte::internal::kScreenSlack);
  idx.resize(n + dte::internal::kScreenSlack);
  for (int r = 0; r < 5; ++r) {
    auto t0 = Clock::now();
    screened = dte::internal::ScreenCandidates(theta.data(), m.data(), v.data(), n, sc, idx.data(),
                                               old.data());
    best_screen = std::min(best_screen, Seconds(t0));
  }
  size_t undecided = 0;
  for (size_t k = 0; k < screened.kept; ++k) undecided += old[k] == dte::internal::kScreenUndecided;
  idx = {};
  bits = {};
  old = {};
  // The whole engine on one tensor, payloads spooled to a temp store.
  std::string dir = std::filesystem::temp_directory_path() / "engine_bench_store";
  std::filesystem::remove_all(dir);
  dte::StoreOptions so;
  so.uri = dir;
  so.create = true;
  auto store = dte::Store::Open(so);
  if (!store.ok()) return std::fprintf(stderr, "%s\n", store.status().message().c_str()), 1;
  double best_engine[2] = {1e30, 1e30};
  uint64_t changed[2] = {0, 0}, resolved[2] = {0, 0}, payload = 0;
  // DTE_BENCH_ENGINE_ONLY=1: only the default engine, 20 times (for perf).
  const bool engine_only = std::getenv("DTE_BENCH_ENGINE_ONLY") != nullptr;
  for (int r = engine_only ? 1 : 0; r < (engine_only ? 40 : 6); r += engine_only ? 2 : 1) {
    const int screen = r % 2;
    dte::internal::BlobSink sink(&(*store)->objects());
    auto spool = sink.NewSpool();
    dte::TensorEntry t;
    t.name = "w";
    t.dtype = dte::DType::kBF16;
    t.shape = {static_cast<int64_t>(n)};
    t.end = 2 * n;
    t.blocks =
        static_cast<uint32_t>((2 * n + dte::kDefaultBlockBytes - 1) / dte::kDefaultBlockBytes);
    std::vector<dte::BlockRecord> records(t.blocks);
    dte::internal::EngineEncoder enc(dte::kDefaultBlockBytes, 16, screen == 1);
    enc.SetParams(Params());
    dte::internal::EngineCounts c;
    auto t0 = Clock::now();
    dte::Status s =
        enc.EncodeTensor(theta.data(), m.data(), v.data(), &t, records.data(), spool->get(), 0, &c);
    best_engine[screen] = std::min(best_engine[screen], Seconds(t0));
    if (!s.ok()) return std::fprintf(stderr, "%s\n", s.message().c_str()), 1;
    changed[screen] = c.changed;
    resolved[screen] = c.resolved;
    payload = (*spool)->size();
  }
  std::filesystem::remove_all(dir);
  if (dump != nullptr) {
    std::filesystem::create_directories(dump);
    for (auto [name, a] : {std::pair{"theta.f32", &theta}, {"m.f32", &m}, {"v.f32", &v}}) {
      std::ofstream(std::string(dump) + "/" + name, std::ios::binary)
          .write(reinterpret_cast<const char*>(a->data()), static_cast<std::streamsize>(4 * n));
    }
    const auto p = Params();
    std::ofstream(std::string(dump) + "/params.json")
        << "{\"lr\": " << p.lr << ", \"beta1\": " << p.beta1 << ", \"beta2\": " << p.beta2
        << ", \"eps\": " << p.eps << ", \"weight_decay\": " << p.weight_decay
        << ", \"step\": " << p.step << ", \"elements\": " << n << "}\n";
  }
  std::printf(
      "{\"elements\": %zu, \"threads\": %zu, \"state_bytes\": %.0f, "
      "\"read_bandwidth_gbs\": %.3f, \"detect_gbs\": %.3f, \"screen_gbs\": %.3f, "
      "\"engine_gbs\": %.3f, \"engine_fused_detector_gbs\": %.3f, \"flagged\": %zu, "
      "\"candidates\": %zu, \"screen_kept\": %zu, \"screen_undecided\": %zu, "
      "\"exact_resolutions\": %llu, \"exact_resolutions_fused_detector\": %llu, "
      "\"changed\": %llu, \"changed_fused_detector\": %llu, \"payload_bytes\": %llu}\n",
      n, dte::kernels::NumThreads(), state, bw / 1e9, state / best_detect / 1e9,
      state / best_screen / 1e9, state / best_engine[1] / 1e9, state / best_engine[0] / 1e9,
      flagged, screened.flagged, screened.kept, undecided,
      static_cast<unsigned long long>(resolved[1]), static_cast<unsigned long long>(resolved[0]),
      static_cast<unsigned long long>(changed[1]), static_cast<unsigned long long>(changed[0]),
      static_cast<unsigned long long>(payload));
  return 0;
}

// A field of /proc/self/status in KiB ("VmRSS", "VmHWM"), or -1.
long StatusKiB(const std::string& field) {
  std::ifstream f("/proc/self/status");
  for (std::string line; std::getline(f, line);) {
    if (line.rfind(field + ":", 0) == 0)
      return std::strtol(line.c_str() + field.size() + 1, nullptr, 10);
  }
  return -1;
}

// Resets the peak resident set size (VmHWM) to the current one (Linux >= 4.0).
void ResetPeakRss() { std::ofstream("/proc/self/clear_refs") << "5"; }

std::string TensorName(size_t k) { return "layer." + std::to_string(k) + ".weight"; }

// Writes BF16(theta_{t-1}) of the model as a checkpoint and imports it.
int Import(const std::string& store_dir, size_t n, size_t tensors) {
  const size_t per = n / tensors;
  const std::string ckpt = store_dir + ".ckpt";
  std::filesystem::create_directories(ckpt);
  {
    std::string header = "{";
    for (size_t k = 0; k < tensors; ++k) {
      header += (k ? ",\"" : "\"") + TensorName(k) + "\":{\"dtype\":\"BF16\",\"shape\":[" +
                std::to_string(per) + "],\"data_offsets\":[" + std::to_string(2 * per * k) + "," +
                std::to_string(2 * per * (k + 1)) + "]}";
    }
    header += "}";
    while ((header.size() + 8) % 8) header += ' ';
    std::ofstream f(ckpt + "/model.safetensors", std::ios::binary);
    const uint64_t len = header.size();
    f.write(reinterpret_cast<const char*>(&len), 8);
    f << header;
    std::vector<float> theta(per), m(per), v(per);
    std::vector<uint16_t> prev(per);
    for (size_t k = 0; k < tensors; ++k) {
      Synthesize(7 + k, 0, per, theta.data(), m.data(), v.data(), prev.data());
      f.write(reinterpret_cast<const char*>(prev.data()), static_cast<std::streamsize>(2 * per));
    }
  }
  std::ofstream(ckpt + "/config.json") << "{\"model_type\": \"bench\"}\n";
  dte::PublisherOptions o;
  o.store = store_dir;
  auto pub = dte::Publisher::Open(o);
  if (!pub.ok()) return std::fprintf(stderr, "%s\n", pub.status().message().c_str()), 1;
  auto t0 = Clock::now();
  auto imported = (*pub)->ImportCheckpoint(ckpt);
  if (!imported.ok()) return std::fprintf(stderr, "%s\n", imported.status().message().c_str()), 1;
  std::printf("{\"elements\": %zu, \"tensors\": %zu, \"import_s\": %.3f}\n", per * tensors, tensors,
              Seconds(t0));
  std::filesystem::remove_all(ckpt);
  return 0;
}

// Publishes one step of the model Import stored, from freshly synthesized
// state (the same data), in a process that holds nothing else.
int Publish(const std::string& store_dir, size_t n, size_t tensors) {
  const size_t per = n / tensors;
  std::vector<std::vector<float>> theta(tensors), m(tensors), v(tensors);
  std::vector<dte::AdamWParamState> states(tensors);
  const std::vector<int64_t> shape{static_cast<int64_t>(per)};
  for (size_t k = 0; k < tensors; ++k) {
    theta[k].resize(per);
    m[k].resize(per);
    v[k].resize(per);
    Synthesize(7 + k, 0, per, theta[k].data(), m[k].data(), v[k].data(), nullptr);
    states[k].name = TensorName(k);
    states[k].param = {theta[k].data(), dte::DType::kF32, shape};
    states[k].exp_avg = {m[k].data(), dte::DType::kF32, shape};
    states[k].exp_avg_sq = {v[k].data(), dte::DType::kF32, shape};
  }
  dte::PublisherOptions o;
  o.store = store_dir;
  auto pub = dte::Publisher::Open(o);
  if (!pub.ok()) return std::fprintf(stderr, "%s\n", pub.status().message().c_str()), 1;
  const auto p = Params();
  dte::AdamWStep h;
  h.lr = p.lr;
  h.beta1 = p.beta1;
  h.beta2 = p.beta2;
  h.eps = p.eps;
  h.weight_decay = p.weight_decay;
  h.step = p.step;
  ResetPeakRss();
  const long rss_before = StatusKiB("VmRSS");
  auto t0 = Clock::now();
  auto r = (*pub)->PublishAdamW(h, states);
  const double s = Seconds(t0);
  const long rss_after = StatusKiB("VmHWM");
  if (!r.ok()) return std::fprintf(stderr, "%s\n", r.status().message().c_str()), 1;
  std::printf(
      "{\"elements\": %zu, \"tensors\": %zu, \"bf16_model_bytes\": %zu, \"state_bytes\": %llu, "
      "\"publish_s\": %.3f, \"publish_state_gbs\": %.3f, \"changed\": %llu, "
      "\"uncertain\": %llu, \"stored_bytes\": %llu, \"rss_before_publish_kib\": %ld, "
      "\"peak_rss_during_publish_kib\": %ld, \"publish_extra_peak_kib\": %ld}\n",
      per * tensors, tensors, 2 * per * tensors, static_cast<unsigned long long>(r->state_bytes), s,
      static_cast<double>(r->state_bytes) / s / 1e9, static_cast<unsigned long long>(r->changed),
      static_cast<unsigned long long>(r->uncertain),
      static_cast<unsigned long long>(r->stored_bytes), rss_before, rss_after,
      rss_after - rss_before);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "kernel" && (argc == 3 || argc == 4)) {
    return Kernel(std::strtoull(argv[2], nullptr, 10), argc == 4 ? argv[3] : nullptr);
  }
  if ((mode == "import" || mode == "publish") && argc == 5) {
    auto run = mode == "import" ? Import : Publish;
    return run(argv[2], std::strtoull(argv[3], nullptr, 10), std::strtoull(argv[4], nullptr, 10));
  }
  std::fprintf(stderr,
               "usage: engine_bench kernel ELEMENTS [DUMP_DIR]\n"
               "       engine_bench import STORE ELEMENTS TENSORS\n"
               "       engine_bench publish STORE ELEMENTS TENSORS\n");
  return 2;
}
