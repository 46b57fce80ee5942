// .dte/status: the daemon's state as one JSON document.
#include <algorithm>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "fs/filesystem.h"
#include "fs/prefetcher.h"
#include "fs/readahead.h"
#include "store/cached_store.h"

namespace dte::fs {
namespace {

using nlohmann::json;

template <typename T>
json OrNull(const std::optional<T>& v) {
  return v ? json(*v) : json();
}

// What full listings lacked, and what reading the manifests found.
json ListingsJson(const ListingGuardStats& g) {
  return {{"damaged", g.damaged},
          {"lacking", g.lacking},
          {"kept", g.kept},
          {"unchecked", g.unchecked},
          {"gone", g.gone},
          {"latest_held", g.latest_held},
          {"events", std::vector<std::string>(g.events.begin(), g.events.end())}};
}

// The read path's counters, at the top level of the document.
void AddReadCounters(ReadPath& reader, json* j) {
  const ReadCounters& c = reader.counters();
  (*j)["blocks_decoded"] = c.blocks.load();
  (*j)["records_decoded"] = c.records.load();
  (*j)["payload_bytes"] = c.payload_bytes.load();
  (*j)["hash_failures"] = c.hash_failures.load();
  const uint64_t cached_base = reader.cached_base_blocks();
  (*j)["snapshot_block_reads"] = c.base_blocks.load() - std::min(c.base_blocks.load(), cached_base);
  (*j)["cached_parent_blocks"] = cached_base;       // chain walks that began at a cached block
  (*j)["join_block_reads"] = c.join_blocks.load();  // blocks read from a join table
  const CacheStats s = reader.cache().Stats();
  (*j)["cache"] = {{"capacity_bytes", s.capacity_bytes},
                   {"bytes", s.bytes},
                   {"entries", s.entries},
                   {"hits", s.hits},
                   {"misses", s.misses},
                   {"evictions", s.evictions}};
}

json SnapshotsJson(const SnapshotSet* set) {
  if (set == nullptr) return nullptr;
  const SnapshotStats ss = set->Stats();
  return {{"dir", set->dir()},
          {"count", ss.count},
          {"bytes", ss.bytes},
          {"versions", ss.versions},
          {"building", OrNull(ss.building)},
          {"building_blocks_done", ss.building_blocks_done},
          {"building_blocks", ss.building_blocks},
          {"built", ss.built},
          {"block_reads", ss.block_reads},
          {"hash_failures", ss.hash_failures},
          {"last_error", ss.last_error}};
}

json BlobCacheJson(CachedStore* cache) {
  if (cache == nullptr) return nullptr;
  const BlobCacheStats b = cache->Stats();
  return {{"dir", cache->dir()},
          {"capacity_bytes", b.capacity_bytes},
          {"chunk_bytes", b.chunk_bytes},
          {"bytes", b.bytes},
          {"chunks", b.chunks},
          {"hits", b.hits},
          {"misses", b.misses},
          {"fetches", b.fetches},
          {"fetched_bytes", b.fetched_bytes},
          {"evictions", b.evictions},
          {"dropped", b.dropped},
          {"write_errors", b.write_errors},
          {"last_error", b.last_error}};
}

json PrefetchJson(const Prefetcher* prefetcher) {
  if (prefetcher == nullptr) return nullptr;
  const PrefetchStats p = prefetcher->Stats();
  return {{"target", "latest"},
          {"version", OrNull(p.version)},
          {"chunks", p.chunks},
          {"chunks_done", p.chunks_done},
          {"bytes", p.bytes},
          {"bytes_done", p.bytes_done},
          {"done", p.done},
          {"versions_done", p.versions_done},
          {"last_error", p.last_error}};
}

json LastPagesJson(const live::LivePageStats& pages) {
  return {{"patched_pages", pages.patched_pages},
          {"read_path_pages", pages.read_path_pages},
          {"skipped_pages", pages.skipped_pages},
          {"refreshed_pages", pages.refreshed_pages},
          {"fetches", pages.fetches},
          {"stores", pages.stores},
          {"resident_ns", pages.resident_ns},
          {"fetch_ns", pages.fetch_ns},
          {"patch_ns", pages.patch_ns},
          {"store_ns", pages.store_ns},
          {"read_ns", pages.read_ns}};
}

// The inference servers whose ranks registered (docs/live.md, "Servers").
json ServersJson(const std::vector<live::Live::Server>& servers) {
  json out = json::array();
  for (const live::Live::Server& s : servers) {
    out.push_back({{"name", s.name},
                   {"size", s.size},
                   {"ranks", s.ranks},
                   {"complete", s.complete},
                   {"version", s.version == DTE_LIVE_LATEST ? json() : json(s.version)}});
  }
  return out;
}

// The prepared apply held (docs/live.md, "Servers on several hosts"), or null.
json PreparedJson(const std::optional<live::Live::PreparedInfo>& p) {
  if (!p) return json();
  return {{"id", p->id},
          {"from", p->from_version},
          {"to", p->to_version},
          {"servers", ServersJson(p->servers)}};
}

json LiveJson(const dte_live_status& live, const live::LivePageStats& pages,
              const std::vector<live::Live::Server>& servers,
              const std::optional<live::Live::PreparedInfo>& prepared) {
  const json version = live.live_version == DTE_LIVE_LATEST ? json() : json(live.live_version);
  return {{"version", version},
          {"applying", live.applying != 0},
          {"receivers", live.receivers},
          {"buffers", live.buffers},
          {"applies", live.applies},
          {"failed_applies", live.failed_applies},
          {"last_apply_time", live.last_apply_time},
          {"last_error", live.last_error},
          {"last_message", std::string(live.last_message)},
          {"last",
           {{"from", live.last.from_version},
            {"to", live.last.to_version},
            {"entries", live.last.entries},
            {"bytes", live.last.bytes},
            {"pages", live.last.pages},
            {"receivers", live.last.receivers},
            {"buffers", live.last.buffers},
            {"elapsed_ns", live.last.elapsed_ns}}},
          {"last_pages", LastPagesJson(pages)},
          {"servers", ServersJson(servers)},
          {"prepared", PreparedJson(prepared)}};
}

// fp8/ views (null when the tree is off): the view settings, views built,
// block rows quantized (and found in the block cache), bytes in and out.
json Fp8Json(const Fp8Reader* fp8) {
  if (fp8 == nullptr) return nullptr;
  const Fp8ReaderStats s = fp8->Stats();
  const Fp8ViewOptions& o = fp8->options();
  return {{"scale", o.rule == kernels::Fp8ScaleRule::kPowerOfTwo ? "pow2" : "plain"},
          {"block", {o.block_rows, o.block_cols}},
          {"keep_modules", o.policy.skip_modules},
          {"partial_blocks", o.policy.quantize_partial_blocks},
          {"views_built", s.views_built},
          {"view_failures", s.view_failures},
          {"rows_quantized", s.rows_quantized},
          {"row_hits", s.row_hits},
          {"bf16_bytes_read", s.bf16_bytes_read},
          {"fp8_bytes_made", s.fp8_bytes_made},
          {"quantize_ns", s.quantize_ns}};
}

}  // namespace

std::string Filesystem::StatusJson() {
  json j;
  j["store"] = store_->uri();
  std::vector<uint64_t> versions;
  std::string bdi;
  {
    MutexLock lock(&mu_);
    for (const auto& [version, v] : versions_) versions.push_back(version);
    j["errors"] = std::vector<std::string>(errors_.begin(), errors_.end());
    bdi = readahead_bdi_;
    // When the newest loaded version was committed (RFC 3339): its age.
    j["latest_created"] = latest_ ? json(latest_->manifest.created) : json();
    j["poll"] = {{"polls", polls_},
                 {"full_listings", full_polls_},
                 {"failed", failed_polls_},
                 {"failing", failing_since_ != 0},
                 {"failing_since", failing_since_ ? json(failing_since_) : nullptr},
                 {"last_error", poll_error_}};
    j["max_version_seen"] = OrNull(max_shown_);
  }
  j["listings"] = ListingsJson(guard_.Stats());
  j["versions"] = versions;
  j["latest"] = versions.empty() ? json() : json(versions.back());
  j["reads"] = reads_.load();
  j["bytes_served"] = bytes_served_.load();
  j["read_errors"] = read_errors_.load();
  AddReadCounters(reader_, &j);
  j["inodes"] = inodes_.size();
  j["snapshots"] = SnapshotsJson(snapshots_.load());
  j["blob_cache"] = BlobCacheJson(store_->blob_cache());
  j["prefetch"] = PrefetchJson(prefetcher_.load());
  j["live"] = LiveJson(LiveStatus(), live_.LastPageStats(), live_.Servers(), live_.Prepared());
  j["fp8"] = Fp8Json(fp8_.get());
  j["readahead_kb"] = nullptr;
  if (!bdi.empty()) {
    auto kb = ReadReadaheadKb(bdi);
    if (kb.ok()) j["readahead_kb"] = *kb;
  }
  return j.dump(2) + "\n";
}

}  // namespace dte::fs
