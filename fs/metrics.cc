#include "fs/metrics.h"

#include <ctime>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "fs/filesystem.h"
#include "fs/latency.h"
#include "sync/metrics/server.h"

namespace dte::fs {
namespace {

using nlohmann::json;

double Number(const json& j) { return j.is_number() ? j.get<double>() : 0.0; }
double Flag(const json& j) { return j.is_boolean() && j.get<bool>() ? 1 : 0; }

// Seconds since the RFC 3339 UTC time `text` ("2026-11-26T14:17:20Z"); -1
// if it does not parse.
double AgeSeconds(const std::string& text) {
  std::tm tm{};
  if (strptime(text.c_str(), "%Y-%m-%dT%H:%M:%S", &tm) == nullptr) return -1;
  const std::time_t t = timegm(&tm);
  return static_cast<double>(std::time(nullptr) - t);
}

// The families of one scrape, appended in the order docs/fs.md lists them.
class Families {
 public:
  void Counter(const char* name, const char* help, double value) {
    out_.push_back(metrics::CounterFamily(name, help, value));
  }
  void Gauge(const char* name, const char* help, double value) {
    out_.push_back(metrics::GaugeFamily(name, help, value));
  }
  void Labelled(const char* name, const char* help, const char* label,
                std::vector<std::pair<std::string, double>> series) {
    out_.push_back(metrics::LabelledGaugeFamily(name, help, label, std::move(series)));
  }
  void Histogram(const char* name, const char* help, const LatencyHistogram& h) {
    const LatencyHistogram::Snapshot snap = h.Take();
    out_.push_back(metrics::HistogramFamily(
        name, help,
        std::vector<double>(LatencyHistogram::kBounds.begin(), LatencyHistogram::kBounds.end()),
        std::vector<uint64_t>(snap.counts.begin(), snap.counts.end()), snap.sum_seconds));
  }
  std::vector<metrics::Family> Take() { return std::move(out_); }

