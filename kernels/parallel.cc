#include "kernels/parallel.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace dte::kernels {
namespace {

// True while the current thread executes a ParallelFor range; nested calls
// then run inline instead of queueing behind the work that is waiting on them.
thread_local bool t_inside_range = false;

// One ParallelFor call. Lives on the caller's stack; the pool never touches it
// after the caller has observed `workers == 0` with the job out of the queue.
struct Job {
  internal::RangeFnPtr fn;
  void* ctx;
  size_t n;
  size_t chunks;
  std::atomic<size_t> next{0};
  size_t workers = 0;  // Guarded by Pool::mu_.
};

// Workers pull jobs from a FIFO; each job is split into `chunks` ranges that
// the caller and any idle workers claim with an atomic counter.
//
// Thread-safety: Run may be called concurrently. The destructor must run only
// once no Run call is in flight (guaranteed by shared_ptr ownership below).
class Pool {
 public:
  explicit Pool(size_t threads) : size_(threads) {
    for (size_t i = 1; i < threads; ++i) workers_.emplace_back([this] { WorkerLoop(); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    work_cv_.notify_all();
    for (std::thread& t : workers_) t.join();
  }
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  size_t size() const { return size_; }
  void Run(Job* job);

 private:
  static void RunChunks(Job* job);
  void RemoveLocked(Job* job);
  void WorkerLoop();

  const size_t size_;
  std::mutex mu_;  // Protects jobs_, stop_ and every queued Job::workers.
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  std::deque<Job*> jobs_;
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

void Pool::RunChunks(Job* job) {
  const bool was_inside = t_inside_range;
  t_inside_range = true;
  for (;;) {
    const size_t c = job->next.fetch_add(1, std::memory_order_relaxed);
    if (c >= job->chunks) break;
    // Balanced split: chunk sizes differ by at most one index.
    const size_t begin = job->n / job->chunks * c + std::min(c, job->n % job->chunks);
    const size_t len = job->n / job->chunks + (c < job->n % job->chunks ? 1 : 0);
    job->fn(job->ctx, begin, begin + len);
  }
  t_inside_range = was_inside;
}

void Pool::RemoveLocked(Job* job) {
  auto it = std::find(jobs_.begin(), jobs_.end(), job);
  if (it != jobs_.end()) jobs_.erase(it);
}

void Pool::Run(Job* job) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    jobs_.push_back(job);
  }
  work_cv_.notify_all();
  RunChunks(job);
  std::unique_lock<std::mutex> lock(mu_);
  // Once out of the queue no new worker can join, so workers == 0 means every
  // claimed chunk has finished and nobody holds a pointer to the job.
  RemoveLocked(job);
  done_cv_.wait(lock, [job] { return job->workers == 0; });
}

void Pool::WorkerLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    work_cv_.wait(lock, [this] { return stop_ || !jobs_.empty(); });
    if (jobs_.empty()) return;  // stop_ is set and nothing is left.
    Job* job = jobs_.front();
    ++job->workers;
    lock.unlock();
    RunChunks(job);
    lock.lock();
    // Every chunk is claimed now; keep other workers from picking it again.
    RemoveLocked(job);
    if (--job->workers == 0) done_cv_.notify_all();
  }
}

size_t ParseThreads(const char* s) {
  if (s == nullptr || *s == '\0') return 0;
  char* end = nullptr;
  const unsigned long long v = std::strtoull(s, &end, 10);
  if (*end != '\0' || v == 0 || v > kMaxThreads) return 0;
  return static_cast<size_t>(v);
}

// The current pool. Callers copy the shared_ptr, so a pool replaced by
// SetNumThreads stays alive until its last ParallelFor returns. Never
// destroyed: kernels may still run during static destruction, and idle
// workers need no joining at exit.
struct Global {
  std::mutex mu;
  std::shared_ptr<Pool> pool;  // Guarded by mu; created lazily.
  size_t requested = 0;        // Guarded by mu; 0 means the default size.
};

Global& TheGlobal() {
  static Global* const g = new Global;
  return *g;
}

std::shared_ptr<Pool> CurrentPool() {
  Global& g = TheGlobal();
  std::lock_guard<std::mutex> lock(g.mu);
  if (!g.pool) {
    g.pool = std::make_shared<Pool>(g.requested != 0 ? g.requested : DefaultNumThreads());
  }
  return g.pool;
}

}  // namespace

size_t DefaultNumThreads() {
  const size_t env = ParseThreads(std::getenv("DTE_THREADS"));
  if (env != 0) return env;
  const size_t hw = std::thread::hardware_concurrency();
  return std::clamp<size_t>(hw, 1, kMaxThreads);
}

void SetNumThreads(size_t n) {
  Global& g = TheGlobal();
  std::shared_ptr<Pool> old;
  {
    std::lock_guard<std::mutex> lock(g.mu);
    g.requested = std::min(n, kMaxThreads);
    old = std::move(g.pool);
  }
  // `old` may be the last reference: its workers are joined here, outside
  // the lock, so concurrent ParallelFor calls are not blocked meanwhile.
}

size_t NumThreads() { return CurrentPool()->size(); }

namespace internal {

void ParallelForRaw(size_t n, size_t grain, RangeFnPtr fn, void* ctx) {
  if (n == 0) return;
  grain = std::max<size_t>(grain, 1);
  if (t_inside_range || n / 2 < grain) {  // a single range would do
    fn(ctx, 0, n);
    return;
  }
  std::shared_ptr<Pool> pool = CurrentPool();
  // A few chunks per thread even out ranges that run at different speeds.
  const size_t chunks = std::min(n / grain, pool->size() * 4);
  if (pool->size() == 1 || chunks <= 1) {
    fn(ctx, 0, n);
    return;
  }
  Job job{fn, ctx, n, chunks};
  pool->Run(&job);
}

}  // namespace internal
}  // namespace dte::kernels
