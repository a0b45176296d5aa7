#pragma once

// The hybrid KV-cache manager: one block pool shared by every KV-cache group, per-group block
// tables of each request, prefix caching with chained block hashes, and the per-type freeing of
// blocks a layer no longer needs, as vLLM's KVCacheManager, HybridKVCacheCoordinator and
// single-type managers (docs/semantics.md §9; vectors §12.K, §12.L).
//
// Owned by the scheduler; not thread-safe (the scheduler calls it from one thread).

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "kvstash/common/hash.h"
#include "kvstash/engine/block_pool.h"
#include "kvstash/engine/cache_hit.h"

namespace kvstash::engine {

// The chained block hashes of a request's full blocks of `block_size` tokens (§9.1, xxh3-128
// over parent hash, token ids and extra keys). Incremental: Update hashes only the blocks that
// became full since the last call. `cache_salt` goes into the first block's extra keys only.
class RequestHasher {
 public:
  RequestHasher(uint32_t block_size, std::string cache_salt = {});
  // Appends the hashes of the full blocks of `tokens` not hashed yet.
  void Update(std::span<const uint32_t> tokens);
  const std::vector<BlockHash>& hashes() const { return hashes_; }
  uint32_t block_size() const { return block_size_; }

 private:
  uint32_t block_size_;
  std::string cache_salt_;
  std::vector<BlockHash> hashes_;
};

struct KvCacheManagerOptions {
  std::vector<AttentionSpec> groups;  // KV-cache groups; the index is the group id
  size_t num_blocks = 0;              // blocks in the pool, the null block 0 included
  bool prefix_caching = true;
  // Block size the request hashes are computed at; 0 means the gcd of the groups' block
  // sizes. Every group's block size must be a multiple of it. A group whose blocks are k hash
  // blocks long keys its i-th block by hash k*i + k - 1, the last of the k: the hashes are
  // chained, so the last one already commits to the whole prefix (vLLM concatenates the k).
  uint32_t hash_block_size = 0;
  // Hits drop their last block per group (the KV a draft model recomputes), as vLLM's eagle.
  bool eagle = false;
  // Record the prefix cache's events for TakeEvents (BlockPool's record_events): whoever turns
  // it on drains them.
  bool record_events = false;
};

// A prefix-cache hit: per group, the blocks for the first `tokens` tokens (null blocks where the
// group needs no KV).
struct ComputedBlocks {
  std::vector<std::vector<BlockId>> blocks;
  size_t tokens = 0;
};

class KvCacheManager {
 public:
  explicit KvCacheManager(KvCacheManagerOptions options);

  size_t num_groups() const;
  const AttentionSpec& group_spec(size_t group) const;
  uint32_t hash_block_size() const;
  // lcm of the groups' block sizes: hits and cached lengths are multiples of it.
  uint32_t lcm_block_size() const;
  size_t num_free_blocks() const;
  // The pool's blocks, the null block included. Fixed at construction: safe from any thread.
  size_t num_blocks() const { return options_.num_blocks; }
  BlockPool& pool();

  // The longest prefix-cache hit of a request that has `num_tokens` tokens and these hashes (at
  // hash_block_size), at most num_tokens - 1 tokens (the last token is always computed).
  // Nothing is allocated or touched. Empty (0 tokens) when prefix caching is off.
  ComputedBlocks GetComputedBlocks(std::span<const BlockHash> hashes, size_t num_tokens) const;

  // Blocks that allocating for these arguments would take from the free queue (new blocks plus
  // hit blocks that sit unreferenced in the free queue), per group summed; what AllocateSlots
  // checks against the free blocks (after freeing what the request no longer needs). Positions
  // a group skips at the computed length (outside a window, before a chunk or a snapshot) take
  // the null block, not a new one, and their hit blocks are not counted. A ring group counts
  // only the blocks it will cache (see AllocateSlots), assuming the request's hashes cover every
  // full block of its tokens, as the scheduler's do; AllocateSlots counts with the hashes given.
  size_t NumBlocksToAllocate(RequestId id, size_t num_computed_tokens, size_t num_new_tokens,
                             const ComputedBlocks* new_computed) const;

  // The fewest blocks a request holds while the token at `position` is computed, whatever its
  // schedule: any allocation that computes the position (a prefill chunk, a decode step, a
  // resumed request's recompute, after any hit) holds at least, per group, the blocks from the
  // first one the group still needs at the position (past a window, a chunk or a state's
  // snapshot) to the one holding it. Ring groups count none: their KV lives outside the pool,
  // and whether a position of theirs takes a block for the prefix cache depends on what the
  // request cached before. Reads only the groups' specs, fixed at construction: safe from any
  // thread.
  size_t MinBlocksHeldAt(size_t position) const;
  // The most MinBlocksHeldAt gives a position from `first` to `last` (what a request holds at
  // its peak computing those positions one per step), looked up over at most one period of the
  // groups' windows, chunks and blocks: past it only the full-attention groups' share grows.
  // Safe from any thread.
  size_t MinBlocksToCompute(size_t first, size_t last) const;

