// Cutting one rank's part of a grouped exchange into bounded groups for
// transports whose groups must stay small (NCCL: see sync/transport/transport.h).
//
// Every message has a global key (sender, receiver, k) where k counts the
// messages of that ordered pair in posting order; both of its endpoints
// compute the same key. Each rank sorts its sends and receives by key and
// cuts the sorted list into groups of at most max_ops, run one after the
// other. This cannot deadlock: the smallest unfinished message is the first
// unfinished one of both its endpoints, so both have it in their current
// group and it can complete; repeat. (Cutting each rank's list in its own
// order, e.g. sends before receives, can deadlock; the tests show one.)
//
// Thread-safety: pure function.
#pragma once

#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include "sync/transport/transport.h"

namespace dte::transport_internal {

struct GroupedOp {
  bool send = false;
  int peer = 0;
  size_t index = 0;  // into the sends or recvs span
};

// Non-empty sends and receives of `rank` in global key order, in groups of
// at most max_ops (>= 1). Zero-byte messages are dropped: both endpoints
// agree on sizes, so both drop them. Messages to the rank itself are left
// out too (the caller copies them): a send and its receive would share one
// key, and a cut between them would wait forever.
std::vector<std::vector<GroupedOp>> ChunkInGlobalOrder(int rank, std::span<const SendBuffer> sends,
                                                       std::span<const RecvBuffer> recvs,
                                                       size_t max_ops);

// Matches the sends of `rank` to itself with its receives from itself, in
// order, and copies them. `me` names the transport in errors: a count or size
// mismatch is a caller bug (InvalidArgument / Corruption).
Status CopyToSelf(int rank, std::span<const SendBuffer> sends, std::span<const RecvBuffer> recvs,
                  const std::string& me);

}  // namespace dte::transport_internal
