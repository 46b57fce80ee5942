// Fuzzes the safetensors header and index parsers on arbitrary bytes.
//
// Input: a selector byte, then the bytes under test.
//   selector % 3 == 0: a whole file (8-byte prefix, header, data section).
//   selector % 3 == 1: a 4-byte little-endian data section size, then the
//                      header JSON (reaches the layout checks without the
//                      fuzzer having to grow a matching data section).
//   selector % 3 == 2: an index file.
// Beyond memory safety, checks that every error is InvalidArgument naming
// the file, and that every accepted header satisfies the invariants the
// parser promises and survives BuildSafetensorsHeader -> parse unchanged.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "store/safetensors.h"

namespace dte {
namespace {

constexpr char kFile[] = "fuzz/model.safetensors";

void Check(bool ok, const char* what) {
  if (ok) return;
  std::fprintf(stderr, "invariant violated: %s\n", what);
  std::abort();
}

void CheckError(const Status& status) {
  Check(status.code() == Code::kInvalidArgument, "errors are InvalidArgument");
  Check(status.message().find(kFile) != std::string::npos, "errors name the file");
}

bool SameTensor(const TensorInfo& a, const TensorInfo& b) {
  return a.name == b.name && a.dtype == b.dtype && a.shape == b.shape && a.begin == b.begin &&
         a.end == b.end;
}

void CheckHeader(const SafetensorsHeader& h) {
  Check(h.data_offset == 8 + h.header_len, "data_offset is 8 + N");
  uint64_t pos = 0;
  for (const TensorInfo& t : h.tensors) {
    Check(t.begin == pos, "tensors tile the data section in offset order");
    Check(t.bytes() == t.elements() * static_cast<uint64_t>(DTypeWidth(t.dtype)),
          "byte length is width x elements");
    pos = t.end;
  }
  Check(pos == h.data_size, "tensors cover the data section");

  std::string built = BuildSafetensorsHeader(h.tensors, h.metadata);
  Check(built.size() % 8 == 0, "built header is padded to 8 bytes");
  std::string_view json = std::string_view(built).substr(8);
  auto again = ParseSafetensorsHeader(json, 8 + json.size() + h.data_size, kFile);
  Check(again.ok(), "a built header parses");
  Check(again->metadata == h.metadata, "metadata survives a round trip");
  Check(again->tensors.size() == h.tensors.size(), "tensor count survives a round trip");
  for (size_t i = 0; i < h.tensors.size(); ++i) {
    Check(SameTensor(again->tensors[i], h.tensors[i]), "tensors survive a round trip");
  }
}

void CheckIndex(const SafetensorsIndex& index) {
  for (const auto& [tensor, shard] : index.weight_map) {
    Check(!shard.empty() && shard[0] != '.', "shard names are plain");
    Check(shard.find_first_of(std::string_view("/\\\0", 3)) == std::string::npos,
          "shard names have no separators or NUL");
    Check(std::binary_search(index.shards.begin(), index.shards.end(), shard),
          "shards lists every shard");
  }
  Check(std::adjacent_find(index.shards.begin(), index.shards.end(),
                           [](const std::string& a, const std::string& b) { return a >= b; }) ==
            index.shards.end(),
        "shards are sorted and distinct");
}

template <typename T>
void Verify(const Result<T>& r, void (*check)(const T&)) {
  if (r.ok()) {
    check(*r);
  } else {
    CheckError(r.status());
  }
}

}  // namespace
}  // namespace dte

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace dte;
  if (size == 0) return 0;
  std::string_view bytes(reinterpret_cast<const char*>(data) + 1, size - 1);
  switch (data[0] % 3) {
    case 0:
      Verify(ParseSafetensorsFile(bytes, kFile), CheckHeader);
      break;
    case 1: {
      if (bytes.size() < 4) return 0;
      uint64_t data_size = 0;
      for (int i = 3; i >= 0; --i) data_size = (data_size << 8) | static_cast<uint8_t>(bytes[i]);
      std::string_view json = bytes.substr(4);
      Verify(ParseSafetensorsHeader(json, 8 + json.size() + data_size, kFile), CheckHeader);
      break;
    }
    default:
      Verify(ParseSafetensorsIndex(bytes, kFile), CheckIndex);
  }
  return 0;
}
