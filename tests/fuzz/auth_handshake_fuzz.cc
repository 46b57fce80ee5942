// Fuzzes the server side of the job secret's handshake
// (sync/transport/auth_handshake.h), which reads bytes from anyone who can
// reach a push server, on arbitrary bytes fed in arbitrary pieces.
//
// Input: a byte of piece size (1-64), then the bytes a client sends.
// Beyond memory safety, checks that the server answers at most once and
// only with nonce and proof, takes no more than the handshake's bytes,
// refuses only with PermissionDenied, and never accepts: no input proves a
// secret it cannot know (a fixed one here).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "sync/transport/auth_handshake.h"

namespace dte::auth_internal {
namespace {

void Check(bool ok, const char* what) {
  if (ok) return;
  std::fprintf(stderr, "invariant violated: %s\n", what);
  std::abort();
}

void Run(const uint8_t* data, size_t size) {
  if (size == 0) return;
  const size_t piece = 1 + data[0] % 64;
  ServerHandshake hs("fuzz-secret-0123456789abcdef", "push");
  std::string in, out;
  size_t fed = 0;
  for (size_t at = 1; at < size; at += piece) {
    const size_t n = std::min(piece, size - at);
    in.append(reinterpret_cast<const char*>(data + at), n);
    fed += n;
    Result<bool> r = hs.Feed(&in, &out);
    if (!r.ok()) {
      Check(r.status().code() == Code::kPermissionDenied, "refusal code");
      return;
    }
    Check(!*r, "accepted a proof without the secret");
    Check(in.size() <= fed, "grew the input");
  }
  Check(out.empty() || out.size() == kAnswerBytes, "answer size");
}

}  // namespace
}  // namespace dte::auth_internal

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  dte::auth_internal::Run(data, size);
  return 0;
}
