#include "sync/publish/internal/dist_wire.h"

namespace dte::dist_internal {

Result<std::vector<std::string>> AllToAll(Transport& t, const std::vector<std::string>& out,
                                          const std::string& what, DistPublishStats* stats) {
  const int n = t.size();
  if (n == 1) return out;  // a world of one: its one message is to itself, nothing is sent
  std::vector<uint64_t> sizes_out(n), sizes_in(n);
  std::vector<SendBuffer> sends;
  std::vector<RecvBuffer> recvs;
  for (int r = 0; r < n; ++r) {
    sizes_out[r] = out[r].size();
    sends.push_back({r, &sizes_out[r], sizeof(uint64_t)});
    recvs.push_back({r, &sizes_in[r], sizeof(uint64_t)});
  }
  RETURN_IF_ERROR(t.Exchange(sends, recvs).WithContext(what + " (sizes)"));
  std::vector<std::string> in(n);
  sends.clear();
  recvs.clear();
  for (int r = 0; r < n; ++r) {
    if (sizes_in[r] > (uint64_t{1} << 40)) {
      return Corruption(what + ": rank " + std::to_string(r) + " announced " +
                        std::to_string(sizes_in[r]) + " bytes");
    }
    in[r].resize(sizes_in[r]);
    if (!out[r].empty()) sends.push_back({r, out[r].data(), out[r].size()});
    if (!in[r].empty()) recvs.push_back({r, in[r].data(), in[r].size()});
    if (stats && r != t.rank()) {
      stats->bytes_sent += out[r].size();
      stats->bytes_received += in[r].size();
      stats->messages_sent += 1 + !out[r].empty();  // the size, then the payload
    }
  }
  RETURN_IF_ERROR(t.Exchange(sends, recvs).WithContext(what));
  return in;
}

Result<std::vector<std::string>> AllToAllMove(Transport& t, std::vector<std::string> out,
                                              const std::string& what, DistPublishStats* stats) {
  const int me = t.rank();
  std::string mine = std::move(out[me]);
  out[me].clear();
  ASSIGN_OR_RETURN(auto in, AllToAll(t, out, what, stats));
  in[me] = std::move(mine);
  return in;
}

Result<std::vector<std::string>> AllGather(Transport& t, const std::string& mine,
                                           const std::string& what, DistPublishStats* stats) {
  return AllToAll(t, std::vector<std::string>(t.size(), mine), what, stats);
}

}  // namespace dte::dist_internal
