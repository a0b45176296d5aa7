#include "cache_events.h"

#include <chrono>
#include <utility>

namespace kvstash::worker {
std::optional<int64_t> SpecWindow(const engine::AttentionSpec& spec) {
  using Kind = engine::AttentionSpec::Kind;
  if (spec.kind == Kind::kSlidingWindow) return spec.window;
  if (spec.kind == Kind::kChunkedLocal) return spec.chunk;
  return std::nullopt;
}

Result<std::unique_ptr<CacheEventPublisher>> CacheEventPublisher::Create(
    const events::PublisherOptions& options, std::vector<engine::AttentionSpec> groups) {
  KVSTASH_ASSIGN_OR_RETURN(std::unique_ptr<events::EventPublisher> publisher,
                           events::EventPublisher::Create(options));
  return std::unique_ptr<CacheEventPublisher>(
      new CacheEventPublisher(std::move(publisher), std::move(groups), options.default_topic));
}

CacheEventPublisher::CacheEventPublisher(std::unique_ptr<events::EventPublisher> publisher,
                                         std::vector<engine::AttentionSpec> groups,
                                         std::string topic)
    : publisher_(std::move(publisher)), groups_(std::move(groups)), topic_(std::move(topic)) {}

events::KvEventBatch CacheEventBatch(const std::vector<engine::CacheEvent>& step,
                                     std::span<const engine::AttentionSpec> groups, bool start) {
  events::KvEventBatch batch{events::NowSeconds(), {}, std::nullopt};
  if (start) batch.events.emplace_back(events::AllBlocksCleared{});
  std::optional<Hash128> chain_end;  // the last stored hash, while the last event is a store
  for (const engine::CacheEvent& e : step) {
    const uint32_t group = e.key.group;
    const events::ExternalHash hash = events::ExternalHashOf(e.key.hash);
    if (e.kind == engine::CacheEvent::Kind::kRemoved) {
      chain_end.reset();
      auto* last =
          batch.events.empty() ? nullptr : std::get_if<events::BlockRemoved>(&batch.events.back());
      if (last != nullptr && last->group_idx == group) {
        last->block_hashes.push_back(hash);
      } else {
        batch.events.emplace_back(
            events::BlockRemoved{{hash}, std::string(events::kMediumGpu), group});
      }
      continue;
    }
    auto* last =
        batch.events.empty() ? nullptr : std::get_if<events::BlockStored>(&batch.events.back());
    // Extends the last event when this block continues its chain.
    if (last != nullptr && last->group_idx == group && e.parent && chain_end == *e.parent) {
      last->block_hashes.push_back(hash);
      chain_end = e.key.hash;
      continue;
    }
    chain_end = e.key.hash;
    events::BlockStored stored;
    stored.block_hashes = {hash};
    if (e.parent) stored.parent_block_hash = events::ExternalHashOf(*e.parent);
    const engine::AttentionSpec* spec = group < groups.size() ? &groups[group] : nullptr;
    stored.block_size = spec != nullptr ? spec->block_size : 0;
    stored.medium = std::string(events::kMediumGpu);
    stored.group_idx = group;
    if (spec != nullptr) {
      stored.kv_cache_spec_kind = std::string(SpecKindName(spec->kind));
      stored.kv_cache_spec_sliding_window = SpecWindow(*spec);
    }
    batch.events.push_back(std::move(stored));
  }
  return batch;
}

void CacheEventPublisher::Publish(const std::vector<engine::CacheEvent>& step) {
  if (step.empty() && started_) return;
  events::KvEventBatch batch = CacheEventBatch(step, groups_, !started_);
  started_ = true;
  // A batch dropped (the queue full) leaves a gap: the next one starts over.
  if (!publisher_->Publish(topic_, std::move(batch))) started_ = false;
}

}  // namespace kvstash::worker
