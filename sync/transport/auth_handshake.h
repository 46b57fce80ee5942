// Mutual authentication of a TCP connection with the job secret
// (sync/transport/job_secret.h): the first bytes on every connection of the push
// protocol and of the TCP transport when the job has a secret. Each side
// proves it knows the secret to the other; neither sends anything else
// until the other's proof is checked.
//
//   challenge := "DTEAUTH1" nonce_c            (client -> server, 40 bytes)
//   answer    := nonce_s proof_s               (server -> client, 64 bytes)
//   proof     := proof_c                       (client -> server, 32 bytes)
//   proof_R   := HMAC-SHA256(secret, "dte-auth-v1" 0 protocol 0 R 0 nonce_c nonce_s)
// with R "server" or "client", nonces 32 fresh random bytes of each side,
// and protocol the name of what the connection then carries ("push",
// "p2p"). The client checks proof_s before it sends proof_c and then its
// protocol's first message without waiting: one round trip in all. Both
// nonces in every proof make an old proof useless on a new connection;
// the role makes the server's proof useless as a client's (a reflection);
// the protocol keeps one protocol's proofs out of the other.
//
// Thread-safety: ServerHandshake is owned by one thread; the functions are
// pure or act on a caller-owned descriptor.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "store/base/status.h"
#include "store/crypto.h"
#include "sync/transport/socket.h"

namespace dte::auth_internal {

inline constexpr char kMagic[] = "DTEAUTH1";
inline constexpr size_t kMagicBytes = 8;
inline constexpr size_t kNonceBytes = 32;
inline constexpr size_t kChallengeBytes = kMagicBytes + kNonceBytes;
inline constexpr size_t kAnswerBytes = kNonceBytes + crypto::kSha256Bytes;
inline constexpr size_t kProofBytes = crypto::kSha256Bytes;

// proof_R of the grammar above.
Result<crypto::Mac> Proof(const std::string& secret, const std::string& protocol,
                          const std::string& role, const uint8_t* nonce_c, const uint8_t* nonce_s);

// The server's side, fed bytes as they arrive (an event loop's socket).
class ServerHandshake {
 public:
  ServerHandshake(std::string secret, std::string protocol)
      : secret_(std::move(secret)), protocol_(std::move(protocol)) {}

  // Takes the bytes of the handshake off the front of *in and appends what
  // to send to *out. Returns true once the client's proof is checked (the
  // rest of *in is then the protocol's), false while it needs more bytes;
  // PermissionDenied saying why for a connection that does not prove it
  // knows the secret (no handshake, a wrong proof), which is then closed.
  Result<bool> Feed(std::string* in, std::string* out);
  bool done() const { return stage_ == Stage::kDone; }

 private:
  enum class Stage { kChallenge, kProof, kDone };
  const std::string secret_, protocol_;
  Stage stage_ = Stage::kChallenge;
  uint8_t nonce_c_[kNonceBytes] = {}, nonce_s_[kNonceBytes] = {};
};

// The client's side over a connected non-blocking socket, bounded by the
// deadline: sends the challenge, checks the server's proof, sends its own.
// PermissionDenied naming `who` when the server's proof is wrong or it
// closes the connection instead of answering (it holds another secret, or
// none).
Status ClientHandshake(int fd, const std::string& secret, const std::string& protocol,
                       const transport_internal::Deadline& deadline, const std::string& who);

// The server's side over a connected socket, blocking (the TCP transport's
// acceptor): PermissionDenied saying why, as ServerHandshake::Feed.
Status ServerHandshakeOn(int fd, const std::string& secret, const std::string& protocol,
                         const transport_internal::Deadline& deadline, const std::string& who);

}  // namespace dte::auth_internal
