#include "tests/testutil/ranks.h"

#include <atomic>
#include <filesystem>
#include <thread>
#include <vector>

namespace dte::test {

void RunRanks(int world, const std::string& dir, std::chrono::milliseconds timeout,
              const std::function<void(int, Transport*)>& fn) {
  static std::atomic<int> next{0};
  const std::string rendezvous = dir + "/rendezvous-" + std::to_string(next++);
  std::filesystem::create_directories(rendezvous);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < world; ++rank) {
    threads.emplace_back([&, rank] {
      TransportOptions o;
      o.rank = rank;
      o.size = world;
      o.rendezvous_dir = rendezvous;
      o.timeout = timeout;
      auto t = ConnectTcpTransport(o);
      fn(rank, t.ok() ? t->get() : nullptr);
    });
  }
  for (auto& th : threads) th.join();
}

Result<PublishResult> PublishOver(Publisher& p, Transport& t, const AdamWStep& h,
                                  const std::vector<RangeState>& ranges) {
  RETURN_IF_ERROR(p.SetGroup({t.rank(), t.size(), &t}));
  auto r = p.PublishRanges(h, ranges);
  p.SetGroup({t.rank(), t.size(), nullptr}).IgnoreError();
  return r;
}

}  // namespace dte::test
