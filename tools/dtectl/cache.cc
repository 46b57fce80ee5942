// dtectl cache: what this host keeps of a store in its cache directory
// (materialized snapshots, disk left), and pruning the snapshots.
#include <sys/statvfs.h>

#include <iostream>
#include <nlohmann/json.hpp>

#include "store/snapshot.h"
#include "tools/dtectl/commands.h"
#include "tools/dtectl/open_store.h"
#include "tools/dtectl/progress.h"

namespace dte::cli {
namespace {

using nlohmann::json;

int Fail(const char* cmd, const Status& s) {
  std::cerr << "dtectl " << cmd << ": error: " << s.message() << "\n";
  return 1;
}

struct DiskSpace {
  uint64_t free = 0, total = 0;
};

DiskSpace SpaceOf(const std::string& dir) {
  struct statvfs st {};
  if (::statvfs(dir.c_str(), &st) != 0) return {};
  return {uint64_t{st.f_bavail} * st.f_frsize, uint64_t{st.f_blocks} * st.f_frsize};
}

std::string VersionList(const std::vector<uint64_t>& versions) {
  std::string out;
  for (uint64_t v : versions) out += (out.empty() ? "" : " ") + VersionName(v);
  return out.empty() ? "none" : out;
}

}  // namespace

int RunCache(const Common& c, std::optional<uint32_t> keep_snapshots) {
  auto store = OpenStore(c, "cache", false, BlobReads::kFromStore);
  if (!store.ok()) return Fail("cache", store.status());
  const std::string dir = SnapshotDir(**store);
  auto set = SnapshotSet::Open(dir);
  if (!set.ok()) return Fail("cache", set.status());
  std::vector<uint64_t> dropped;
  if (keep_snapshots) dropped = (*set)->KeepNewest(*keep_snapshots);
  const SnapshotStats s = (*set)->Stats();
  const DiskSpace disk = SpaceOf(dir);
  if (c.json) {
    json j{{"cache_dir", (*store)->CachePath()},
           {"snapshots",
            {{"dir", dir}, {"count", s.count}, {"bytes", s.bytes}, {"versions", s.versions}}},
           {"dropped", dropped},
           {"free_bytes", disk.free},
           {"total_bytes", disk.total},
           {"reserve_bytes", disk.total / 20}};
    std::cout << j.dump() << "\n";
    return 0;
  }
  std::cout << "cache: " << (*store)->CachePath() << "\n"
            << "snapshots: " << s.count << " (" << HumanBytes(static_cast<double>(s.bytes))
            << "): " << VersionList(s.versions) << "\n";
  if (keep_snapshots) std::cout << "dropped: " << VersionList(dropped) << "\n";
  std::cout << "disk: " << HumanBytes(static_cast<double>(disk.free)) << " free of "
            << HumanBytes(static_cast<double>(disk.total))
            << " (no snapshot is written that would leave less than 5% free)\n";
  return 0;
}

}  // namespace dte::cli
