#include "sync/publish/publish_metrics.h"

#include <prometheus/counter.h>
#include <prometheus/exposer.h>
#include <prometheus/gateway.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

#include <chrono>
#include <exception>
#include <utility>

#include "sync/publish/dist_publisher.h"
#include "sync/publish/publisher.h"

namespace dte {
namespace {

prometheus::Counter& NewCounter(prometheus::Registry& r, const char* name, const char* help) {
  return prometheus::BuildCounter().Name(name).Help(help).Register(r).Add({});
}

prometheus::Gauge& NewGauge(prometheus::Registry& r, const char* name, const char* help) {
  return prometheus::BuildGauge().Name(name).Help(help).Register(r).Add({});
}

// Seconds, from a hundredth to ten minutes: a small model's publish to a
// large model's on a slow store.
const prometheus::Histogram::BucketBoundaries kPublishBuckets = {
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 600};
// A push: a millisecond to a minute.
const prometheus::Histogram::BucketBoundaries kPushBuckets = {
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60};

prometheus::Histogram& NewHistogram(prometheus::Registry& r, const char* name, const char* help,
                                    const prometheus::Histogram::BucketBoundaries& buckets) {
  return prometheus::BuildHistogram().Name(name).Help(help).Register(r).Add({}, buckets);
}

double Now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

struct PublishMetrics::Impl {
  std::shared_ptr<prometheus::Registry> registry = std::make_shared<prometheus::Registry>();
  prometheus::Registry& r = *registry;

  prometheus::Counter& versions = NewCounter(r, "dte_publish_versions_total", "Versions committed");
  prometheus::Counter& failures =
      NewCounter(r, "dte_publish_failures_total", "Publishes that failed, committing nothing");
  prometheus::Counter& tensors =
      NewCounter(r, "dte_publish_tensors_total", "Tensors published from optimizer state");
  prometheus::Counter& elements =
      NewCounter(r, "dte_publish_elements_total", "Elements of the tensors published");
  prometheus::Counter& changed = NewCounter(r, "dte_publish_changed_elements_total",
                                            "Elements stored in the versions' deltas");
  prometheus::Counter& flagged =
      NewCounter(r, "dte_publish_flagged_elements_total",
                 "Candidate elements the screen or the fused detector reported");
  prometheus::Counter& false_positives =
      NewCounter(r, "dte_publish_false_positive_elements_total",
                 "Candidates reported, then proven unchanged (not stored)");
  prometheus::Counter& uncertain =
      NewCounter(r, "dte_publish_uncertain_elements_total",
                 "Elements stored because their old bits were not provable");
  prometheus::Counter& state_bytes = NewCounter(r, "dte_publish_state_read_bytes_total",
                                                "Bytes of optimizer state read (theta, m, v)");
  prometheus::Counter& stored_bytes =
      NewCounter(r, "dte_publish_stored_bytes_total", "Bytes of blobs the versions added");
  prometheus::Counter& anchors =
      NewCounter(r, "dte_publish_anchors_total", "Versions that also carry a full table");
  prometheus::Counter& full_bytes = NewCounter(r, "dte_publish_full_table_bytes_total",
                                               "Payload bytes of the anchors' full tables");
  prometheus::Counter& joins = NewCounter(r, "dte_publish_join_tables_total", "Join tables stored");
  prometheus::Counter& join_bytes =
      NewCounter(r, "dte_publish_join_table_bytes_total", "Bytes of the join tables stored");
  prometheus::Counter& pushes =
      NewCounter(r, "dte_publish_pushes_total", "Pushes run after a commit");
  prometheus::Counter& push_errors = NewCounter(r, "dte_publish_push_errors_total",
                                                "Pushes that could not run (receivers catch up)");
  prometheus::Counter& push_bytes =
      NewCounter(r, "dte_publish_push_bytes_total", "Bytes pushed, over all receivers");
  prometheus::Counter& push_receivers =
      NewCounter(r, "dte_publish_push_receivers_total", "Receivers that confirmed a push");
  prometheus::Counter& push_dropped =
      NewCounter(r, "dte_publish_push_receivers_dropped_total", "Receivers dropped by a push");
  prometheus::Counter& dist_entries =
      NewCounter(r, "dte_publish_dist_entries_sent_total", "Changed entries this rank routed");
  prometheus::Counter& dist_sent = NewCounter(r, "dte_publish_dist_sent_bytes_total",
                                              "Payload bytes this rank sent to other ranks");
  prometheus::Counter& dist_received =
      NewCounter(r, "dte_publish_dist_received_bytes_total", "Payload bytes this rank received");
  prometheus::Counter& dist_owned =
      NewCounter(r, "dte_publish_dist_owned_tensors_total", "Tensors this rank encoded");
  prometheus::Counter& dist_parent =
      NewCounter(r, "dte_publish_dist_parent_read_bytes_total",
                 "Parent block bytes this rank read to encode its tensors");

