// Runs the CPU FP8 quantizer (kernels/fp8.h) over raw little-endian files so
// tests/py/test_fp8_reference.py can compare it with an independent
// reference:
//   fp8_tool quantize   ROWS COLS BR BC RULE IN.bf16 OUT.e4m3 OUT.scales
//   fp8_tool dequantize ROWS COLS BR BC RULE IN.e4m3 IN.scales OUT.f32
//   fp8_tool changes    ROWS COLS BR BC RULE PARENT.bf16 CHILD.bf16 OUT_PREFIX
// RULE is plain or pow2. `changes` writes OUT_PREFIX.byte_index (uint64),
// .byte_value (uint8), .scale_index (uint64) and .scale_value (float32).
// Exit status: 0 done, 3 the quantizer refused the input (its message on
// stderr; quantize still writes its outputs), 2 bad usage or I/O.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "kernels/fp8.h"

namespace {

using dte::kernels::Fp8Layout;

template <typename T>
bool ReadFile(const std::string& path, size_t n, std::vector<T>* out) {
  std::ifstream f(path, std::ios::binary);
  out->resize(n);
  f.read(reinterpret_cast<char*>(out->data()), static_cast<std::streamsize>(n * sizeof(T)));
  return f.gcount() == static_cast<std::streamsize>(n * sizeof(T));
}

template <typename T>
bool WriteFile(const std::string& path, const std::vector<T>& v) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(v.data()),
          static_cast<std::streamsize>(v.size() * sizeof(T)));
  return static_cast<bool>(f);
}

int Fail(const std::string& why) {
  std::fprintf(stderr, "fp8_tool: %s\n", why.c_str());
  return 2;
}

int Quantize(const Fp8Layout& l, char** a) {
  std::vector<uint16_t> x;
  if (!ReadFile(a[0], l.num_elements(), &x)) return Fail(std::string("cannot read ") + a[0]);
  std::vector<uint8_t> q(l.num_elements());
  std::vector<float> s(l.num_blocks());
  const std::string why = dte::kernels::Fp8Quantize(l, x.data(), q.data(), s.data(), a[0]);
  if (!WriteFile(a[1], q) || !WriteFile(a[2], s)) return Fail("cannot write outputs");
  if (why.empty()) return 0;
  std::fprintf(stderr, "%s\n", why.c_str());
  return 3;
}

int Dequantize(const Fp8Layout& l, char** a) {
  std::vector<uint8_t> q;
  std::vector<float> s, out(l.num_elements());
  if (!ReadFile(a[0], l.num_elements(), &q) || !ReadFile(a[1], l.num_blocks(), &s)) {
    return Fail("cannot read inputs");
  }
  dte::kernels::Fp8Dequantize(l, q.data(), s.data(), out.data());
  return WriteFile(a[2], out) ? 0 : Fail("cannot write output");
}

int Changes(const Fp8Layout& l, char** a) {
  std::vector<uint16_t> parent, child;
  if (!ReadFile(a[0], l.num_elements(), &parent) || !ReadFile(a[1], l.num_elements(), &child)) {
    return Fail("cannot read inputs");
  }
  dte::kernels::Fp8ChangeSet cs;
  const std::string why = dte::kernels::Fp8Changes(l, parent.data(), child.data(), a[1], &cs);
  if (!why.empty()) {
    std::fprintf(stderr, "%s\n", why.c_str());
    return 3;
  }
  const std::string p = a[2];
  const bool ok = WriteFile(p + ".byte_index", cs.byte_index) &&
                  WriteFile(p + ".byte_value", cs.byte_value) &&
                  WriteFile(p + ".scale_index", cs.scale_index) &&
                  WriteFile(p + ".scale_value", cs.scale_value);
  return ok ? 0 : Fail("cannot write outputs");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 10) return Fail("usage: see the comment at the top of tests/kernels/fp8_tool.cc");
  const std::string cmd = argv[1], rule = argv[6];
  Fp8Layout l;
  l.rows = std::strtoull(argv[2], nullptr, 10);
  l.cols = std::strtoull(argv[3], nullptr, 10);
  l.block_rows = std::strtoull(argv[4], nullptr, 10);
  l.block_cols = std::strtoull(argv[5], nullptr, 10);
  if (rule != "plain" && rule != "pow2") return Fail("RULE must be plain or pow2, not " + rule);
  l.rule =
      rule == "pow2" ? dte::kernels::Fp8ScaleRule::kPowerOfTwo : dte::kernels::Fp8ScaleRule::kPlain;
  const std::string why = dte::kernels::Fp8LayoutError(l);
  if (!why.empty()) return Fail(why);
  if (cmd == "quantize") return Quantize(l, argv + 7);
  if (cmd == "dequantize") return Dequantize(l, argv + 7);
  if (cmd == "changes") return Changes(l, argv + 7);
  return Fail("unknown command " + cmd);
}
