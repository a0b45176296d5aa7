#pragma once

// The cluster client's counter registry: every counter the engine-side client of the offload
// nodes keeps (connector::NodeClient, through connector::BlockStoreClient::counters()) is named
// once, in kClientCounterDefs below, with its help text and its Prometheus type. Whoever shows
// them iterates the table: the connector's and the engine's stats carry a ClientCounters
// snapshot, a worker's /kvstash/stats and /metrics export every row, Python's
// stats()["client"] has every row by its name. Adding a counter is an enumerator and a row
// here (the compiler checks they agree), and the Add where it happens.
//
// In kvstash::common, not in the connector, because the engine and the worker, which know no
// transport and do not link the connector, export these rows too.

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>

namespace kvstash {

// One counter of the client. The enumerators' order is the table's.
enum class ClientCounter : size_t {
  kCalls,
  kUnreachable,
  kRefused,
  kTouchedKeys,
  kPinnedKeys,
  kUnservedKeys,
  kRepairedBlocks,
  kMembersJoined,
  kMembersLeft,
  kSkippedCalls,
  kLateKeys,
  kProbes,
  kAbandonedCalls,
  kCount
};

inline constexpr size_t kClientCounterCount = static_cast<size_t>(ClientCounter::kCount);

// How a value goes up: a counter only grows (Prometheus's counter, exported as NAME_total); a
// gauge says how much there is now.
enum class CounterKind { kCounter, kGauge };

struct ClientCounterDef {
  ClientCounter id;
  // The client's name for it: the key of Python's stats()["client"].
  const char* name;
  // The name an engine's worker exports it under: its key in /kvstash/stats (and in
  // `kvstash-engine generate --stats`), and kvstash_worker_<export_name>, with _total for a
  // counter, in /metrics. Those that predate the registry keep the names users scrape.
  const char* export_name;
  CounterKind kind;
  const char* help;  // one line: /metrics' HELP
};

// Every counter of the client, one row each, in ClientCounter's order. Nothing here is a miss:
// a block a node does not hold is an answer, not an error.
inline constexpr std::array<ClientCounterDef, kClientCounterCount> kClientCounterDefs = {{
    {ClientCounter::kCalls, "calls", "node_calls", CounterKind::kCounter,
     "Calls sent to offload nodes (a batch over a node's limits is split into several)"},
    {ClientCounter::kUnreachable, "unreachable", "node_unreachable", CounterKind::kCounter,
     "Calls to offload nodes that were down or late (their blocks were misses)"},
    // Errors, logged: a lookup's keys read as misses for the caller to go on, never silently.
    {ClientCounter::kRefused, "refused", "node_refusals", CounterKind::kCounter,
     "Calls an offload node refused (an error: a limit, a wrong token, a quota) or answered "
     "with a reply that did not parse"},
    {ClientCounter::kTouchedKeys, "touched_keys", "touched_keys", CounterKind::kCounter,
     "Keys whose use the offload nodes were told of"},
    {ClientCounter::kPinnedKeys, "pinned_keys", "node_pinned_keys", CounterKind::kCounter,
     "Keys the offload nodes pinned against eviction until their load was done"},
    // Misses and failed stores, where unreachable counts the calls. With replicas, a node that
    // is down costs keys here only for keys it held alone.
    {ClientCounter::kUnservedKeys, "unserved_keys", "node_unserved_keys", CounterKind::kCounter,
     "Keys of lookups, loads and stores that no offload node answered (every replica down)"},
    {ClientCounter::kRepairedBlocks, "repaired_blocks", "node_repaired_blocks",
     CounterKind::kCounter,
     "Blocks copied to replicas that lacked them (a lookup found them on another replica)"},
    {ClientCounter::kMembersJoined, "members_joined", "members_joined", CounterKind::kCounter,
     "Offload nodes that joined the followed cluster (etcd) after the client started"},
    {ClientCounter::kMembersLeft, "members_left", "members_left", CounterKind::kCounter,
     "Offload nodes that left the followed cluster (etcd)"},
    // Suspect: a node that stopped answering (connector::NodeClientOptions::suspect_after).
    {ClientCounter::kSkippedCalls, "skipped_calls", "node_skipped_calls", CounterKind::kCounter,
     "Calls not sent because their node was suspect (their keys missed, or went to another "
     "replica)"},
    {ClientCounter::kLateKeys, "late_keys", "node_late_keys", CounterKind::kCounter,
     "Keys of lookups whose node had not answered within the lookup's budget (read as misses, "
     "and counted in the unserved keys too)"},
    {ClientCounter::kProbes, "probes", "node_probes", CounterKind::kCounter,
     "Echoes sent to suspect offload nodes to see whether they answer again"},
    {ClientCounter::kAbandonedCalls, "abandoned_calls", "node_abandoned_calls",
     CounterKind::kCounter,
     "Calls given up once not needed (a store's call to a late replica after another held "
     "every block, a read hedged to another replica)"},
}};

namespace internal {
constexpr bool RowsFollowTheEnum() {
  for (size_t i = 0; i < kClientCounterDefs.size(); ++i) {
    const ClientCounterDef& def = kClientCounterDefs[i];
    if (static_cast<size_t>(def.id) != i || def.name == nullptr || def.export_name == nullptr ||
        def.help == nullptr) {
      return false;
    }
  }
  return true;
}
}  // namespace internal
static_assert(internal::RowsFollowTheEnum(),
              "kClientCounterDefs needs one complete row per ClientCounter, in its order");

// One reading of a client's counters: a value per row of kClientCounterDefs. Monotonic from one
// reading to the next of the same client. A plain value (an array), cheap to copy; not
// thread-safe to write, as any value.
class ClientCounters {
 public:
  uint64_t operator[](ClientCounter counter) const { return values_[Index(counter)]; }
  uint64_t& operator[](ClientCounter counter) { return values_[Index(counter)]; }

  // Calls fn(const ClientCounterDef&, uint64_t value) for every row, in the table's order.
  template <typename Fn>
  void ForEach(Fn&& fn) const {
    for (const ClientCounterDef& def : kClientCounterDefs) fn(def, values_[Index(def.id)]);
  }

  friend bool operator==(const ClientCounters&, const ClientCounters&) = default;

 private:
  static constexpr size_t Index(ClientCounter counter) { return static_cast<size_t>(counter); }

  std::array<uint64_t, kClientCounterCount> values_{};
};

// The counters as a client keeps them: relaxed atomics, added to on the call path and read by
// Snapshot (each value as of its own load: the rows need not read one instant). Thread-safe.
class AtomicClientCounters {
 public:
  void Add(ClientCounter counter, uint64_t n = 1) {
    if (n != 0) values_[static_cast<size_t>(counter)].fetch_add(n, std::memory_order_relaxed);
  }
  uint64_t Get(ClientCounter counter) const {
    return values_[static_cast<size_t>(counter)].load(std::memory_order_relaxed);
  }
  ClientCounters Snapshot() const {
    ClientCounters out;
    for (const ClientCounterDef& def : kClientCounterDefs) out[def.id] = Get(def.id);
    return out;
  }

 private:
  std::array<std::atomic<uint64_t>, kClientCounterCount> values_{};
};

}  // namespace kvstash
