// Ranks of a job as threads of the test process, each with its own TCP
// transport on loopback, for tests of what runs on every rank.
//
// Thread-safety: RunRanks blocks until every rank's function returns.
#pragma once

#include <chrono>
#include <functional>
#include <string>

#include "store/base/status.h"
#include "sync/transport/transport.h"

namespace dte::test {

// Connects `world` ranks over a fresh rendezvous directory under `dir` and
// runs fn(rank, transport) on each, on its own thread; a rank whose
// transport cannot connect gets fn(rank, nullptr). The transport is closed
// when fn returns.
void RunRanks(int world, const std::string& dir, std::chrono::milliseconds timeout,
              const std::function<void(int, Transport*)>& fn);

}  // namespace dte::test
