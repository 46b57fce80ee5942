// Ranks of a job as threads of the test process, each with its own TCP
// transport on loopback, for tests of what runs on every rank; and a
// publish of one rank over its transport.
//
// Thread-safety: RunRanks blocks until every rank's function returns.
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "store/base/status.h"
#include "sync/publish/publisher.h"
#include "sync/transport/transport.h"

namespace dte::test {

// Connects `world` ranks over a fresh rendezvous directory under `dir` and
// runs fn(rank, transport) on each, on its own thread; a rank whose
// transport cannot connect gets fn(rank, nullptr). The transport is closed
// when fn returns.
void RunRanks(int world, const std::string& dir, std::chrono::milliseconds timeout,
              const std::function<void(int, Transport*)>& fn);

// p.PublishRanges(h, ranges) as rank t.rank() of t.size(), exchanging over
// t (Publisher::SetGroup); p lets go of t afterwards.
Result<PublishResult> PublishOver(Publisher& p, Transport& t, const AdamWStep& h,
                                  const std::vector<RangeState>& ranges);

}  // namespace dte::test
