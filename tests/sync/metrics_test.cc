#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "sync/metrics/family.h"
#include "sync/metrics/registry.h"
#include "sync/metrics/server.h"
#include "tests/testutil/metrics_text.h"

namespace dte::metrics {
namespace {

using test::MetricValue;

// The body of GET http://127.0.0.1:PORT/metrics, or "" if it cannot connect.
std::string Scrape(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    close(fd);
    return "";
  }
  const std::string request =
      "GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
  EXPECT_EQ(write(fd, request.data(), request.size()), static_cast<ssize_t>(request.size()));
  std::string response;
  char buf[4096];
  for (ssize_t n; (n = read(fd, buf, sizeof(buf))) > 0;) response.append(buf, n);
  close(fd);
  const size_t body = response.find("\r\n\r\n");
  return body == std::string::npos ? "" : response.substr(body + 4);
}

TEST(MetricsRegistry, TextHoldsEachMetricWithItsHelpAndValue) {
  Registry r;
  Counter c = r.AddCounter("t_things_total", "Things done");
  Gauge g = r.AddGauge("t_level", "The level");
  Histogram h = r.AddHistogram("t_seconds", "Time taken", {0.1, 1});
  c.Increment();
  c.Increment(2.5);
  g.Set(-4);
  h.Observe(0.05);
  h.Observe(0.5);
  h.Observe(7);
  const std::string text = r.Text();
  EXPECT_NE(text.find("# HELP t_things_total Things done"), std::string::npos) << text;
  EXPECT_NE(text.find("# TYPE t_level gauge"), std::string::npos) << text;
  EXPECT_EQ(MetricValue(text, "t_things_total"), 3.5);
  EXPECT_EQ(MetricValue(text, "t_level"), -4);
  EXPECT_EQ(MetricValue(text, "t_seconds_bucket{le=\"0.1\"}"), 1);
  EXPECT_EQ(MetricValue(text, "t_seconds_bucket{le=\"1\"}"), 2);
  EXPECT_EQ(MetricValue(text, "t_seconds_bucket{le=\"+Inf\"}"), 3);
  EXPECT_EQ(MetricValue(text, "t_seconds_sum"), 7.55);
}

TEST(MetricsFamily, HistogramCountsBecomeCumulativeBuckets) {
  const std::string text = Text({CounterFamily("t_a_total", "A", 7), GaugeFamily("t_b", "B", 2),
                                 HistogramFamily("t_h", "H", {0.5, 2}, {1, 0, 4}, 9.25)});
  EXPECT_NE(text.find("# TYPE t_a_total counter"), std::string::npos) << text;
  EXPECT_NE(text.find("# TYPE t_h histogram"), std::string::npos) << text;
  EXPECT_EQ(MetricValue(text, "t_a_total"), 7);
  EXPECT_EQ(MetricValue(text, "t_b"), 2);
  EXPECT_EQ(MetricValue(text, "t_h_bucket{le=\"0.5\"}"), 1);
  EXPECT_EQ(MetricValue(text, "t_h_bucket{le=\"2\"}"), 1);
  EXPECT_EQ(MetricValue(text, "t_h_bucket{le=\"+Inf\"}"), 5);
  EXPECT_EQ(MetricValue(text, "t_h_count"), 5);
  EXPECT_EQ(MetricValue(text, "t_h_sum"), 9.25);
}

TEST(MetricsFamily, ALabelledGaugeHasOneSeriesPerLabelValue) {
  const std::string text =
      Text({LabelledGaugeFamily("t_ranks", "Ranks", "server", {{"a", 2}, {"b\"c", 1}}),
            GaugeFamily("t_x", "X", 3)});
  EXPECT_EQ(text.find("# TYPE t_ranks gauge"), text.rfind("# TYPE t_ranks gauge")) << text;
  EXPECT_EQ(MetricValue(text, "t_ranks{server=\"a\"}"), 2) << text;
  EXPECT_EQ(MetricValue(text, "t_ranks{server=\"b\\\"c\"}"), 1) << text;
  EXPECT_EQ(MetricValue(text, "t_x"), 3) << text;
}

TEST(MetricsServer, ServesRegistriesAndCollectorsAsTheyAreAtEachScrape) {
  Registry r;
  Counter c = r.AddCounter("t_kept_total", "Kept");
  int scrapes = 0;
  auto server = Server::Start("127.0.0.1:0", 1);
  ASSERT_TRUE(server.ok()) << server.status().message();
  (*server)->Serve(r);
  (*server)->Serve(
      [&scrapes] { return std::vector<Family>{GaugeFamily("t_read", "R", ++scrapes)}; });
  const int port = (*server)->port();
  ASSERT_GT(port, 0);
  c.Increment(3);
  std::string text = Scrape(port);
  EXPECT_EQ(MetricValue(text, "t_kept_total"), 3) << text;
  EXPECT_EQ(MetricValue(text, "t_read"), 1) << text;
  c.Increment();
  text = Scrape(port);
  EXPECT_EQ(MetricValue(text, "t_kept_total"), 4) << text;
  EXPECT_EQ(MetricValue(text, "t_read"), 2) << text;
  server->reset();
  EXPECT_EQ(Scrape(port), "");
}

TEST(MetricsServer, AnAddressInUseIsRefusedNamingIt) {
  auto first = Server::Start("127.0.0.1:0", 1);
  ASSERT_TRUE(first.ok()) << first.status().message();
  const std::string address = "127.0.0.1:" + std::to_string((*first)->port());
  auto second = Server::Start(address, 1);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), Code::kIOError);
  EXPECT_EQ(second.status().message().rfind("cannot listen on " + address + ": ", 0), 0u)
      << second.status().message();
}

}  // namespace
}  // namespace dte::metrics
