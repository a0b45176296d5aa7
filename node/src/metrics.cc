#include "kvstash/node/metrics.h"

#include <prometheus/collectable.h>
#include <prometheus/exposer.h>
#include <prometheus/metric_family.h>

#include <limits>
#include <map>

namespace kvstash::node {
namespace {

using prometheus::ClientMetric;
using prometheus::MetricFamily;
using prometheus::MetricType;

// Samples of a family: (labels, counter name).
using Samples = std::vector<std::pair<std::vector<ClientMetric::Label>, const char*>>;

// One exported metric: a family name and a sample per (labels, counter name).
struct Export {
  const char* name;
  MetricType type;
  const char* help;
  Samples samples;
};

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

// kvstash_lookup_keys_total's samples: {kind, result} -> node.lookup_<result>s.<kind>.
Samples LookupSamples() {
  static const char* const kCounters[][4] = {
      {"per_key", "node.lookup_hits.per_key", "node.lookup_misses.per_key",
       "node.lookup_retries.per_key"},
      {"prefix", "node.lookup_hits.prefix", "node.lookup_misses.prefix",
       "node.lookup_retries.prefix"},
      {"window", "node.lookup_hits.window", "node.lookup_misses.window",
       "node.lookup_retries.window"},
  };
  Samples samples;
  for (const auto& kind : kCounters) {
    samples.push_back({{{"kind", kind[0]}, {"result", "hit"}}, kind[1]});
    samples.push_back({{{"kind", kind[0]}, {"result", "miss"}}, kind[2]});
    samples.push_back({{{"kind", kind[0]}, {"result", "retry"}}, kind[3]});
  }
  return samples;
}

const std::vector<Export>& Exports() {
  static const std::vector<Export> exports = {
      {"kvstash_blocks",
       MetricType::Gauge,
       "Blocks held, by tier",
       {{{{"tier", "cpu"}}, "cpu.resident_blocks"}, {{{"tier", "ssd"}}, "ssd.resident_blocks"}}},
      {"kvstash_bytes",
       MetricType::Gauge,
       "Bytes of the blocks held (blocks x block size), by tier",
       {{{{"tier", "cpu"}}, "cpu.resident_bytes"}, {{{"tier", "ssd"}}, "ssd.resident_bytes"}}},
      {"kvstash_capacity_blocks",
       MetricType::Gauge,
       "Block capacity, by tier",
       {{{{"tier", "cpu"}}, "cpu.capacity_blocks"}, {{{"tier", "ssd"}}, "ssd.capacity_blocks"}}},
      {"kvstash_block_bytes", MetricType::Gauge, "Bytes of every block", {{{}, "cpu.block_bytes"}}},
      {"kvstash_cpu_arc_blocks",
       MetricType::Gauge,
       "ARC's lists in the CPU tier (0 under LRU): t1 holds blocks seen once, t2 blocks used "
       "again since they were stored",
       {{{{"list", "t1"}}, "cpu.arc_t1_blocks"}, {{{"list", "t2"}}, "cpu.arc_t2_blocks"}}},
      {"kvstash_touched_keys_total",
       MetricType::Counter,
       "Keys clients marked used (touches, and stores of blocks the node held)",
       {{{}, "node.touched_keys"}}},
      {"kvstash_lookup_keys_total", MetricType::Counter,
       "Lookup results, by lookup kind and result. per_key: each key's result. prefix and "
       "window: a scan counts its hit_length keys as hits and its other keys as misses, or, "
       "when it answers retry, one retry (and no keys)",
       LookupSamples()},
      {"kvstash_blocks_stored_total",
       MetricType::Counter,
       "Blocks committed",
       {{{}, "node.blocks_stored"}}},
      {"kvstash_blocks_aborted_total",
       MetricType::Counter,
       "Block stores aborted (by the client, a failed transfer or an ended session)",
       {{{}, "node.blocks_aborted"}}},
      {"kvstash_blocks_loaded_total",
       MetricType::Counter,
       "Blocks sent to clients",
       {{{}, "node.blocks_loaded"}}},
      {"kvstash_payload_bytes_total",
       MetricType::Counter,
       "Block bytes moved, by direction",
       {{{{"direction", "in"}}, "node.bytes_in"}, {{{"direction", "out"}}, "node.bytes_out"}}},
      {"kvstash_checksum_failures_total",
       MetricType::Counter,
       "Blocks whose bytes did not match the client's checksum",
       {{{}, "node.checksum_failures"}}},
      {"kvstash_ssd_checksum_failures_total",
       MetricType::Counter,
       "SSD blocks whose bytes did not match their index record (read as misses and dropped)",
       {{{}, "ssd.checksum_failures"}}},
      {"kvstash_evictions_total",
       MetricType::Counter,
       "Blocks evicted to make room, by tier (cpu: for stores and promotions; ssd: for "
       "cascades)",
       {{{{"tier", "cpu"}}, "store.cpu_evictions"}, {{{"tier", "ssd"}}, "ssd.evictions"}}},
      {"kvstash_promotions_total",
       MetricType::Counter,
       "Blocks promoted from SSD to the CPU tier",
       {{{}, "store.promotions_done"}}},
      {"kvstash_cascades_total",
       MetricType::Counter,
       "Blocks written from the CPU tier to SSD",
       {{{}, "store.cascades_done"}}},
      {"kvstash_sessions_closed_total",
       MetricType::Counter,
       "Client sessions that ended",
       {{{}, "node.sessions_closed"}}},
      {"kvstash_pins_released_on_close_total",
       MetricType::Counter,
       "Pins an ended session still held",
       {{{}, "node.pins_released_on_close"}}},
      {"kvstash_leases_expired_total",
       MetricType::Counter,
       "Silent sessions whose pins and unfinished stores were undone",
       {{{}, "node.leases_expired"}}},
      {"kvstash_connections",
       MetricType::Gauge,
       "Open client connections",
       {{{}, "transport.connections"}}},
      {"kvstash_requests_total",
       MetricType::Counter,
       "Requests dispatched",
       {{{}, "transport.calls"}}},
      {"kvstash_refusals_total",
       MetricType::Counter,
       "Connections refused for a wrong token",
       {{{}, "transport.refused"}}},
      {"kvstash_malformed_frames_total",
       MetricType::Counter,
       "Malformed frames received",
       {{{}, "transport.malformed_frames"}}},
  };
  return exports;
}

class NodeCollectable : public prometheus::Collectable {
 public:
  explicit NodeCollectable(NodeServer& node) : node_(node) {}

