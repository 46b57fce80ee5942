// dtefs's metrics without a mount: the exposition text of a Filesystem
// against its .dte/status, and the server's refusal of a bound address.
#include "fs/metrics.h"

#include <fcntl.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>

#include "fs/filesystem.h"
#include "tests/fs/fs_fixture.h"
#include "tests/testutil/metrics_text.h"

namespace dte::fs {
namespace {

using test::MetricValue;

TEST(FsMetrics, TextCarriesTheStatusFiguresAndTheReadHistogram) {
  test::SeriesStore env(3);
  std::unique_ptr<Store> store = env.Open();
  ASSERT_NE(store, nullptr);
  for (uint64_t v = 0; v < 3; ++v) ASSERT_TRUE(env.Commit(*store, v).ok());
  Filesystem fs(store.get(), uint64_t{64} << 20);
  ASSERT_TRUE(fs.Refresh().ok());
  auto f = fs.Open(test::FileIno(fs, 2, "config.json"), O_RDONLY);
  ASSERT_TRUE(f.ok()) << f.status().message();
  const std::string config = test::ReadRange(fs, **f, 0, 1 << 20).value();
  EXPECT_EQ(config, env.series().files(2).at("config.json"));

  const std::string text = MetricsText(fs);
  const nlohmann::json s = nlohmann::json::parse(fs.StatusJson());
  EXPECT_EQ(MetricValue(text, "dte_fs_versions"), 3) << text;
  EXPECT_EQ(MetricValue(text, "dte_fs_latest_version"), 2);
  EXPECT_EQ(MetricValue(text, "dte_fs_reads_total"), s["reads"].get<double>());
  EXPECT_EQ(MetricValue(text, "dte_fs_read_bytes_total"), s["bytes_served"].get<double>());
  EXPECT_GE(MetricValue(text, "dte_fs_read_bytes_total").value_or(0), config.size());
  EXPECT_EQ(MetricValue(text, "dte_fs_block_cache_capacity_bytes"), uint64_t{64} << 20);
  EXPECT_EQ(MetricValue(text, "dte_fs_live_applying"), 0);
  EXPECT_EQ(MetricValue(text, "dte_fs_live_version"), s["live"]["version"].get<double>());
  EXPECT_EQ(MetricValue(text, "dte_fs_live_applies_total"), 0);
  EXPECT_NE(text.find("# TYPE dte_fs_read_duration_seconds histogram"), std::string::npos);
  EXPECT_GE(MetricValue(text, "dte_fs_read_duration_seconds_count").value_or(0), 1);
  EXPECT_EQ(MetricValue(text, "dte_fs_read_duration_seconds_count"),
            MetricValue(text, "dte_fs_read_duration_seconds_bucket{le=\"+Inf\"}"));
  EXPECT_EQ(MetricValue(text, "dte_fs_apply_duration_seconds_count"), 0);
}

TEST(FsMetrics, ServerOnABoundAddressFailsNamingIt) {
  test::SeriesStore env(1);
  std::unique_ptr<Store> store = env.Open();
  ASSERT_NE(store, nullptr);
  Filesystem fs(store.get(), uint64_t{1} << 20);
  auto first = MetricsServer::Start("127.0.0.1:0", &fs);
  ASSERT_TRUE(first.ok()) << first.status().message();
  const std::string address = "127.0.0.1:" + std::to_string((*first)->port());
  auto second = MetricsServer::Start(address, &fs);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().message().rfind("metrics: cannot listen on " + address, 0), 0u)
      << second.status().message();
}

}  // namespace
}  // namespace dte::fs