  // Makes the request's block tables cover num_computed_tokens (+ new_computed->tokens, a hit
  // from GetComputedBlocks given on the request's first allocation; ignored once the request
  // holds blocks) + num_new_tokens tokens: first frees the blocks its groups no longer need at
  // num_computed_tokens (+ the hit), then takes the hit blocks (Touch) and new blocks, group
  // by group. Then caches the hashes of the blocks that will be full once these tokens are
  // computed (at most num_tokens tokens and as many blocks as `hashes` cover; with more than
  // one group clamped to a multiple of the lcm block size; sliding-window groups cache only
  // their needed tail of each lcm segment; null blocks never).
  // A ring group (AttentionSpec::ring) keeps its KV outside the pool: its table covers the
  // tokens like a sliding window's, but only blocks that this call caches, completed by these
  // new tokens, get a pool block (the runner copies them from its step buffer); every other
  // entry is the null block, so with prefix caching off the group holds no block at all. Its
  // hit blocks are taken and freed as a sliding window's.
  // Returns false, with nothing changed, when the pool has too few free blocks (counting those
  // the freeing would return); the scheduler may preempt and call again.
  // `hashes` are the request's block hashes at hash_block_size, `num_tokens` its token count.
  // `delay_cache`: the new tokens' KV arrives from elsewhere (a load from an offload node), so
  // nothing is cached now; CacheBlocks caches the blocks once it has arrived.
  bool AllocateSlots(RequestId id, std::span<const BlockHash> hashes, size_t num_tokens,
                     size_t num_computed_tokens, size_t num_new_tokens,
                     const ComputedBlocks* new_computed = nullptr, bool delay_cache = false);

  // Caches the hashes of the request's blocks full within its first num_computed_tokens tokens
  // (as AllocateSlots does), after a load AllocateSlots was told to delay caching for.
  void CacheBlocks(RequestId id, std::span<const BlockHash> hashes, size_t num_tokens,
                   size_t num_computed_tokens);

  // The request's block table per group (num_groups() empty tables if it holds none). Valid
  // until the next AllocateSlots or Free of this request.
  const std::vector<std::vector<BlockId>>& BlockTables(RequestId id) const;

  // Frees every block of the request: per group in reverse table order (its tail evicted
  // first), null blocks skipped. No-op for an unknown id.
  void Free(RequestId id);

  // With record_events: the hashes cached and evicted since the last call, in order.
  std::vector<CacheEvent> TakeEvents();
  // The same, the evicted hashes only.
  std::vector<CachedKey> TakeRemovedEvents();

 private:
  struct RequestState {
    std::vector<std::vector<BlockId>> tables;
    std::vector<size_t> num_cached;  // per group: blocks already cached
    // Per ring group: every entry below is the null block. A ring table has null entries
    // between its cached blocks, so freeing cannot stop at the first null one.
    std::vector<size_t> null_below;
  };
  // Caches the blocks of `state` full within cache_tokens (from num_cached on).
  void CacheUpTo(RequestState& state, std::span<const BlockHash> hashes, size_t cache_tokens);
  // Group `g`'s view of hashes at hash_block_size: its block count and its i-th block's hash.
  size_t NumGroupHashes(size_t g, std::span<const BlockHash> hashes) const;
  const BlockHash& GroupHash(size_t g, std::span<const BlockHash> hashes, size_t i) const;
  // Whether group `g` caches its i-th block (sliding windows keep only each lcm segment's tail).
  bool CachesBlock(size_t g, size_t i) const;
  // What NumBlocksToAllocate counts for one group; `state` is null for a new request.
  // `cacheable`: the group's blocks that may be cached (the ring group's count).
  size_t GroupBlocksToAllocate(size_t g, const RequestState* state, size_t total_computed,
                               size_t total_tokens, std::span<const BlockId> hit,
                               size_t cacheable) const;
  // The blocks [first, last) of ring group `g` that may get a pool block in an allocation to
  // `total_tokens` from `total_computed`: cached now (below `cacheable`, not cached before)
  // and completed by the new tokens (the runner copies a block out of its step buffer in the
  // step that completes it). Those among them that CachesBlock and whose entry is null do.
  std::pair<size_t, size_t> RingBlockRange(size_t g, size_t num_cached, size_t total_computed,
                                           size_t total_tokens, size_t cacheable) const;
  // Blocks a ring group takes in that range: CachesBlock, entry null or past `table`.
  size_t RingBlocksToAllocate(size_t g, std::span<const BlockId> table, size_t num_cached,
                              size_t total_computed, size_t total_tokens, size_t cacheable) const;
  // Tokens of a request with `total_tokens` (at most `num_tokens`) that may be cached.
  size_t CacheableTokens(size_t total_tokens, size_t num_tokens) const;
  KvCacheManagerOptions options_;
  uint32_t hash_block_size_ = 0;
  uint32_t lcm_block_size_ = 1;
  BlockPool pool_;
  std::unordered_map<RequestId, RequestState> requests_;
  std::vector<std::vector<BlockId>> empty_tables_;
};

}  // namespace kvstash::engine
