// Authentication with the job secret (sync/transport/job_secret.h,
// sync/transport/auth_handshake.h): the handshake's state machine against
// wrong proofs, replays and reflections; the push server and the TCP
// transport against strangers on real loopback sockets (raw sockets that
// skip the handshake, hold another secret, or replay and reflect proofs),
// while the job's own peers keep being served; where the secret comes from
// and the files it may come from.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "store/crypto.h"
#include "sync/push/internal/push_wire.h"
#include "sync/push/push_receiver.h"
#include "sync/push/push_server.h"
#include "sync/transport/auth_handshake.h"
#include "sync/transport/job_secret.h"
#include "sync/transport/socket.h"
#include "sync/transport/transport.h"
#include "tests/testutil/memory_store.h"
#include "tests/testutil/wait.h"

namespace dte {
namespace {

using namespace std::chrono_literals;
using auth_internal::kAnswerBytes;
using auth_internal::kChallengeBytes;
using auth_internal::kMagic;
using auth_internal::kMagicBytes;
using auth_internal::kNonceBytes;
using auth_internal::kProofBytes;
using transport_internal::Deadline;

const std::string kSecret = "0123456789abcdef-the-job";
const std::string kOther = "fedcba9876543210-another";

// The environment's secret must not leak into these tests.
class NoSecretInEnvironment : public ::testing::Environment {
 public:
  void SetUp() override {
    unsetenv(kSecretEnv);
    unsetenv(kSecretFileEnv);
  }
};
const auto* const kEnv = ::testing::AddGlobalTestEnvironment(new NoSecretInEnvironment);

std::string Challenge(const uint8_t* nonce_c) {
  return std::string(kMagic, kMagicBytes) +
         std::string(reinterpret_cast<const char*>(nonce_c), kNonceBytes);
}

std::string ProofBytes(const std::string& secret, const std::string& role, const uint8_t* nc,
                       const uint8_t* ns) {
  auto p = auth_internal::Proof(secret, "push", role, nc, ns);
  EXPECT_TRUE(p.ok());
  return std::string(reinterpret_cast<const char*>(p->data()), p->size());
}

TEST(AuthHandshake, ProofsBindBothNoncesTheRoleTheProtocolAndTheSecret) {
  uint8_t a[kNonceBytes], b[kNonceBytes];
  ASSERT_TRUE(crypto::RandomBytes(a, sizeof a).ok());
  ASSERT_TRUE(crypto::RandomBytes(b, sizeof b).ok());
  const std::string base = ProofBytes(kSecret, "client", a, b);
  EXPECT_EQ(base, ProofBytes(kSecret, "client", a, b));
  EXPECT_NE(base, ProofBytes(kSecret, "server", a, b));
  EXPECT_NE(base, ProofBytes(kSecret, "client", b, a));
  EXPECT_NE(base, ProofBytes(kOther, "client", a, b));
  auto p2p = auth_internal::Proof(kSecret, "p2p", "client", a, b);
  ASSERT_TRUE(p2p.ok());
  EXPECT_NE(base, std::string(p2p->begin(), p2p->end()));
}

// Runs a server handshake over `challenge`; returns its answer.
std::string Answer(auth_internal::ServerHandshake& hs, const std::string& challenge) {
  std::string in = challenge, out;
  auto r = hs.Feed(&in, &out);
  EXPECT_TRUE(r.ok()) << r.status().message();
  EXPECT_FALSE(r.ok() && *r);
  EXPECT_EQ(out.size(), kAnswerBytes);
  return out;
}

TEST(AuthHandshake, ServerRefusesNoHandshakeWrongProofReplayAndReflection) {
  uint8_t nc[kNonceBytes];
  ASSERT_TRUE(crypto::RandomBytes(nc, sizeof nc).ok());
  {  // a push hello instead of a challenge: refused at its first bytes
    auth_internal::ServerHandshake hs(kSecret, "push");
    std::string in = push_internal::Frame(push_internal::Msg::kHello, "{}").substr(0, 4), out;
    auto r = hs.Feed(&in, &out);
    EXPECT_EQ(r.status().code(), Code::kPermissionDenied);
    EXPECT_NE(r.status().message().find("no authentication handshake (it sent \"DPSH"),
              std::string::npos)
        << r.status().message();
    EXPECT_TRUE(out.empty());
  }
  // A client that knows the secret, for a proof to replay.
  std::string old_answer;
  {
    auth_internal::ServerHandshake hs(kSecret, "push");
    old_answer = Answer(hs, Challenge(nc));
    const auto* ns = reinterpret_cast<const uint8_t*>(old_answer.data());
    EXPECT_EQ(old_answer.substr(kNonceBytes), ProofBytes(kSecret, "server", nc, ns));
    std::string in = ProofBytes(kSecret, "client", nc, ns) + "hello", out;
    auto r = hs.Feed(&in, &out);
    ASSERT_TRUE(r.ok() && *r) << r.status().message();
    EXPECT_EQ(in, "hello");  // the protocol's bytes are left for it
  }
  const auto* old_ns = reinterpret_cast<const uint8_t*>(old_answer.data());
  auto refused = [&](const std::string& what, auto make_proof) {
    auth_internal::ServerHandshake hs(kSecret, "push");
    const std::string answer = Answer(hs, Challenge(nc));
    std::string in = make_proof(answer), out;
    auto r = hs.Feed(&in, &out);
    EXPECT_EQ(r.status().code(), Code::kPermissionDenied) << what;
    EXPECT_NE(r.status().message().find("wrong authentication proof"), std::string::npos) << what;
    EXPECT_TRUE(out.empty()) << what;
  };
  refused("another secret", [&](const std::string& a) {
    return ProofBytes(kOther, "client", nc, reinterpret_cast<const uint8_t*>(a.data()));
  });
  refused("a replayed proof",
          [&](const std::string&) { return ProofBytes(kSecret, "client", nc, old_ns); });
  refused("the server's own proof reflected",
          [&](const std::string& a) { return a.substr(kNonceBytes); });
}

// A raw connection to 127.0.0.1:port.
ScopedFd Dial(int port) {
  auto fd = transport_internal::ConnectTcp("127.0.0.1:" + std::to_string(port), Deadline(5s),
                                           "the server");
  EXPECT_TRUE(fd.ok()) << fd.status().message();
  return fd.ok() ? std::move(fd).value() : ScopedFd();
}

// Everything the peer sends until it closes the connection (or 5 s pass).
std::string ReadUntilClosed(int fd) {
  std::string got;
  char buf[4096];
  Deadline d(5s);
  while (!d.Expired()) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, d.RemainingMs()) <= 0) break;
    const ssize_t n = recv(fd, buf, sizeof buf, 0);
    if (n <= 0) return got;
    got.append(buf, static_cast<size_t>(n));
  }
  return got + "<still open>";
}

