#include "kvstash/engine/cache_hit.h"

#include <algorithm>
#include <numeric>
#include <utility>

namespace kvstash::engine {
namespace {

using Kind = AttentionSpec::Kind;
constexpr int64_t kNull = -1;

// The search of §9.3 over hash indices: each entry is the index of the hash whose cached
// block goes there, or kNull. `hit(i)` says whether hash i is cached (i < count).
std::vector<int64_t> Find(const AttentionSpec& spec, size_t count,
                          const std::function<bool(size_t)>& hit, size_t max_length,
                          size_t alignment, bool eagle) {
  const size_t bs = spec.block_size;
  const size_t max_blocks = std::min(max_length / bs, count);
  std::vector<int64_t> out;
  auto align = [&] {
    while (!out.empty() && out.size() * bs % alignment != 0) out.pop_back();
  };
  switch (spec.kind) {
    case Kind::kFull: {
      for (size_t i = 0; i < max_blocks && hit(i); ++i) out.push_back(static_cast<int64_t>(i));
      if (eagle && !out.empty()) out.pop_back();
      align();
      return out;
    }
    case Kind::kSlidingWindow: {
      // Right to left for the last run of ceil((W-1)/bs) cached blocks; everything before it is
      // outside the window (null).
      const size_t need = CeilDiv(spec.window - 1, bs) + (eagle ? 1 : 0);
      out.assign(max_blocks, kNull);
      size_t run = 0;
      bool found = false;
      for (size_t i = max_blocks; i-- > 0;) {
        if (!hit(i)) {
          run = 0;
          continue;
        }
        // A run must end on an aligned boundary.
        if (run == 0 && bs != alignment && ((eagle ? i : i + 1) * bs) % alignment != 0) continue;
        out[i] = static_cast<int64_t>(i);
        if (++run >= need) {
          out.resize(i + run);
          found = true;
          break;
        }
      }
      if (!found) {
        // No whole window: the run that reached block 0 (shorter than a window) is the hit.
        out.resize(run);
        align();
      }
      if (eagle && !out.empty()) {
        out.pop_back();
        align();
      }
      return out;
    }
    case Kind::kChunkedLocal: {
      // Blocks before the current chunk are not attended to; within it, a prefix scan.
      const size_t start = max_length == 0 ? 0 : max_length / spec.chunk * spec.chunk;
      const size_t first = std::min(start / bs, max_blocks);
      out.assign(first, kNull);
      for (size_t i = first; i < max_blocks && hit(i); ++i) out.push_back(static_cast<int64_t>(i));
      return out;
    }
    case Kind::kState: {
      // Only the last snapshot matters: the rightmost aligned hit, nulls before it.
      for (size_t i = max_blocks; i-- > 0;) {
        if (!hit(i) || (i + 1) * bs % alignment != 0) continue;
        out.assign(i, kNull);
        out.push_back(static_cast<int64_t>(i));
        return out;
      }
      return out;
    }
  }
  return out;
}

std::vector<BlockId> Materialize(const std::vector<int64_t>& found, const CachedBlocks& cached) {
  std::vector<BlockId> blocks;
  blocks.reserve(found.size());
  for (int64_t i : found) {
    blocks.push_back(i == kNull ? kNullBlock : cached.at(static_cast<size_t>(i)).value());
  }
  return blocks;
}

}  // namespace

std::vector<BlockId> FindLongestCacheHit(const AttentionSpec& spec, const CachedBlocks& cached,
                                         size_t max_length, size_t alignment, bool eagle) {
  const auto found = Find(
      spec, cached.count, [&](size_t i) { return cached.at(i).has_value(); }, max_length, alignment,
      eagle);
  return Materialize(found, cached);
}

size_t NumSkippedTokens(const AttentionSpec& spec, size_t num_tokens) {
  switch (spec.kind) {
    case Kind::kFull:
      return 0;
    case Kind::kSlidingWindow:
      return num_tokens + 1 > spec.window ? num_tokens + 1 - spec.window : 0;
    case Kind::kChunkedLocal:
      return num_tokens / spec.chunk * spec.chunk;
    case Kind::kState:
      return num_tokens > 0 ? num_tokens - 1 : 0;
  }
  return 0;
}

std::vector<BlockId> RemoveSkippedBlocks(const AttentionSpec& spec, std::vector<BlockId>& table,
                                         size_t num_tokens) {
  const size_t k = std::min(NumSkippedTokens(spec, num_tokens) / spec.block_size, table.size());
  std::vector<BlockId> freed;
  for (size_t i = k; i-- > 0;) {
    if (table[i] == kNullBlock) break;  // everything before was removed already
    freed.push_back(std::exchange(table[i], kNullBlock));
  }
  return freed;
}

HybridCacheHit FindLongestHybridCacheHit(std::span<const CacheGroup> groups, size_t max_length,
                                         bool eagle) {
  HybridCacheHit result;
  result.blocks.resize(groups.size());
  if (groups.empty()) return result;
  // Attention groups: KV groups of identical spec, looked up together; full attention first.
  std::vector<std::vector<size_t>> members;
  for (size_t g = 0; g < groups.size(); ++g) {
    auto it = std::find_if(members.begin(), members.end(),
                           [&](const auto& m) { return groups[m[0]].spec == groups[g].spec; });
    if (it == members.end()) {
      members.push_back({g});
    } else {
      it->push_back(g);
    }
  }
  std::stable_partition(members.begin(), members.end(),
                        [&](const auto& m) { return groups[m[0]].spec.kind == Kind::kFull; });
  size_t lcm = 1;
  for (const CacheGroup& g : groups) lcm = std::lcm(lcm, size_t{g.spec.block_size});
  // One full-attention group and one other: the other's answer is final (a second round could
  // only repeat it, or, with eagle, drop another block).
  const bool simple_hybrid = members.size() == 2 && groups[members[0][0]].spec.kind == Kind::kFull;

  std::vector<std::optional<std::vector<int64_t>>> found(members.size());
  // Attention groups whose eagle drop was applied at the current candidate length.
  std::vector<bool> eagle_done(members.size(), false);
  size_t hit = max_length;
  while (true) {
    size_t cur = hit;
    for (size_t a = 0; a < members.size(); ++a) {
      const AttentionSpec& spec = groups[members[a][0]].spec;
      if (spec.kind == Kind::kFull && found[a].has_value()) {
        cur = cur / spec.block_size * spec.block_size;  // downward-closed: trim, no re-lookup
        continue;
      }
      const bool drop = eagle && !eagle_done[a] &&
                        (spec.kind == Kind::kFull || spec.kind == Kind::kSlidingWindow);
      // With the drop, match one block past the candidate so that the hit lands back on it.
      const size_t length = drop ? std::min(cur + spec.block_size, max_length) : cur;
      size_t count = SIZE_MAX;
      for (size_t g : members[a]) count = std::min(count, groups[g].cached.count);
      found[a] = Find(
          spec, count,
          [&](size_t i) {
            return std::all_of(members[a].begin(), members[a].end(),
                               [&](size_t g) { return groups[g].cached.at(i).has_value(); });
          },
          length, lcm, drop);
      const size_t group_hit = found[a]->size() * spec.block_size;
      if (drop) {
        eagle_done[a] = true;
      } else if (group_hit < cur) {
        // A shorter candidate: every eagle group must drop again relative to it.
        std::fill(eagle_done.begin(), eagle_done.end(), false);
      }
      cur = group_hit;
    }
    if (cur >= hit) break;
    hit = cur;
    if (simple_hybrid) break;
  }
  for (size_t a = 0; a < members.size(); ++a) {
    const AttentionSpec& spec = groups[members[a][0]].spec;
    if (spec.kind == Kind::kFull) {
      found[a]->resize(std::min(found[a]->size(), hit / spec.block_size));
    }
    for (size_t g : members[a]) result.blocks[g] = Materialize(*found[a], groups[g].cached);
  }
  result.tokens = hit;
  return result;
}

}  // namespace kvstash::engine
