#pragma once

// Prefix-cache hit search of the hybrid KV-cache manager, per attention type and across
// KV-cache groups, exactly as vLLM's single-type managers and HybridKVCacheCoordinator do
// (docs/semantics.md §9.3, §9.4; vectors §12.K). The block pool and the
// hashing are not here: a group's cached blocks are given as a lookup by hash index.
//
// Block tables hold block ids; block 0 is the null block (a position whose KV is not needed:
// outside a sliding window, before a chunk, before a state snapshot).

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <vector>

namespace kvstash::engine {

using BlockId = uint32_t;
inline constexpr BlockId kNullBlock = 0;
using RequestId = uint64_t;

// Blocks of `block_size` tokens that `tokens` tokens take (the last one possibly partial).
constexpr size_t CeilDiv(size_t tokens, size_t block_size) {
  return (tokens + block_size - 1) / block_size;
}

struct AttentionSpec {
  enum class Kind : uint8_t { kFull, kSlidingWindow, kChunkedLocal, kState };
  Kind kind = Kind::kFull;
  uint32_t block_size = 16;  // tokens per block
  uint32_t window = 0;       // kSlidingWindow: tokens in the window
  uint32_t chunk = 0;        // kChunkedLocal: tokens per chunk
  // kSlidingWindow: the layers keep a request's KV in a ring of `window` tokens outside the
  // pool (KvLayout's swa_ring). Hits, freeing and the cache mask are a sliding window's; the
  // group's blocks exist only to be cached (see KvCacheManager::AllocateSlots).
  bool ring = false;
  friend bool operator==(const AttentionSpec&, const AttentionSpec&) = default;
};

// The cached block of the group's i-th block hash (its view of the request's hashes at its
// block size), or nullopt on a miss. `count` hashes exist.
struct CachedBlocks {
  size_t count = 0;
  std::function<std::optional<BlockId>(size_t i)> at;
};

// The longest cache hit of one group for the first `max_length` tokens, its length a multiple
// of `alignment` tokens (the coordinator passes the lcm of the groups' block sizes): the
// group's block table for those tokens, null blocks where the type needs no KV. `eagle`
// drops the last matched block (its KV is recomputed for the draft model).
std::vector<BlockId> FindLongestCacheHit(const AttentionSpec& spec, const CachedBlocks& cached,
                                         size_t max_length, size_t alignment, bool eagle = false);

// Tokens of the first `num_tokens` whose KV this type no longer needs.
size_t NumSkippedTokens(const AttentionSpec& spec, size_t num_tokens);

// Replaces the blocks of `table` that hold only skipped tokens by the null block, from the
// last such block back to the first one already null, and returns them in that order (the
// order to free them in: a later block stands for a longer prefix, so it goes first).
std::vector<BlockId> RemoveSkippedBlocks(const AttentionSpec& spec, std::vector<BlockId>& table,
                                         size_t num_tokens);

// One KV-cache group for the hybrid search.
struct CacheGroup {
  AttentionSpec spec;
  CachedBlocks cached;
};

struct HybridCacheHit {
  std::vector<std::vector<BlockId>> blocks;  // per group, in the order given
  size_t tokens = 0;                         // the hit length, a multiple of every block size
};

// The longest hit all groups agree on, at most `max_length` tokens (the request's tokens - 1):
// groups of identical spec are looked up together (a hash hits only when it hits in each), full
// attention first; the candidate length shrinks until every attention type accepts it. With
// exactly one full-attention and one other attention group, one round decides it.
//
// `eagle`: full-attention and sliding-window groups drop their last matched block (vLLM's
// eagle): such a group is looked up with one block more than the candidate length (capped at
// `max_length`) and drops one, at most once per candidate length, so that the drop does not
// compound over the rounds. Chunked-local and state groups get no eagle treatment (a draft
// model has no such layers).
HybridCacheHit FindLongestHybridCacheHit(std::span<const CacheGroup> groups, size_t max_length,
                                         bool eagle = false);

}  // namespace kvstash::engine
