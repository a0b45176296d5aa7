#pragma once

// What the fuzz targets share: a check whose failure is a finding (libFuzzer keeps the input
// that made it abort), and the reads their input layouts are made of.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <span>
#include <string_view>

// Aborts, naming the broken property, when `condition` is false: for what the code under test
// promises beyond not crashing (a parsed frame stays inside its bytes, a reply answers every
// key), which no sanitizer sees.
#define KVSTASH_FUZZ_CHECK(condition)                                                         \
  do {                                                                                        \
    if (!(condition)) {                                                                       \
      std::fprintf(stderr, "%s:%d: fuzz check failed: %s\n", __FILE__, __LINE__, #condition); \
      std::abort();                                                                           \
    }                                                                                         \
  } while (0)

namespace kvstash::fuzz {

// The next sizeof(T) bytes of `in` as a little-endian T, consumed; 0 when fewer are left (they
// are consumed too).
template <typename T>
T Take(std::span<const uint8_t>& in) {
  T value = 0;
  if (in.size() < sizeof(T)) {
    in = {};
    return value;
  }
  std::memcpy(&value, in.data(), sizeof(T));
  in = in.subspan(sizeof(T));
  return value;
}

// The next `n` bytes of `in` (fewer when fewer are left), consumed.
inline std::span<const uint8_t> TakeBytes(std::span<const uint8_t>& in, size_t n) {
  n = std::min(n, in.size());
  const std::span<const uint8_t> out = in.first(n);
  in = in.subspan(n);
  return out;
}

inline std::string_view AsText(std::span<const uint8_t> bytes) {
  return {reinterpret_cast<const char*>(bytes.data()), bytes.size()};
}

}  // namespace kvstash::fuzz
