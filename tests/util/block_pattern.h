// Deterministic block contents for tests: every byte depends on a seed and its position, so a
// block read back can be checked without keeping a copy.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace kvstash::testing {

inline std::byte PatternByte(uint64_t seed, size_t i) {
  uint64_t x = (seed + 1) * 0x9e3779b97f4a7c15ULL + (i / 8) * 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 29;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 32;
  return static_cast<std::byte>(x >> ((i % 8) * 8));
}

inline void FillPattern(uint64_t seed, std::span<std::byte> out) {
  for (size_t i = 0; i < out.size(); ++i) out[i] = PatternByte(seed, i);
}

// True when `bytes` is exactly FillPattern(seed) of its size.
inline bool MatchesPattern(uint64_t seed, std::span<const std::byte> bytes) {
  for (size_t i = 0; i < bytes.size(); ++i) {
    if (bytes[i] != PatternByte(seed, i)) return false;
  }
  return true;
}

}  // namespace kvstash::testing
