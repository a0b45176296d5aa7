#include "scheduler/hit_finder.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace kvstash::connector {
namespace {

// Signed: the lookup compares differences of token counts that may go below zero.
using Tokens = int64_t;

constexpr Tokens CeilDiv(Tokens a, Tokens b) { return (a + b - 1) / b; }

}  // namespace

std::optional<size_t> HitFinder::MaximalPrefixLookup(std::span<const BlockKey> keys) {
  // A kRetry counts as a hit so that the scan goes on and the manager starts its asynchronous
  // lookups for every block up to the first miss at once.
  return MaximalPrefix(keys.size(), [&](size_t i) { return manager_.Lookup(keys[i]); });
}

std::optional<size_t> HitFinder::SlidingWindowLookup(std::span<const BlockKey> keys,
                                                     size_t window) {
  // A kRetry is not a hit yet; the scan goes on so the manager starts its other lookups. With no
  // full window, the hits from block 0 on, if any.
  return SlidingWindow(keys.size(), window, [&](size_t i) { return manager_.Lookup(keys[i]); });
}

std::optional<size_t> HitFinder::Find(const TrackedRequest& state) {
  const Tokens computed = static_cast<Tokens>(state.num_locally_computed_tokens);
  Tokens max_hit = static_cast<Tokens>(state.num_tokens);
  // With a window or state group the last prompt token must be computed (a window's KV cannot
  // yield its logits); taking it off here keeps the hit valid after the engine would.
  if (!groups_.window_groups().empty()) max_hit -= 1;
  Tokens num_hit = 0;
  bool defer = false;
  // Each group can only shorten the hit; a shorter hit may undo what an earlier group accepted
  // (a window group's window moves), so passes repeat until the length holds for every group.
  std::span<const uint32_t> next_pass = groups_.lookup_order();
  while (!next_pass.empty()) {
    const std::span<const uint32_t> pass = next_pass;
    next_pass = {};
    bool looked_up_window = false;
    for (const uint32_t g : pass) {
      const OffloadGroupInfo& group = groups_[g];
      const Tokens block = group.offloaded_block_size;
      const std::vector<BlockKey>& keys = state.groups[g].keys;
      max_hit = std::min(max_hit, static_cast<Tokens>(keys.size()) * block);
      if (max_hit - computed < block) return 0;  // less than a block to load: not worth it
      const size_t num_blocks = std::min(static_cast<size_t>(CeilDiv(max_hit, block)), keys.size());
      const size_t start = static_cast<size_t>(computed / block);
      const std::span<const BlockKey> slice = std::span(keys).subspan(start, num_blocks - start);
      const std::optional<size_t> found = groups_.IsWindow(g)
                                              ? SlidingWindowLookup(slice, *group.window_blocks)
                                              : MaximalPrefixLookup(slice);
      if (found.has_value() && *found == 0) return 0;
      if (!found.has_value()) {
        defer = true;
      } else {
        max_hit = std::min(max_hit, block * static_cast<Tokens>(start + *found));
      }
      const Tokens new_hit = max_hit - computed;
      if (new_hit < block) return 0;
      if (new_hit < num_hit) {
        if (defer) {
          // The deferring group may not matter at the shorter length: look at all again.
          defer = false;
          next_pass = groups_.lookup_order();
        } else if (looked_up_window && next_pass.empty()) {
          // A window accepted earlier in this pass ended at the longer length.
          next_pass = groups_.window_groups();
        }
      }
      looked_up_window |= groups_.IsWindow(g);
      num_hit = new_hit;
    }
  }
  if (defer) return std::nullopt;

  if (prefix_caching_ && jobs_.AnyBeingLoaded()) {
    // Another request is loading part of this hit: wait for it and hit its blocks in the GPU
    // prefix cache rather than load them twice.
    for (size_t g = 0; g < groups_.size(); ++g) {
      const Tokens block = groups_[g].offloaded_block_size;
      std::span<const BlockKey> keys = state.groups[g].keys;
      const size_t end =
          std::min(static_cast<size_t>(CeilDiv(computed + num_hit, block)), keys.size());
      const size_t start = std::min(static_cast<size_t>(computed / block), end);
      keys = keys.subspan(start, end - start);
      if (groups_.IsWindow(g)) {
        // Only the window at the end of the hit is loaded.
        keys = keys.last(std::min<size_t>(keys.size(), *groups_[g].window_blocks));
      }
      for (const BlockKey& key : keys) {
        if (jobs_.BeingLoaded(key)) return std::nullopt;
      }
    }
  }
  return static_cast<size_t>(num_hit);
}

}  // namespace kvstash::connector
