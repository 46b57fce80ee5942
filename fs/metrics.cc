#include "fs/metrics.h"

#include <prometheus/collectable.h>
#include <prometheus/exposer.h>
#include <prometheus/metric_family.h>
#include <prometheus/text_serializer.h>

#include <ctime>
#include <exception>
#include <limits>
#include <nlohmann/json.hpp>
#include <utility>
#include <vector>

#include "fs/filesystem.h"
#include "fs/latency.h"

namespace dte::fs {
namespace {

using prometheus::ClientMetric;
using prometheus::MetricFamily;
using prometheus::MetricType;

double Number(const nlohmann::json& j) { return j.is_number() ? j.get<double>() : 0.0; }

// Seconds since the RFC 3339 UTC time `text` ("2026-11-26T14:17:20Z"); -1
// if it does not parse.
double AgeSeconds(const std::string& text) {
  std::tm tm{};
  if (strptime(text.c_str(), "%Y-%m-%dT%H:%M:%S", &tm) == nullptr) return -1;
  const std::time_t t = timegm(&tm);
  return static_cast<double>(std::time(nullptr) - t);
}

class FsCollector : public prometheus::Collectable {
 public:
  explicit FsCollector(Filesystem* fs) : fs_(fs) {}

  std::vector<MetricFamily> Collect() const override {
    const nlohmann::json s = nlohmann::json::parse(fs_->StatusJson());
    std::vector<MetricFamily> out;
    auto add = [&](const char* name, const char* help, MetricType type, double value) {
      MetricFamily f{name, help, type, {}};
      ClientMetric m;
      if (type == MetricType::Counter) {
        m.counter.value = value;
      } else {
        m.gauge.value = value;
      }
      f.metric.push_back(std::move(m));
      out.push_back(std::move(f));
    };
    const auto kC = MetricType::Counter, kG = MetricType::Gauge;
    add("dte_fs_reads_total", "Reads of version files served", kC, Number(s["reads"]));
    add("dte_fs_read_bytes_total", "Bytes of version files served", kC, Number(s["bytes_served"]));
    add("dte_fs_read_errors_total",
        "Reads that failed (a block that does not verify, a store "
        "error)",
        kC, Number(s["read_errors"]));
    add("dte_fs_blocks_decoded_total", "Blocks materialized from records", kC,
        Number(s["blocks_decoded"]));
    add("dte_fs_records_decoded_total", "Block records decoded", kC, Number(s["records_decoded"]));
    add("dte_fs_payload_bytes_total", "Record payload bytes read from the store", kC,
        Number(s["payload_bytes"]));
    add("dte_fs_hash_failures_total", "Blocks whose content did not match their hash", kC,
        Number(s["hash_failures"]));
    add("dte_fs_snapshot_block_reads_total", "Blocks read from a host-local snapshot", kC,
        Number(s["snapshot_block_reads"]));
    add("dte_fs_join_block_reads_total", "Blocks read from a join table", kC,
        Number(s["join_block_reads"]));
    const nlohmann::json& c = s["cache"];
    add("dte_fs_block_cache_capacity_bytes", "Block cache capacity", kG,
        Number(c["capacity_bytes"]));
    add("dte_fs_block_cache_bytes", "Bytes in the block cache", kG, Number(c["bytes"]));
    add("dte_fs_block_cache_entries", "Blocks in the block cache", kG, Number(c["entries"]));
    add("dte_fs_block_cache_hits_total", "Block cache hits", kC, Number(c["hits"]));
    add("dte_fs_block_cache_misses_total", "Block cache misses", kC, Number(c["misses"]));
    add("dte_fs_block_cache_evictions_total", "Block cache evictions", kC, Number(c["evictions"]));
    if (s["snapshots"].is_object()) {
      const nlohmann::json& ss = s["snapshots"];
      add("dte_fs_snapshots", "Host-local snapshots of versions", kG, Number(ss["count"]));
      add("dte_fs_snapshot_bytes", "Bytes of host-local snapshots", kG, Number(ss["bytes"]));
      add("dte_fs_snapshots_built_total", "Snapshots this daemon built", kC, Number(ss["built"]));
    }
    if (s["blob_cache"].is_object()) {
      const nlohmann::json& b = s["blob_cache"];
      add("dte_fs_blob_cache_bytes", "Bytes in the local blob cache (s3:// stores)", kG,
          Number(b["bytes"]));
      add("dte_fs_blob_cache_hits_total", "Blob cache chunk hits", kC, Number(b["hits"]));
      add("dte_fs_blob_cache_misses_total", "Blob cache chunk misses", kC, Number(b["misses"]));
      add("dte_fs_blob_cache_fetched_bytes_total", "Bytes fetched from the object store", kC,
          Number(b["fetched_bytes"]));
    }
    const nlohmann::json& poll = s["poll"];
    add("dte_fs_polls_total", "Looks for new versions", kC, Number(poll["polls"]));
    add("dte_fs_poll_failures_total", "Looks for new versions that failed", kC,
        Number(poll["failed"]));
    add("dte_fs_poll_failing", "1 while the store cannot be listed", kG,
        poll["failing"].is_boolean() && poll["failing"].get<bool>() ? 1 : 0);
    const nlohmann::json& listings = s["listings"];
    add("dte_fs_listings_damaged_total",
        "Listings the store found damaged (lacking a version it knows) and made again", kC,
        Number(listings["damaged"]));
    add("dte_fs_listings_lacking_total", "Full listings that lacked a version the mount shows", kC,
        Number(listings["lacking"]));
    add("dte_fs_versions_kept_total",
        "Versions a listing lacked that stayed: their manifest was read and is there", kC,
        Number(listings["kept"]));
    add("dte_fs_versions_unchecked_total",
        "Versions a listing lacked that stayed unchecked (the manifest read failed or waits)", kC,
        Number(listings["unchecked"]));
    add("dte_fs_versions_gone_total",
        "Versions that left the mount: their manifest was read and is gone", kC,
        Number(listings["gone"]));
    add("dte_fs_latest_held_total",
        "Full listings whose newest was older than latest, which stayed", kC,
        Number(listings["latest_held"]));
    add("dte_fs_versions", "Versions the mount shows", kG, Number(s["versions"].size()));
    if (s["max_version_seen"].is_number()) {
      add("dte_fs_max_version_seen", "The newest version the mount has ever shown", kG,
          Number(s["max_version_seen"]));
    }
    if (s["latest"].is_number()) {
      add("dte_fs_latest_version", "The newest version the mount shows", kG, Number(s["latest"]));
      if (s["latest_created"].is_string()) {
        const double age = AgeSeconds(s["latest_created"].get<std::string>());
        if (age >= 0) {
          add("dte_fs_latest_age_seconds", "Seconds since the newest version was committed", kG,
              age);
        }
      }
    }
    const nlohmann::json& live = s["live"];
    if (live["version"].is_number()) {
      add("dte_fs_live_version", "The version live/ serves", kG, Number(live["version"]));
    }
    add("dte_fs_live_applies_total", "Live applies that succeeded", kC, Number(live["applies"]));
    add("dte_fs_live_failed_applies_total", "Live applies that failed", kC,
        Number(live["failed_applies"]));
    add("dte_fs_live_receivers", "Registered live receivers", kG, Number(live["receivers"]));
    add("dte_fs_live_buffers", "Registered live receiver buffers", kG, Number(live["buffers"]));
    add("dte_fs_live_applying", "1 while a live apply runs", kG,
        live["applying"].is_boolean() && live["applying"].get<bool>() ? 1 : 0);

    auto histogram = [&](const char* name, const char* help, const LatencyHistogram& h) {
      const LatencyHistogram::Snapshot snap = h.Take();
      MetricFamily f{name, help, MetricType::Histogram, {}};
      ClientMetric m;
      uint64_t cumulative = 0;
      for (size_t b = 0; b < snap.counts.size(); ++b) {
        cumulative += snap.counts[b];
        ClientMetric::Bucket bucket;
        bucket.cumulative_count = cumulative;
        bucket.upper_bound = b < LatencyHistogram::kBounds.size()
                                 ? LatencyHistogram::kBounds[b]
                                 : std::numeric_limits<double>::infinity();
        m.histogram.bucket.push_back(bucket);
      }
      m.histogram.sample_count = cumulative;
      m.histogram.sample_sum = snap.sum_seconds;
      f.metric.push_back(std::move(m));
      out.push_back(std::move(f));
    };
    histogram("dte_fs_read_duration_seconds", "Time to materialize a read's bytes",
              fs_->read_latency());
    histogram("dte_fs_apply_duration_seconds", "Time of a live apply, request to reply",
              fs_->live().apply_latency());
    return out;
  }

 private:
  Filesystem* fs_;
};

}  // namespace

class MetricsServer::Impl {
 public:
  std::unique_ptr<prometheus::Exposer> exposer;
  std::shared_ptr<FsCollector> collector;
};

Result<std::unique_ptr<MetricsServer>> MetricsServer::Start(const std::string& address,
                                                            Filesystem* fs) {
  auto impl = std::make_unique<Impl>();
  try {
    impl->exposer = std::make_unique<prometheus::Exposer>(address, 2);
  } catch (const std::exception& e) {
    return IOError("metrics: cannot listen on " + address + ": " + e.what());
  }
  impl->collector = std::make_shared<FsCollector>(fs);
  impl->exposer->RegisterCollectable(impl->collector);
  return std::unique_ptr<MetricsServer>(new MetricsServer(std::move(impl)));
}

MetricsServer::MetricsServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
MetricsServer::~MetricsServer() = default;

int MetricsServer::port() const {
  const std::vector<int> ports = impl_->exposer->GetListeningPorts();
  return ports.empty() ? 0 : ports.front();
}

std::string MetricsText(Filesystem& fs) {
  return prometheus::TextSerializer().Serialize(FsCollector(&fs).Collect());
}

}  // namespace dte::fs
