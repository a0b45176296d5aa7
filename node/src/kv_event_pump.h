// KvEventPump: a node's KV events (docs/semantics.md §19): what each tier of its store has
// stored and removed, published in vLLM's schema on one topic per namespace.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>

#include "kvstash/common/block_key.h"
#include "kvstash/common/mutex.h"
#include "kvstash/common/status.h"
#include "kvstash/events/publisher.h"
#include "kvstash/node/node_server.h"
#include "kvstash/store/tiered_store.h"

namespace kvstash::node {

class KvEventRound;  // kv_event_pump.cc

// Counters since start, with the publisher's.
struct KvEventPumpStats {
  events::PublisherStats publisher;
  uint64_t rounds_lost = 0;  // a tier dropped undrained events (kLost): AllBlocksCleared sent
};

// Drains the store's events every `interval` (store::TieredStore with enable_events) and
// publishes them: each namespace's on its own topic, its name, starting with AllBlocksCleared
// (and the blocks the SSD tier held at start). Events name keys as their clients gave them
// (hash, group) with block_size 0 and no tokens, as vLLM's CPU tier does. A tier that dropped
// events (store::OffloadEvent::kLost) makes every topic start over with AllBlocksCleared, and
// a batch the publisher dropped (its queue full) its own topic.
//
// Owns its thread and the publisher; the store and `name_of` must outlive it. Thread-safe.
class KvEventPump {
 public:
  using NameOf = std::function<std::optional<std::string>(NamespaceId)>;
  // The publisher's errors (endpoints).
  static Result<std::unique_ptr<KvEventPump>> Create(const KvEventOptions& options,
                                                     store::TieredStore* store, NameOf name_of);
  // Publishes what is left, then stops.
  ~KvEventPump();
  KvEventPump(const KvEventPump&) = delete;
  KvEventPump& operator=(const KvEventPump&) = delete;

  const events::EventPublisher& publisher() const { return *publisher_; }
  // Drains and publishes the store's events now, on this thread, and returns once they are
  // sent (tests; the pump's own rounds go on).
  void PublishNow();
  KvEventPumpStats stats() const;

 private:
  KvEventPump(const KvEventOptions& options, store::TieredStore* store, NameOf name_of,
              std::unique_ptr<events::EventPublisher> publisher);
  void Run();
  // One round: drains both tiers and publishes per namespace.
  void Pump() EXCLUDES(pump_mu_);
  // Publishes namespace `ns`'s events of `round` on `topic`, after AllBlocksCleared when
  // `clear`; a batch the publisher drops marks the topic for a fresh start.
  void Publish(NamespaceId ns, const std::string& topic, const KvEventRound& round, bool clear)
      REQUIRES(pump_mu_);

  const std::chrono::milliseconds interval_;
  store::TieredStore* const store_;
  const NameOf name_of_;
  std::unique_ptr<events::EventPublisher> publisher_;
  // Held by a round: namespaces whose topic began, and those whose last batch the publisher
  // dropped (their next batch starts with AllBlocksCleared).
  Mutex pump_mu_;
  std::set<NamespaceId> announced_ GUARDED_BY(pump_mu_);
  std::set<NamespaceId> dropped_ GUARDED_BY(pump_mu_);
  // The tiers' drained events; their memory goes back to the tiers at the next drain.
  store::OffloadEventLog cpu_log_ GUARDED_BY(pump_mu_);
  store::OffloadEventLog ssd_log_ GUARDED_BY(pump_mu_);
  std::unique_ptr<KvEventRound> round_ PT_GUARDED_BY(pump_mu_);  // reused from round to round

  mutable Mutex mu_;
  CondVar wake_;
  bool stopping_ GUARDED_BY(mu_) = false;
  uint64_t rounds_lost_ GUARDED_BY(mu_) = 0;
  std::thread thread_;  // last
};

}  // namespace kvstash::node
