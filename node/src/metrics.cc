#include "kvstash/node/metrics.h"

#include <httplib.h>
#include <prometheus/metric_family.h>

#include <charconv>
#include <chrono>
#include <limits>
#include <map>

#include "counters.h"
#include "kvstash/http/http_front.h"
#include "kvstash/http/prometheus_text.h"

namespace kvstash::node {
namespace {

using prometheus::ClientMetric;
using prometheus::MetricFamily;
using prometheus::MetricType;

// kvstash_request_seconds: one histogram per wire method, with cumulative buckets as
// Prometheus wants them.
MetricFamily RequestSeconds(const std::vector<MethodLatency>& latencies) {
  MetricFamily family{"kvstash_request_seconds",
                      "Request latency by method: from dispatch until the reply is handed to "
                      "the transport (put_block: including its payload's arrival; get_block "
                      "and echo: until the reply's payload has been sent)",
                      MetricType::Histogram,
                      {}};
  for (const MethodLatency& latency : latencies) {
    ClientMetric metric;
    metric.label = {{"method", latency.method}};
    uint64_t cumulative = 0;
    for (size_t i = 0; i < kLatencyBuckets.size(); ++i) {
      cumulative += latency.buckets[i];
      metric.histogram.bucket.push_back(
          {cumulative, std::chrono::duration<double>(kLatencyBuckets[i]).count()});
    }
    metric.histogram.bucket.push_back({latency.count, std::numeric_limits<double>::infinity()});
    metric.histogram.sample_count = latency.count;
    metric.histogram.sample_sum = std::chrono::duration<double>(latency.sum).count();
    family.metric.push_back(std::move(metric));
  }
  return family;
}

// Per-namespace families, from the node's namespace table (names bounded by
// kMaxNamedNamespaces, the rest under "other").
std::vector<MetricFamily> NamespaceFamilies(const std::vector<NamespaceStats>& namespaces) {
  MetricFamily blocks{"kvstash_namespace_blocks",
                      "Blocks a namespace holds (readable or being written), by tier; namespaces "
                      "with a quota or seen at hello, the first 256, the rest summed as \"other\"",
                      MetricType::Gauge,
                      {}};
  MetricFamily quotas{"kvstash_namespace_quota_blocks",
                      "A namespace's quota (the most blocks it may hold), by tier",
                      MetricType::Gauge,
                      {}};
  MetricFamily refusals{"kvstash_quota_refusals_total",
                        "Blocks a namespace's clients asked to store and were refused because "
                        "the namespace was at its quota with none of its own blocks idle to evict",
                        MetricType::Counter,
                        {}};
  for (const NamespaceStats& ns : namespaces) {
    ClientMetric held;
    held.label = {{"namespace", ns.name}, {"tier", "cpu"}};
    held.gauge.value = static_cast<double>(ns.cpu_blocks);
    blocks.metric.push_back(std::move(held));
    if (ns.cpu_quota_blocks) {
      ClientMetric quota;
      quota.label = {{"namespace", ns.name}, {"tier", "cpu"}};
      quota.gauge.value = static_cast<double>(*ns.cpu_quota_blocks);
      quotas.metric.push_back(std::move(quota));
    }
    ClientMetric refused;
    refused.label = {{"namespace", ns.name}};
    refused.counter.value = static_cast<double>(ns.quota_refusals);
    refusals.metric.push_back(std::move(refused));
  }
  return {std::move(blocks), std::move(quotas), std::move(refusals)};
}

MetricFamily FaultedShare(const NodeServer& node) {
  ClientMetric share;
  share.gauge.value = node.memory_faulted_share();
  return MetricFamily{"kvstash_cpu_memory_faulted_ratio",
                      "Share of the CPU tier's memory faulted in (the node serves from the start "
                      "and faults its memory in in the background)",
                      MetricType::Gauge,
                      {share}};
}

// The node's registration in etcd (--etcd).
std::vector<MetricFamily> EtcdFamilies(const membership::Registration& registration) {
  const membership::RegistrationStats stats = registration.stats();
  ClientMetric registered;
  registered.gauge.value = stats.registered ? 1 : 0;
  ClientMetric registrations;
  registrations.counter.value = static_cast<double>(stats.registrations);
  ClientMetric errors;
  errors.counter.value = static_cast<double>(stats.errors);
  return {
      MetricFamily{"kvstash_etcd_registered",
                   "1 while the node's key is in etcd as far as it knows; 0 while etcd "
                   "cannot be reached (the node serves on and retries every second)",
                   MetricType::Gauge,
                   {registered}},
      MetricFamily{"kvstash_etcd_registrations_total",
                   "Times the node wrote its key to etcd (again after a lease was lost)",
                   MetricType::Counter,
                   {registrations}},
      MetricFamily{
          "kvstash_etcd_errors_total", "Calls to etcd that failed", MetricType::Counter, {errors}}};
}

// /metrics: the registry's exported counters, then the families of their own.
class NodeMetrics {
 public:
  NodeMetrics(NodeServer& node, const membership::Registration* registration)
      : node_(node), registration_(registration) {}

