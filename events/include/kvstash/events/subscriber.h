// EventSubscriber: reads one topic of a KV events publisher (vLLM's or kvstash's) and hands its
// batches on in order, each exactly once, filling gaps through the publisher's replay socket;
// KvIndex: what each source holds, as its events say.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "kvstash/common/mutex.h"
#include "kvstash/common/status.h"
#include "kvstash/events/kv_events.h"

namespace kvstash::events {

struct SubscriberOptions {
  std::string endpoint;         // the publisher's PUB socket, connected to
  std::string replay_endpoint;  // its ROUTER; empty: a gap cannot be filled (a reset)
  std::string topic;            // followed exactly (ZMQ filters by prefix; the rest is dropped)
  // How long a replay may take to answer before the gap counts as lost.
  std::chrono::milliseconds replay_timeout{2000};
  // Asks the replay for everything it holds as soon as it starts, rather than when the first
  // live batch shows that it joined late (a quiet publisher may send none for long): what a
  // router that starts beside running workers wants.
  bool replay_at_start = false;
};

// One batch handed on. `reset`: batches before it were lost for good (the replay no longer had
// them, or one could not be read): whatever the consumer knew of this source is stale, and it
// starts over from this batch (as after an AllBlocksCleared).
struct Delivery {
  int64_t sequence = 0;
  KvEventBatch batch;
  bool reset = false;
};

// Counters since Create. Monotonic.
struct SubscriberStats {
  uint64_t delivered = 0;   // batches handed on
  uint64_t duplicates = 0;  // batches seen twice (a replay overlapping live ones), dropped
  uint64_t gaps = 0;        // gaps seen in the sequence numbers
  uint64_t replayed = 0;    // batches a replay filled in
  uint64_t resets = 0;      // deliveries with reset
  uint64_t malformed = 0;   // messages that were not [topic, sequence, batch]
  uint64_t restarts = 0;    // the publisher started over: a new life (docs/semantics.md §19)
};

// Runs its own thread; `on_batch` is called on it, in sequence order, never concurrently.
// Thread-safe.
class EventSubscriber {
 public:
  using OnBatch = std::function<void(const Delivery&)>;
  // InvalidArgument for an endpoint ZMQ refuses.
  static Result<std::unique_ptr<EventSubscriber>> Create(const SubscriberOptions& options,
                                                         OnBatch on_batch);
  ~EventSubscriber();
  EventSubscriber(const EventSubscriber&) = delete;
  EventSubscriber& operator=(const EventSubscriber&) = delete;

  // Drops the connection to the publisher until Reconnect (what a cut network does: whatever is
  // published meanwhile never arrives, and shows as a gap at the next batch after Reconnect).
  // Each returns once the subscriber's thread has acted on it.
  void Disconnect();
  void Reconnect();
  // The next sequence number it waits for (how many batches it has handed on, counting from
  // the publisher's last start); -1 before the first.
  int64_t expected() const;
  SubscriberStats stats() const;

  class Impl;

 private:
  explicit EventSubscriber(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// What a set of sources (workers, nodes) hold, as their deliveries say: per source, the
// (medium, group, hash) of every block stored and not removed since its last AllBlocksCleared
// or reset. A source holding more than `max_blocks_per_source` blocks is cleared (counted):
// an index never grows without bound, whatever a publisher sends. Thread-safe.
class KvIndex {
 public:
  explicit KvIndex(size_t max_blocks_per_source = size_t{1} << 24)
      : max_blocks_(max_blocks_per_source) {}

  void Apply(std::string_view source, const Delivery& delivery);
  // Whether `source` holds the block in `medium` (any medium when empty).
  bool Holds(std::string_view source, std::string_view medium, int64_t group,
             const ExternalHash& hash) const;
  size_t blocks(std::string_view source) const;
  // Drops everything `source` holds (a worker or node no longer followed).
  void Forget(std::string_view source);
  // Everything `source` holds, in order (tests compare two indexes by it).
  using Entry = std::tuple<std::string, int64_t, ExternalHash>;  // medium, group, hash
  std::vector<Entry> Snapshot(std::string_view source) const;
  uint64_t overflows() const;

 private:
  const size_t max_blocks_;
  mutable Mutex mu_;
  std::map<std::string, std::set<Entry>, std::less<>> sources_ GUARDED_BY(mu_);
  uint64_t overflows_ GUARDED_BY(mu_) = 0;
};

}  // namespace kvstash::events
