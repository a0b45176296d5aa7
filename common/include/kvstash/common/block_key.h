// The vocabulary every layer shares: the key a block is stored under (what identifies a block is
// docs/semantics.md §18), a lookup's answer for one key, and the two scans over a request's keys
// (§1, §7.4). The connector, the node, the store and the wire (kvstash/proto/convert.h) all
// speak these, so there is one key type, one hash for in-memory tables and one tri-state.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>

#include "kvstash/common/hash.h"
#include "kvstash/common/status.h"

namespace kvstash {

// The id a node gives a namespace (the name a client gives at hello): its own, in the order
// names reach it, never derived from the name. A client's keys carry 0, "the connection's", and
// the node fills in the connection's id (docs/semantics.md §18).
using NamespaceId = uint32_t;

// (namespace id, group, block hash): one block of one KV-cache group of one prefix in one
// namespace. The block hash is chained, so the key commits to the whole prefix. A value type,
// 24 bytes. docs/semantics.md §18 says what each field is and which checksum guards the block.
struct BlockKey {
  BlockHash hash;
  uint32_t group = 0;
  NamespaceId namespace_id = 0;

  friend bool operator==(const BlockKey&, const BlockKey&) = default;
  friend auto operator<=>(const BlockKey&, const BlockKey&) = default;

  // "0x2a", "0x2a/g1" (the group when not 0), "0x2a/g1@ns7" (the namespace id when not 0); a
  // 128-bit hash as "0x<hi><lo>". Without a namespace, what ParseBlockKey reads back.
  std::string ToString() const;
};

// What a client that knows its tokens may say of a block beyond its key (wire.BlockMeta), so
// that the node's KV events say it too (docs/semantics.md §19): the block before it in its
// request, in the same group, and the tokens it holds. A value type.
struct BlockMeta {
  // The kind of the block's KV-cache group, for a node's eviction (docs/semantics.md §4b).
  enum class Kind : uint8_t { kUnspecified, kFull, kSlidingWindow, kChunkedLocal, kState };

  std::optional<BlockHash> parent;  // the previous block's hash; none: the request's first block
  uint32_t tokens = 0;
  Kind kind = Kind::kUnspecified;
  // A sliding-window or chunked-local group: the blocks a hit must end with; state: 1.
  uint32_t window_blocks = 0;
  // The client expects a later request's hit to end within this block's window: it is among
  // the last window_blocks blocks before its request's end, or before where the request's
  // prefix left what the nodes held. A window or state block that is not is stored spare.
  bool at_hit_end = false;

  // Whether a node stores the block spare (store::StoreHint::kSpare): a sliding-window,
  // chunked-local or state block that no expected hit end needs.
  bool spare() const { return kind >= Kind::kSlidingWindow && !at_hit_end; }

  friend bool operator==(const BlockMeta&, const BlockMeta&) = default;
};

// "0x2a", "0x2a/g1", "42" (decimal), with an optional 128-bit hex hash "0x<hi><lo>"; the
// namespace is 0. InvalidArgument naming the text otherwise.
Result<BlockKey> ParseBlockKey(std::string_view text);

// The hash in-memory tables use for a key (not stable across versions; never persist it).
inline uint64_t KeyHash(const BlockKey& key) {
  const uint64_t tag = ((uint64_t{key.namespace_id} << 32) | key.group) * 0x9e3779b97f4a7c15ULL;
  return Mix64(key.hash.lo ^ Mix64(key.hash.hi ^ tag));
}

// A hash of a key's block hash and group, not of its namespace: the same in every namespace,
// so that an in-process model of a node, which cannot know the ids a node gives namespaces,
// hashes a key as the node does (AF-LRU's ghost fingerprints, adaptive admission's sample).
inline uint64_t NamespaceFreeHash(const BlockKey& key) {
  return Mix64(key.hash.lo ^ Mix64(key.hash.hi ^ (key.group * 0x9e3779b97f4a7c15ULL)));
}

// A lookup's answer for one key.
enum class LookupResult : uint8_t {
  kMiss = 0,   // not stored
  kHit = 1,    // stored and readable now
  kRetry = 2,  // not decided yet (being written, being promoted from SSD): ask again later
};

// A number of blocks, or nullopt for "retry later" (a key the scan relied on was RETRY).
using ScanResult = std::optional<size_t>;

// Maximal prefix: scans keys 0, 1, ... and counts hits until the first miss. A RETRY counts as
// a hit so the scan goes on (starting any asynchronous work for the later keys) but makes the
// result nullopt. `lookup(i)` answers for key i and is called once per key scanned, in order.
template <typename LookupFn>
ScanResult MaximalPrefix(size_t num_keys, LookupFn&& lookup) {
  bool retry = false;
  size_t hits = 0;
  for (size_t i = 0; i < num_keys; ++i) {
    const LookupResult r = lookup(i);
    if (r == LookupResult::kMiss) break;
    if (r == LookupResult::kRetry) retry = true;
    ++hits;
  }
  if (retry) return std::nullopt;
  return hits;
}

// Sliding window: scans right to left for the right-most run of `window` consecutive hits and
// returns its exclusive end; with no full window, the run of hits starting at key 0 (the prefix
// fallback). A RETRY breaks the run and makes the result nullopt, unless a full window is found
// to its right first. A window of 0 is treated as 1.
template <typename LookupFn>
ScanResult SlidingWindow(size_t num_keys, size_t window, LookupFn&& lookup) {
  if (window == 0) window = 1;
  bool retry = false;
  size_t run = 0;
  for (size_t i = num_keys; i-- > 0;) {
    const LookupResult r = lookup(i);
    if (r == LookupResult::kHit) {
      if (++run == window) {
        if (retry) return std::nullopt;
        return i + window;
      }
    } else {
      if (r == LookupResult::kRetry) retry = true;
      run = 0;
    }
  }
  if (retry) return std::nullopt;
  return run;
}

}  // namespace kvstash

// Keys in std::unordered_map and std::unordered_set without naming a hasher.
template <>
struct std::hash<kvstash::BlockKey> {
  size_t operator()(const kvstash::BlockKey& key) const noexcept { return kvstash::KeyHash(key); }
};
