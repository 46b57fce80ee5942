#include "sync/publish/publish_metrics.h"

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include "sync/publish/publisher.h"
#include "tests/testutil/metrics_text.h"

namespace dte {
namespace {

using test::MetricValue;

// A loopback port nothing listens on (bound, then closed).
int ClosedPort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  socklen_t n = sizeof(a);
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &n);
  close(fd);
  return ntohs(a.sin_port);
}

TEST(PublishMetrics, CountWhatEachPublishCommitted) {
  PublishMetrics m;
  PublishResult a;
  a.version = 4;
  a.tensors = 3;
  a.elements = 1000;
  a.changed = 15;
  a.flagged = 40;
  a.false_positives = 25;
  a.uncertain = 1;
  a.stored_bytes = 700;
  a.state_bytes = 12000;
  a.full_table = true;
  a.full_bytes = 5000;
  PushReport push;
  push.pushed = 2;
  push.bytes = 300;
  push.seconds = 0.02;
  push.dropped = {"receiver 1: timed out"};
  a.push = push;
  PublishResult b = a;
  b.version = 5;
  b.changed = 10;
  b.full_table = false;
  b.join_table = true;
  b.join_bytes = 64;
  b.push.reset();
  b.push_error = "no receivers";
  m.Committed(a, 7, 1.5);
  m.Committed(b, 8, 0.03);
  m.Failed(0.2);
  DistPublishStats s;
  s.entries_sent = 9;
  s.bytes_sent = 54;
  s.bytes_received = 30;
  s.tensors_owned = 2;
  s.parent_bytes_read = 4096;
  m.Routed(s);
  m.Routed(s);

  const std::string text = m.Text();
  auto v = [&](const std::string& name) {
    std::optional<double> x = MetricValue(text, name);
    EXPECT_TRUE(x.has_value()) << name << " is not in\n" << text;
    return x.value_or(-1);
  };
  EXPECT_EQ(v("dte_publish_versions_total"), 2);
  EXPECT_EQ(v("dte_publish_failures_total"), 1);
  EXPECT_EQ(v("dte_publish_tensors_total"), 6);
  EXPECT_EQ(v("dte_publish_elements_total"), 2000);
  EXPECT_EQ(v("dte_publish_changed_elements_total"), 25);
  EXPECT_EQ(v("dte_publish_flagged_elements_total"), 80);
  EXPECT_EQ(v("dte_publish_false_positive_elements_total"), 50);
  EXPECT_EQ(v("dte_publish_uncertain_elements_total"), 2);
  EXPECT_EQ(v("dte_publish_stored_bytes_total"), 1400);
  EXPECT_EQ(v("dte_publish_state_read_bytes_total"), 24000);
  EXPECT_EQ(v("dte_publish_anchors_total"), 1);
  EXPECT_EQ(v("dte_publish_full_table_bytes_total"), 5000);
  EXPECT_EQ(v("dte_publish_join_tables_total"), 1);
  EXPECT_EQ(v("dte_publish_join_table_bytes_total"), 64);
  EXPECT_EQ(v("dte_publish_pushes_total"), 1);
  EXPECT_EQ(v("dte_publish_push_errors_total"), 1);
  EXPECT_EQ(v("dte_publish_push_bytes_total"), 300);
  EXPECT_EQ(v("dte_publish_push_receivers_total"), 2);
  EXPECT_EQ(v("dte_publish_push_receivers_dropped_total"), 1);
  EXPECT_EQ(v("dte_publish_dist_entries_sent_total"), 18);
  EXPECT_EQ(v("dte_publish_dist_sent_bytes_total"), 108);
  EXPECT_EQ(v("dte_publish_dist_received_bytes_total"), 60);
  EXPECT_EQ(v("dte_publish_dist_owned_tensors_total"), 4);
  EXPECT_EQ(v("dte_publish_dist_parent_read_bytes_total"), 8192);
  EXPECT_EQ(v("dte_publish_last_version"), 5);
  EXPECT_EQ(v("dte_publish_last_step"), 8);
  EXPECT_DOUBLE_EQ(v("dte_publish_last_changed_ratio"), 0.01);
  EXPECT_GT(v("dte_publish_last_success_timestamp_seconds"), 1.7e9);
  // Three publishes timed (the failure too): 0.03 and 0.2 fall in the
  // 0.25 s bucket, 1.5 s in the 2.5 s one.
  EXPECT_EQ(v("dte_publish_duration_seconds_count"), 3);
  EXPECT_DOUBLE_EQ(v("dte_publish_duration_seconds_sum"), 1.73);
  EXPECT_EQ(v("dte_publish_duration_seconds_bucket{le=\"0.025\"}"), 0);
  EXPECT_EQ(v("dte_publish_duration_seconds_bucket{le=\"0.25\"}"), 2);
  EXPECT_EQ(v("dte_publish_duration_seconds_bucket{le=\"2.5\"}"), 3);
  EXPECT_EQ(v("dte_publish_push_duration_seconds_count"), 1);
  EXPECT_NE(text.find("# TYPE dte_publish_versions_total counter"), std::string::npos);
  EXPECT_NE(text.find("# TYPE dte_publish_last_version gauge"), std::string::npos);
  EXPECT_NE(text.find("# TYPE dte_publish_duration_seconds histogram"), std::string::npos);
}