std::string Send(int fd, const std::string& bytes) {
  Status s = transport_internal::SendAll(fd, bytes.data(), bytes.size(), Deadline(5s), "server");
  return s.ok() ? "" : s.message();
}

// The server's answer to a challenge with nonce nc.
std::string ReadAnswer(int fd) {
  std::string a(kAnswerBytes, '\0');
  Status s = transport_internal::RecvAll(fd, a.data(), a.size(), Deadline(5s), "server");
  EXPECT_TRUE(s.ok()) << s.message();
  return a;
}

struct Receiver {
  std::vector<uint16_t> tensor = std::vector<uint16_t>(64, 7);
  std::unique_ptr<PushReceiver> rx;
};

std::unique_ptr<Receiver> OpenReceiver(int port, const std::string& secret) {
  auto r = std::make_unique<Receiver>();
  PushReceiverOptions o;
  o.address = "127.0.0.1:" + std::to_string(port);
  o.secret = secret;
  o.tensors.push_back({"t", DType::kBF16, {64}, r->tensor.data()});
  auto rx = PushReceiver::Open(o);
  EXPECT_TRUE(rx.ok()) << rx.status().message();
  if (rx.ok()) r->rx = std::move(rx).value();
  return r;
}

std::string AllEvents(PushServer& s) {
  std::string all;
  for (const std::string& e : s.TakeEvents()) all += e + "\n";
  return all;
}

