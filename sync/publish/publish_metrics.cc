#include "sync/publish/publish_metrics.h"

#include <chrono>
#include <utility>
#include <vector>

#include "sync/metrics/gateway.h"
#include "sync/metrics/server.h"
#include "sync/publish/publisher.h"

namespace dte {
namespace {

// Seconds, from a hundredth to ten minutes: a small model's publish to a
// large model's on a slow store.
const std::vector<double> kPublishBuckets = {0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1,  2.5,
                                             5,    10,    25,   50,  100,  250, 600};
// A push: a millisecond to a minute.
const std::vector<double> kPushBuckets = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                                          0.5,   1,      2.5,   5,    10,    25,   60};

double Now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

struct PublishMetrics::Impl {
  metrics::Registry r;

  metrics::Counter versions = r.AddCounter("dte_publish_versions_total", "Versions committed");
  metrics::Counter failures =
      r.AddCounter("dte_publish_failures_total", "Publishes that failed, committing nothing");
  metrics::Counter tensors =
      r.AddCounter("dte_publish_tensors_total", "Tensors published from optimizer state");
  metrics::Counter elements =
      r.AddCounter("dte_publish_elements_total", "Elements of the tensors published");
  metrics::Counter changed =
      r.AddCounter("dte_publish_changed_elements_total", "Elements stored in the versions' deltas");
  metrics::Counter flagged =
      r.AddCounter("dte_publish_flagged_elements_total",
                   "Candidate elements the screen or the fused detector reported");
  metrics::Counter false_positives =
      r.AddCounter("dte_publish_false_positive_elements_total",
                   "Candidates reported, then proven unchanged (not stored)");
  metrics::Counter uncertain =
      r.AddCounter("dte_publish_uncertain_elements_total",
                   "Elements stored because their old bits were not provable");
  metrics::Counter state_bytes = r.AddCounter("dte_publish_state_read_bytes_total",
                                              "Bytes of optimizer state read (theta, m, v)");
  metrics::Counter stored_bytes =
      r.AddCounter("dte_publish_stored_bytes_total", "Bytes of blobs the versions added");
  metrics::Counter weights_versions =
      r.AddCounter("dte_publish_weights_versions_total",
                   "Versions whose changes were found by comparing the new weights with the "
                   "parent version (publish_weights) rather than by inverting AdamW");
  metrics::Counter parent_bytes = r.AddCounter("dte_publish_parent_read_bytes_total",
                                               "Bytes of parent versions read (publish_weights)");
  metrics::Counter anchors =
      r.AddCounter("dte_publish_anchors_total", "Versions that also carry a full table");
  metrics::Counter full_bytes = r.AddCounter("dte_publish_full_table_bytes_total",
                                             "Payload bytes of the anchors' full tables");
  metrics::Counter joins = r.AddCounter("dte_publish_join_tables_total", "Join tables stored");
  metrics::Counter join_bytes =
      r.AddCounter("dte_publish_join_table_bytes_total", "Bytes of the join tables stored");
  metrics::Counter pushes = r.AddCounter("dte_publish_pushes_total", "Pushes run after a commit");
  metrics::Counter push_errors = r.AddCounter("dte_publish_push_errors_total",
                                              "Pushes that could not run (receivers catch up)");
  metrics::Counter push_bytes =
      r.AddCounter("dte_publish_push_bytes_total", "Bytes pushed, over all receivers");
  metrics::Counter push_receivers =
      r.AddCounter("dte_publish_push_receivers_total", "Receivers that confirmed a push");
  metrics::Counter push_dropped =
      r.AddCounter("dte_publish_push_receivers_dropped_total", "Receivers dropped by a push");
  metrics::Counter dist_entries =
      r.AddCounter("dte_publish_dist_entries_sent_total", "Changed entries this rank routed");
  metrics::Counter dist_sent = r.AddCounter("dte_publish_dist_sent_bytes_total",
                                            "Payload bytes this rank sent to other ranks");
  metrics::Counter dist_received =
      r.AddCounter("dte_publish_dist_received_bytes_total", "Payload bytes this rank received");
  metrics::Counter dist_owned =
      r.AddCounter("dte_publish_dist_owned_tensors_total", "Tensors this rank encoded");
  metrics::Counter dist_parent =
      r.AddCounter("dte_publish_dist_parent_read_bytes_total",
                   "Parent block bytes this rank read to encode its tensors");

