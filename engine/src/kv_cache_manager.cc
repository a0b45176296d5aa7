#include "kvstash/engine/kv_cache_manager.h"

#include <algorithm>
#include <cassert>
#include <numeric>
#include <utility>

namespace kvstash::engine {
namespace {

using Kind = AttentionSpec::Kind;

std::span<const BlockId> HitOf(const ComputedBlocks* hit, size_t g) {
  if (hit == nullptr || g >= hit->blocks.size()) return {};
  return hit->blocks[g];
}

}  // namespace

RequestHasher::RequestHasher(uint32_t block_size, std::string cache_salt)
    : block_size_(block_size), cache_salt_(std::move(cache_salt)) {}

void RequestHasher::Update(std::span<const uint32_t> tokens) {
  for (size_t start = hashes_.size() * block_size_; start + block_size_ <= tokens.size();
       start += block_size_) {
    const BlockHash parent = hashes_.empty() ? BlockHash{} : hashes_.back();
    // The salt separates tenants' caches; on the first block it already reaches every later
    // hash through the chain.
    std::span<const std::byte> extra;
    if (start == 0) extra = std::as_bytes(std::span(cache_salt_.data(), cache_salt_.size()));
    hashes_.push_back(ChainBlockHash(parent, tokens.subspan(start, block_size_), extra));
  }
}

KvCacheManager::KvCacheManager(KvCacheManagerOptions options)
    : options_(std::move(options)),
      pool_(options_.num_blocks, options_.prefix_caching, options_.record_events),
      empty_tables_(options_.groups.size()) {
  uint32_t gcd = 0;
  for (const AttentionSpec& spec : options_.groups) {
    gcd = std::gcd(gcd, spec.block_size);
    lcm_block_size_ = std::lcm(lcm_block_size_, spec.block_size);
  }
  hash_block_size_ = options_.hash_block_size != 0 ? options_.hash_block_size : gcd;
  for ([[maybe_unused]] const AttentionSpec& spec : options_.groups) {
    assert(hash_block_size_ != 0 && spec.block_size % hash_block_size_ == 0);
  }
}

size_t KvCacheManager::num_groups() const { return options_.groups.size(); }
const AttentionSpec& KvCacheManager::group_spec(size_t group) const {
  return options_.groups[group];
}
uint32_t KvCacheManager::hash_block_size() const { return hash_block_size_; }
uint32_t KvCacheManager::lcm_block_size() const { return lcm_block_size_; }
size_t KvCacheManager::num_free_blocks() const { return pool_.num_free(); }
BlockPool& KvCacheManager::pool() { return pool_; }

size_t KvCacheManager::NumGroupHashes(size_t g, std::span<const BlockHash> hashes) const {
  return hashes.size() / (options_.groups[g].block_size / hash_block_size_);
}

const BlockHash& KvCacheManager::GroupHash(size_t g, std::span<const BlockHash> hashes,
                                           size_t i) const {
  const size_t k = options_.groups[g].block_size / hash_block_size_;
  return hashes[i * k + k - 1];
}

bool KvCacheManager::CachesBlock(size_t g, size_t i) const {
  const AttentionSpec& spec = options_.groups[g];
  if (spec.kind != Kind::kSlidingWindow) return true;
  // A hit ends on an lcm boundary and needs only the window's blocks before it (one more with
  // eagle, whose run ends one block past the boundary): the other blocks of a segment can
  // never be part of a hit, so caching them would only crowd out useful hashes.
  const size_t per_segment = lcm_block_size_ / spec.block_size;
  const size_t need = CeilDiv(spec.window - 1, spec.block_size) + (options_.eagle ? 1 : 0);
  if (need >= per_segment) return true;
  const size_t shift = options_.eagle ? 1 : 0;
  return i >= shift && (i - shift) % per_segment >= per_segment - need;
}

ComputedBlocks KvCacheManager::GetComputedBlocks(std::span<const BlockHash> hashes,
                                                 size_t num_tokens) const {
  ComputedBlocks out;
  out.blocks.resize(num_groups());
  if (!options_.prefix_caching || num_tokens == 0 || num_groups() == 0) return out;
  std::vector<CacheGroup> groups;
  groups.reserve(num_groups());
  for (size_t g = 0; g < num_groups(); ++g) {
    const uint32_t group_id = static_cast<uint32_t>(g);
    groups.push_back(CacheGroup{
        options_.groups[g],
        CachedBlocks{NumGroupHashes(g, hashes),
                     [this, g, group_id, hashes](size_t i) -> std::optional<BlockId> {
                       auto blocks =
                           pool_.GetCachedBlock(GroupHash(g, hashes, i), std::span(&group_id, 1));
                       if (!blocks) return std::nullopt;
                       return (*blocks)[0];
                     }}});
  }
  // The last token is always computed: its logits are what the step is for.
  HybridCacheHit hit = FindLongestHybridCacheHit(groups, num_tokens - 1, options_.eagle);
  out.blocks = std::move(hit.blocks);
  out.tokens = hit.tokens;
  return out;
}

size_t KvCacheManager::CacheableTokens(size_t total_tokens, size_t num_tokens) const {
  // Only tokens the request has (not speculative ones past it) may be committed to the cache.
  size_t cache_tokens = std::min(total_tokens, num_tokens);
  // Hits are lcm-aligned, so with several groups a hash past the last lcm boundary could never
  // be part of one.
  if (num_groups() > 1) cache_tokens = cache_tokens / lcm_block_size_ * lcm_block_size_;
  return cache_tokens;
}

std::pair<size_t, size_t> KvCacheManager::RingBlockRange(size_t g, size_t num_cached,
                                                         size_t total_computed, size_t total_tokens,
                                                         size_t cacheable) const {
  if (!options_.prefix_caching) return {0, 0};
  const AttentionSpec& spec = options_.groups[g];
  const size_t skipped = NumSkippedTokens(spec, total_computed) / spec.block_size;
  // A block completed by an earlier step is no longer whole in the runner's step buffer.
  const size_t first = std::max({num_cached, skipped, total_computed / spec.block_size});
  const size_t last = std::min(cacheable, CeilDiv(total_tokens, spec.block_size));
  return {first, std::max(first, last)};
}

size_t KvCacheManager::RingBlocksToAllocate(size_t g, std::span<const BlockId> table,
                                            size_t num_cached, size_t total_computed,
                                            size_t total_tokens, size_t cacheable) const {
  const auto [first, last] = RingBlockRange(g, num_cached, total_computed, total_tokens, cacheable);
  size_t n = 0;
  for (size_t i = first; i < last; ++i) {
    if (CachesBlock(g, i) && (i >= table.size() || table[i] == kNullBlock)) ++n;
  }
  return n;
}

size_t KvCacheManager::GroupBlocksToAllocate(size_t g, const RequestState* state,
                                             size_t total_computed, size_t total_tokens,
                                             std::span<const BlockId> hit, size_t cacheable) const {
  const AttentionSpec& spec = options_.groups[g];
  const size_t held = state != nullptr ? state->tables[g].size() : 0;
  const size_t required = CeilDiv(total_tokens, spec.block_size);
  // Skipped positions get the null block: they need neither a new block nor their hit block.
  const size_t skipped = NumSkippedTokens(spec, total_computed) / spec.block_size;
  const size_t covered = std::max(skipped, held + hit.size());
  size_t fresh = required > covered ? required - covered : 0;
  if (spec.ring) {
    fresh = state != nullptr
                ? RingBlocksToAllocate(g, state->tables[g], state->num_cached[g], total_computed,
                                       total_tokens, cacheable)
                : RingBlocksToAllocate(g, {}, 0, total_computed, total_tokens, cacheable);
  }
  // A hit block with no reference sits in the free queue: taking it costs a free block.
  size_t evictable = 0;
  for (size_t i = std::min(skipped > held ? skipped - held : 0, hit.size()); i < hit.size(); ++i) {
    if (hit[i] != kNullBlock && pool_.ref_count(hit[i]) == 0) ++evictable;
  }
  return fresh + evictable;
}

size_t KvCacheManager::NumBlocksToAllocate(RequestId id, size_t num_computed_tokens,
                                           size_t num_new_tokens,
                                           const ComputedBlocks* new_computed) const {
  auto it = requests_.find(id);
  const RequestState* state = it != requests_.end() ? &it->second : nullptr;
  if (state != nullptr) new_computed = nullptr;  // hits only count on the first allocation
  const size_t total_computed = num_computed_tokens + (new_computed ? new_computed->tokens : 0);
  const size_t total_tokens = total_computed + num_new_tokens;
  const size_t cache_tokens = CacheableTokens(total_tokens, total_tokens);
  size_t n = 0;
  for (size_t g = 0; g < num_groups(); ++g) {
    n += GroupBlocksToAllocate(g, state, total_computed, total_tokens, HitOf(new_computed, g),
                               cache_tokens / options_.groups[g].block_size);
  }
  return n;
}

size_t KvCacheManager::MinBlocksHeldAt(size_t position) const {
  size_t n = 0;
  for (const AttentionSpec& spec : options_.groups) {
    if (spec.ring) continue;
    // An allocation computing [computed, end) with computed <= position < end holds its
    // table from the skipped blocks at `computed` up to `end`: at least this much.
    const size_t required = CeilDiv(position + 1, spec.block_size);
    n += required - std::min(required, NumSkippedTokens(spec, position) / spec.block_size);
  }
  return n;
}

size_t KvCacheManager::MinBlocksToCompute(size_t first, size_t last) const {
  // The other groups' share repeats with this period (a sliding window's once the window is
  // full; below that it is smaller), while full attention's only grows: the peak is in the
  // last period.
  size_t period = 1;
  for (const AttentionSpec& spec : options_.groups) {
    period = std::lcm(period, size_t{spec.block_size});
    if (spec.kind == Kind::kChunkedLocal) period = std::lcm(period, size_t{spec.chunk});
  }
  size_t peak = 0;
  for (size_t p = last - std::min(last - first, period - 1); p <= last; ++p) {
    peak = std::max(peak, MinBlocksHeldAt(p));
  }
  return peak;
}

bool KvCacheManager::AllocateSlots(RequestId id, std::span<const BlockHash> hashes,
                                   size_t num_tokens, size_t num_computed_tokens,
                                   size_t num_new_tokens, const ComputedBlocks* new_computed,
                                   bool delay_cache) {
  auto it = requests_.find(id);
  const bool running = it != requests_.end();
  if (running) new_computed = nullptr;
  const size_t total_computed = num_computed_tokens + (new_computed ? new_computed->tokens : 0);
  const size_t total_tokens = total_computed + num_new_tokens;
  const size_t cache_tokens = CacheableTokens(total_tokens, num_tokens);
  auto cacheable = [&](size_t g) {
    return std::min(cache_tokens / options_.groups[g].block_size, NumGroupHashes(g, hashes));
  };

  // The fit check counts the blocks that freeing the skipped positions would return, so that a
  // refusal can leave everything as it was and still decide as freeing first would.
  size_t needed = 0;
  for (size_t g = 0; g < num_groups(); ++g) {
    needed += GroupBlocksToAllocate(g, running ? &it->second : nullptr, total_computed,
                                    total_tokens, HitOf(new_computed, g), cacheable(g));
  }
  size_t returned = 0;
  if (running) {
    for (size_t g = 0; g < num_groups(); ++g) {
      const AttentionSpec& spec = options_.groups[g];
      const auto& table = it->second.tables[g];
      const size_t k =
          std::min(NumSkippedTokens(spec, total_computed) / spec.block_size, table.size());
      if (spec.ring) {
        for (size_t i = k; i-- > it->second.null_below[g];) {
          if (table[i] != kNullBlock && pool_.ref_count(table[i]) == 1) ++returned;
        }
        continue;
      }
      for (size_t i = k; i-- > 0 && table[i] != kNullBlock;) {
        if (pool_.ref_count(table[i]) == 1) ++returned;
      }
    }
  }
  if (needed > pool_.num_free() + returned) return false;

  if (!running) {
    it = requests_.emplace(id, RequestState{}).first;
    it->second.tables.resize(num_groups());
    it->second.num_cached.resize(num_groups(), 0);
    it->second.null_below.resize(num_groups(), 0);
  }
  RequestState& state = it->second;
  if (running) {
    // Freed before the allocation so that the new blocks can reuse them.
    for (size_t g = 0; g < num_groups(); ++g) {
      const AttentionSpec& spec = options_.groups[g];
      if (spec.ring) {
        // RemoveSkippedBlocks' order (the last first), past the null entries between blocks.
        auto& table = state.tables[g];
        const size_t k =
            std::min(NumSkippedTokens(spec, total_computed) / spec.block_size, table.size());
        std::vector<BlockId> freed;
        for (size_t i = k; i-- > state.null_below[g];) {
          if (table[i] != kNullBlock) freed.push_back(std::exchange(table[i], kNullBlock));
        }
        state.null_below[g] = std::max(state.null_below[g], k);
        pool_.FreeBlocks(freed);
        continue;
      }
      const std::vector<BlockId> freed = RemoveSkippedBlocks(spec, state.tables[g], total_computed);
      pool_.FreeBlocks(freed);
    }
  }
  // Every group's hit blocks are taken before any new block, so that the new blocks cannot
  // evict another group's hit.
  for (size_t g = 0; g < num_groups(); ++g) {
    const AttentionSpec& spec = options_.groups[g];
    auto& table = state.tables[g];
    const size_t skipped = NumSkippedTokens(spec, total_computed) / spec.block_size;
    if (table.size() < skipped) table.resize(skipped, kNullBlock);
    const std::span<const BlockId> hit = HitOf(new_computed, g);
    if (hit.size() > table.size()) {
      const auto kept = hit.subspan(table.size());
      pool_.Touch(kept);
      table.insert(table.end(), kept.begin(), kept.end());
    }
    // A new request's hit blocks are cached already and its skipped positions are null:
    // nothing before here to cache.
    if (!running) state.num_cached[g] = table.size();
  }
  for (size_t g = 0; g < num_groups(); ++g) {
    auto& table = state.tables[g];
    const size_t required = CeilDiv(total_tokens, options_.groups[g].block_size);
    if (options_.groups[g].ring) {
      // Only the blocks cached below get one; the runner fills them from its step buffer.
      const size_t n = RingBlocksToAllocate(g, table, state.num_cached[g], total_computed,
                                            total_tokens, cacheable(g));
      if (table.size() < required) table.resize(required, kNullBlock);
      if (n == 0) continue;
      Result<std::vector<BlockId>> blocks = pool_.GetNewBlocks(n);
      assert(blocks.ok());  // counted above
      const auto [first, last] =
          RingBlockRange(g, state.num_cached[g], total_computed, total_tokens, cacheable(g));
      size_t next = 0;
      for (size_t i = first; i < last; ++i) {
        if (CachesBlock(g, i) && table[i] == kNullBlock) table[i] = (*blocks)[next++];
      }
      assert(next == n);
      continue;
    }
    if (required <= table.size()) continue;
    Result<std::vector<BlockId>> blocks = pool_.GetNewBlocks(required - table.size());
    assert(blocks.ok());  // counted above
    table.insert(table.end(), blocks->begin(), blocks->end());
  }

  if (!delay_cache) CacheUpTo(state, hashes, cache_tokens);
  return true;
}

void KvCacheManager::CacheUpTo(RequestState& state, std::span<const BlockHash> hashes,
                               size_t cache_tokens) {
  if (!options_.prefix_caching) return;
  for (size_t g = 0; g < num_groups(); ++g) {
    const auto& table = state.tables[g];
    const size_t cacheable =
        std::min(cache_tokens / options_.groups[g].block_size, NumGroupHashes(g, hashes));
    const size_t full = std::min(cacheable, table.size());
    for (size_t i = state.num_cached[g]; i < full; ++i) {
      if (table[i] == kNullBlock || !CachesBlock(g, i)) continue;
      // The parent is the chain's hash before the block's first token: the previous block's key
      // in the group's own block size.
      std::optional<Hash128> parent;
      if (i > 0) parent = GroupHash(g, hashes, i - 1);
      pool_.CacheBlock(table[i], CachedKey{GroupHash(g, hashes, i), static_cast<uint32_t>(g)},
                       parent);
    }
    state.num_cached[g] = std::max(state.num_cached[g], full);
  }
}

void KvCacheManager::CacheBlocks(RequestId id, std::span<const BlockHash> hashes, size_t num_tokens,
                                 size_t num_computed_tokens) {
  auto it = requests_.find(id);
  if (it == requests_.end()) return;
  CacheUpTo(it->second, hashes, CacheableTokens(num_computed_tokens, num_tokens));
}

const std::vector<std::vector<BlockId>>& KvCacheManager::BlockTables(RequestId id) const {
  auto it = requests_.find(id);
  return it != requests_.end() ? it->second.tables : empty_tables_;
}

void KvCacheManager::Free(RequestId id) {
  auto it = requests_.find(id);
  if (it == requests_.end()) return;
  for (const auto& table : it->second.tables) {
    // The tail first: it stands for the longest prefix, the least likely to be hit again.
    const std::vector<BlockId> reversed(table.rbegin(), table.rend());
    pool_.FreeBlocks(reversed);  // the pool skips null blocks
  }
  requests_.erase(it);
}

std::vector<CacheEvent> KvCacheManager::TakeEvents() { return pool_.TakeEvents(); }
std::vector<CachedKey> KvCacheManager::TakeRemovedEvents() { return pool_.TakeRemoved(); }

}  // namespace kvstash::engine
