// The TCP transport: one stream per pair of ranks, non-blocking sockets
// multiplexed with poll(2) under the Exchange deadline.
//
// Stream grammar (every integer u64 little-endian):
//   auth    := the job secret's handshake, protocol "p2p"
//              (sync/transport/auth_handshake.h; the connector is the client)
//   hello   := magic "DTEP2P01" rank size        (connector -> acceptor, once)
//   stream  := frame* [abort]
//   frame   := length payload                     (length < 2^63)
//   abort   := 0xffffffffffffffff msg_len msg     (then the sender shuts down)
// A rank whose Exchange fails sends `abort` with its error to every peer it
// is not in the middle of a frame with, so ranks that wait on it fail naming
// the root cause instead of timing out; then it shuts its streams down.
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <optional>
#include <vector>

#include "sync/transport/auth_handshake.h"
#include "sync/transport/internal/chunk.h"
#include "sync/transport/job_secret.h"
#include "sync/transport/socket.h"
#include "sync/transport/transport.h"

namespace dte {
namespace {

using transport_internal::Deadline;
using transport_internal::GetU64;
using transport_internal::PutU64;

constexpr uint64_t kMagic = 0x3130503250455444;  // "DTEP2P01" little-endian
constexpr uint64_t kAbortTag = ~uint64_t{0};

std::string RankName(int r) { return "rank " + std::to_string(r); }

// Progress of one peer's queue of frames within an Exchange.
struct PeerIo {
  int fd = -1;
  std::vector<const SendBuffer*> out;
  size_t out_i = 0, out_off = 0;  // frame index, bytes of it written
  uint8_t out_hdr[8];
  std::vector<const RecvBuffer*> in;
  size_t in_i = 0, in_off = 0;  // frame index, bytes of it read
  uint8_t in_hdr[8];
  bool Pending() const { return out_i < out.size() || in_i < in.size(); }
};

// Thread-safety: one caller at a time (the Transport contract); no locks.
class TcpTransport final : public Transport {
 public:
  TcpTransport(const TransportOptions& o, std::vector<ScopedFd> fds)
      : options_(o), fds_(std::move(fds)) {}
  ~TcpTransport() override = default;

  int rank() const override { return options_.rank; }
  int size() const override { return options_.size; }
  Status Exchange(std::span<const SendBuffer> sends, std::span<const RecvBuffer> recvs) override;

 private:
  std::string Me() const {
    return "TCP transport " + RankName(options_.rank) + " of " + std::to_string(options_.size);
  }
  Status WriteSome(int peer, PeerIo& io);
  Status ReadSome(int peer, PeerIo& io);
  Status ReadAbort(int peer, int fd);
  // Moves every pending frame until all are done, one fails or the deadline.
  Status Progress(std::map<int, PeerIo>& ios, const Deadline& deadline);
  Status Fail(Status st, const std::map<int, PeerIo>& ios);

