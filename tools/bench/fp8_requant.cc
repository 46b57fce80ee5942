// The alternative to an FP8 receiver's live apply: re-quantizing the whole
// model from BF16 after every step. Reads every safetensors file of DIR (a
// version directory of a dtefs mount: MNT/vNNNNNNNN) with 1 MiB reads,
// quantizes each tensor the default FP8 policy quantizes (kernels/fp8.h,
// on the CPU thread pool) and copies the others, into one /dev/shm object
// that stands for the receiver's buffers. Prints one JSON line:
//   {"read_s": ..., "quantize_s": ..., "total_s": ..., "read_bytes": ...,
//    "written_bytes": ..., "quantized_elements": ..., "threads": ...}
// Usage: fp8_requant DIR BLOCK plain|pow2
#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/fp8.h"
#include "kernels/parallel.h"
#include "store/fp8_policy.h"
#include "store/safetensors.h"

namespace {

using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

std::vector<std::string> SafetensorsFiles(const std::string& dir) {
  std::vector<std::string> out;
  if (DIR* d = opendir(dir.c_str())) {
    while (dirent* e = readdir(d)) {
      const std::string n = e->d_name;
      if (n.size() > 12 && n.ends_with(".safetensors")) out.push_back(dir + "/" + n);
    }
    closedir(d);
  }
  std::sort(out.begin(), out.end());
  return out;
}

bool ReadWhole(const std::string& path, std::vector<char>* out) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  out->clear();
  size_t used = 0;
  for (;;) {
    out->resize(used + (1 << 20));
    const ssize_t n = read(fd, out->data() + used, 1 << 20);
    if (n <= 0) break;
    used += static_cast<size_t>(n);
  }
  out->resize(used);
  close(fd);
  return true;
}

// The quantized output of every tensor, in a shm object (the receiver).
struct Output {
  uint8_t* data = nullptr;
  size_t size = 0;
  size_t used = 0;
};

// The default policy with the benchmark's block, as a receiver decides.
bool Quantized(const dte::TensorInfo& t, const dte::kernels::Fp8Layout& block) {
  return dte::QuantizeAsFp8(dte::Fp8Policy{}, {block.block_rows, block.block_cols}, t.name, t.dtype,
                            t.shape);
}

uint64_t OutputBytes(const dte::SafetensorsHeader& h, const dte::kernels::Fp8Layout& block) {
  uint64_t n = 0;
  for (const dte::TensorInfo& t : h.tensors) {
    if (!Quantized(t, block)) {
      n += t.bytes();
      continue;
    }
    dte::kernels::Fp8Layout l = block;
    l.rows = static_cast<uint64_t>(t.shape[0]);
    l.cols = static_cast<uint64_t>(t.shape[1]);
    n += l.num_elements() + 4 * l.num_blocks();
  }
  return n;
}

// Quantizes or copies every tensor of one file held in `bytes`.
bool Convert(const dte::SafetensorsHeader& h, const std::vector<char>& bytes,
             const dte::kernels::Fp8Layout& block, Output* out, uint64_t* elements) {
  for (const dte::TensorInfo& t : h.tensors) {
    const char* src = bytes.data() + h.data_offset + t.begin;
    uint8_t* dst = out->data + out->used;
    if (!Quantized(t, block)) {
      std::memcpy(dst, src, t.bytes());
      out->used += t.bytes();
      continue;
    }
    dte::kernels::Fp8Layout l = block;
    l.rows = static_cast<uint64_t>(t.shape[0]);
    l.cols = static_cast<uint64_t>(t.shape[1]);
    auto* scales = reinterpret_cast<float*>(dst + (l.num_elements() + 3) / 4 * 4);
    const std::string err =
        dte::kernels::Fp8Quantize(l, reinterpret_cast<const uint16_t*>(src), dst, scales, t.name);
    if (!err.empty()) {
      std::fprintf(stderr, "fp8_requant: %s\n", err.c_str());
      return false;
    }
    out->used += (l.num_elements() + 3) / 4 * 4 + 4 * l.num_blocks();
    *elements += l.num_elements();
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: fp8_requant DIR BLOCK plain|pow2\n");
    return 2;
  }
  dte::kernels::Fp8Layout block;
  block.block_rows = block.block_cols = std::stoull(argv[2]);
  block.rule = std::string(argv[3]) == "pow2" ? dte::kernels::Fp8ScaleRule::kPowerOfTwo
                                              : dte::kernels::Fp8ScaleRule::kPlain;
  const std::vector<std::string> files = SafetensorsFiles(argv[1]);
  std::vector<dte::SafetensorsHeader> headers;
  uint64_t total = 0;
  for (const std::string& f : files) {
    auto h = dte::ReadSafetensorsHeader(f);
    if (!h.ok()) {
      std::fprintf(stderr, "fp8_requant: %s\n", h.status().message().c_str());
      return 2;
    }
    total += OutputBytes(*h, block) + 4 * h->tensors.size();
    headers.push_back(std::move(h).value());
  }
  const std::string shm = "/fp8-requant-" + std::to_string(getpid());
  const int fd = shm_open(shm.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0 || ftruncate(fd, static_cast<off_t>(total)) != 0) return 2;
  Output out;
  out.size = total;
  out.data = static_cast<uint8_t*>(
      mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0));
  close(fd);
  shm_unlink(shm.c_str());
  if (out.data == MAP_FAILED) return 2;
  const Clock::time_point start = Clock::now();
  double read_s = 0, quantize_s = 0;
  uint64_t read_bytes = 0, elements = 0;
  std::vector<char> bytes;
  for (size_t i = 0; i < files.size(); ++i) {
    Clock::time_point t = Clock::now();
    if (!ReadWhole(files[i], &bytes)) return 2;
    read_s += Since(t);
    read_bytes += bytes.size();
    t = Clock::now();
    if (!Convert(headers[i], bytes, block, &out, &elements)) return 3;
    quantize_s += Since(t);
  }
  std::printf(
      "{\"read_s\": %.4f, \"quantize_s\": %.4f, \"total_s\": %.4f, \"read_bytes\": %llu, "
      "\"written_bytes\": %llu, \"quantized_elements\": %llu, \"threads\": %zu}\n",
      read_s, quantize_s, Since(start), static_cast<unsigned long long>(read_bytes),
      static_cast<unsigned long long>(out.used), static_cast<unsigned long long>(elements),
      dte::kernels::NumThreads());
  munmap(out.data, out.size);
  return 0;
}
