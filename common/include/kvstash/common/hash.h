// Hashing: xxh3 from libxxhash for everything that leaves the process (block hashes,
// checksums: which covers what is docs/semantics.md §18), and a cheap 64-bit mixer for
// in-memory hash tables.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

namespace kvstash {

// A 128-bit hash value, e.g. a chained block hash. A value type; `lo` and `hi` are the low and
// high 64 bits of XXH3-128's result.
struct Hash128 {
  uint64_t lo = 0;
  uint64_t hi = 0;

  friend bool operator==(const Hash128&, const Hash128&) = default;
  friend auto operator<=>(const Hash128&, const Hash128&) = default;

  // 32 lower-case hex digits, most significant first.
  std::string ToHex() const;
};

// The hash of a block of tokens, chained: it commits to every token of the prefix.
using BlockHash = Hash128;

// XXH3-128 of `bytes` with `seed`.
Hash128 Xxh3Hash128(std::span<const std::byte> bytes, uint64_t seed = 0);
// XXH3-64 of `bytes` with `seed`.
uint64_t Xxh3Hash64(std::span<const std::byte> bytes, uint64_t seed = 0);

// The chained block hash: XXH3-128 over (parent hash, token ids, extra keys), each part
// length-prefixed so that different splits never collide. The root block's parent is a
// zero hash. `extra_keys` carries LoRA name, multimodal identifiers, cache salt (any bytes; the
// engine's is its model fingerprint, so two models never share a hash: docs/semantics.md §18).
BlockHash ChainBlockHash(const BlockHash& parent, std::span<const uint32_t> token_ids,
                         std::span<const std::byte> extra_keys = {});

// A strong 64-bit finalizer (splitmix64): spreads small or structured integers over all bits.
constexpr uint64_t Mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

}  // namespace kvstash
