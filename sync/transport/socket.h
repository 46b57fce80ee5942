// Socket and rendezvous helpers of the TCP transport (sync/transport/transport.h).
// Every blocking step takes a Deadline and polls, so nothing waits past it.
//
// Thread-safety: pure functions over caller-owned descriptors.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

#include "store/base/posix_file.h"
#include "store/base/status.h"

namespace dte::transport_internal {

class Deadline {
 public:
  explicit Deadline(std::chrono::milliseconds timeout)
      : end_(std::chrono::steady_clock::now() + timeout) {}
  // Milliseconds left, rounded up, >= 0: a poll(2) timeout.
  int RemainingMs() const;
  bool Expired() const { return std::chrono::steady_clock::now() >= end_; }

 private:
  std::chrono::steady_clock::time_point end_;
};

// Writes `content` to dir/name atomically (a temp file renamed into place),
// so readers never see a partial file.
Status PublishFile(const std::string& dir, const std::string& name, const std::string& content);

// Waits until dir/name exists and returns its content; on the deadline fails
// with DeadlineExceeded "timed out ... waiting for <who>".
Result<std::string> WaitForFile(const std::string& dir, const std::string& name,
                                const Deadline& deadline, const std::string& who);

// A listening IPv4 loopback socket on an ephemeral port, stored to *port.
Result<ScopedFd> ListenLoopback(int backlog, int* port);

// A connected, non-blocking socket to 127.0.0.1:port (TCP_NODELAY).
Result<ScopedFd> ConnectLoopback(int port, const Deadline& deadline, const std::string& who);

// "host:port" split at the last ':' (IPv6 hosts in brackets: "[::1]:29600");
// InvalidArgument naming the address otherwise. Port 0 asks for an
// ephemeral port when listening.
Status SplitHostPort(const std::string& address, std::string* host, int* port);

// A listening TCP socket on host:port (resolved with getaddrinfo; "" or
// "0.0.0.0" for every interface), its bound port stored to *bound_port.
Result<ScopedFd> ListenTcp(const std::string& address, int backlog, int* bound_port);

// A connected, non-blocking socket to host:port (TCP_NODELAY), trying each
// resolved address until the deadline. `who` says what the peer is ("the
// push server"); errors add " at ADDRESS" to it.
Result<ScopedFd> ConnectTcp(const std::string& address, const Deadline& deadline,
                            const std::string& who);

// True when every address host:port resolves to (for listening) is a
// loopback one (127.0.0.0/8, ::1); false for "", "0.0.0.0", "::" and any
// other interface.
Result<bool> IsLoopbackAddress(const std::string& address);

// "HOST:PORT" of a connected socket's peer (numeric), or "an unknown peer".
std::string PeerName(int fd);

// Accepts one connection on a listening socket, or fails on the deadline.
Result<ScopedFd> AcceptOne(int listen_fd, const Deadline& deadline, const std::string& waiting_for);

// Makes fd non-blocking with TCP_NODELAY.
Status PrepareStream(int fd);

// Blocking-style full transfers over a non-blocking socket, bounded by the
// deadline; `who` names the peer in errors ("rank 3").
Status SendAll(int fd, const void* data, size_t len, const Deadline& deadline,
               const std::string& who);
Status RecvAll(int fd, void* data, size_t len, const Deadline& deadline, const std::string& who);

void PutU64(uint8_t* p, uint64_t v);  // little-endian
uint64_t GetU64(const uint8_t* p);

}  // namespace dte::transport_internal