TEST(PushAuth, StrangersAreRefusedAndLoggedBeforeAnythingWhileTheJobIsServed) {
  ::testing::internal::CaptureStderr();
  PushServerOptions o;
  o.secret = kSecret;
  auto server = PushServer::Start(o);
  ASSERT_TRUE(server.ok()) << server.status().message();
  PushServer& s = **server;
  auto member = OpenReceiver(s.port(), kSecret);
  ASSERT_TRUE(test::WaitFor([&] { return s.Receivers().size() == 1; }));

  // A receiver of the wire format without the handshake: refused, nothing sent.
  ScopedFd plain = Dial(s.port());
  EXPECT_EQ(Send(plain.get(), push_internal::Frame(push_internal::Msg::kHello,
                                                   R"({"rank":0,"tp":1,"tensors":[]})")),
            "");
  EXPECT_EQ(ReadUntilClosed(plain.get()), "");

  uint8_t nc[kNonceBytes];
  ASSERT_TRUE(crypto::RandomBytes(nc, sizeof nc).ok());
  // A legitimate handshake, recorded (a sniffer's view), for the replay.
  ScopedFd recorded = Dial(s.port());
  ASSERT_EQ(Send(recorded.get(), Challenge(nc)), "");
  const std::string old = ReadAnswer(recorded.get());
  const std::string old_proof =
      ProofBytes(kSecret, "client", nc, reinterpret_cast<const uint8_t*>(old.data()));
  ASSERT_EQ(Send(recorded.get(), old_proof), "");
  recorded = ScopedFd();

  // Another secret, a replayed proof, a reflected one: each gets the
  // handshake's answer and nothing after it.
  auto stranger = [&](auto proof_of) {
    ScopedFd fd = Dial(s.port());
    EXPECT_EQ(Send(fd.get(), Challenge(nc)), "");
    const std::string answer = ReadAnswer(fd.get());
    EXPECT_EQ(Send(fd.get(), proof_of(answer) + push_internal::Frame(push_internal::Msg::kHello,
                                                                     R"({"rank":0,"tp":1})")),
              "");
    EXPECT_EQ(ReadUntilClosed(fd.get()), "");
  };
  stranger([&](const std::string& a) {
    return ProofBytes(kOther, "client", nc, reinterpret_cast<const uint8_t*>(a.data()));
  });
  stranger([&](const std::string&) { return old_proof; });
  stranger([&](const std::string& a) { return a.substr(kNonceBytes); });
  // A receiver without the secret, and one with another.
  auto no_secret = OpenReceiver(s.port(), "");
  auto other = OpenReceiver(s.port(), kOther);
  ASSERT_TRUE(test::WaitFor([&] { return s.refused() >= 6; })) << s.refused();
  ASSERT_TRUE(test::WaitFor([&] {
    return other->rx->GetStatus().error.find("did not prove it knows the job secret") !=
           std::string::npos;
  })) << other->rx->GetStatus().error;
  EXPECT_FALSE(no_secret->rx->GetStatus().connected);

  const std::string events = AllEvents(s);
  EXPECT_NE(events.find("from 127.0.0.1:"), std::string::npos) << events;
  EXPECT_NE(events.find("refused: no authentication handshake (it sent \"DPSH"), std::string::npos)
      << events;
  EXPECT_NE(events.find("refused: wrong authentication proof"), std::string::npos) << events;
  EXPECT_NE(events.find("before authenticating"), std::string::npos) << events;
  // The job's receivers: the first still there, a new one served.
  auto second = OpenReceiver(s.port(), kSecret);
  ASSERT_TRUE(test::WaitFor([&] { return s.Receivers().size() == 2; })) << s.Receivers().size();
  EXPECT_TRUE(member->rx->GetStatus().connected);
  const auto status = nlohmann::json::parse(s.StatusJson());
  EXPECT_EQ(status["authenticated"], true);
  EXPECT_GE(status["refused"].get<uint64_t>(), 6u);
  // Both ends log: the server each refusal, the receiver the server that
  // did not prove the secret (once).
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(log.find(": connection 2 from 127.0.0.1:"), std::string::npos) << log;
  const std::string rx_line =
      "dte: push receiver rank 0: the push server at 127.0.0.1:" + std::to_string(s.port()) +
      " did not prove it knows the job secret";
  const size_t first = log.find(rx_line);
  EXPECT_NE(first, std::string::npos) << log;
  EXPECT_EQ(log.find(rx_line, first + 1), std::string::npos) << log;
}

