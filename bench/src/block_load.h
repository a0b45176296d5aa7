#pragma once

// The load of `kvstash bench node` and `kvstash bench peer`, the same for every store so their
// figures compare: --clients client threads, each with its own connection, store new blocks and
// read back among their recent ones for --seconds, and every block read is checked against what
// was stored (see "Block content" in block_load.cc). A store is reached through a
// BlockConnection: a kvstash node client, a Redis or a memcached connection.

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kvstash/common/status.h"

namespace kvstash::bench {

// One client's connection to the store under load. Made and used by one client thread: not
// thread-safe.
class BlockConnection {
 public:
  virtual ~BlockConnection() = default;
  // Stores blocks[i] under keys[i] (keys.size() == blocks.size()): OK, or the first error.
  virtual Status Put(std::span<const uint64_t> keys,
                     std::span<const std::span<const std::byte>> blocks) = 0;
  // Reads the block of keys[i] into outs[i]: per key, the bytes the store returned, NotFound
  // when it does not hold the key (evicted: a miss, not an error), or the error.
  virtual std::vector<Result<size_t>> Get(std::span<const uint64_t> keys,
                                          std::span<const std::span<std::byte>> outs) = 0;
};

// Makes client `client`'s connection (0-based), on that client's thread.
using Connect = std::function<Result<std::unique_ptr<BlockConnection>>(int client)>;

struct LoadSettings {
  uint64_t block_bytes = 0;  // a multiple of 4 KiB
  int clients = 1;
  double seconds = 1;
  double read_share = 0.5;   // share of operations that read back
  int keys_per_client = 64;  // reads pick among the client's last this many stored keys
  int check_every = 8;       // every this many'th read is checked word for word
  int batch = 1;             // blocks per operation
  // Client i stores keys (i + 1) << 40 | n for n = first_sequence, first_sequence + 1, ...: a
  // second load on the same store gives another (1 << 32 apart) so that it stores new blocks.
  uint64_t first_sequence = 0;
  // Set from elsewhere (a signal handler): the load stops early.
  const std::atomic<bool>* cancel = nullptr;
};

// What the clients did.
struct LoadTotals {
  uint64_t puts = 0, gets = 0, misses = 0, errors = 0, mismatches = 0;  // blocks
  std::vector<double> put_us, get_us;                                   // latency of each operation
  double seconds = 0;       // of load, from the clients' start to their end
  std::string first_error;  // the message of the first error, if any

  double PutGbps(uint64_t block_bytes) const;
  double GetGbps(uint64_t block_bytes) const;
  void Add(const LoadTotals& other);
};

// Live counts, for a progress line while the load runs.
struct LoadCounts {
  uint64_t puts = 0, gets = 0, errors = 0, mismatches = 0;
};
// Called every 100 ms on the calling thread while the load runs.
using LoadTick = std::function<void(const LoadCounts& counts)>;

// Runs the load: settings.clients threads, each connecting with `connect` and then storing and
// reading for settings.seconds (connecting counts in the time, as an engine's first calls
// would). The totals, or Unavailable with the message of the first client that could not
// connect; Cancelled when settings.cancel was set.
Result<LoadTotals> RunLoad(const LoadSettings& settings, const Connect& connect,
                           const LoadTick& tick);

// ---- block content, for the checks and their tests ---------------------------------------------

// The block stored under `key` (client buffers hold this pattern, stamped per key), for
// `batch` send buffers: words.size() * 8 bytes.
void FillBlock(uint64_t key, size_t batch, std::span<uint64_t> words);
// The checks RunLoad makes of every block read: every 4 KiB page's stamp and last word
// (StampsMatch, every read), every word (Matches, every --check-every'th read).
bool StampsMatch(uint64_t key, size_t batch, std::span<const uint64_t> words);
bool Matches(uint64_t key, size_t batch, std::span<const uint64_t> words);

// OK if the checks catch a block of another key and a byte flipped anywhere in a block of
// `block_bytes`; Internal otherwise (a bench must not run with a check that cannot fail).
Status CheckTheChecks(uint64_t block_bytes);

}  // namespace kvstash::bench
