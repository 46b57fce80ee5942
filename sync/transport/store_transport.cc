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

  // A receive this rank waits for: its message's key, in posting order per
  // peer.
  struct Wait {
    const RecvBuffer* buf;
    std::string key;
    bool done = false;
  };

  Status Run(std::span<const SendBuffer> sends, std::span<const RecvBuffer> recvs) {
    RETURN_IF_ERROR(PostSends(sends));
    std::vector<Wait> waits;
    RETURN_IF_ERROR(PostRecvs(recvs, &waits));
    const auto deadline = std::chrono::steady_clock::now() + options_.base.timeout;
    size_t left = waits.size();
    while (left > 0) {
      for (Wait& w : waits) {
        if (w.done) continue;
        ASSIGN_OR_RETURN(w.done, TryReceive(w));
        if (w.done) --left;
      }
      if (left == 0) break;
      RETURN_IF_ERROR(CheckPeers(waits, deadline));
      std::this_thread::sleep_for(options_.poll_interval);
    }
    return Status::Ok();
  }

  Status PostSends(std::span<const SendBuffer> sends) {
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
    return Status::Ok();
  }

  // Receives from this rank itself are matched at once; the others wait.
  Status PostRecvs(std::span<const RecvBuffer> recvs, std::vector<Wait>* waits) {
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
      waits->push_back({&b, Key(b.peer, rank(), received_[b.peer]++)});
    }
    return Status::Ok();
  }

  // True once w's message arrived (copied out and its object deleted).
  Result<bool> TryReceive(const Wait& w) {
    auto got = objects_->Get(w.key);
    if (!got.ok()) {
      if (got.status().code() == Code::kNotFound) return false;
      return got.status().WithContext("receiving from " + RankName(w.buf->peer));
    }
    if (got->size() != w.buf->bytes) {
      return Corruption(RankName(w.buf->peer) + " sent a message of " +
                        std::to_string(got->size()) + " bytes where " +
                        std::to_string(w.buf->bytes) + " were expected");
    }
    if (!got->empty()) std::memcpy(w.buf->data, got->data(), got->size());
    objects_->Delete(w.key).IgnoreError();
    return true;
  }

  // A peer still waited for that failed said why; past the deadline, the
  // peers still waited for are named.
  Status CheckPeers(const std::vector<Wait>& waits,
                    std::chrono::steady_clock::time_point deadline) {
    for (const Wait& w : waits) {
      if (w.done) continue;
      auto abort = objects_->Get(options_.prefix + "abort-" + std::to_string(w.buf->peer));
      if (abort.ok()) return Aborted(RankName(w.buf->peer) + " aborted the exchange: " + *abort);
    }
    if (std::chrono::steady_clock::now() < deadline) return Status::Ok();
    std::string who;
    for (const Wait& w : waits) {
      if (!w.done) who += (who.empty() ? "" : ", ") + RankName(w.buf->peer);
    }
    return DeadlineExceeded("timed out after " + std::to_string(options_.base.timeout.count()) +
                            " ms waiting for " + who + " (exited, crashed or stalled?)");
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
