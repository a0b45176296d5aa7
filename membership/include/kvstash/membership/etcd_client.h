#pragma once

// EtcdClient: the few etcd v3 operations membership needs (leases, puts, prefix reads, deletes
// and watches), through etcd's JSON gateway over plain HTTP with cpp-httplib. etcd itself keeps
// the state and does the consensus; kvstash writes none of its own.
//
// Why the JSON gateway rather than gRPC: every etcd v3 server serves it on its client port, it
// needs nothing beyond cpp-httplib (already used for the engine's HTTP API), and membership makes
// a handful of calls a second at most, so gRPC's efficiency buys nothing here.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kvstash/common/mutex.h"
#include "kvstash/common/status.h"

namespace kvstash::membership {

struct EtcdOptions {
  // Client URLs of the etcd members ("http://HOST:PORT" or "HOST:PORT"); a call tries them in
  // turn, starting with the one that answered last.
  std::vector<std::string> endpoints;
  // Connection and read limit of each request (a watch's read waits without limit).
  std::chrono::milliseconds timeout{2000};
};

struct KeyValue {
  std::string key;
  std::string value;
  int64_t mod_revision = 0;
  int64_t lease = 0;
};

struct WatchEvent {
  enum class Type : uint8_t { kPut, kDelete };
  Type type = Type::kPut;
  KeyValue kv;  // for kDelete, the key and the revision only
};

// Parses "URL[,URL...]" into endpoints; InvalidArgument naming a bad one (only http:// is
// served: kvstash speaks plain HTTP to etcd).
Result<std::vector<std::string>> ParseEtcdEndpoints(std::string_view list);

// Thread-safe: each call opens its own connection. Errors: Unavailable when no endpoint answers
// (the message names the last endpoint tried and why); the code etcd gave otherwise (NotFound
// for a lease that expired, FailedPrecondition, InvalidArgument...).
class EtcdClient {
 public:
  static Result<std::unique_ptr<EtcdClient>> Create(EtcdOptions options);
  ~EtcdClient();
  EtcdClient(const EtcdClient&) = delete;
  EtcdClient& operator=(const EtcdClient&) = delete;

  // A new lease of `ttl` seconds: its id.
  Result<int64_t> GrantLease(int64_t ttl_s);
  // Refreshes `lease`: the seconds it has left. NotFound when it has expired or was revoked.
  Result<int64_t> KeepAlive(int64_t lease);
  // Ends `lease`, deleting the keys bound to it. OK when it was gone already.
  Status RevokeLease(int64_t lease);

  // Sets `key` to `value`, bound to `lease` (0: none). NotFound when the lease has expired.
  Status Put(std::string_view key, std::string_view value, int64_t lease = 0);
  // Deletes `key`: whether it existed.
  Result<bool> Delete(std::string_view key);

  struct Range {
    std::vector<KeyValue> kvs;  // in key order
    int64_t revision = 0;       // the store's revision this read saw
  };
  // Every key starting with `prefix`.
  Result<Range> GetPrefix(std::string_view prefix);

  // Watches the keys starting with `prefix` from `start_revision` (0: from now), calling
  // `on_event` for each change, in order, on this thread, until StopWatches() is called
  // (Cancelled), the stream breaks (Unavailable) or etcd has compacted the revisions asked for
  // (OutOfRange: read again with GetPrefix and watch from its revision + 1). `on_created` runs
  // once etcd has accepted the watch.
  Status Watch(std::string_view prefix, int64_t start_revision,
               const std::function<void(const WatchEvent&)>& on_event,
               const std::function<void()>& on_created = nullptr);
  // Ends every Watch running on this client, and every later one at once. A Watch that is
  // still opening its connection may miss it: call again until the watching thread is done.
  // Any thread.
  void StopWatches();

  // The endpoint that answered last, for logs.
  std::string endpoint() const;

 private:
  explicit EtcdClient(EtcdOptions options) : options_(std::move(options)) {}
  // POSTs `body` to `path` of an endpoint that answers: the response's JSON text.
  Result<std::string> Post(std::string_view path, const std::string& body);

  const EtcdOptions options_;
  std::atomic<size_t> preferred_{0};  // index of the endpoint that answered last
  std::atomic<bool> stopping_{false};
  Mutex mu_;
  uint64_t next_watch_ GUARDED_BY(mu_) = 0;
  std::map<uint64_t, std::function<void()>> watch_stops_ GUARDED_BY(mu_);  // running watches
};

}  // namespace kvstash::membership