TEST(PublishMetrics, ListenAddressesAreLoopbackUnlessGiven) {
  EXPECT_EQ(MetricsListenAddress("9464"), "127.0.0.1:9464");
  EXPECT_EQ(MetricsListenAddress("0.0.0.0:9464"), "0.0.0.0:9464");
  EXPECT_EQ(MetricsListenAddress("[::1]:9464"), "[::1]:9464");
}

TEST(PublishMetrics, BadGatewaysAndGroupsAreRefusedNamingThem) {
  PublishMetrics m;
  auto expect = [&](const std::string& gateway, const std::string& job,
                    std::map<std::string, std::string> labels, Code code,
                    const std::string& needle) {
    Status s = m.Push(gateway, job, labels);
    EXPECT_EQ(s.code(), code) << gateway << " " << job << ": " << s.message();
    EXPECT_NE(s.message().find(needle), std::string::npos) << s.message();
  };
  expect("localhost", "trainer", {}, Code::kInvalidArgument, "gateway \"localhost\"");
  expect("http://localhost", "trainer", {}, Code::kInvalidArgument, "is not HOST:PORT");
  expect("http://localhost:9091", "", {}, Code::kInvalidArgument, "job \"\"");
  expect("http://localhost:9091", "a/b", {}, Code::kInvalidArgument, "job \"a/b\"");
  expect("http://localhost:9091", "trainer", {{"rank", ""}}, Code::kInvalidArgument,
         "grouping label rank");
  const std::string url = "http://127.0.0.1:" + std::to_string(ClosedPort());
  expect(url, "trainer", {{"rank", "0"}}, Code::kUnavailable,
         "push to " + url + " (job trainer): transfer failed");
}

TEST(PublishMetrics, AFailedServeKeepsTheServerRunning) {
  PublishMetrics m;
  Result<int> port = m.Serve("0");
  ASSERT_TRUE(port.ok()) << port.status().message();
  EXPECT_GT(*port, 0);
  Result<int> again = m.Serve(std::to_string(*port));
  ASSERT_FALSE(again.ok());
  EXPECT_EQ(again.status().code(), Code::kIOError);
  EXPECT_NE(again.status().message().find("cannot listen on 127.0.0.1:" + std::to_string(*port)),
            std::string::npos)
      << again.status().message();
  // The first server still holds the port: a third listener is refused too.
  EXPECT_FALSE(m.Serve(std::to_string(*port)).ok());
  Result<int> stopped = m.Serve("");
  ASSERT_TRUE(stopped.ok());
  EXPECT_EQ(*stopped, 0);
  Result<int> reuse = m.Serve(std::to_string(*port));
  EXPECT_TRUE(reuse.ok()) << reuse.status().message();
}

}  // namespace
}  // namespace dte
