// CacheEventPublisher: a worker's KV events (docs/semantics.md §19): what its engine's prefix
// cache caches and evicts, as vLLM's workers publish theirs (medium GPU).
#pragma once

#include <memory>
#include <vector>

#include "kvstash/common/status.h"
#include "kvstash/engine/block_pool.h"
#include "kvstash/engine/cache_hit.h"
#include "kvstash/events/publisher.h"
#include "kvstash/worker/protocol.h"

namespace kvstash::worker {

// The window a group's events state: tokens of a sliding window or of a chunk, none otherwise
// (its kind's name is SpecKindName, protocol.h).
std::optional<int64_t> SpecWindow(const engine::AttentionSpec& spec);

// One engine step's cache events as a batch (the rules below); `start`: it begins with
// AllBlocksCleared.
events::KvEventBatch CacheEventBatch(const std::vector<engine::CacheEvent>& step,
                                     std::span<const engine::AttentionSpec> groups, bool start);

// Turns the engine's cache events into batches and publishes them on `topic`: the first batch
// starts with AllBlocksCleared; a run of hashes of one group that chain (each the parent of the
// next) is one BlockStored with the first's parent, the group's block size in tokens, its kind
// and window; evicted hashes are BlockRemoved. Token ids are not sent (a router hashes the
// prompt itself, as the engine does). Owned by the worker; called on its engine thread only.
class CacheEventPublisher {
 public:
  // The publisher's errors.
  static Result<std::unique_ptr<CacheEventPublisher>> Create(
      const events::PublisherOptions& options, std::vector<engine::AttentionSpec> groups);

  // Publishes the events of one engine step (none: nothing sent). Never blocks.
  void Publish(const std::vector<engine::CacheEvent>& step);
  const events::EventPublisher& publisher() const { return *publisher_; }
  // Waits until everything published so far is sent (and buffered for replay).
  void Flush() { publisher_->Flush(); }

 private:
  CacheEventPublisher(std::unique_ptr<events::EventPublisher> publisher,
                      std::vector<engine::AttentionSpec> groups, std::string topic);

  std::unique_ptr<events::EventPublisher> publisher_;
  const std::vector<engine::AttentionSpec> groups_;
  const std::string topic_;
  bool started_ = false;  // AllBlocksCleared sent
};

}  // namespace kvstash::worker
