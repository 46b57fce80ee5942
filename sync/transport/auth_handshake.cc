#include "sync/transport/auth_handshake.h"

#include <cctype>
#include <cstring>

namespace dte::auth_internal {
namespace {

// The first bytes of what a connection sent instead of a challenge, for
// messages ("DPSH..." is a push hello: a receiver without the secret).
std::string Printable(const std::string& bytes, size_t n) {
  std::string out;
  for (size_t i = 0; i < std::min(n, bytes.size()); ++i) {
    const unsigned char c = static_cast<unsigned char>(bytes[i]);
    out += std::isprint(c) ? static_cast<char>(c) : '.';
  }
  return out;
}

}  // namespace

Result<crypto::Mac> Proof(const std::string& secret, const std::string& protocol,
                          const std::string& role, const uint8_t* nonce_c, const uint8_t* nonce_s) {
  std::string transcript = "dte-auth-v1";
  transcript += '\0';
  transcript += protocol;
  transcript += '\0';
  transcript += role;
  transcript += '\0';
  transcript.append(reinterpret_cast<const char*>(nonce_c), kNonceBytes);
  transcript.append(reinterpret_cast<const char*>(nonce_s), kNonceBytes);
  return crypto::HmacSha256(secret, transcript);
}

Result<bool> ServerHandshake::Feed(std::string* in, std::string* out) {
  if (stage_ == Stage::kChallenge) {
    const size_t have = std::min(in->size(), kMagicBytes);
    if (std::memcmp(in->data(), kMagic, have) != 0) {
      return PermissionDenied("no authentication handshake (it sent \"" + Printable(*in, 8) +
                              "...\"; a peer without the job secret?)");
    }
    if (in->size() < kChallengeBytes) return false;
    std::memcpy(nonce_c_, in->data() + kMagicBytes, kNonceBytes);
    in->erase(0, kChallengeBytes);
    RETURN_IF_ERROR(crypto::RandomBytes(nonce_s_, kNonceBytes));
    ASSIGN_OR_RETURN(crypto::Mac mine, Proof(secret_, protocol_, "server", nonce_c_, nonce_s_));
    out->append(reinterpret_cast<const char*>(nonce_s_), kNonceBytes);
    out->append(reinterpret_cast<const char*>(mine.data()), mine.size());
    stage_ = Stage::kProof;
  }
  if (stage_ == Stage::kProof) {
    if (in->size() < kProofBytes) return false;
    ASSIGN_OR_RETURN(crypto::Mac want, Proof(secret_, protocol_, "client", nonce_c_, nonce_s_));
    const bool good = crypto::EqualInConstantTime(in->data(), want.data(), kProofBytes);
    in->erase(0, kProofBytes);
    if (!good) {
      return PermissionDenied("wrong authentication proof (another job secret, or a replay)");
    }
    stage_ = Stage::kDone;
  }
  return true;
}

Status ClientHandshake(int fd, const std::string& secret, const std::string& protocol,
                       const transport_internal::Deadline& deadline, const std::string& who) {
  uint8_t challenge[kChallengeBytes];
  std::memcpy(challenge, kMagic, kMagicBytes);
  uint8_t* nonce_c = challenge + kMagicBytes;
  RETURN_IF_ERROR(crypto::RandomBytes(nonce_c, kNonceBytes));
  RETURN_IF_ERROR(transport_internal::SendAll(fd, challenge, sizeof challenge, deadline, who));
  uint8_t answer[kAnswerBytes];
  Status got = transport_internal::RecvAll(fd, answer, sizeof answer, deadline, who);
  if (!got.ok()) {
    return got.WithContext("no answer to the authentication challenge (does " + who +
                           " hold this job's secret?)");
  }
  const uint8_t* nonce_s = answer;
  ASSIGN_OR_RETURN(crypto::Mac want, Proof(secret, protocol, "server", nonce_c, nonce_s));
  if (!crypto::EqualInConstantTime(answer + kNonceBytes, want.data(), kProofBytes)) {
    return PermissionDenied(who +
                            " did not prove it knows the job secret (another job's, or "
                            "not a dte " +
                            protocol + " peer)");
  }
  ASSIGN_OR_RETURN(crypto::Mac mine, Proof(secret, protocol, "client", nonce_c, nonce_s));
  return transport_internal::SendAll(fd, mine.data(), mine.size(), deadline, who);
}

Status ServerHandshakeOn(int fd, const std::string& secret, const std::string& protocol,
                         const transport_internal::Deadline& deadline, const std::string& who) {
  ServerHandshake hs(secret, protocol);
  std::string in, out;
  // Exactly the handshake's bytes are read: what follows is the protocol's.
  for (size_t want : {kMagicBytes, kNonceBytes, kProofBytes}) {
    const size_t at = in.size();
    in.resize(at + want);
    RETURN_IF_ERROR(transport_internal::RecvAll(fd, in.data() + at, want, deadline, who));
    ASSIGN_OR_RETURN(bool done, hs.Feed(&in, &out));
    if (!out.empty()) {
      RETURN_IF_ERROR(transport_internal::SendAll(fd, out.data(), out.size(), deadline, who));
      out.clear();
    }
    if (done) return Status::Ok();
  }
  return Internal("the authentication handshake with " + who + " did not complete");
}

}  // namespace dte::auth_internal
