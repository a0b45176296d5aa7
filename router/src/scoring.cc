#include "kvstash/router/scoring.h"

#include <algorithm>
#include <numeric>

#include "kvstash/engine/kv_cache_manager.h"
#include "kvstash/events/kv_events.h"

namespace kvstash::router {
namespace {

// The hash of block i of a group whose blocks are `k` hash blocks long: the last inside it
// (docs/semantics.md §7.2, KvCacheManager::GroupHash).
const BlockHash& GroupHash(std::span<const BlockHash> hashes, size_t k, size_t i) {
  return hashes[i * k + k - 1];
}

}  // namespace

std::vector<BlockHash> PromptHashes(const CacheLayout& layout, std::span<const uint32_t> tokens) {
  if (layout.hash_block_size == 0) return {};
  engine::RequestHasher hasher(layout.hash_block_size, layout.cache_salt);
  hasher.Update(tokens);
  return hasher.hashes();
}

size_t HybridHitTokens(const events::KvIndex& index, std::string_view source,
                       std::string_view medium, const CacheLayout& layout,
                       std::span<const BlockHash> hashes, size_t num_tokens) {
  const std::string one(source);
  return HybridHitTokens(index, std::span(&one, 1), medium, layout, hashes, num_tokens);
}

size_t HybridHitTokens(const events::KvIndex& index, std::span<const std::string> sources,
                       std::string_view medium, const CacheLayout& layout,
                       std::span<const BlockHash> hashes, size_t num_tokens) {
  if (layout.groups.empty() || layout.hash_block_size == 0 || num_tokens == 0) return 0;
  std::vector<engine::CacheGroup> groups;
  groups.reserve(layout.groups.size());
  // Each block is looked up once and its answer kept: the search asks about a block more than
  // once (whether it is held, then its id), and the index changes under it as events arrive,
  // so that a block held at the first question and gone at the second would break the search.
  std::vector<std::vector<int8_t>> seen(layout.groups.size());  // -1: not asked; 0, 1
  for (size_t g = 0; g < layout.groups.size(); ++g) {
    const engine::AttentionSpec& spec = layout.groups[g];
    if (spec.block_size == 0 || spec.block_size % layout.hash_block_size != 0) return 0;
    const size_t k = spec.block_size / layout.hash_block_size;
    engine::CachedBlocks cached;
    cached.count = hashes.size() / k;
    seen[g].assign(cached.count, -1);
    // A block id is all the search needs to tell a hit: 1 for "held".
    cached.at = [&index, &seen, sources, medium, hashes, k,
                 g](size_t i) -> std::optional<engine::BlockId> {
      int8_t& held = seen[g][i];
      if (held < 0) {
        held = 0;
        const events::ExternalHash hash = events::ExternalHashOf(GroupHash(hashes, k, i));
        for (const std::string& source : sources) {
          if (index.Holds(source, medium, static_cast<int64_t>(g), hash)) {
            held = 1;
            break;
          }
        }
      }
      return held != 0 ? std::optional<engine::BlockId>(1) : std::nullopt;
    };
    groups.push_back({spec, std::move(cached)});
  }
  return engine::FindLongestHybridCacheHit(groups, num_tokens - 1).tokens;
}

size_t MaxHitTokens(const CacheLayout& layout, size_t num_hashes, size_t num_tokens) {
  if (layout.groups.empty() || layout.hash_block_size == 0 || num_tokens == 0) return 0;
  std::vector<engine::CacheGroup> groups;
  groups.reserve(layout.groups.size());
  for (const engine::AttentionSpec& spec : layout.groups) {
    if (spec.block_size == 0 || spec.block_size % layout.hash_block_size != 0) return 0;
    engine::CachedBlocks cached;
    cached.count = num_hashes / (spec.block_size / layout.hash_block_size);
    cached.at = [](size_t) -> std::optional<engine::BlockId> { return engine::BlockId(1); };
    groups.push_back({spec, std::move(cached)});
  }
  return engine::FindLongestHybridCacheHit(groups, num_tokens - 1).tokens;
}

size_t GroupBlindHitTokens(const events::KvIndex& index, std::string_view source,
                           std::string_view medium, const CacheLayout& layout,
                           std::span<const BlockHash> hashes, size_t num_tokens) {
  for (size_t g = 0; g < layout.groups.size(); ++g) {
    const engine::AttentionSpec& spec = layout.groups[g];
    if (spec.kind != engine::AttentionSpec::Kind::kFull || layout.hash_block_size == 0) continue;
    const size_t k = spec.block_size / layout.hash_block_size;
    size_t blocks = 0;
    while (blocks < hashes.size() / k &&
           index.Holds(source, medium, static_cast<int64_t>(g),
                       events::ExternalHashOf(GroupHash(hashes, k, blocks)))) {
      ++blocks;
    }
    return std::min(blocks * spec.block_size, num_tokens == 0 ? 0 : num_tokens - 1);
  }
  return 0;
}

}  // namespace kvstash::router
