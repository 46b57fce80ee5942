// .dte/status: the daemon's state as one JSON document.
#include <nlohmann/json.hpp>

#include "fs/filesystem.h"

namespace dte::fs {

std::string Filesystem::StatusJson() {
  nlohmann::json j;
  j["store"] = store_->uri();
  std::vector<uint64_t> versions;
  {
    MutexLock lock(&mu_);
    for (const auto& [version, v] : versions_) versions.push_back(version);
    j["errors"] = std::vector<std::string>(errors_.begin(), errors_.end());
  }
  j["versions"] = versions;
  j["latest"] = versions.empty() ? nlohmann::json() : nlohmann::json(versions.back());
  j["reads"] = reads_.load();
  j["bytes_served"] = bytes_served_.load();
  j["read_errors"] = read_errors_.load();
  const ReadCounters& c = reader_.counters();
  j["blocks_decoded"] = c.blocks.load();
  j["records_decoded"] = c.records.load();
  j["payload_bytes"] = c.payload_bytes.load();
  j["hash_failures"] = c.hash_failures.load();
  const CacheStats s = reader_.cache().Stats();
  j["cache"] = {{"capacity_bytes", s.capacity_bytes},
                {"bytes", s.bytes},
                {"entries", s.entries},
                {"hits", s.hits},
                {"misses", s.misses},
                {"evictions", s.evictions}};
  j["inodes"] = inodes_.size();
  return j.dump(2) + "\n";
}

}  // namespace dte::fs