TEST(PushAuth, WithoutASecretTheServerListensOnLoopbackOnly) {
  PushServerOptions o;
  o.address = "0.0.0.0:0";
  auto refused = PushServer::Start(o);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), Code::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("0.0.0.0:0, which is not a loopback address"),
            std::string::npos)
      << refused.status().message();
  EXPECT_NE(refused.status().message().find("DTE_JOB_SECRET"), std::string::npos);
  o.address = "127.0.0.1:0";
  auto loopback = PushServer::Start(o);
  ASSERT_TRUE(loopback.ok()) << loopback.status().message();
  EXPECT_EQ(nlohmann::json::parse((*loopback)->StatusJson())["authenticated"], false);
  o.address = "0.0.0.0:0";
  o.secret = kSecret;
  auto with_secret = PushServer::Start(o);
  EXPECT_TRUE(with_secret.ok()) << with_secret.status().message();
}

void WriteFile(const std::string& path, const std::string& text, mode_t mode) {
  std::ofstream(path) << text;
  ASSERT_EQ(chmod(path.c_str(), mode), 0);
}

TEST(JobSecret, FilesOthersMayReadAreRefusedNamingTheFile) {
  test::ScopedTempDir dir;
  const std::string path = dir.path() + "/secret";
  WriteFile(path, kSecret + "\n", 0644);
  auto bad = ReadSecretFile(path);
  EXPECT_EQ(bad.status().code(), Code::kPermissionDenied);
  EXPECT_NE(bad.status().message().find(path + " has mode 0644"), std::string::npos)
      << bad.status().message();
  auto found = FindJobSecret("", dir.path());
  EXPECT_EQ(found.status().code(), Code::kPermissionDenied);
  ASSERT_EQ(chmod(path.c_str(), 0600), 0);
  auto good = FindJobSecret("", dir.path());
  ASSERT_TRUE(good.ok() && good->has_value()) << good.status().message();
  EXPECT_EQ((*good)->key, kSecret);  // without the newline
  WriteFile(path, "short", 0600);
  EXPECT_EQ(ReadSecretFile(path).status().code(), Code::kInvalidArgument);
}

