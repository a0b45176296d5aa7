// What a router scores a worker or a node by: the hit a prompt would really get there, computed
// as the worker's engine computes its own (docs/semantics.md §7.4, §9.4) over what the source's
// KV events say it holds (kvstash::events::KvIndex).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvstash/common/hash.h"
#include "kvstash/engine/cache_hit.h"
#include "kvstash/events/subscriber.h"

namespace kvstash::router {

// A worker's KV-cache layout, as its /v1/models states it: its groups (block size in tokens,
// kind, window), the block size its prompts are hashed at and the salt of their first block.
struct CacheLayout {
  std::vector<engine::AttentionSpec> groups;
  uint32_t hash_block_size = 0;
  std::string cache_salt;
};

// The chained hashes of the prompt's full blocks of hash_block_size tokens, as the worker's
// engine computes them (engine::RequestHasher).
std::vector<BlockHash> PromptHashes(const CacheLayout& layout, std::span<const uint32_t> tokens);

// The tokens of a `num_tokens`-token prompt (its hashes `hashes`) whose KV `source` holds in
// `medium` (empty: in any medium), by the engine's own rule (engine::FindLongestHybridCacheHit:
// the longest prefix every group can serve, a sliding window its last blocks, a state group its
// snapshot at the hit's end); never the last token, which is always computed.
size_t HybridHitTokens(const events::KvIndex& index, std::string_view source,
                       std::string_view medium, const CacheLayout& layout,
                       std::span<const BlockHash> hashes, size_t num_tokens);

// The same over several sources at once (a block counts when any of them holds it): the hit a
// worker gets from the offload nodes, each of which holds part of what the cluster holds.
size_t HybridHitTokens(const events::KvIndex& index, std::span<const std::string> sources,
                       std::string_view medium, const CacheLayout& layout,
                       std::span<const BlockHash> hashes, size_t num_tokens);

// The hit a `num_tokens`-token prompt (`num_hashes` hashes) would get if every block of it were
// held: the most any source can give it, and what a prefill that pushes its blocks leaves for
// the decode worker to pull.
size_t MaxHitTokens(const CacheLayout& layout, size_t num_hashes, size_t num_tokens);

// What a group-blind scorer counts (what routers that ignore groups do): the prefix of the
// full-attention group's blocks the source holds, in tokens. For comparison only.
size_t GroupBlindHitTokens(const events::KvIndex& index, std::string_view source,
                           std::string_view medium, const CacheLayout& layout,
                           std::span<const BlockHash> hashes, size_t num_tokens);

}  // namespace kvstash::router
