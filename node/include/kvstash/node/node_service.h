#pragma once

// NodeService: what an offload node does, without a transport. It owns the tiered store and
// keeps what each client holds (its session: the stores whose bytes are arriving and the blocks
// it pinned), the clients' leases, the namespaces' quotas and names, and the node's counters.
// NodeServer (node_server.h) serves it over a transport::Listener: it parses each request,
// moves the payloads and replies; everything a request means happens here. Tests drive it
// directly, with a clock of their own.
//
// Sessions: a client's session is its connection. Every request begins with BeginRequest, which
// makes the session at the connection's first request (in the namespace the client named at
// hello) and renews its lease. A session that ends (EndSession: the client closed, crashed or
// was cut off) releases its pins, and a store whose bytes had not all arrived is aborted, so a
// crashed engine never leaks capacity nor leaves half a block readable; a session silent past
// the lease (ExpireLeases) loses its pins the same way and keeps its connection.
//
// Thread-compatible: one thread at a time (a node's transport progress thread) calls everything
// but Counters and Namespaces, which any thread may call at any time. The store it owns is
// thread-safe and only ever called from that thread.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvstash/common/block_key.h"
#include "kvstash/common/status.h"
#include "kvstash/store/tiered_store.h"

namespace kvstash::node {

struct NodeServiceOptions {
  store::TieredStoreOptions store;  // block size, CPU capacity and policy, SSD tier, cascade
  // A client silent for this long (no request at all) loses its pins, so an engine that hangs
  // without disconnecting does not hold capacity forever.
  std::chrono::milliseconds lease_timeout{30000};
  // Ceilings on the blocks a namespace (the one a client names at hello) holds in the CPU tier:
  // by name, and for every namespace not named; none: shared capacity. A namespace at its
  // ceiling makes room by evicting its own least recently used idle blocks, and its stores are
  // refused (ResourceExhausted) when none can go; a ceiling reserves nothing. Each is 1 block to
  // the CPU tier's capacity. They bound the CPU tier only: the SSD tier holds what it cascades.
  std::map<std::string, size_t> namespace_quota_blocks;
  std::optional<size_t> default_namespace_quota_blocks;
  // The most namespaces (distinct names given at hello or in quotas) the node serves; a hello
  // naming one more is refused. Each name holds its id in the store's keys for the node's life
  // (docs/semantics.md §18: ids are the node's, by exact name).
  size_t max_namespaces = 65536;
  // The time leases are measured in; empty: std::chrono::steady_clock. Tests give their own.
  std::function<std::chrono::steady_clock::time_point()> clock;
};

// Namespaces are reported by name up to this many (those with a named quota always, then those
// seen at hello, first come); the rest are summed under "other", so that clients choosing names
// cannot grow the metrics without bound.
inline constexpr size_t kMaxNamedNamespaces = 256;
// The name they are summed under; a namespace of that name is counted there too, and no quota
// may name it.
inline constexpr std::string_view kOtherNamespaces = "other";

// One namespace as the node's metrics show it.
struct NamespaceStats {
  std::string name;         // kOtherNamespaces: namespaces past kMaxNamedNamespaces
  uint64_t cpu_blocks = 0;  // held in the CPU tier, readable or being written
  std::optional<uint64_t> cpu_quota_blocks;
  uint64_t quota_refusals = 0;  // blocks its clients were refused for its quota, since start
};

class NodeService {
 public:
  // Reads the namespace table (in the SSD directory), checks the quotas and opens the store.
  // InvalidArgument naming a quota outside 1..the CPU tier's capacity or the reserved name
  // kOtherNamespaces, or a damaged namespace table; the store's errors.
  static Result<std::unique_ptr<NodeService>> Create(NodeServiceOptions options);
  // Ends every session (undoing its pins and unfinished stores), then closes the store.
  ~NodeService();
  NodeService(const NodeService&) = delete;
  NodeService& operator=(const NodeService&) = delete;

  // A client names `name` at hello: the node gives the name its id now, if new, so that a hello
  // the node cannot serve is refused at once. InvalidArgument (an empty name or one over 256
  // bytes), ResourceExhausted (max_namespaces names already), Unavailable (the namespace table
  // on disk cannot be written).
  Status AdmitNamespace(std::string_view name);

  // The start of every request of `connection`, whose client named `key_namespace` at hello:
  // makes its session at its first request and renews its lease. The namespace's id, which the
  // request's keys carry (docs/semantics.md §18); AdmitNamespace's errors when the name has no id
  // yet and cannot get one.
  Result<NamespaceId> BeginRequest(uint64_t connection, std::string_view key_namespace);