  const TransportOptions options_;
  std::vector<ScopedFd> fds_;  // [peer], -1 for this rank
  Status error_;               // set once broken
};

Status TcpTransport::WriteSome(int peer, PeerIo& io) {
  while (io.out_i < io.out.size()) {
    const SendBuffer& b = *io.out[io.out_i];
    if (io.out_off == 0) PutU64(io.out_hdr, b.bytes);
    const bool in_header = io.out_off < 8;
    const uint8_t* p = in_header ? io.out_hdr + io.out_off
                                 : static_cast<const uint8_t*>(b.data) + (io.out_off - 8);
    const size_t left = in_header ? 8 - io.out_off : b.bytes - (io.out_off - 8);
    ssize_t n = 0;
    if (left > 0) {
      n = send(io.fd, p, left, MSG_NOSIGNAL);
      if (n < 0) {
        if (errno == EAGAIN || errno == EINTR) return Status::Ok();
        Status failed = ErrnoStatus("send to " + RankName(peer), errno);
        // A peer that failed first sent its reason before closing: report
        // that (naming the root cause) rather than the broken pipe.
        uint8_t hdr[8];
        if (io.in_off == 0 && recv(io.fd, hdr, 8, MSG_PEEK | MSG_DONTWAIT) == 8 &&
            GetU64(hdr) == kAbortTag && recv(io.fd, hdr, 8, MSG_DONTWAIT) == 8) {
          return ReadAbort(peer, io.fd);
        }
        return failed;
      }
    }
    io.out_off += static_cast<size_t>(n);
    if (io.out_off == 8 + b.bytes) {
      ++io.out_i;
      io.out_off = 0;
    }
  }
  return Status::Ok();
}

Status TcpTransport::ReadAbort(int peer, int fd) {
  const Deadline deadline(options_.timeout);
  uint8_t len_bytes[8];
  RETURN_IF_ERROR(transport_internal::RecvAll(fd, len_bytes, 8, deadline, RankName(peer)));
  const uint64_t len = GetU64(len_bytes);
  if (len > (1u << 16)) return Corruption(RankName(peer) + " sent a malformed abort");
  std::string msg(len, '\0');
  RETURN_IF_ERROR(transport_internal::RecvAll(fd, msg.data(), len, deadline, RankName(peer)));
  return Aborted(RankName(peer) + " aborted the exchange: " + msg);
}

Status TcpTransport::ReadSome(int peer, PeerIo& io) {
  while (io.in_i < io.in.size()) {
    const RecvBuffer& b = *io.in[io.in_i];
    const bool in_header = io.in_off < 8;
    uint8_t* p =
        in_header ? io.in_hdr + io.in_off : static_cast<uint8_t*>(b.data) + (io.in_off - 8);
    const size_t left = in_header ? 8 - io.in_off : b.bytes - (io.in_off - 8);
    ssize_t n = 0;
    if (left > 0) {
      n = recv(io.fd, p, left, 0);
      if (n == 0)
        return Unavailable(RankName(peer) + " closed the connection (exited or crashed?)");
      if (n < 0) {
        if (errno == EAGAIN || errno == EINTR) return Status::Ok();
        return ErrnoStatus("recv from " + RankName(peer), errno);
      }
    }
    io.in_off += static_cast<size_t>(n);
    if (in_header && io.in_off == 8) {
      const uint64_t len = GetU64(io.in_hdr);
      if (len == kAbortTag) return ReadAbort(peer, io.fd);
      if (len != b.bytes) {
        return Corruption(RankName(peer) + " sent a message of " + std::to_string(len) +
                          " bytes where " + std::to_string(b.bytes) + " were expected");
      }
    }
    if (io.in_off == 8 + b.bytes) {
      ++io.in_i;
      io.in_off = 0;
    }
  }
  return Status::Ok();
}

Status TcpTransport::Fail(Status st, const std::map<int, PeerIo>& ios) {
  error_ = st.WithContext(Me());
  std::vector<uint8_t> abort(16);
  PutU64(abort.data(), kAbortTag);
  PutU64(abort.data() + 8, error_.message().size());
  abort.insert(abort.end(), error_.message().begin(), error_.message().end());
  for (int peer = 0; peer < options_.size; ++peer) {
    const int fd = fds_[peer].get();
    if (fd < 0) continue;
    auto it = ios.find(peer);
    const bool mid_frame = it != ios.end() && it->second.out_off != 0;
    // Best effort and non-blocking: a full socket buffer leaves the peer
    // with a plain end of stream instead.
    if (!mid_frame) (void)!send(fd, abort.data(), abort.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    shutdown(fd, SHUT_WR);
  }
  return error_;
}

Status TcpTransport::Exchange(std::span<const SendBuffer> sends,
                              std::span<const RecvBuffer> recvs) {
  if (!error_.ok()) return error_;
  std::map<int, PeerIo> ios;
  for (const SendBuffer& b : sends) {
    if (b.peer < 0 || b.peer >= options_.size) return InvalidArgument(Me() + ": bad peer");
    if (b.peer != options_.rank) ios[b.peer].out.push_back(&b);
  }
  for (const RecvBuffer& b : recvs) {
    if (b.peer < 0 || b.peer >= options_.size) return InvalidArgument(Me() + ": bad peer");
    if (b.peer != options_.rank) ios[b.peer].in.push_back(&b);
  }
  if (Status st = transport_internal::CopyToSelf(options_.rank, sends, recvs, Me()); !st.ok())
    return Fail(st, ios);
  for (auto& [peer, io] : ios) io.fd = fds_[peer].get();
  if (Status st = Progress(ios, Deadline(options_.timeout)); !st.ok()) return Fail(st, ios);
  return Status::Ok();
}

Status TcpTransport::Progress(std::map<int, PeerIo>& ios, const Deadline& deadline) {
  for (;;) {
    std::vector<pollfd> fds;
    std::vector<int> peers;
    for (auto& [peer, io] : ios) {
      if (!io.Pending()) continue;
      short ev = 0;
      if (io.out_i < io.out.size()) ev |= POLLOUT;
      if (io.in_i < io.in.size()) ev |= POLLIN;
      fds.push_back({io.fd, ev, 0});
      peers.push_back(peer);
    }
    if (fds.empty()) return Status::Ok();
    const int n = poll(fds.data(), fds.size(), deadline.RemainingMs());
    if (n < 0 && errno != EINTR) return ErrnoStatus("poll", errno);
    if (n == 0) {
      std::string who;
      for (int p : peers) who += (who.empty() ? "" : ", ") + RankName(p);
      return DeadlineExceeded("timed out after " + std::to_string(options_.timeout.count()) +
                              " ms waiting for " + who);
    }
    for (size_t i = 0; n > 0 && i < fds.size(); ++i) {
      if (fds[i].revents == 0) continue;
      PeerIo& io = ios[peers[i]];
      RETURN_IF_ERROR(ReadSome(peers[i], io));
      RETURN_IF_ERROR(WriteSome(peers[i], io));
    }
  }
}

constexpr char kProtocol[] = "p2p";

// Connector side of one pair: this rank dials `peer` (a lower rank).
Result<ScopedFd> Dial(const TransportOptions& o, const std::string& secret, int peer,
                      const Deadline& deadline) {
  const std::string who = RankName(peer);
  ASSIGN_OR_RETURN(std::string port,
                   transport_internal::WaitForFile(o.rendezvous_dir, "rank-" + std::to_string(peer),
                                                   deadline, who));
  ASSIGN_OR_RETURN(ScopedFd fd,
                   transport_internal::ConnectLoopback(std::atoi(port.c_str()), deadline, who));
  RETURN_IF_ERROR(auth_internal::ClientHandshake(fd.get(), secret, kProtocol, deadline, who));
  uint8_t hello[24];
  PutU64(hello, kMagic);
  PutU64(hello + 8, static_cast<uint64_t>(o.rank));
  PutU64(hello + 16, static_cast<uint64_t>(o.size));
  RETURN_IF_ERROR(transport_internal::SendAll(fd.get(), hello, sizeof(hello), deadline, who));
  return fd;
}

// Bound on one connection's handshake: a stranger that connects and sends
// nothing holds the acceptor up this long at most.
constexpr int kHandshakeMs = 5000;

// Accepts the next connection that proves it knows the secret; the others
// are logged, closed and counted (*refusals, *refused: the last one).
Result<ScopedFd> AcceptAuthenticated(const TransportOptions& o, const std::string& secret,
                                     int listen_fd, const Deadline& deadline,
                                     const std::string& missing, uint64_t* refusals,
                                     std::string* refused) {
  for (;;) {
    std::string waiting = missing + " to connect";
    if (*refusals > 0) {
      waiting += " (refused " + std::to_string(*refusals) +
                 " connection(s) without the job secret; the last " + *refused + ")";
    }
    ASSIGN_OR_RETURN(ScopedFd fd, transport_internal::AcceptOne(listen_fd, deadline, waiting));
    const std::string from = "from " + transport_internal::PeerName(fd.get());
    const Deadline bound(std::chrono::milliseconds(std::min(deadline.RemainingMs(), kHandshakeMs)));
    const Status auth = auth_internal::ServerHandshakeOn(fd.get(), secret, kProtocol, bound,
                                                         "the connection " + from);
    if (auth.ok()) return fd;
    ++*refusals;
    *refused = from + ": " + auth.message();
    std::fprintf(stderr, "dte: TCP transport rank %d of %d refused a connection %s\n", o.rank,
                 o.size, refused->c_str());
  }
}

// Acceptor side: every higher rank dials in, proves it knows the secret
// and says who it is.
Status AcceptHigher(const TransportOptions& o, const std::string& secret, int listen_fd,
                    const Deadline& deadline, std::vector<ScopedFd>* fds) {
  uint64_t refusals = 0;
  std::string refused;
  for (int pending = o.size - 1 - o.rank; pending > 0; --pending) {
    std::string missing;
    for (int p = o.rank + 1; p < o.size; ++p) {
      if ((*fds)[p].get() < 0) missing += (missing.empty() ? "" : ", ") + RankName(p);
    }
    ASSIGN_OR_RETURN(ScopedFd fd, AcceptAuthenticated(o, secret, listen_fd, deadline, missing,
                                                      &refusals, &refused));
    uint8_t hello[24];
    RETURN_IF_ERROR(
        transport_internal::RecvAll(fd.get(), hello, sizeof(hello), deadline, "a connecting rank"));
    const uint64_t peer = GetU64(hello + 8);
    if (GetU64(hello) != kMagic || GetU64(hello + 16) != static_cast<uint64_t>(o.size) ||
        peer <= static_cast<uint64_t>(o.rank) || peer >= static_cast<uint64_t>(o.size) ||
        (*fds)[peer].get() >= 0) {
      return Corruption("unexpected hello from a connecting peer (another job sharing " +
                        o.rendezvous_dir + "?)");
    }
    (*fds)[peer] = std::move(fd);
  }
  return Status::Ok();
}

// The secret given (argument, environment); on rank 0 else the rendezvous
// directory's, created when there is none. Empty: a rank above 0 reads the
// rendezvous's (RendezvousSecret).
Result<std::string> OwnSecret(const TransportOptions& o) {
  ASSIGN_OR_RETURN(std::optional<JobSecret> given,
                   FindJobSecret(o.secret, o.rank == 0 ? o.rendezvous_dir : ""));
  if (given) return std::move(given->key);
  if (o.rank != 0) return std::string();
  ASSIGN_OR_RETURN(JobSecret created, CreateRendezvousSecret(o.rendezvous_dir));
  return std::move(created.key);
}

// A rank above 0 without a secret of its own: the one rank 0 put in the
// rendezvous directory before publishing its address.
Status RendezvousSecret(const TransportOptions& o, const Deadline& deadline, std::string* secret) {
  RETURN_IF_ERROR(
      transport_internal::WaitForFile(o.rendezvous_dir, "rank-0", deadline, RankName(0)).status());
  ASSIGN_OR_RETURN(std::optional<JobSecret> found, FindJobSecret("", o.rendezvous_dir));
  if (!found) {
    return NotFound("no job secret: rank 0 published its address in " + o.rendezvous_dir +
                    " but no secret file (it has a secret of its own: give every rank the same "
                    "one; " +
                    HowToGiveASecret() + ")");
  }
  *secret = std::move(found->key);
  return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<Transport>> ConnectTcpTransport(const TransportOptions& o) {
  if (o.size < 1 || o.rank < 0 || o.rank >= o.size || o.rendezvous_dir.empty()) {
    return InvalidArgument("TCP transport: rank " + std::to_string(o.rank) + " of " +
                           std::to_string(o.size) + " with rendezvous dir '" + o.rendezvous_dir +
                           "' is not a valid setup");
  }
  const std::string me = "TCP transport " + RankName(o.rank) + " of " + std::to_string(o.size);
  const Deadline deadline(o.timeout);
  // Rank 0 settles the secret before it publishes its address; the others
  // read the rendezvous's, if they have none, once rank 0's address is there.
  Result<std::string> secret = OwnSecret(o);
  if (!secret.ok()) return secret.status().WithContext(me);
  int port = 0;
  ASSIGN_OR_RETURN(ScopedFd listener, transport_internal::ListenLoopback(o.size, &port));
  RETURN_IF_ERROR(transport_internal::PublishFile(
                      o.rendezvous_dir, "rank-" + std::to_string(o.rank), std::to_string(port))
                      .WithContext(me));
  if (secret->empty()) {
    Status read = RendezvousSecret(o, deadline, &*secret);
    if (!read.ok()) return read.WithContext(me);
  }
  std::vector<ScopedFd> fds(o.size);
  for (int peer = 0; peer < o.rank; ++peer) {
    Result<ScopedFd> fd = Dial(o, *secret, peer, deadline);
    if (!fd.ok()) return fd.status().WithContext(me);
    fds[peer] = std::move(fd).value();
  }
  RETURN_IF_ERROR(AcceptHigher(o, *secret, listener.get(), deadline, &fds).WithContext(me));
  return std::unique_ptr<Transport>(new TcpTransport(o, std::move(fds)));
}

}  // namespace dte