  prometheus::Gauge& last_version =
      NewGauge(r, "dte_publish_last_version", "The version committed last");
  prometheus::Gauge& last_step =
      NewGauge(r, "dte_publish_last_step", "The optimizer step published last");
  prometheus::Gauge& last_ratio = NewGauge(r, "dte_publish_last_changed_ratio",
                                           "Changed elements / elements of the last publish");
  prometheus::Gauge& last_time =
      NewGauge(r, "dte_publish_last_success_timestamp_seconds", "Unix time of the last commit");

  prometheus::Histogram& duration = NewHistogram(
      r, "dte_publish_duration_seconds", "Time of a publish, call to return", kPublishBuckets);
  prometheus::Histogram& push_duration = NewHistogram(
      r, "dte_publish_push_duration_seconds", "Time of a push after a commit", kPushBuckets);

  std::unique_ptr<prometheus::Exposer> exposer;
};

PublishMetrics::PublishMetrics() : impl_(std::make_unique<Impl>()) {}
PublishMetrics::~PublishMetrics() = default;

std::shared_ptr<prometheus::Registry> PublishMetrics::registry() const { return impl_->registry; }

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

std::string PublishMetrics::Text() const {
  return prometheus::TextSerializer().Serialize(impl_->registry->Collect());
}

Result<int> PublishMetrics::Serve(const std::string& address) {
  if (address.empty()) {
    impl_->exposer.reset();
    return 0;
  }
  const std::string listen = MetricsListenAddress(address);
  std::unique_ptr<prometheus::Exposer> exposer;
  try {
    exposer = std::make_unique<prometheus::Exposer>(listen, 1);
  } catch (const std::exception& e) {
    return IOError("publisher metrics: cannot listen on " + listen + ": " + e.what());
  }
  exposer->RegisterCollectable(impl_->registry);
  impl_->exposer = std::move(exposer);  // the previous server, if any, stops
  const std::vector<int> ports = impl_->exposer->GetListeningPorts();
  return ports.empty() ? 0 : ports.front();
}

Status PublishMetrics::Push(const std::string& gateway, const std::string& job,
                            const std::map<std::string, std::string>& labels) {
  std::string url = gateway;
  while (!url.empty() && url.back() == '/') url.pop_back();
  if (url.find("://") == std::string::npos) url = "http://" + url;
  const size_t colon = url.rfind(':');
  if (colon == std::string::npos || colon < url.find("://") + 3 || colon + 1 == url.size()) {
    return InvalidArgument("publisher metrics: gateway \"" + gateway + "\" is not HOST:PORT");
  }
  if (job.empty() || job.find('/') != std::string::npos) {
    return InvalidArgument("publisher metrics: Pushgateway job \"" + job +
                           "\" must be non-empty and without '/'");
  }
  for (const auto& [name, value] : labels) {
    if (name.empty() || value.empty() || value.find('/') != std::string::npos) {
      return InvalidArgument("publisher metrics: grouping label " + name + "=\"" + value +
                             "\" must have a name and a non-empty value without '/'");
    }
  }
  const std::string what = "publisher metrics: push to " + url + " (job " + job + ")";
  try {
    prometheus::Gateway g(url.substr(0, colon), url.substr(colon + 1), job,
                          prometheus::Labels(labels.begin(), labels.end()));
    g.RegisterCollectable(impl_->registry);
    const int code = g.Push();
    if (code < 200 || code >= 300) {
      return IOError(what + ": " +
                     (code < 0 ? "transfer failed (curl error " + std::to_string(-code) + ")"
                               : "HTTP " + std::to_string(code)));
    }
  } catch (const std::exception& e) {
    return IOError(what + ": " + e.what());
  }
  return Status::Ok();
}

}  // namespace dte
