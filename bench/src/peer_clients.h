#pragma once

// The peers' side of the block load (block_load.h): a Redis connection through hiredis and a
// memcached connection through libmemcached, as users of those stores would drive them, so
// `kvstash bench peer` puts and reads the same blocks through them as through a node client.

#include <cstdint>
#include <memory>
#include <string>

#include "block_load.h"

namespace kvstash::bench {

// Where a Redis listens: TCP `host`:`port`, or the unix socket `unix_path` when it is not empty.
struct RedisAddress {
  std::string host = "127.0.0.1";
  uint16_t port = 0;
  std::string unix_path;
};

// A hiredis connection: SET with the block as a binary-safe argument, GET with the reply's
// bytes written by hiredis's reader straight into the caller's buffer (its reply functions
// replaced: no reply object, no copy of it). Unavailable (hiredis's message) when it cannot
// connect.
Result<std::unique_ptr<BlockConnection>> ConnectRedis(const RedisAddress& address);

enum class MemcachedProtocol : uint8_t { kAscii, kBinary };

// A libmemcached connection to one server: memcached_set, and memcached_get copied into the
// caller's buffer. Unavailable when it cannot be set up.
Result<std::unique_ptr<BlockConnection>> ConnectMemcached(const std::string& host, uint16_t port,
                                                          MemcachedProtocol protocol);

// The text key of block key `key` in the peers: "kvstash-bench:<16 hex digits>".
std::string PeerKey(uint64_t key);

}  // namespace kvstash::bench
