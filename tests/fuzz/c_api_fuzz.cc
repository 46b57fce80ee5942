// Fuzzes what the C ABI (sync/capi/c_api.h) parses of what its callers give it.
//
// Input: a selector byte, then the bytes under test.
//   selector % 4 == 0: a dte_mcore_layout (24 bytes: tp, ep, etp as int32,
//     vocab_divisible_by as int64, norms and experts as uint16), then the
//     text of a config.json, as dte_publisher_open_mcore takes them:
//     ParseHfConfig, ValidateLayout and the padded vocabulary a valid
//     layout gives.
//   selector % 4 == 1: a dtype name, as a dte_push_tensor gives it.
//   selector % 4 == 2: operations on the table of handles every entry
//     point looks its handles up in (sync/capi/internal/c_api_handles.h), with
//     tokens it gave and arbitrary ones, checked against a model of it.
//   selector % 4 == 3: a distributed publish's header, as a peer, or the
//     exchange function of a dte_transport_callback, hands it over
//     (sync/publish/internal/dist_header.h); one that decodes must survive
//     encoding and decoding again unchanged.
// Beyond memory safety and undefined behaviour, checks the error codes and
// that the table answers as the model says.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "store/dtype.h"
#include "sync/capi/internal/c_api_handles.h"
#include "sync/convert/convert.h"
#include "sync/publish/internal/dist_header.h"

namespace dte {
namespace {

void Check(bool ok, const char* what) {
  if (ok) return;
  std::fprintf(stderr, "invariant violated: %s\n", what);
  std::abort();
}

template <typename T>
T Take(std::string_view* in) {
  T v{};
  size_t n = std::min(sizeof(T), in->size());
  std::memcpy(&v, in->data(), n);
  in->remove_prefix(n);
  return v;
}

void Config(std::string_view in) {
  // The layout as sync/capi/internal/c_api_convert.cc's ToLayout fills it (enums are checked
  // there).
  ParallelLayout layout;
  layout.tp = Take<int32_t>(&in);
  layout.ep = Take<int32_t>(&in);
  layout.etp = Take<int32_t>(&in);
  int64_t vocab_divisible_by = Take<int64_t>(&in);
  if (vocab_divisible_by > 0) layout.vocab_divisible_by = vocab_divisible_by;
  layout.norms = Take<uint16_t>(&in) % 2 ? McoreNorms::kLocal : McoreNorms::kTransformerEngine;
  layout.experts = Take<uint16_t>(&in) % 2 ? McoreExperts::kGrouped : McoreExperts::kSequential;
  auto spec = ParseHfConfig(in, "config.json");
  if (!spec.ok()) {
    Code c = spec.status().code();
    Check(c == Code::kInvalidArgument || c == Code::kUnimplemented, "config code");
    Check(spec.status().message().rfind("config.json: ", 0) == 0, "config message");
    return;
  }
  Status s = ValidateLayout(*spec, layout);
  Check(s.ok() || s.code() == Code::kInvalidArgument, "layout code");
  if (!s.ok()) return;
  int64_t padded = layout.PaddedVocab(spec->vocab);
  Check(padded >= spec->vocab && padded % (layout.vocab_divisible_by * layout.tp) == 0,
        "padded vocabulary");
}

void DTypeNameRoundTrip(std::string_view name) {
  std::optional<DType> d = ParseDType(name);
  if (d) Check(DTypeName(*d) == name, "dtype round trip");
}

void Handles(std::string_view in) {
  using capi::HandleKind;
  capi::HandleTable table;
  std::map<uintptr_t, HandleKind> open;  // the model
  std::vector<uintptr_t> given;
  while (!in.empty()) {
    uint8_t op = Take<uint8_t>(&in);
    auto kind = static_cast<HandleKind>(1 + (op >> 2) % 7);
    if (op % 4 == 0) {
      uintptr_t t = table.Add(kind, std::make_shared<int>(1));
      Check(t != 0 && open.count(t) == 0, "fresh token");
      open[t] = kind;
      given.push_back(t);
      continue;
    }
    uint64_t raw = Take<uint64_t>(&in);
    uintptr_t token = raw % 2 && !given.empty() ? given[(raw >> 1) % given.size()]
                                                : static_cast<uintptr_t>(raw >> 1);
    auto it = open.find(token);
    bool live = it != open.end() && it->second == kind;
    std::string error;
    if (op % 4 == 1) {
      Check((table.Find(token, kind, "f", &error) != nullptr) == live, "find");
    } else if (op % 4 == 2) {
      Check((table.Remove(token, kind, "f", &error) != nullptr) == live, "remove");
      if (live) open.erase(it);
    } else {
      size_t n = 0;
      for (const auto& [t, k] : open) n += k == kind;
      Check(table.Count(kind) == n, "count");
    }
    if (!live && op % 4 != 3) {
      std::string want = std::string("f: expected a ") + capi::KindName(kind) + " handle, got ";
      Check(error.rfind(want, 0) == 0, "error message");
    }
  }
}

void DistHeader(std::string_view in) {
  using dist_internal::Header;
  auto h = dist_internal::DecodeHeader(std::string(in), 3);
  Check(h.ok() || h.status().code() == Code::kCorruption, "header code");
  if (!h.ok()) return;
  auto again = dist_internal::DecodeHeader(dist_internal::EncodeHeader(*h), 3);
  Check(again.ok(), "header round trip");
  Check(again->error == h->error && again->fields == h->fields && again->latest == h->latest &&
            again->last_version == h->last_version && again->last_step == h->last_step &&
            again->push == h->push && again->ranges.size() == h->ranges.size(),
        "header fields round trip");
  for (size_t i = 0; i < h->ranges.size(); ++i) {
    const Header::Range &a = h->ranges[i], &b = again->ranges[i];
    Check(a.name == b.name && a.tp == b.tp && a.ep == b.ep && a.begin == b.begin &&
              a.end == b.end && a.state_step == b.state_step,
          "header range round trip");
  }
}

}  // namespace
}  // namespace dte

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  std::string_view in(reinterpret_cast<const char*>(data) + 1, size - 1);
  switch (data[0] % 4) {
    case 0:
      dte::Config(in);
      break;
    case 1:
      dte::DTypeNameRoundTrip(in);
      break;
    case 2:
      dte::Handles(in);
      break;
    default:
      dte::DistHeader(in);
  }
  return 0;
}
