#pragma once

// A block's key as the connector knows it, and a lookup's answer for one key. Kept apart from the
// node client so that the scheduler side (OffloadScheduler) builds without the transport.

#include <cstdint>
#include <string>
#include <string_view>

#include "kvstash/common/hash.h"
#include "kvstash/common/status.h"

namespace kvstash::connector {

// A block's key as the client knows it; the node adds the connection's namespace.
struct BlockKey {
  Hash128 hash;
  uint32_t group = 0;
  friend bool operator==(const BlockKey&, const BlockKey&) = default;
  std::string ToString() const;  // "0x2a/g1"
};
// "0x2a", "0x2a/g1", "42" (decimal), with an optional 128-bit hex hash "0x<hi><lo>".
Result<BlockKey> ParseBlockKey(std::string_view text);

enum class KeyState : uint8_t { kMiss, kHit, kRetry };

}  // namespace kvstash::connector