  // Each key's result, in order; counted.
  std::vector<LookupResult> Lookup(std::span<const BlockKey> keys);
  // Marks the keys used, the first most recent (store::TieredStore::Touch); counted.
  void Touch(std::span<const BlockKey> keys, store::TouchKind kind = store::TouchKind::kUse);

  // A store of one block: BeginPut, the bytes into `slot`, EndPut.
  struct PutSlot {
    // The block is held or being stored already: the bytes are not wanted, and the store
    // counted as a use of the block (a touch). No slot, no EndPut.
    bool skipped = false;
    std::span<std::byte> slot;  // where the bytes go
    // Non-null: the slot may be written only once this opens (a write-back to SSD still reads
    // it; store::SlotGate). The caller waits without blocking: the progress thread never waits
    // on a disk.
    std::shared_ptr<store::SlotGate> gate;
    // Blocks of the caller's namespace evicted to make room (other namespaces' evictions are
    // not its business).
    std::vector<BlockKey> evicted;
  };
  // Reserves a slot for `key` in the CPU tier. InvalidArgument for a length that is not the
  // block size; AlreadyExists when this session is storing the key already; ResourceExhausted
  // when no slot can be had (the tier is pinned full, or the namespace is at its quota: then
  // counted and the message names the namespace).
  // `hint`: what the put said the block is for (store::StoreHint).
  Result<PutSlot> BeginPut(uint64_t connection, const BlockKey& key, size_t length,
                           store::StoreHint hint = store::StoreHint::kNormal);
  // The bytes of a BeginPut are in the slot (`received` OK) or could not arrive. Commits the
  // block when they are in and match `checksum` (xxh3-64; 0: unchecked; docs/semantics.md
  // §18), aborts it otherwise, so a block is readable whole or not at all. `received`, or DataLoss
  // for a checksum mismatch. When the session ended while the bytes were arriving, the block is
  // aborted and the session ends now.
  Status EndPut(uint64_t connection, const BlockKey& key, Status received, uint64_t checksum);

  // Pins each key held in the CPU tier for the session (one pin per call; a key may be pinned
  // several times): its block's length, or nullopt for a key not readable in the CPU tier now
  // (absent, being written, or on SSD only).
  std::vector<std::optional<size_t>> Load(uint64_t connection, std::span<const BlockKey> keys);
  // Releases one of the session's pins of each key; keys it does not pin are ignored.
  void Release(uint64_t connection, std::span<const BlockKey> keys);

  // A read of one block: BeginGet, the bytes out of `block`, EndGet.
  struct Read {
    std::span<const std::byte> block;
    bool pinned_for_read = false;  // pinned for this read only (the session held no pin)
  };
  // From the session's pin when it holds one, or else pinned for the read. NotFound when the
  // node does not hold the block; Aborted (ask again) while it is being promoted from SSD.
  Result<Read> BeginGet(uint64_t connection, const BlockKey& key);
  // The bytes of a BeginGet have left (`sent` OK) or could not; releases the read's own pin.
  void EndGet(const BlockKey& key, const Read& read, const Status& sent);
  // The reply of a batched read (GetBlocks) left with `blocks` blocks of `bytes` in all, copied
  // out of their slots before (EndGet released their pins then, unsent): counted as sent.
  void Loaded(size_t blocks, uint64_t bytes);
  // A batched store's payload (PutBlocks) did not match its checksum: none of it was stored.
  void ChecksumFailed();

  // Whether the connection has a session (BeginRequest made it, EndSession has not ended it).
  bool HasSession(uint64_t connection) const;
  // The connection ended: its pins are released, and once no bytes are arriving into its slots
  // any more (EndPut), the session is gone. Unknown connections are ignored.
  void EndSession(uint64_t connection);
  // Sessions silent for longer than the lease lose their pins (their connections stay; the next
  // request starts a new lease). Call a few times per lease.
  void ExpireLeases();
  // Waits for the store's background work and, under write-back, writes every block the SSD
  // tier lacks. The store's error.
  Status Flush();

  // The node's counters (node.*) and the store's (cpu.*, ssd.*, store.*), by name: see
  // node/src/counters.cc, the one place they are named. Thread-safe.
  std::map<std::string, uint64_t> Counters() const;
  // Every namespace with a named quota or seen at hello (up to kMaxNamedNamespaces, then
  // "other", listed last when any namespace fell into it), by name. Only for the operator's
  // metrics: other namespaces' names are not a client's business, so Counters (which clients
  // read) has totals only. Thread-safe.
  std::vector<NamespaceStats> Namespaces() const;
  store::TieredStore& store();
  size_t sessions() const;
  // The name of namespace id `ns`, if the node's table gives it one. Thread-safe.
  std::optional<std::string> NamespaceName(NamespaceId ns) const;

  class Impl;

 private:
  explicit NodeService(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvstash::node
