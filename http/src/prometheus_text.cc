#include "kvstash/http/prometheus_text.h"

#include <prometheus/text_serializer.h>

#include <utility>

namespace kvstash::http {
namespace {

// HELP's escaping in the text format: a backslash and a line break.
std::string EscapeHelp(std::string_view help) {
  std::string out;
  out.reserve(help.size());
  for (const char c : help) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

}  // namespace

prometheus::MetricFamily& PrometheusWriter::FamilyOf(std::string_view name,
                                                     prometheus::MetricType type,
                                                     std::string_view help) {
  const auto it = index_.find(name);
  if (it != index_.end()) return families_[it->second];
  index_.emplace(std::string(name), families_.size());
  families_.push_back({std::string(name), std::string(help), type, {}});
  return families_.back();
}

void PrometheusWriter::Add(std::string_view name, prometheus::MetricType type,
                           std::string_view help, double value, MetricLabels labels) {
  prometheus::MetricFamily& family = FamilyOf(name, type, help);
  prometheus::ClientMetric metric;
  metric.label = std::move(labels);
  switch (family.type) {
    case prometheus::MetricType::Counter:
      metric.counter.value = value;
      break;
    case prometheus::MetricType::Gauge:
      metric.gauge.value = value;
      break;
    default:
      metric.untyped.value = value;
      break;
  }
  family.metric.push_back(std::move(metric));
}

void PrometheusWriter::Add(prometheus::MetricFamily family) {
  prometheus::MetricFamily& into = FamilyOf(family.name, family.type, family.help);
  for (prometheus::ClientMetric& metric : family.metric) into.metric.push_back(std::move(metric));
}

std::string PrometheusWriter::Text() const {
  std::vector<prometheus::MetricFamily> escaped = families_;
  for (prometheus::MetricFamily& family : escaped) family.help = EscapeHelp(family.help);
  return prometheus::TextSerializer().Serialize(escaped);
}

}  // namespace kvstash::http
