#pragma once

// The one writer of Prometheus's text exposition (format 0.0.4) for every kvstash process: a
// node's /metrics and /healthz (kvstash::node) and an engine worker's /metrics (kvstash::worker)
// both build prometheus-cpp's MetricFamily rows through it and serialize them with prometheus-cpp's
// TextSerializer, so that label values and numbers are escaped and formatted one way everywhere.
// Its header names prometheus-cpp's types, so prometheus-cpp's core comes with kvstash::http,
// publicly.

#include <prometheus/client_metric.h>
#include <prometheus/metric_family.h>
#include <prometheus/metric_type.h>

#include <cstddef>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace kvstash::http {

// The Content-Type of the text exposition.
inline constexpr const char* kPrometheusContentType = "text/plain; version=0.0.4; charset=utf-8";

using MetricLabels = std::vector<prometheus::ClientMetric::Label>;

// The families of one scrape, in the order they were first added, and their text. A value: not
// thread-safe, one per scrape.
class PrometheusWriter {
 public:
  // Adds a sample of the family `name` (`value` in the field of `type`: counter, gauge or
  // untyped). The first sample of a name starts its family, with this type and help; later ones
  // join it, wherever they are added (their type and help are the family's), so that the
  // samples of one family with different labels may come from rows that are not next to each
  // other. Names and labels are the caller's to keep valid (prometheus::CheckMetricName).
  void Add(std::string_view name, prometheus::MetricType type, std::string_view help, double value,
           MetricLabels labels = {});
  // Adds a family built whole (a histogram, a summary): its samples join an earlier family of its
  // name, as Add's.
  void Add(prometheus::MetricFamily family);

  const std::vector<prometheus::MetricFamily>& families() const { return families_; }

  // The text exposition of every family added: "# HELP" (when the help is not empty) and
  // "# TYPE" once per family, then its samples. Help is escaped as the format wants (a backslash
  // as \\, a line break as \n), which prometheus-cpp 1.0's TextSerializer leaves to its caller.
  std::string Text() const;

 private:
  prometheus::MetricFamily& FamilyOf(std::string_view name, prometheus::MetricType type,
                                     std::string_view help);

  std::vector<prometheus::MetricFamily> families_;
  std::map<std::string, size_t, std::less<>> index_;  // a family's name -> families_[i]
};

}  // namespace kvstash::http
