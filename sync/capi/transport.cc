// The C ABI of dte_transport: how a dist publisher's ranks exchange data.
#include "sync/transport/transport.h"

#include <chrono>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "sync/capi/c_api.h"
#include "sync/capi/internal/c_api_glue.h"
#include "sync/capi/internal/c_api_objects.h"

using dte::capi::Close;
using dte::capi::Fail;
using dte::capi::FailWith;
using dte::capi::Find;
using dte::capi::Guard;
using dte::capi::Issue;

namespace {

// A transport whose exchanges a dte_exchange_fn runs; broken after the
// first failure, as the other transports are.
class CallbackTransport : public dte::Transport {
 public:
  CallbackTransport(int rank, int size, dte_exchange_fn fn, void* ctx)
      : rank_(rank), size_(size), fn_(fn), ctx_(ctx) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  dte::Status Exchange(std::span<const dte::SendBuffer> sends,
                       std::span<const dte::RecvBuffer> recvs) override {
    if (!broken_.ok()) return broken_;
    std::vector<dte_message> s, r;
    for (const auto& b : sends) {
      s.push_back({b.peer, const_cast<void*>(b.data), static_cast<uint64_t>(b.bytes)});
    }
    for (const auto& b : recvs) r.push_back({b.peer, b.data, static_cast<uint64_t>(b.bytes)});
    char error[1024] = {0};
    if (fn_(ctx_, s.data(), s.size(), r.data(), r.size(), error, sizeof(error)) != 0) {
      error[sizeof(error) - 1] = 0;
      broken_ = dte::IOError(std::string("exchange failed: ") +
                             (error[0] ? error : "the exchange function gave no reason"));
    }
    return broken_;
  }

 private:
  int rank_, size_;
  dte_exchange_fn fn_;
  void* ctx_;
  dte::Status broken_;
};

}  // namespace

int dte_transport_tcp(int32_t rank, int32_t size, const char* rendezvous_dir, int64_t timeout_ms,
                      const char* secret, dte_transport** out) {
  return Guard([&] {
    if (rendezvous_dir == nullptr || out == nullptr || timeout_ms <= 0) {
      return FailWith(DTE_INVALID_ARGUMENT,
                      "dte_transport_tcp: rendezvous_dir, out and a positive timeout must be set");
    }
    dte::TransportOptions o;
    o.rank = rank;
    o.size = size;
    o.rendezvous_dir = rendezvous_dir;
    if (secret) o.secret = secret;
    o.timeout = std::chrono::milliseconds(timeout_ms);
    auto t = dte::ConnectTcpTransport(o);
    if (!t.ok()) return Fail(t.status());
    *out = Issue(new dte_transport{nullptr, std::move(t).value()});
    return static_cast<int>(DTE_OK);
  });
}

int dte_transport_callback(int32_t rank, int32_t size, dte_exchange_fn fn, void* ctx,
                           dte_transport** out) {
  return Guard([&] {
    if (fn == nullptr || out == nullptr || size < 1 || rank < 0 || rank >= size) {
      return FailWith(DTE_INVALID_ARGUMENT,
                      "dte_transport_callback: fn and out must be set, 0 <= rank < size");
    }
    *out =
        Issue(new dte_transport{nullptr, std::make_unique<CallbackTransport>(rank, size, fn, ctx)});
    return static_cast<int>(DTE_OK);
  });
}

int dte_transport_store(dte_publisher* h, int32_t rank, int32_t size, const char* job,
                        int64_t timeout_ms, dte_transport** out) {
  return Guard([&] {
    // The transport uses p's store: it keeps p alive.
    std::shared_ptr<dte_publisher> p = Find(h, "dte_transport_store");
    if (p == nullptr) return static_cast<int>(DTE_INVALID_ARGUMENT);
    if (job == nullptr || *job == '\0' || out == nullptr || timeout_ms <= 0) {
      return FailWith(DTE_INVALID_ARGUMENT,
                      "dte_transport_store: job, out and a positive timeout must be set");
    }
    dte::StoreTransportOptions o;
    o.base.rank = rank;
    o.base.size = size;
    o.base.timeout = std::chrono::milliseconds(timeout_ms);
    o.prefix = std::string("exchange/") + job + "/";
    auto t = dte::ConnectStoreTransport(&p->impl->store().objects(), o);
    if (!t.ok()) return Fail(t.status());
    *out = Issue(new dte_transport{p, std::move(t).value()});
    return static_cast<int>(DTE_OK);
  });
}

int dte_transport_close(dte_transport* t) { return Close(t, __func__); }
