#include "sync/transport/socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>

namespace dte::transport_internal {
namespace {

sockaddr_in Loopback(int port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  return a;
}

// Polls one descriptor for `events` until ready or the deadline.
Status WaitReady(int fd, short events, const Deadline& deadline, const std::string& what) {
  for (;;) {
    pollfd p{fd, events, 0};
    const int n = poll(&p, 1, deadline.RemainingMs());
    if (n > 0) return Status::Ok();
    if (n == 0) return DeadlineExceeded("timed out " + what);
    if (errno != EINTR) return ErrnoStatus("poll while " + what, errno);
  }
}

}  // namespace

int Deadline::RemainingMs() const {
  const auto left = end_ - std::chrono::steady_clock::now();
  if (left <= std::chrono::steady_clock::duration::zero()) return 0;
  return static_cast<int>(std::chrono::ceil<std::chrono::milliseconds>(left).count());
}

Status PublishFile(const std::string& dir, const std::string& name, const std::string& content) {
  const std::string tmp = dir + "/." + name + ".tmp";
  ASSIGN_OR_RETURN(ScopedFd fd, OpenFile(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644));
  RETURN_IF_ERROR(WriteAll(fd.get(), content.data(), content.size(), tmp));
  RETURN_IF_ERROR(fd.Close(tmp));
  if (rename(tmp.c_str(), (dir + "/" + name).c_str()) != 0) {
    return ErrnoStatus("rename " + tmp, errno);
  }
  return Status::Ok();
}

Result<std::string> WaitForFile(const std::string& dir, const std::string& name,
                                const Deadline& deadline, const std::string& who) {
  const std::string path = dir + "/" + name;
  for (;;) {
    if (access(path.c_str(), F_OK) == 0) return ReadWholeFile(path);
    if (deadline.Expired()) {
      return DeadlineExceeded("timed out waiting for " + who + " to publish " + path);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

Result<ScopedFd> ListenLoopback(int backlog, int* port) {
  ScopedFd fd(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (fd.get() < 0) return ErrnoStatus("socket", errno);
  sockaddr_in a = Loopback(0);
  if (bind(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    return ErrnoStatus("bind 127.0.0.1", errno);
  }
  if (listen(fd.get(), backlog) != 0) return ErrnoStatus("listen", errno);
  socklen_t len = sizeof(a);
  if (getsockname(fd.get(), reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    return ErrnoStatus("getsockname", errno);
  }
  *port = ntohs(a.sin_port);
  return fd;
}

Status PrepareStream(int fd) {
  const int flags = fcntl(fd, F_GETFL, 0);
  if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) != 0) {
    return ErrnoStatus("fcntl O_NONBLOCK", errno);
  }
  const int one = 1;
  if (setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one)) != 0) {
    return ErrnoStatus("setsockopt TCP_NODELAY", errno);
  }
  return Status::Ok();
}

Result<ScopedFd> ConnectLoopback(int port, const Deadline& deadline, const std::string& who) {
  ScopedFd fd(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (fd.get() < 0) return ErrnoStatus("socket", errno);
  RETURN_IF_ERROR(PrepareStream(fd.get()));
  sockaddr_in a = Loopback(port);
  if (connect(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    if (errno != EINPROGRESS) return ErrnoStatus("connect to " + who, errno);
    RETURN_IF_ERROR(WaitReady(fd.get(), POLLOUT, deadline, "connecting to " + who));
    int err = 0;
    socklen_t len = sizeof(err);
    getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
    if (err != 0) return ErrnoStatus("connect to " + who, err);
  }
  return fd;
}

Status SplitHostPort(const std::string& address, std::string* host, int* port) {
  const size_t colon = address.rfind(':');
  auto bad = [&](const std::string& why) {
    return InvalidArgument("address \"" + address + "\": " + why + " (expected HOST:PORT)");
  };
  if (colon == std::string::npos) return bad("no port");
  std::string h = address.substr(0, colon);
  const std::string p = address.substr(colon + 1);
  if (h.size() >= 2 && h.front() == '[' && h.back() == ']') h = h.substr(1, h.size() - 2);
  if (p.empty() || p.size() > 5 || p.find_first_not_of("0123456789") != std::string::npos) {
    return bad("port is not a number");
  }
  const int n = std::stoi(p);
  if (n > 65535) return bad("port out of range");
  *host = h;
  *port = n;
  return Status::Ok();
}

namespace {

struct AddrInfoDeleter {
  void operator()(addrinfo* a) const { freeaddrinfo(a); }
};

Result<std::unique_ptr<addrinfo, AddrInfoDeleter>> Resolve(const std::string& address,
                                                           bool passive) {
  std::string host;
  int port = 0;
  RETURN_IF_ERROR(SplitHostPort(address, &host, &port));
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  const int rc =
      getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &found);
  if (rc != 0) {
    // EAI_AGAIN: the name server did not answer this time.
    return Status(rc == EAI_AGAIN ? Code::kUnavailable : Code::kIOError,
                  "cannot resolve \"" + address + "\": " + std::string(gai_strerror(rc)));
  }
  return std::unique_ptr<addrinfo, AddrInfoDeleter>(found);
}

}  // namespace

Result<bool> IsLoopbackAddress(const std::string& address) {
  ASSIGN_OR_RETURN(auto found, Resolve(address, /*passive=*/true));
  for (addrinfo* a = found.get(); a != nullptr; a = a->ai_next) {
    if (a->ai_family == AF_INET) {
      const auto* in = reinterpret_cast<const sockaddr_in*>(a->ai_addr);
      if ((ntohl(in->sin_addr.s_addr) >> 24) != 127) return false;
    } else if (a->ai_family == AF_INET6) {
      const auto* in6 = reinterpret_cast<const sockaddr_in6*>(a->ai_addr);
      if (!IN6_IS_ADDR_LOOPBACK(&in6->sin6_addr)) return false;
    } else {
      return false;
    }
  }
  return true;
}

std::string PeerName(int fd) {
  sockaddr_storage peer{};
  socklen_t len = sizeof peer;
  char host[NI_MAXHOST], port[NI_MAXSERV];
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &len) != 0 ||
      getnameinfo(reinterpret_cast<sockaddr*>(&peer), len, host, sizeof host, port, sizeof port,
                  NI_NUMERICHOST | NI_NUMERICSERV) != 0) {
    return "an unknown peer";
  }
  return peer.ss_family == AF_INET6 ? "[" + std::string(host) + "]:" + port
                                    : std::string(host) + ":" + port;
}

Result<ScopedFd> ListenTcp(const std::string& address, int backlog, int* bound_port) {
  ASSIGN_OR_RETURN(auto found, Resolve(address, /*passive=*/true));
  Status last = Unavailable("no address to listen on for \"" + address + "\"");
  for (addrinfo* a = found.get(); a != nullptr; a = a->ai_next) {
    ScopedFd fd(socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol));
    if (fd.get() < 0) {
      last = ErrnoStatus("socket for " + address, errno);
      continue;
    }
    const int one = 1;
    setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd.get(), a->ai_addr, a->ai_addrlen) != 0) {
      last = ErrnoStatus("bind " + address, errno);
      continue;
    }
    if (listen(fd.get(), backlog) != 0) return ErrnoStatus("listen on " + address, errno);
    sockaddr_storage bound{};
    socklen_t len = sizeof(bound);
    if (getsockname(fd.get(), reinterpret_cast<sockaddr*>(&bound), &len) != 0) {
      return ErrnoStatus("getsockname", errno);
    }
    *bound_port =
        ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                          : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
    return fd;
  }
  return last;
}