TEST(JobSecret, ArgumentThenEnvironmentThenRendezvous) {
  test::ScopedTempDir dir;
  auto created = CreateRendezvousSecret(dir.path());
  ASSERT_TRUE(created.ok()) << created.status().message();
  EXPECT_EQ(created->key.size(), 64u);
  struct stat st {};
  ASSERT_EQ(stat((dir.path() + "/secret").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_EQ(CreateRendezvousSecret(dir.path())->key, created->key);  // kept
  EXPECT_EQ((*FindJobSecret("", dir.path()))->key, created->key);
  EXPECT_FALSE(FindJobSecret("", "")->has_value());
  const std::string file = dir.path() + "/env-secret";
  WriteFile(file, kOther, 0600);
  setenv(kSecretFileEnv, file.c_str(), 1);
  EXPECT_EQ((*FindJobSecret("", dir.path()))->key, kOther);
  setenv(kSecretEnv, "environment-secret-0123", 1);
  EXPECT_EQ((*FindJobSecret("", dir.path()))->key, "environment-secret-0123");
  EXPECT_EQ((*FindJobSecret(kSecret, dir.path()))->key, kSecret);
  unsetenv(kSecretEnv);
  unsetenv(kSecretFileEnv);
}

// The two ranks' results of connecting a transport.
struct TwoRanks {
  Result<std::unique_ptr<Transport>> r0 = Internal("not run");
  Result<std::unique_ptr<Transport>> r1 = Internal("not run");
};

TEST(TcpTransportAuth, StrangersAreRefusedAndLoggedAndTheRanksStillConnect) {
  test::ScopedTempDir dir;
  TwoRanks t;
  ::testing::internal::CaptureStderr();
  std::thread rank0([&] { t.r0 = ConnectTcpTransport({0, 2, dir.path(), 10s, {}}); });
  auto port = transport_internal::WaitForFile(dir.path(), "rank-0", Deadline(5s), "rank 0");
  ASSERT_TRUE(port.ok());
  // A hello without the handshake, then a handshake with another secret.
  ScopedFd plain = Dial(std::stoi(*port));
  std::string hello(24, '\0');
  std::memcpy(hello.data(), "DTEP2P01", 8);
  hello[8] = 1;
  hello[16] = 2;
  EXPECT_EQ(Send(plain.get(), hello), "");
  EXPECT_EQ(ReadUntilClosed(plain.get()), "");
  ScopedFd wrong = Dial(std::stoi(*port));
  Status st = auth_internal::ClientHandshake(wrong.get(), kOther, "p2p", Deadline(5s), "rank 0");
  EXPECT_EQ(st.code(), Code::kPermissionDenied) << st.message();
  wrong = ScopedFd();  // it gives up, as a stranger's client would
  t.r1 = ConnectTcpTransport({1, 2, dir.path(), 10s, {}});
  rank0.join();
  const std::string log = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(t.r0.ok()) << t.r0.status().message();
  ASSERT_TRUE(t.r1.ok()) << t.r1.status().message();
  EXPECT_NE(log.find("TCP transport rank 0 of 2 refused a connection from 127.0.0.1:"),
            std::string::npos)
      << log;
  EXPECT_NE(log.find("no authentication handshake (it sent \"DTEP2P01"), std::string::npos) << log;
  const std::vector<uint8_t> out = {1, 2, 3};
  std::vector<uint8_t> in(3);
  std::thread peer([&] {
    const RecvBuffer r[] = {{0, in.data(), 3}};
    EXPECT_TRUE((*t.r1)->Exchange({}, r).ok());
  });
  const SendBuffer s[] = {{1, out.data(), 3}};
  EXPECT_TRUE((*t.r0)->Exchange(s, {}).ok());
  peer.join();
  EXPECT_EQ(in, out);
}

TEST(TcpTransportAuth, RankWithAnotherSecretIsRefusedAndNamed) {
  test::ScopedTempDir dir;
  TwoRanks t;
  ::testing::internal::CaptureStderr();
  std::thread rank0([&] {
    TransportOptions o{0, 2, dir.path(), 1500ms, kSecret};
    t.r0 = ConnectTcpTransport(o);
  });
  TransportOptions o{1, 2, dir.path(), 1500ms, kOther};
  t.r1 = ConnectTcpTransport(o);
  rank0.join();
  ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(t.r1.status().code(), Code::kPermissionDenied) << t.r1.status().message();
  EXPECT_NE(t.r1.status().message().find("rank 0 did not prove it knows the job secret"),
            std::string::npos)
      << t.r1.status().message();
  ASSERT_FALSE(t.r0.ok());
  EXPECT_NE(t.r0.status().message().find("refused 1 connection(s) without the job secret"),
            std::string::npos)
      << t.r0.status().message();
}

TEST(TcpTransportAuth, RendezvousSecretOthersMayReadIsRefused) {
  test::ScopedTempDir dir;
  WriteFile(dir.path() + "/secret", kSecret, 0640);
  auto t = ConnectTcpTransport({0, 1, dir.path(), 1s, {}});
  EXPECT_EQ(t.status().code(), Code::kPermissionDenied);
  EXPECT_NE(t.status().message().find(dir.path() + "/secret has mode 0640"), std::string::npos)
      << t.status().message();
}

}  // namespace
}  // namespace dte
