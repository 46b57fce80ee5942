// Thread-safety annotations for clang's -Wthread-safety analysis, and a mutex
// the analysis understands.
//
// Under clang the macros expand to the analysis attributes; under other
// compilers they expand to nothing and serve as documentation. libstdc++'s
// std::mutex carries no capability attribute, so members guarded by a lock
// use dte::Mutex (a thin annotated wrapper) with dte::MutexLock.
//
// Thread-safety: Mutex is a mutex. A MutexLock belongs to the scope (and so
// the thread) that created it. CondVar is a condition variable over a Mutex
// its waiter holds.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>

#if defined(__clang__)
#define DTE_THREAD_ANNOTATION(x) __attribute__((x))
#else
#define DTE_THREAD_ANNOTATION(x)
#endif

#define CAPABILITY(x) DTE_THREAD_ANNOTATION(capability(x))
#define SCOPED_CAPABILITY DTE_THREAD_ANNOTATION(scoped_lockable)
#define GUARDED_BY(x) DTE_THREAD_ANNOTATION(guarded_by(x))
#define PT_GUARDED_BY(x) DTE_THREAD_ANNOTATION(pt_guarded_by(x))
#define ACQUIRED_BEFORE(...) DTE_THREAD_ANNOTATION(acquired_before(__VA_ARGS__))
#define ACQUIRED_AFTER(...) DTE_THREAD_ANNOTATION(acquired_after(__VA_ARGS__))
#define REQUIRES(...) DTE_THREAD_ANNOTATION(requires_capability(__VA_ARGS__))
#define ACQUIRE(...) DTE_THREAD_ANNOTATION(acquire_capability(__VA_ARGS__))
#define RELEASE(...) DTE_THREAD_ANNOTATION(release_capability(__VA_ARGS__))
#define EXCLUDES(...) DTE_THREAD_ANNOTATION(locks_excluded(__VA_ARGS__))
#define NO_THREAD_SAFETY_ANALYSIS DTE_THREAD_ANNOTATION(no_thread_safety_analysis)

namespace dte {

// A non-recursive mutex visible to the analysis.
class CAPABILITY("mutex") Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void Lock() ACQUIRE() { mu_.lock(); }
  void Unlock() RELEASE() { mu_.unlock(); }

 private:
  friend class CondVar;
  std::mutex mu_;
};

// Holds `mu` for the lifetime of the scope.
class SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex* mu) ACQUIRE(mu) : mu_(mu) { mu_->Lock(); }
  ~MutexLock() RELEASE() { mu_->Unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex* const mu_;
};

// A condition variable whose waits hold a dte::Mutex across them (released
// while blocked, held again on return, as std::condition_variable does).
class CondVar {
 public:
  CondVar() = default;
  CondVar(const CondVar&) = delete;
  CondVar& operator=(const CondVar&) = delete;

  void Signal() { cv_.notify_one(); }
  void SignalAll() { cv_.notify_all(); }

  // Waits until `done()` holds or `deadline` passes; returns done().
  template <typename Clock, typename Duration, typename Pred>
  bool WaitUntil(Mutex* mu, std::chrono::time_point<Clock, Duration> deadline, Pred done)
      REQUIRES(mu) {
    std::unique_lock<std::mutex> lock(mu->mu_, std::adopt_lock);
    const bool ok = cv_.wait_until(lock, deadline, done);
    lock.release();  // mu stays held, as the caller's scope says
    return ok;
  }
  // Waits until `done()` holds.
  template <typename Pred>
  void Wait(Mutex* mu, Pred done) REQUIRES(mu) {
    std::unique_lock<std::mutex> lock(mu->mu_, std::adopt_lock);
    cv_.wait(lock, done);
    lock.release();
  }

 private:
  std::condition_variable cv_;
};

}  // namespace dte