Result<ScopedFd> ConnectTcp(const std::string& address, const Deadline& deadline,
                            const std::string& who) {
  ASSIGN_OR_RETURN(auto found, Resolve(address, /*passive=*/false));
  Status last = Unavailable("no address to connect to for " + who + " at " + address);
  for (addrinfo* a = found.get(); a != nullptr; a = a->ai_next) {
    ScopedFd fd(socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol));
    if (fd.get() < 0) {
      last = ErrnoStatus("socket for " + address, errno);
      continue;
    }
    RETURN_IF_ERROR(PrepareStream(fd.get()));
    if (connect(fd.get(), a->ai_addr, a->ai_addrlen) != 0) {
      if (errno != EINPROGRESS) {
        last = ErrnoStatus("connect to " + who + " at " + address, errno);
        continue;
      }
      Status ready =
          WaitReady(fd.get(), POLLOUT, deadline, "connecting to " + who + " at " + address);
      if (!ready.ok()) return ready;
      int err = 0;
      socklen_t len = sizeof(err);
      getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
      if (err != 0) {
        last = ErrnoStatus("connect to " + who + " at " + address, err);
        continue;
      }
    }
    return fd;
  }
  return last;
}

Result<ScopedFd> AcceptOne(int listen_fd, const Deadline& deadline,
                           const std::string& waiting_for) {
  for (;;) {
    RETURN_IF_ERROR(WaitReady(listen_fd, POLLIN, deadline, "waiting for " + waiting_for));
    ScopedFd fd(accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC));
    if (fd.get() >= 0) {
      RETURN_IF_ERROR(PrepareStream(fd.get()));
      return fd;
    }
    if (errno != EINTR && errno != EAGAIN && errno != ECONNABORTED) {
      return ErrnoStatus("accept", errno);
    }
  }
}

Status SendAll(int fd, const void* data, size_t len, const Deadline& deadline,
               const std::string& who) {
  const auto* p = static_cast<const uint8_t*>(data);
  while (len > 0) {
    const ssize_t n = send(fd, p, len, MSG_NOSIGNAL);
    if (n > 0) {
      p += n;
      len -= static_cast<size_t>(n);
    } else if (errno == EAGAIN || errno == EINTR) {
      RETURN_IF_ERROR(WaitReady(fd, POLLOUT, deadline, "sending to " + who));
    } else {
      return ErrnoStatus("send to " + who, errno);
    }
  }
  return Status::Ok();
}

Status RecvAll(int fd, void* data, size_t len, const Deadline& deadline, const std::string& who) {
  auto* p = static_cast<uint8_t*>(data);
  while (len > 0) {
    const ssize_t n = recv(fd, p, len, 0);
    if (n > 0) {
      p += n;
      len -= static_cast<size_t>(n);
    } else if (n == 0) {
      return Unavailable(who + " closed the connection (exited or crashed?)");
    } else if (errno == EAGAIN || errno == EINTR) {
      RETURN_IF_ERROR(WaitReady(fd, POLLIN, deadline, "receiving from " + who));
    } else {
      return ErrnoStatus("recv from " + who, errno);
    }
  }
  return Status::Ok();
}

void PutU64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}

uint64_t GetU64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}

}  // namespace dte::transport_internal
