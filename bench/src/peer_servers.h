#pragma once

// The stores `kvstash bench peer` starts for each measurement: a kvstashd, a redis-server or a
// memcached, as children on loopback ports it picks, each sized to one tier of memory and
// stopped (SIGTERM, then SIGKILL) when its owner goes. Children die with the bench as well
// (ChildProcess): an interrupted run leaves no server behind.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "kvstash/common/status.h"
#include "kvstash/common/subprocess.h"

namespace kvstash::bench {

// A store the bench started. Stops it when destroyed. Not thread-safe.
class StoreServer {
 public:
  StoreServer(std::string name, std::unique_ptr<ChildProcess> child, uint16_t port,
              std::string unix_path);
  ~StoreServer();
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;

  uint16_t port() const { return port_; }
  // Its unix socket (Redis), or empty.
  const std::string& unix_path() const { return unix_path_; }
  // Whether it has not exited.
  bool running() { return !child_->Exited(); }
  // SIGTERM, then SIGKILL after a while; its exit status (128 + signal when killed).
  int Stop();

 private:
  std::string name_;
  std::unique_ptr<ChildProcess> child_;
  uint16_t port_;
  std::string unix_path_;
};

// What every store is given: its program, the block size and how much memory it may hold.
struct StoreSettings {
  std::string program;  // a path, or a name looked up on PATH
  uint64_t block_bytes = 0;
  uint64_t memory_bytes = 0;
  // A directory the bench owns (its unix sockets, Redis's working directory).
  std::string dir;
  // How long a store may take to listen; set from a signal handler: stop waiting.
  std::chrono::milliseconds start_timeout{30000};
  const std::atomic<bool>* cancel = nullptr;
};

// kvstashd with a CPU tier of memory_bytes, blocks of block_bytes, UCX transports `tls` (or
// the stream transport when `stream`), on a port it picks (--port 0, read from its start line).
Result<std::unique_ptr<StoreServer>> StartKvstashd(const StoreSettings& settings,
                                                   const std::string& tls, bool stream = false);
// redis-server as a cache: no persistence (--save '', --appendonly no), --maxmemory
// memory_bytes with allkeys-lru, on a free TCP port and a unix socket in settings.dir.
Result<std::unique_ptr<StoreServer>> StartRedis(const StoreSettings& settings);
// memcached with -m memory_bytes, items up to twice block_bytes (-I), its default threads, on
// a free TCP port.
Result<std::unique_ptr<StoreServer>> StartMemcached(const StoreSettings& settings);

}  // namespace kvstash::bench
