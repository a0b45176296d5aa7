// PrometheusWriter, the one writer of Prometheus text for the node and the worker: families in
// the order first added, samples of one name joined into one family wherever they are added,
// label values and help escaped as the text format wants, numbers as Prometheus reads them.

#include "kvstash/http/prometheus_text.h"

#include <gtest/gtest.h>

#include <limits>
#include <string>

namespace kvstash::http {
namespace {

using prometheus::MetricType;

TEST(PrometheusWriterTest, OneSampleFamiliesOfEachType) {
  PrometheusWriter out;
  out.Add("kvstash_x_total", MetricType::Counter, "Things done", 3);
  out.Add("kvstash_y", MetricType::Gauge, "Things now", 0.25);
  EXPECT_EQ(out.Text(),
            "# HELP kvstash_x_total Things done\n"
            "# TYPE kvstash_x_total counter\n"
            "kvstash_x_total 3\n"
            "# HELP kvstash_y Things now\n"
            "# TYPE kvstash_y gauge\n"
            "kvstash_y 0.25\n");
}

TEST(PrometheusWriterTest, SamplesOfANameJoinItsFamilyWhereverTheyAreAdded) {
  PrometheusWriter out;
  out.Add("kvstash_blocks", MetricType::Gauge, "Blocks held", 5, {{"tier", "cpu"}});
  out.Add("kvstash_other_total", MetricType::Counter, "Other", 1);
  out.Add("kvstash_blocks", MetricType::Gauge, "ignored: the family has its help", 7,
          {{"tier", "ssd"}});
  ASSERT_EQ(out.families().size(), 2u);
  EXPECT_EQ(out.Text(),
            "# HELP kvstash_blocks Blocks held\n"
            "# TYPE kvstash_blocks gauge\n"
            "kvstash_blocks{tier=\"cpu\"} 5\n"
            "kvstash_blocks{tier=\"ssd\"} 7\n"
            "# HELP kvstash_other_total Other\n"
            "# TYPE kvstash_other_total counter\n"
            "kvstash_other_total 1\n");
}

TEST(PrometheusWriterTest, LabelValuesAndHelpAreEscaped) {
  PrometheusWriter out;
  out.Add("kvstash_info", MetricType::Gauge, "A help with a \\ and\na second line", 1,
          {{"model", "odd \"name\"\\\nx"}, {"role", "both"}});
  EXPECT_EQ(out.Text(),
            "# HELP kvstash_info A help with a \\\\ and\\na second line\n"
            "# TYPE kvstash_info gauge\n"
            "kvstash_info{model=\"odd \\\"name\\\"\\\\\\nx\",role=\"both\"} 1\n");
}

TEST(PrometheusWriterTest, EmptyHelpWritesNoHelpLine) {
  PrometheusWriter out;
  out.Add("kvstash_up", MetricType::Gauge, "", 1);
  EXPECT_EQ(out.Text(), "# TYPE kvstash_up gauge\nkvstash_up 1\n");
}

TEST(PrometheusWriterTest, CountersAreWholeNumbersUpTo2To53) {
  PrometheusWriter out;
  out.Add("kvstash_bytes_total", MetricType::Counter, "Bytes", 9007199254740992.0);
  out.Add("kvstash_zero_total", MetricType::Counter, "Zero", 0);
  const std::string text = out.Text();
  EXPECT_NE(text.find("\nkvstash_bytes_total 9007199254740992\n"), std::string::npos) << text;
  EXPECT_NE(text.find("\nkvstash_zero_total 0\n"), std::string::npos) << text;
}

TEST(PrometheusWriterTest, WholeFamiliesJoinAsSamplesDo) {
  prometheus::MetricFamily histogram{
      "kvstash_request_seconds", "Latency", MetricType::Histogram, {}};
  prometheus::ClientMetric metric;
  metric.label = {{"method", "lookup"}};
  metric.histogram.bucket = {{2, 0.001}, {3, std::numeric_limits<double>::infinity()}};
  metric.histogram.sample_count = 3;
  metric.histogram.sample_sum = 0.5;
  histogram.metric.push_back(metric);
  PrometheusWriter out;
  out.Add(histogram);
  metric.label = {{"method", "put_block"}};
  histogram.metric = {metric};
  out.Add(histogram);
  ASSERT_EQ(out.families().size(), 1u);
  const std::string text = out.Text();
  EXPECT_NE(text.find("# TYPE kvstash_request_seconds histogram\n"), std::string::npos) << text;
  EXPECT_NE(text.find("kvstash_request_seconds_bucket{method=\"lookup\",le=\"+Inf\"} 3\n"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("kvstash_request_seconds_count{method=\"put_block\"} 3\n"), std::string::npos)
      << text;
}

}  // namespace
}  // namespace kvstash::http
