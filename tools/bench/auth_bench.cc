// Cost of authenticating a push connection with the job secret
// (sync/transport/auth_handshake.h): a real PushServer on loopback, and
// `connections` receivers' worth of connections made one after another, each
// connect, [handshake,] hello, welcome, close; with and without a secret, in
// the same run. Also the CPU time of one HMAC-SHA256 proof and the bytes
// the handshake adds to a connection.
//
// Usage: auth_bench [connections]   (default 2000)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "store/crypto.h"
#include "sync/push/internal/push_wire.h"
#include "sync/push/push_server.h"
#include "sync/transport/auth_handshake.h"
#include "sync/transport/socket.h"

namespace dte {
namespace {

using Clock = std::chrono::steady_clock;
using transport_internal::Deadline;

struct Times {
  double mean_us = 0, p50_us = 0, p99_us = 0;
};

Times Summarize(std::vector<double> us) {
  std::sort(us.begin(), us.end());
  Times t;
  for (double x : us) t.mean_us += x / us.size();
  t.p50_us = us[us.size() / 2];
  t.p99_us = us[us.size() * 99 / 100];
  return t;
}

// One connection: connect, handshake when `secret` is set, hello, welcome.
Status OneConnection(int port, const std::string& secret) {
  const Deadline d(std::chrono::seconds(10));
  const std::string who = "the push server";
  ASSIGN_OR_RETURN(ScopedFd fd,
                   transport_internal::ConnectTcp("127.0.0.1:" + std::to_string(port), d, who));
  if (!secret.empty()) {
    RETURN_IF_ERROR(auth_internal::ClientHandshake(fd.get(), secret, "push", d, who));
  }
  const std::string hello =
      push_internal::Frame(push_internal::Msg::kHello, R"({"rank":0,"tp":1,"tensors":[]})");
  RETURN_IF_ERROR(transport_internal::SendAll(fd.get(), hello.data(), hello.size(), d, who));
  ASSIGN_OR_RETURN(auto welcome, push_internal::RecvFrame(fd.get(), 1 << 20, d, who));
  if (welcome.type != push_internal::Msg::kWelcome) return Internal("no welcome");
  return Status::Ok();
}

Result<Times> Run(int connections, const std::string& secret) {
  PushServerOptions o;
  o.secret = secret;
  ASSIGN_OR_RETURN(auto server, PushServer::Start(o));
  std::vector<double> us;
  for (int i = 0; i < connections + 50; ++i) {
    const auto t0 = Clock::now();
    RETURN_IF_ERROR(OneConnection(server->port(), secret));
    const double took = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
    if (i >= 50) us.push_back(took);  // the first 50 warm up
  }
  return Summarize(std::move(us));
}

double ProofMicros() {
  uint8_t nc[32] = {1}, ns[32] = {2};
  constexpr int kN = 100000;
  const auto t0 = Clock::now();
  for (int i = 0; i < kN; ++i) {
    nc[0] = static_cast<uint8_t>(i);
    auto p = auth_internal::Proof("a-job-secret-of-64-hex-characters-0123456789abcdef0123456789ab",
                                  "push", "client", nc, ns);
    if (!p.ok()) std::abort();
  }
  return std::chrono::duration<double, std::micro>(Clock::now() - t0).count() / kN;
}

}  // namespace
}  // namespace dte

int main(int argc, char** argv) {
  const int n = argc > 1 ? std::atoi(argv[1]) : 2000;
  std::fprintf(stderr, "(the servers' log lines follow)\n");
  auto plain = dte::Run(n, "");
  auto authed = dte::Run(n, "a-job-secret-of-64-hex-characters-0123456789abcdef0123456789ab");
  if (!plain.ok() || !authed.ok()) {
    std::fprintf(stderr, "auth_bench: %s\n",
                 (plain.ok() ? authed.status() : plain.status()).message().c_str());
    return 1;
  }
  std::printf("%d connections to a push server on loopback: connect, hello, welcome\n", n);
  std::printf("%-16s %10s %10s %10s\n", "", "mean us", "p50 us", "p99 us");
  std::printf("%-16s %10.1f %10.1f %10.1f\n", "no secret", plain->mean_us, plain->p50_us,
              plain->p99_us);
  std::printf("%-16s %10.1f %10.1f %10.1f\n", "job secret", authed->mean_us, authed->p50_us,
              authed->p99_us);
  std::printf(
      "handshake adds %.1f us per connection (mean), %zu bytes on the wire "
      "(%zu + %zu + %zu), one round trip\n",
      authed->mean_us - plain->mean_us,
      dte::auth_internal::kChallengeBytes + dte::auth_internal::kAnswerBytes +
          dte::auth_internal::kProofBytes,
      dte::auth_internal::kChallengeBytes, dte::auth_internal::kAnswerBytes,
      dte::auth_internal::kProofBytes);
  std::printf("one HMAC-SHA256 proof: %.2f us of CPU (4 per connection, 2 each side)\n",
              dte::ProofMicros());
  return 0;
}
