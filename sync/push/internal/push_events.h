// PushEvents: the push server's events (receivers dropped or refused, the
// newest kMaxEvents, for StatusJson and TakeEvents) and the count of
// connections refused at the handshake.
//
// Thread-safety: every method may be called from any thread. Its mutex is
// a leaf: taken while the server holds its connections' lock
// (sync/push/internal/push_server_impl.h), it takes no other.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "store/base/thread_annotations.h"

namespace dte::push_internal {

class PushEvents {
 public:
  static constexpr size_t kMaxEvents = 1000;

  // Keeps `line`; the oldest goes once kMaxEvents are kept.
  void Add(std::string line) EXCLUDES(mu_);
  // A connection refused at the handshake: counted, and kept as Add does.
  void AddRefused(std::string line) EXCLUDES(mu_);
  // The events kept so far, forgotten here.
  std::vector<std::string> Take() EXCLUDES(mu_);
  uint64_t refused() const EXCLUDES(mu_);

 private:
  void AddLocked(std::string line) REQUIRES(mu_);

  mutable Mutex mu_;
  std::vector<std::string> events_ GUARDED_BY(mu_);
  uint64_t refused_ GUARDED_BY(mu_) = 0;
};

}  // namespace dte::push_internal
