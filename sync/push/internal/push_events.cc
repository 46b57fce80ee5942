#include "sync/push/internal/push_events.h"

#include <utility>

namespace dte::push_internal {

void PushEvents::Add(std::string line) {
  MutexLock lock(&mu_);
  AddLocked(std::move(line));
}

void PushEvents::AddRefused(std::string line) {
  MutexLock lock(&mu_);
  ++refused_;
  AddLocked(std::move(line));
}

std::vector<std::string> PushEvents::Take() {
  MutexLock lock(&mu_);
  return std::exchange(events_, {});
}

uint64_t PushEvents::refused() const {
  MutexLock lock(&mu_);
  return refused_;
}

void PushEvents::AddLocked(std::string line) {
  if (events_.size() == kMaxEvents) events_.erase(events_.begin());
  events_.push_back(std::move(line));
}

}  // namespace dte::push_internal
