// Waiting in tests for a condition, never for a length of time.
//
// A test that must see something happen (a receiver listed, a version
// applied, a counter reached, a process gone) polls for it with WaitFor,
// which returns as soon as it holds; the timeout only bounds how long a
// broken build keeps the test running, it is never what the test waits
// for. A test that must see something *not* happen waits for a later event
// that proves the moment has passed, then checks; the comment at such a
// check names the event.
#pragma once

#include <chrono>
#include <thread>

namespace dte::test {

// Calls `done` every `poll` until it returns true; false if it still does
// not after `timeout`. Callers assert on the result and say what they
// waited for:
//   ASSERT_TRUE(test::WaitFor([&] { return s.Receivers().size() == 2; }))
//       << "2 receivers, listed: " << s.Receivers().size();
template <typename Done>
[[nodiscard]] bool WaitFor(Done&& done,
                           std::chrono::milliseconds timeout = std::chrono::seconds(30),
                           std::chrono::milliseconds poll = std::chrono::milliseconds(1)) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!done()) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(poll);
  }
  return true;
}

}  // namespace dte::test