 private:
  std::vector<metrics::Family> out_;
};

void AddReads(const json& s, Families& f) {
  f.Counter("dte_fs_reads_total", "Reads of version files served", Number(s["reads"]));
  f.Counter("dte_fs_read_bytes_total", "Bytes of version files served", Number(s["bytes_served"]));
  f.Counter("dte_fs_read_errors_total",
            "Reads that failed (a block that does not verify, a store error)",
            Number(s["read_errors"]));
  f.Counter("dte_fs_blocks_decoded_total", "Blocks materialized from records",
            Number(s["blocks_decoded"]));
  f.Counter("dte_fs_records_decoded_total", "Block records decoded", Number(s["records_decoded"]));
  f.Counter("dte_fs_payload_bytes_total", "Record payload bytes read from the store",
            Number(s["payload_bytes"]));
  f.Counter("dte_fs_hash_failures_total", "Blocks whose content did not match their hash",
            Number(s["hash_failures"]));
  f.Counter("dte_fs_snapshot_block_reads_total", "Blocks read from a host-local snapshot",
            Number(s["snapshot_block_reads"]));
  f.Counter("dte_fs_join_block_reads_total", "Blocks read from a join table",
            Number(s["join_block_reads"]));
}

void AddCaches(const json& s, Families& f) {
  const json& c = s["cache"];
  f.Gauge("dte_fs_block_cache_capacity_bytes", "Block cache capacity", Number(c["capacity_bytes"]));
  f.Gauge("dte_fs_block_cache_bytes", "Bytes in the block cache", Number(c["bytes"]));
  f.Gauge("dte_fs_block_cache_entries", "Blocks in the block cache", Number(c["entries"]));
  f.Counter("dte_fs_block_cache_hits_total", "Block cache hits", Number(c["hits"]));
  f.Counter("dte_fs_block_cache_misses_total", "Block cache misses", Number(c["misses"]));
  f.Counter("dte_fs_block_cache_evictions_total", "Block cache evictions", Number(c["evictions"]));
  if (s["snapshots"].is_object()) {
    const json& ss = s["snapshots"];
    f.Gauge("dte_fs_snapshots", "Host-local snapshots of versions", Number(ss["count"]));
    f.Gauge("dte_fs_snapshot_bytes", "Bytes of host-local snapshots", Number(ss["bytes"]));
    f.Counter("dte_fs_snapshots_built_total", "Snapshots this daemon built", Number(ss["built"]));
  }
  if (s["blob_cache"].is_object()) {
    const json& b = s["blob_cache"];
    f.Gauge("dte_fs_blob_cache_bytes", "Bytes in the local blob cache (s3:// stores)",
            Number(b["bytes"]));
    f.Counter("dte_fs_blob_cache_hits_total", "Blob cache chunk hits", Number(b["hits"]));
    f.Counter("dte_fs_blob_cache_misses_total", "Blob cache chunk misses", Number(b["misses"]));
    f.Counter("dte_fs_blob_cache_fetched_bytes_total", "Bytes fetched from the object store",
              Number(b["fetched_bytes"]));
  }
}

void AddVersions(const json& s, Families& f) {
  const json& poll = s["poll"];
  f.Counter("dte_fs_polls_total", "Looks for new versions", Number(poll["polls"]));
  f.Counter("dte_fs_poll_failures_total", "Looks for new versions that failed",
            Number(poll["failed"]));
  f.Gauge("dte_fs_poll_failing", "1 while the store cannot be listed", Flag(poll["failing"]));
  const json& listings = s["listings"];
  f.Counter("dte_fs_listings_damaged_total",
            "Listings the store found damaged (lacking a version it knows) and made again",
            Number(listings["damaged"]));
  f.Counter("dte_fs_listings_lacking_total", "Full listings that lacked a version the mount shows",
            Number(listings["lacking"]));
  f.Counter("dte_fs_versions_kept_total",
            "Versions a listing lacked that stayed: their manifest was read and is there",
            Number(listings["kept"]));
  f.Counter("dte_fs_versions_unchecked_total",
            "Versions a listing lacked that stayed unchecked (the manifest read failed or waits)",
            Number(listings["unchecked"]));
  f.Counter("dte_fs_versions_gone_total",
            "Versions that left the mount: their manifest was read and is gone",
            Number(listings["gone"]));
  f.Counter("dte_fs_latest_held_total",
            "Full listings whose newest was older than latest, which stayed",
            Number(listings["latest_held"]));
  f.Gauge("dte_fs_versions", "Versions the mount shows", Number(s["versions"].size()));
  if (s["max_version_seen"].is_number()) {
    f.Gauge("dte_fs_max_version_seen", "The newest version the mount has ever shown",
            Number(s["max_version_seen"]));
  }
  if (!s["latest"].is_number()) return;
  f.Gauge("dte_fs_latest_version", "The newest version the mount shows", Number(s["latest"]));
  const double age =
      s["latest_created"].is_string() ? AgeSeconds(s["latest_created"].get<std::string>()) : -1;
  if (age >= 0) {
    f.Gauge("dte_fs_latest_age_seconds", "Seconds since the newest version was committed", age);
  }
}

void AddLive(const json& s, Families& f) {
  const json& live = s["live"];
  if (live["version"].is_number()) {
    f.Gauge("dte_fs_live_version", "The version live/ serves", Number(live["version"]));
  }
  f.Counter("dte_fs_live_applies_total", "Live applies that succeeded", Number(live["applies"]));
  f.Counter("dte_fs_live_failed_applies_total", "Live applies that failed",
            Number(live["failed_applies"]));
  f.Gauge("dte_fs_live_receivers", "Registered live receivers", Number(live["receivers"]));
  f.Gauge("dte_fs_live_buffers", "Registered live receiver buffers", Number(live["buffers"]));
  f.Gauge("dte_fs_live_applying", "1 while a live apply runs", Flag(live["applying"]));
  if (!live["servers"].is_array() || live["servers"].empty()) return;
  std::vector<std::pair<std::string, double>> ranks, complete;
  for (const json& s : live["servers"]) {
    const std::string name = s["name"].is_string() ? s["name"].get<std::string>() : "";
    ranks.emplace_back(name, Number(s["ranks"].size()));
    complete.emplace_back(name, Flag(s["complete"]));
  }
  f.Labelled("dte_fs_live_server_ranks", "Ranks of an inference server registered on the mount",
             "server", std::move(ranks));
  f.Labelled("dte_fs_live_server_complete",
             "1 when every rank of an inference server registered (an apply writes it)", "server",
             std::move(complete));
}

// What a scrape of `fs` returns, read from its status of the moment.
std::vector<metrics::Family> Collect(Filesystem* fs) {
  const json s = json::parse(fs->StatusJson());
  Families f;
  AddReads(s, f);
  AddCaches(s, f);
  AddVersions(s, f);
  AddLive(s, f);
  f.Histogram("dte_fs_read_duration_seconds", "Time to materialize a read's bytes",
              fs->read_latency());
  f.Histogram("dte_fs_apply_duration_seconds", "Time of a live apply, request to reply",
              fs->live_apply_latency());
  return f.Take();
}

}  // namespace

class MetricsServer::Impl {
 public:
  std::unique_ptr<metrics::Server> server;
};

Result<std::unique_ptr<MetricsServer>> MetricsServer::Start(const std::string& address,
                                                            Filesystem* fs) {
  auto impl = std::make_unique<Impl>();
  auto server = metrics::Server::Start(address, 2);
  if (!server.ok()) return server.status().WithContext("metrics");
  impl->server = std::move(*server);
  impl->server->Serve([fs] { return Collect(fs); });
  return std::unique_ptr<MetricsServer>(new MetricsServer(std::move(impl)));
}

MetricsServer::MetricsServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
MetricsServer::~MetricsServer() = default;

int MetricsServer::port() const { return impl_->server->port(); }

std::string MetricsText(Filesystem& fs) { return metrics::Text(Collect(&fs)); }

}  // namespace dte::fs
