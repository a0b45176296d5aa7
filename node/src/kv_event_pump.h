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

#include "block_meta_table.h"
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
  // Block metadata pushed out of its table before its block's event was published.
  uint64_t block_metas_dropped = 0;
};

// Drains the store's events every `interval` (store::TieredStore with enable_events) and
// publishes them: each namespace's on its own topic, its name, starting with AllBlocksCleared
// (and the blocks the SSD tier held at start). Events name keys as their clients gave them
// (hash, group) with no tokens. A block whose put said what it holds (`metas`: the block before
// it and its tokens) is published in the CPU tier with them, in one BlockStored per chain of
// such blocks stored in a round (parent_block_hash, block_size); every other, as vLLM's CPU tier
// does, with no parent and block_size 0. A tier that dropped events (store::OffloadEvent::kLost)
// makes every topic start over with AllBlocksCleared, and a batch the publisher dropped (its queue
// full) its own topic.
//
// Owns its thread and the publisher; the store, `name_of` and the metadata table must outlive
// it. Thread-safe.
class KvEventPump {
 public:
  using NameOf = std::function<std::optional<std::string>(NamespaceId)>;
  // The publisher's errors (endpoints). `metas`: where the node records what a put said of its
  // block, before the store commits the block, so that the round that publishes the block's
  // BlockStored finds it (and takes it out); null: none is ever said.
  static Result<std::unique_ptr<KvEventPump>> Create(const KvEventOptions& options,
                                                     store::TieredStore* store, NameOf name_of,
                                                     BlockMetaTable* metas = nullptr);
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
              BlockMetaTable* metas, std::unique_ptr<events::EventPublisher> publisher);
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
  BlockMetaTable* const metas_;  // may be null
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
