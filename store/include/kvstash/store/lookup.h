// Lookups over a request's keys: the per-key scans of docs/semantics.md §7.4.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <utility>

namespace kvstash::store {

// The answer for one key.
enum class LookupResult : uint8_t {
  kMiss = 0,   // not stored
  kHit = 1,    // stored and readable
  kRetry = 2,  // being written (or promoted): ask again later
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
    LookupResult r = lookup(i);
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
    LookupResult r = lookup(i);
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

}  // namespace kvstash::store