  metrics::Gauge last_version =
      r.AddGauge("dte_publish_last_version", "The version committed last");
  metrics::Gauge last_step =
      r.AddGauge("dte_publish_last_step", "The optimizer step published last");
  metrics::Gauge last_ratio = r.AddGauge("dte_publish_last_changed_ratio",
                                         "Changed elements / elements of the last publish");
  metrics::Gauge last_time =
      r.AddGauge("dte_publish_last_success_timestamp_seconds", "Unix time of the last commit");

  metrics::Histogram duration = r.AddHistogram(
      "dte_publish_duration_seconds", "Time of a publish, call to return", kPublishBuckets);
  metrics::Histogram push_duration = r.AddHistogram("dte_publish_push_duration_seconds",
                                                    "Time of a push after a commit", kPushBuckets);

  std::unique_ptr<metrics::Server> server;
};

PublishMetrics::PublishMetrics() : impl_(std::make_unique<Impl>()) {}
PublishMetrics::~PublishMetrics() = default;

std::shared_ptr<prometheus::Registry> PublishMetrics::registry() const { return impl_->r.native(); }

void PublishMetrics::Committed(const PublishResult& r, int64_t step, double seconds) {
  Impl& m = *impl_;
  m.versions.Increment();
  m.tensors.Increment(static_cast<double>(r.tensors));
  m.elements.Increment(static_cast<double>(r.elements));
  m.changed.Increment(static_cast<double>(r.changed));
  m.flagged.Increment(static_cast<double>(r.flagged));
  m.false_positives.Increment(static_cast<double>(r.false_positives));
  m.uncertain.Increment(static_cast<double>(r.uncertain));
  m.state_bytes.Increment(static_cast<double>(r.state_bytes));
  m.stored_bytes.Increment(static_cast<double>(r.stored_bytes));
  if (r.from_weights) {
    m.weights_versions.Increment();
    m.parent_bytes.Increment(static_cast<double>(r.parent_bytes));
  }
  if (r.full_table) {
    m.anchors.Increment();
    m.full_bytes.Increment(static_cast<double>(r.full_bytes));
  }
  if (r.join_table) {
    m.joins.Increment();
    m.join_bytes.Increment(static_cast<double>(r.join_bytes));
  }
  if (r.push) {
    m.pushes.Increment();
    m.push_bytes.Increment(static_cast<double>(r.push->bytes));
    m.push_receivers.Increment(static_cast<double>(r.push->pushed));
    m.push_dropped.Increment(static_cast<double>(r.push->dropped.size()));
    m.push_duration.Observe(r.push->seconds);
  } else if (!r.push_error.empty()) {
    m.push_errors.Increment();
  }
  m.last_version.Set(static_cast<double>(r.version));
  m.last_step.Set(static_cast<double>(step));
  m.last_ratio.Set(r.elements ? static_cast<double>(r.changed) / static_cast<double>(r.elements)
                              : 0.0);
  m.last_time.Set(Now());
  m.duration.Observe(seconds);
}

void PublishMetrics::Failed(double seconds) {
  impl_->failures.Increment();
  impl_->duration.Observe(seconds);
}

void PublishMetrics::Routed(const DistPublishStats& s) {
  Impl& m = *impl_;
  m.dist_entries.Increment(static_cast<double>(s.entries_sent));
  m.dist_sent.Increment(static_cast<double>(s.bytes_sent));
  m.dist_received.Increment(static_cast<double>(s.bytes_received));
  m.dist_owned.Increment(static_cast<double>(s.tensors_owned));
  m.dist_parent.Increment(static_cast<double>(s.parent_bytes_read));
}

std::string PublishMetrics::Text() const { return impl_->r.Text(); }

Result<int> PublishMetrics::Serve(const std::string& address) {
  if (address.empty()) {
    impl_->server.reset();
    return 0;
  }
  auto server = metrics::Server::Start(MetricsListenAddress(address), 1);
  if (!server.ok()) return server.status().WithContext("publisher metrics");
  (*server)->Serve(impl_->r);
  impl_->server = std::move(*server);  // the previous server, if any, stops
  return impl_->server->port();
}

Status PublishMetrics::Push(const std::string& gateway, const std::string& job,
                            const std::map<std::string, std::string>& labels) {
  return metrics::PushToGateway(impl_->r, gateway, job, labels).WithContext("publisher metrics");
}

}  // namespace dte
