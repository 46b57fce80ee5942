#include "sync/transport/internal/chunk.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <tuple>

namespace dte::transport_internal {

std::vector<std::vector<GroupedOp>> ChunkInGlobalOrder(int rank, std::span<const SendBuffer> sends,
                                                       std::span<const RecvBuffer> recvs,
                                                       size_t max_ops) {
  using Key = std::tuple<int, int, size_t>;  // (sender, receiver, k)
  std::vector<std::pair<Key, GroupedOp>> keyed;
  std::map<int, size_t> sent_to, received_from;  // k per pair
  for (size_t i = 0; i < sends.size(); ++i) {
    const size_t k = sent_to[sends[i].peer]++;
    if (sends[i].bytes == 0 || sends[i].peer == rank) continue;
    keyed.push_back({{rank, sends[i].peer, k}, {true, sends[i].peer, i}});
  }
  for (size_t i = 0; i < recvs.size(); ++i) {
    const size_t k = received_from[recvs[i].peer]++;
    if (recvs[i].bytes == 0 || recvs[i].peer == rank) continue;
    keyed.push_back({{recvs[i].peer, rank, k}, {false, recvs[i].peer, i}});
  }
  std::sort(keyed.begin(), keyed.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  max_ops = std::max<size_t>(max_ops, 1);
  std::vector<std::vector<GroupedOp>> groups;
  for (size_t i = 0; i < keyed.size(); ++i) {
    if (i % max_ops == 0) groups.emplace_back();
    groups.back().push_back(keyed[i].second);
  }
  return groups;
}

Status CopyToSelf(int rank, std::span<const SendBuffer> sends, std::span<const RecvBuffer> recvs,
                  const std::string& me) {
  std::vector<const SendBuffer*> s;
  std::vector<const RecvBuffer*> r;
  for (const SendBuffer& b : sends) {
    if (b.peer == rank) s.push_back(&b);
  }
  for (const RecvBuffer& b : recvs) {
    if (b.peer == rank) r.push_back(&b);
  }
  if (s.size() != r.size()) {
    return InvalidArgument(me + ": " + std::to_string(s.size()) + " sends to itself but " +
                           std::to_string(r.size()) + " receives");
  }
  for (size_t k = 0; k < s.size(); ++k) {
    if (s[k]->bytes != r[k]->bytes) {
      return Corruption(me + ": message " + std::to_string(k) + " to itself has " +
                        std::to_string(s[k]->bytes) + " bytes, receive expects " +
                        std::to_string(r[k]->bytes));
    }
    if (s[k]->bytes != 0) std::memcpy(r[k]->data, s[k]->data, s[k]->bytes);
  }
  return Status::Ok();
}

}  // namespace dte::transport_internal