  std::vector<MetricFamily> Collect() const override {
    const std::map<std::string, uint64_t> counters = node_.Counters();
    std::vector<MetricFamily> families;
    for (const Export& e : Exports()) {
      MetricFamily family{e.name, e.help, e.type, {}};
      for (const auto& [labels, counter] : e.samples) {
        auto it = counters.find(counter);
        const double value = it == counters.end() ? 0.0 : static_cast<double>(it->second);
        ClientMetric metric;
        metric.label = labels;
        if (e.type == MetricType::Counter) {
          metric.counter.value = value;
        } else {
          metric.gauge.value = value;
        }
        family.metric.push_back(std::move(metric));
      }
      families.push_back(std::move(family));
    }
    families.push_back(RequestSeconds(node_.Latencies()));
    for (MetricFamily& family : NamespaceFamilies(node_.Namespaces())) {
      families.push_back(std::move(family));
    }
    return families;
  }

 private:
  NodeServer& node_;
};

// /healthz: answers while the daemon serves.
class Up : public prometheus::Collectable {
 public:
  std::vector<MetricFamily> Collect() const override {
    ClientMetric up;
    up.gauge.value = 1;
    return {MetricFamily{"kvstash_up", "1 while the node serves", MetricType::Gauge, {up}}};
  }
};

}  // namespace

class MetricsEndpoint::Impl {
 public:
  std::shared_ptr<NodeCollectable> node;
  std::shared_ptr<Up> up = std::make_shared<Up>();
  std::unique_ptr<prometheus::Exposer> exposer;
};

Result<std::unique_ptr<MetricsEndpoint>> MetricsEndpoint::Start(const std::string& address,
                                                                NodeServer& node) {
  auto impl = std::make_unique<Impl>();
  impl->node = std::make_shared<NodeCollectable>(node);
  try {
    impl->exposer = std::make_unique<prometheus::Exposer>(address, /*num_threads=*/1);
  } catch (const std::exception& e) {
    return UnavailableError("metrics address {}: {}", address, e.what());
  }
  impl->exposer->RegisterCollectable(impl->node, "/metrics");
  impl->exposer->RegisterCollectable(impl->up, "/healthz");
  return std::unique_ptr<MetricsEndpoint>(new MetricsEndpoint(std::move(impl)));
}

MetricsEndpoint::MetricsEndpoint(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
MetricsEndpoint::~MetricsEndpoint() = default;

uint16_t MetricsEndpoint::port() const {
  const std::vector<int> ports = impl_->exposer->GetListeningPorts();
  return ports.empty() ? 0 : static_cast<uint16_t>(ports.front());
}

}  // namespace kvstash::node
