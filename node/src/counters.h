#pragma once

// The node's counter registry: every counter a node reports is named once, in counters.cc, with
// where its value comes from and how /metrics exports it. NodeService::Counters and
// NodeServer::Counters (and so wire.StatsReply, `kvstash stats`) read their values through it,
// and the metrics endpoint builds its Prometheus families from the same rows.

#include <prometheus/metric_type.h>

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "kvstash/store/tiered_store.h"
#include "kvstash/transport/rpc.h"

namespace kvstash::node {

// What the node service counts itself. Monotonic.
enum class NodeCounter : size_t {
  kLookups,  // keys looked up
  kLookupHits,
  kLookupMisses,
  kLookupRetries,
  kBlocksStored,  // committed
  kBlocksAborted,
  kBlocksLoaded,  // blocks sent (GetBlock replies whose payload left)
  kBytesIn,       // block payload bytes received
  kBytesOut,      // block payload bytes sent
  kChecksumFailures,
  kSessionsClosed,
  kPinsReleasedOnClose,   // pins an ended session still held
  kStoresAbortedOnClose,  // stores an ended session never finished
  kLeasesExpired,         // silent sessions whose pins and stores were undone
  kPinsReleasedOnExpiry,
  kTouchedKeys,        // keys marked used: touches, and stores of blocks the node held
  kPinnedKeys,         // pins taken by Load
  kBlocksNotAdmitted,  // puts the reuse filter turned away (answered skipped, not stored)
  kCount
};

// The service's counters: relaxed atomics, added to on the request path and read by scrapes.
class NodeCounters {
 public:
  void Add(NodeCounter counter, uint64_t n = 1) {
    if (n != 0) values_[static_cast<size_t>(counter)].fetch_add(n, std::memory_order_relaxed);
  }
  uint64_t Get(NodeCounter counter) const {
    return values_[static_cast<size_t>(counter)].load(std::memory_order_relaxed);
  }

 private:
  std::array<std::atomic<uint64_t>, static_cast<size_t>(NodeCounter::kCount)> values_{};
};

// One reading of the sources, taken once per Counters() call so that every row reads the same
// moment. A source that is absent leaves its rows out.
struct CounterSnapshot {
  const NodeCounters* node = nullptr;
  struct Store {
    store::TieredStoreStats tiers;
    store::SsdTierStats ssd;
    bool has_ssd = false;
    uint64_t block_bytes = 0;
    uint64_t cpu_capacity = 0, cpu_resident = 0;
    uint64_t ssd_capacity = 0, ssd_resident = 0;
    bool arc = false;
    bool aflru = false;
    store::AdmissionState admission;
    store::PolicySizes arc_sizes;  // the policy's lists
  };
  std::optional<Store> store;
  struct Transport {
    transport::TransportStats stats;
    uint64_t connections = 0;
  };
  std::optional<Transport> transport;
  // The CPU tier's memory and how much of it is faulted in
  // (common/include/kvstash/common/memory_warmer.h).
  struct Memory {
    uint64_t total = 0, faulted = 0;
  };
  std::optional<Memory> memory;
  // KV events (kv_event_pump.h), when the node publishes them.
  struct Events {
    uint64_t batches_sent = 0, batches_dropped = 0, batches_replayed = 0;
    uint64_t replays_served = 0, replays_refused = 0, rounds_lost = 0;
    uint64_t block_metas_dropped = 0;
  };
  std::optional<Events> events;
};

// Reads the store's side of a snapshot.
CounterSnapshot::Store SnapshotOf(store::TieredStore& store);

// The counters of the snapshot's sources, by name.
std::map<std::string, uint64_t> ReadCounters(const CounterSnapshot& snapshot);

// A Prometheus family of /metrics.
struct MetricFamilyDef {
  const char* name;
  prometheus::MetricType type;
  const char* help;
};

// One counter: its name (StatsReply, `kvstash stats`), where its value comes from (nullopt:
// not reported, its source being absent or it not applying, as ARC's lists under LRU) and the
// sample of /metrics it is, if any.
struct CounterDef {
  const char* name;
  std::optional<uint64_t> (*read)(const CounterSnapshot&);
  const MetricFamilyDef* family = nullptr;  // none: not exported
  std::vector<std::pair<std::string, std::string>> labels;
};

// Every counter, in the order /metrics lists their families.
std::span<const CounterDef> CounterDefs();

}  // namespace kvstash::node
