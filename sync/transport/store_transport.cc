// The store transport: messages as objects of the store every rank shares.
//
// Key grammar, under the job's prefix:
//   message := "m/" from "-" to "/" seq        (seq: that pair's count, from 0)
//   abort   := "abort-" rank                   (the failed rank's reason)
// A sender writes each message with Put (atomic: readers see all of it or
// nothing); the receiver polls Get until it is there, then deletes it.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <deque>
#include <map>
#include <thread>
#include <vector>

#include "store/object_store.h"
#include "sync/transport/transport.h"

namespace dte {
namespace {

std::string RankName(int r) { return "rank " + std::to_string(r); }

class StoreTransport : public Transport {
 public:
  StoreTransport(ObjectStore* objects, StoreTransportOptions options)
      : objects_(objects),
        options_(std::move(options)),
        sent_(options_.base.size, 0),
        received_(options_.base.size, 0) {}

  int rank() const override { return options_.base.rank; }
  int size() const override { return options_.base.size; }

  Status Exchange(std::span<const SendBuffer> sends, std::span<const RecvBuffer> recvs) override {
    if (!error_.ok()) return error_;
    Status s = Run(sends, recvs);
    if (!s.ok()) {
      error_ =
          s.WithContext("store transport " + RankName(rank()) + " of " + std::to_string(size()));
      // Best effort: peers waiting on this rank learn why.
      objects_->Put(options_.prefix + "abort-" + std::to_string(rank()), error_.message())
          .IgnoreError();
    }
    return error_;
  }

 private:
  std::string Key(int from, int to, uint64_t seq) const {
    return options_.prefix + "m/" + std::to_string(from) + "-" + std::to_string(to) + "/" +
           std::to_string(seq);
  }

  Status Run(std::span<const SendBuffer> sends, std::span<const RecvBuffer> recvs) {
    for (const SendBuffer& b : sends) {
      if (b.peer < 0 || b.peer >= size())
        return InvalidArgument("bad peer " + std::to_string(b.peer));
      if (b.peer == rank()) {  // to itself: no object
        to_self_.emplace_back(static_cast<const char*>(b.data), b.bytes);
        continue;
      }
      RETURN_IF_ERROR(objects_
                          ->Put(Key(rank(), b.peer, sent_[b.peer]++),
                                std::string_view(static_cast<const char*>(b.data), b.bytes))
                          .WithContext("sending to " + RankName(b.peer)));
    }
    // The keys to wait for, in posting order per peer.
    struct Wait {
      const RecvBuffer* buf;
      std::string key;
      bool done = false;
    };
    std::vector<Wait> waits;
    for (const RecvBuffer& b : recvs) {
      if (b.peer < 0 || b.peer >= size())
        return InvalidArgument("bad peer " + std::to_string(b.peer));
      if (b.peer == rank()) {
        if (to_self_.empty() || to_self_.front().size() != b.bytes) {
          return InvalidArgument("a receive of " + std::to_string(b.bytes) +
                                 " bytes from this rank itself matches no message it sent");
        }
        if (b.bytes > 0) std::memcpy(b.data, to_self_.front().data(), b.bytes);
        to_self_.pop_front();
        continue;
      }
      waits.push_back({&b, Key(b.peer, rank(), received_[b.peer]++)});
    }
    const auto deadline = std::chrono::steady_clock::now() + options_.base.timeout;
    size_t left = waits.size();
    while (left > 0) {
      for (Wait& w : waits) {
        if (w.done) continue;
        auto got = objects_->Get(w.key);
        if (got.ok()) {
          if (got->size() != w.buf->bytes) {
            return Corruption(RankName(w.buf->peer) + " sent a message of " +
                              std::to_string(got->size()) + " bytes where " +
                              std::to_string(w.buf->bytes) + " were expected");
          }
          if (!got->empty()) std::memcpy(w.buf->data, got->data(), got->size());
          objects_->Delete(w.key).IgnoreError();
          w.done = true;
          --left;
        } else if (got.status().code() != Code::kNotFound) {
          return got.status().WithContext("receiving from " + RankName(w.buf->peer));
        }
      }
      if (left == 0) break;
      // A peer that failed said why.
      for (const Wait& w : waits) {
        if (w.done) continue;
        auto abort = objects_->Get(options_.prefix + "abort-" + std::to_string(w.buf->peer));
        if (abort.ok()) return IOError(RankName(w.buf->peer) + " aborted the exchange: " + *abort);
      }
      if (std::chrono::steady_clock::now() >= deadline) {
        std::string who;
        for (const Wait& w : waits) {
          if (!w.done) who += (who.empty() ? "" : ", ") + RankName(w.buf->peer);
        }
        return IOError("timed out after " + std::to_string(options_.base.timeout.count()) +
                       " ms waiting for " + who + " (exited, crashed or stalled?)");
      }
      std::this_thread::sleep_for(options_.poll_interval);
    }
    return Status::Ok();
  }

  ObjectStore* objects_;
  StoreTransportOptions options_;
  std::vector<uint64_t> sent_, received_;
  std::deque<std::string> to_self_;  // messages to itself, in posting order
  Status error_;
};

}  // namespace

Result<std::unique_ptr<Transport>> ConnectStoreTransport(ObjectStore* objects,
                                                         const StoreTransportOptions& options) {
  if (objects == nullptr) return InvalidArgument("store transport: no store");
  if (options.base.size < 1 || options.base.rank < 0 || options.base.rank >= options.base.size) {
    return InvalidArgument("store transport: rank " + std::to_string(options.base.rank) + " of " +
                           std::to_string(options.base.size));
  }
  if (options.prefix.empty() || options.prefix.back() != '/') {
    return InvalidArgument("store transport: the prefix must end in '/', not \"" + options.prefix +
                           "\"");
  }
  return std::unique_ptr<Transport>(new StoreTransport(objects, options));
}

}  // namespace dte
