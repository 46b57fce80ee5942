// Benchmark of the CUDA backend against the device's own copy bandwidth and
// against the CPU backend, on the same synthetic AdamW step.
//
//   cuda_bench [ELEMENTS]   (default 2^28: 3 GiB of theta, m and v)
//
// Synthesizes one AdamW step on ELEMENTS FP32 weights (tools/bench/
// adamw_synth.h: ~2% of BF16 weights change), uploads theta, m, v and the
// previous BF16 weights, and times, best of 5 after a warm-up, each with
// wall-clock time around a stream synchronize:
//   - copy: a device-to-device copy of theta, m and v (the baseline; its
//     bandwidth counts bytes read plus bytes written);
//   - invert_detect: CudaAdamWInvertDetect (inverse + BF16 cast + compare +
//     compaction), in bytes of optimizer state (12 B/element) per second;
//   - find_changes: CudaAdamWFindChanges (invert_detect plus the exact
//     resolution of each reported element: what a distributed publisher
//     runs on state in GPU memory), in bytes of optimizer state per second;
//   - invert: CudaAdamWInvert (writes the FP32 previous weights);
//   - cast: CudaCastFp32ToBf16 of theta;
//   - detect_bf16: CudaDetectChanges of the previous against the new BF16
//     weights (width 2).
// and the CPU backend's AdamWInvertDetect on the same host data with the
// engine's thread pool. It checks that both backends select the same indices
// and BF16 values (for invert_detect and find_changes), and prints one JSON object with every rate,
// the ratios invert_detect/copy and gpu/cpu, and the selected count. Exit 77 without a device.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "kernels/adamw.h"
#include "kernels/bf16.h"
#include "kernels/change_detect.h"
#include "kernels/cuda.h"
#include "kernels/parallel.h"
#include "tools/bench/adamw_synth.h"

namespace {

using Clock = std::chrono::steady_clock;
namespace k = dte::kernels;

[[noreturn]] void Fail(const std::string& what, const k::CudaStatus& st) {
  std::fprintf(stderr, "cuda_bench: %s: %s\n", what.c_str(), st.message.c_str());
  std::exit(1);
}

void Check(const std::string& what, const k::CudaStatus& st) {
  if (!st.ok()) Fail(what, st);
}

// Best wall time of `reps` runs of fn (after one warm-up), each ending with a
// synchronize of the default stream.
double Best(const char* what, int reps, const std::function<k::CudaStatus()>& fn) {
  double best = 1e30;
  for (int r = 0; r <= reps; ++r) {
    const auto t0 = Clock::now();
    Check(what, fn());
    Check(what, k::CudaStreamSynchronize(nullptr));
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    if (r > 0) best = std::min(best, s);
  }
  return best;
}

k::CudaBuffer Alloc(size_t bytes) {
  k::CudaBuffer b;
  Check("cudaMalloc of " + std::to_string(bytes) + " bytes", b.Allocate(bytes));
  return b;
}

}  // namespace