  std::string Text() const {
    const std::map<std::string, uint64_t> counters = node_.Counters();
    // The registry's exported counters, each family where its first counter is (the writer
    // joins a family's samples); a counter the node does not report now (ARC's lists under LRU)
    // reads 0.
    http::PrometheusWriter out;
    for (const CounterDef& def : CounterDefs()) {
      if (def.family == nullptr) continue;
      auto value = counters.find(def.name);
      http::MetricLabels labels;
      for (const auto& [name, label] : def.labels) labels.push_back({name, label});
      out.Add(def.family->name, def.family->type, def.family->help,
              value == counters.end() ? 0.0 : static_cast<double>(value->second),
              std::move(labels));
    }
    out.Add(RequestSeconds(node_.Latencies()));
    out.Add(FaultedShare(node_));
    for (MetricFamily& family : NamespaceFamilies(node_.Namespaces())) out.Add(std::move(family));
    if (registration_ != nullptr) {
      for (MetricFamily& family : EtcdFamilies(*registration_)) out.Add(std::move(family));
    }
    return out.Text();
  }

 private:
  NodeServer& node_;
  const membership::Registration* registration_;  // null without --etcd
};

// /healthz: answers while the daemon serves (it is ready as soon as it listens), with the share
// of its memory faulted in.
class Up {
 public:
  explicit Up(const NodeServer& node) : node_(node) {}
  std::string Text() const {
    http::PrometheusWriter out;
    out.Add("kvstash_up", MetricType::Gauge, "1 while the node serves", 1);
    out.Add(FaultedShare(node_));
    return out.Text();
  }

 private:
  const NodeServer& node_;
};

// The node's HTTP endpoint is kvstash::http's connection front, with these bounds. Civetweb
// (prometheus-cpp's Exposer, before) gave a connection one of its worker threads from accept
// until its request was in, so as many silent or trickling clients as it had threads blocked
// /healthz for 30 s, and its accept loop spun at EMFILE. On the front a connection waiting for
// its request costs a socket, no thread: the front's I/O thread reads every request's line and
// headers. Then:
//   - the request must arrive within kRequestTimeout (else 408, or closed if nothing came) and
//     its answer leave within kWriteTimeout;
//   - at kMaxConnections the oldest connection still waiting for a request is closed to make
//     room, so a flood of slow clients cannot keep a prober out;
//   - /healthz has a thread of its own that no /metrics scrape can take, /metrics
//     kMetricsThreads, anything else (404s, other methods) one;
//   - at EMFILE/ENFILE accepting pauses with a back-off (10 ms to 1 s, and as connections
//     close), logged once per episode, while the connections open are served;
//   - each answer closes its connection.
constexpr size_t kMaxConnections = 128;
constexpr size_t kMaxRequestBytes = 8192;
constexpr size_t kMetricsThreads = 2;
constexpr std::chrono::milliseconds kRequestTimeout{5000};
constexpr std::chrono::milliseconds kWriteTimeout{10000};

}  // namespace

// What the routes read, and the front that serves them.
class MetricsEndpoint::Impl {
 public:
  Impl(NodeServer& node, const membership::Registration* registration)
      : node_metrics(node, registration), up(node) {}

  const NodeMetrics node_metrics;
  const Up up;
  std::unique_ptr<http::HttpFront> front;  // last: stopped before what it reads
};

Result<std::unique_ptr<MetricsEndpoint>> MetricsEndpoint::Create(
    const std::string& address, NodeServer& node, const membership::Registration* registration) {
  const size_t colon = address.rfind(':');
  unsigned port = 0;
  const char* digits = address.data() + (colon == std::string::npos ? address.size() : colon + 1);
  const auto [end, ec] = std::from_chars(digits, address.data() + address.size(), port);
  if (colon == std::string::npos || colon == 0 || ec != std::errc() ||
      end != address.data() + address.size() || port > 65535) {
    return InvalidArgumentError("metrics address '{}' is not HOST:PORT", address);
  }
  std::string host = address.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  http::FrontOptions options;
  options.name = "metrics endpoint";
  options.listen = host;
  options.port = static_cast<uint16_t>(port);
  options.request_threads = 1;
  options.info_threads = kMetricsThreads;
  options.health_threads = 1;
  options.max_connections = kMaxConnections;
  options.at_limit = http::AtLimit::kCloseOldestWaiting;
  options.header_timeout = kRequestTimeout;
  options.read_timeout = kRequestTimeout;
  options.write_timeout = kWriteTimeout;
  options.max_header_bytes = kMaxRequestBytes;
  // Each answer closes its connection (Connection: close; Prometheus reconnects), so no
  // connection is kept open for a next request.
  options.max_requests_per_connection = 1;
  options.classify = [](std::string_view method, std::string_view path) {
    if (method != "GET" && method != "HEAD") return http::Lane::kRequests;
    if (path == "/healthz") return http::Lane::kHealth;
    if (path == "/metrics") return http::Lane::kInfo;
    return http::Lane::kRequests;
  };
  auto impl = std::make_unique<Impl>(node, registration);
  Result<std::unique_ptr<http::HttpFront>> front = http::HttpFront::Create(std::move(options));
  if (!front.ok()) return UnavailableError("metrics endpoint: {}", front.status().message());
  impl->front = std::move(*front);
  httplib::Server& router = impl->front->router();
  router.Get("/metrics",
             [metrics = &impl->node_metrics](const httplib::Request&, httplib::Response& res) {
               res.set_content(metrics->Text(), http::kPrometheusContentType);
             });
  router.Get("/healthz", [up = &impl->up](const httplib::Request&, httplib::Response& res) {
    res.set_content(up->Text(), http::kPrometheusContentType);
  });
  impl->front->Start();
  return std::unique_ptr<MetricsEndpoint>(new MetricsEndpoint(std::move(impl)));
}

MetricsEndpoint::MetricsEndpoint(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
MetricsEndpoint::~MetricsEndpoint() = default;

uint16_t MetricsEndpoint::port() const { return impl_->front->port(); }

}  // namespace kvstash::node