int main(int argc, char** argv) {
  const size_t n = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : (size_t{1} << 28);
  if (!k::CudaDeviceAvailable()) {
    std::fprintf(stderr, "cuda_bench: no CUDA device (or dte was built without CUDA)\n");
    return 77;
  }
  std::vector<float> theta(n), m(n), v(n);
  std::vector<uint16_t> prev(n);
  dte::bench::Synthesize(1, 0, n, theta.data(), m.data(), v.data(), prev.data());
  const auto p = dte::bench::SynthParams();
  k::AdamWDetectOptions o;
  o.report_near_boundary = true;
  o.margin_ulps = 16;

  // CPU backend on the same data.
  std::vector<uint64_t> cpu_idx(n);
  std::vector<uint16_t> cpu_bits(n);
  size_t cpu_count = 0;
  double cpu_best = 1e30;
  for (int r = 0; r < 3; ++r) {
    const auto t0 = Clock::now();
    cpu_count = k::AdamWInvertDetect(theta.data(), m.data(), v.data(), n, p, o, cpu_idx.data(),
                                     cpu_bits.data())
                    .count;
    cpu_best = std::min(cpu_best, std::chrono::duration<double>(Clock::now() - t0).count());
  }

  const size_t f32 = 4 * n;
  k::CudaBuffer d_state = Alloc(3 * f32), d_copy = Alloc(3 * f32), d_prev = Alloc(2 * n),
                d_bf16 = Alloc(2 * n), d_idx = Alloc(8 * n), d_vals = Alloc(2 * n),
                d_f32 = Alloc(f32), d_count = Alloc(8);
  auto* state = static_cast<char*>(d_state.data());
  auto* d_theta = reinterpret_cast<const float*>(state);
  auto* d_m = reinterpret_cast<const float*>(state + f32);
  auto* d_v = reinterpret_cast<const float*>(state + 2 * f32);
  Check("upload theta", k::CudaCopyToDevice(state, theta.data(), f32));
  Check("upload m", k::CudaCopyToDevice(state + f32, m.data(), f32));
  Check("upload v", k::CudaCopyToDevice(state + 2 * f32, v.data(), f32));
  Check("upload previous BF16", k::CudaCopyToDevice(d_prev.data(), prev.data(), 2 * n));
  size_t ws_detect = 0, ws_changes = 0, ws_find = 0;
  Check("workspace query", k::CudaAdamWInvertDetectWorkspaceBytes(n, &ws_detect));
  Check("workspace query", k::CudaDetectChangesWorkspaceBytes(n, 2, &ws_changes));
  Check("workspace query", k::CudaAdamWFindChangesWorkspaceBytes(n, &ws_find));
  k::CudaBuffer d_ws = Alloc(std::max({ws_detect, ws_changes, ws_find}));
  auto* idx = static_cast<uint64_t*>(d_idx.data());
  auto* count = static_cast<uint64_t*>(d_count.data());

  const int reps = 5;
  const double t_copy = Best("copy", reps, [&] {
    return k::CudaCopyOnDevice(d_copy.data(), d_state.data(), 3 * f32, nullptr);
  });
  const double t_detect = Best("invert_detect", reps, [&] {
    return k::CudaAdamWInvertDetect(d_ws.data(), ws_detect, d_theta, d_m, d_v, n, p, o, idx,
                                    static_cast<uint16_t*>(d_vals.data()), count, nullptr);
  });
  uint64_t gpu_count = 0;
  Check("download count", k::CudaCopyToHost(&gpu_count, count, 8));
  bool same = gpu_count == cpu_count;
  if (same) {
    std::vector<uint64_t> gi(gpu_count);
    std::vector<uint16_t> gb(gpu_count);
    Check("download indices", k::CudaCopyToHost(gi.data(), idx, 8 * gpu_count));
    Check("download values", k::CudaCopyToHost(gb.data(), d_vals.data(), 2 * gpu_count));
    for (size_t i = 0; i < gpu_count && same; ++i) {
      same = gi[i] == cpu_idx[i] && gb[i] == cpu_bits[i];
    }
  }
  const double t_find = Best("find_changes", reps, [&] {
    return k::CudaAdamWFindChanges(d_ws.data(), ws_find, d_theta, d_m, d_v, n, p, o.margin_ulps,
                                   idx, static_cast<uint16_t*>(d_vals.data()), count, nullptr);
  });
  uint64_t kept = 0;
  Check("download count", k::CudaCopyToHost(&kept, count, 8));
  {
    // The CPU backend's selection on the same data, element for element.
    std::vector<uint64_t> gi(kept);
    std::vector<uint16_t> gb(kept);
    Check("download indices", k::CudaCopyToHost(gi.data(), idx, 8 * kept));
    Check("download values", k::CudaCopyToHost(gb.data(), d_vals.data(), 2 * kept));
    const size_t cpu_kept = k::AdamWFindChanges(theta.data(), m.data(), v.data(), n, p,
                                                o.margin_ulps, cpu_idx.data(), cpu_bits.data());
    same = same && cpu_kept == kept;
    for (size_t i = 0; i < kept && same; ++i) same = gi[i] == cpu_idx[i] && gb[i] == cpu_bits[i];
  }
  const double t_invert = Best("invert", reps, [&] {
    return k::CudaAdamWInvert(d_theta, d_m, d_v, n, p, static_cast<float*>(d_f32.data()), nullptr);
  });
  const double t_cast = Best("cast", reps, [&] {
    return k::CudaCastFp32ToBf16(d_theta, static_cast<uint16_t*>(d_bf16.data()), n, nullptr);
  });
  uint64_t bf16_changed = 0;
  const double t_changes = Best("detect_bf16", reps, [&] {
    return k::CudaDetectChanges(d_ws.data(), ws_changes, d_prev.data(), d_bf16.data(), n, 2, idx,
                                d_vals.data(), count, nullptr);
  });
  Check("download count", k::CudaCopyToHost(&bf16_changed, count, 8));

  const double state_bytes = 12.0 * static_cast<double>(n);
  const double copy_bw = 2 * state_bytes / t_copy;  // read + write
  const double detect_bw = state_bytes / t_detect;
  std::printf(
      "{\"elements\": %zu, \"state_bytes\": %.0f, \"copy_gbps\": %.1f, "
      "\"invert_detect_gbps\": %.1f, \"invert_detect_over_copy\": %.3f, "
      "\"find_changes_gbps\": %.1f, \"find_changes_over_copy\": %.3f, \"kept\": %llu, "
      "\"invert_gbps\": %.1f, \"cast_gbps\": %.1f, \"detect_bf16_gbps\": %.1f, "
      "\"cpu_invert_detect_gbps\": %.2f, \"cpu_threads\": %zu, \"gpu_over_cpu\": %.1f, "
      "\"selected\": %llu, \"bf16_changed\": %llu, \"same_selection\": %s}\n",
      n, state_bytes, copy_bw / 1e9, detect_bw / 1e9, detect_bw / copy_bw,
      state_bytes / t_find / 1e9, state_bytes / t_find / copy_bw,
      static_cast<unsigned long long>(kept),
      // invert reads 12 B and writes 4 B; cast reads 4 and writes 2; detect
      // reads 2 + 2 (the few changes written are not counted).
      16.0 * static_cast<double>(n) / t_invert / 1e9, 6.0 * static_cast<double>(n) / t_cast / 1e9,
      4.0 * static_cast<double>(n) / t_changes / 1e9, state_bytes / cpu_best / 1e9, k::NumThreads(),
      t_detect > 0 ? cpu_best / t_detect : 0.0, static_cast<unsigned long long>(gpu_count),
      static_cast<unsigned long long>(bf16_changed), same ? "true" : "false");
  return same ? 0 : 1;
}
