#include "kvstash/node/node_service.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <filesystem>
#include <unordered_map>
#include <utility>

#include "counters.h"
#include "kvstash/common/hash.h"
#include "kvstash/common/logging.h"
#include "kvstash/common/mutex.h"
#include "namespace_registry.h"

namespace kvstash::node {

using Clock = std::chrono::steady_clock;

class NodeService::Impl {
 public:
  explicit Impl(NodeServiceOptions options) : options_(std::move(options)) {
    if (!options_.clock) options_.clock = [] { return Clock::now(); };
  }

  ~Impl() {
    // Pins and reservations go back before the store closes (the transport has stopped: no
    // bytes can land in a slot any more).
    for (auto& [connection, session] : sessions_) {
      for (const auto& [key, slot] : session.arriving) {
        store_->CompleteStore(std::span(&key, 1), false);
      }
      ReleasePins(session);
    }
    sessions_.clear();
    store_.reset();
  }

  Status Open() {
    // The namespace table lives beside the SSD tier's blocks, whose keys carry its ids; it is
    // read first, so that the tier keeps only blocks of namespaces it still names.
    std::string table;
    if (options_.store.ssd) {
      std::error_code error;
      std::filesystem::create_directories(options_.store.ssd->dir, error);
      if (error) {
        return UnavailableError("cannot create SSD directory {}: {}", options_.store.ssd->dir,
                                error.message());
      }
      table = options_.store.ssd->dir + "/namespaces";
    }
    KVSTASH_ASSIGN_OR_RETURN(registry_, NamespaceRegistry::Open(table, options_.max_namespaces));
    KVSTASH_RETURN_IF_ERROR(SetUpQuotas());
    if (options_.store.ssd) {
      options_.store.ssd->keep_namespace = [registry = registry_.get()](NamespaceId ns) {
        return registry->Known(ns);
      };
    }
    KVSTASH_ASSIGN_OR_RETURN(store_, store::TieredStore::Create(options_.store));
    return Status::OK();
  }

  Status AdmitNamespace(std::string_view name) { return registry_->Register(name).status(); }
  std::optional<std::string> NamespaceName(NamespaceId ns) const { return registry_->NameOf(ns); }

  Result<NamespaceId> BeginRequest(uint64_t connection, std::string_view key_namespace) {
    auto it = sessions_.find(connection);
    if (it == sessions_.end()) {
      KVSTASH_ASSIGN_OR_RETURN(const NamespaceId ns, registry_->Register(key_namespace));
      it = sessions_.try_emplace(connection).first;
      it->second.ns = ns;
      it->second.name = std::string(key_namespace);
      NoteNamespace(ns, it->second.name);
    }
    Session& session = it->second;
    session.last_seen = options_.clock();
    return session.ns;
  }

  std::vector<LookupResult> Lookup(std::span<const BlockKey> keys) {
    std::vector<LookupResult> results(keys.size());
    store_->Lookup(keys, results);
    uint64_t hits = 0, misses = 0;
    for (LookupResult r : results) {
      hits += r == LookupResult::kHit ? 1 : 0;
      misses += r == LookupResult::kMiss ? 1 : 0;
    }
    counters_.Add(NodeCounter::kLookups, keys.size());
    counters_.Add(NodeCounter::kLookupHits, hits);
    counters_.Add(NodeCounter::kLookupMisses, misses);
    counters_.Add(NodeCounter::kLookupRetries, keys.size() - hits - misses);
    return results;
  }

  void Touch(std::span<const BlockKey> keys, store::TouchKind kind) {
    store_->Touch(keys, kind);
    counters_.Add(NodeCounter::kTouchedKeys, keys.size());
  }

  Result<PutSlot> BeginPut(uint64_t connection, const BlockKey& key, size_t length,
                           store::StoreHint hint) {
    Session& session = sessions_[connection];
    if (length != store_->block_bytes()) {
      return InvalidArgumentError("block {} of {} bytes; this node's block size is {}",
                                  key.ToString(), length, store_->block_bytes());
    }
    if (session.arriving.contains(key)) {
      return AlreadyExistsError("block {} is being sent already", key.ToString());
    }
    store::StorePlan plan;
    std::shared_ptr<store::SlotGate> gate;
    if (Status prepared =
            store_->PrepareStore(std::span(&key, 1), &plan, &gate, std::span(&hint, 1));
        !prepared.ok()) {
      if (plan.quota_refused != 0) return QuotaRefusal(session, plan.quota_refused, prepared);
      return prepared;
    }
    PutSlot put;
    for (const BlockKey& evicted : plan.evicted) {
      if (evicted.namespace_id == session.ns) put.evicted.push_back(evicted);
    }
    if (plan.keys_to_store.empty()) {
      // Held or being stored already: the bytes are not taken, and the store counts as a use
      // of the block (as the connector's touch after a store, docs/semantics.md §7.6). Or
      // turned away by the reuse filter (§2a): not stored, answered skipped all the same (a
      // cache may decline a block as it may evict one), and counted.
      counters_.Add(NodeCounter::kBlocksNotAdmitted, plan.filtered);
      Touch(std::span(&key, 1), store::TouchKind::kRefresh);
      put.skipped = true;
      return put;
    }
    put.slot = store_->CpuSlot(plan.slots[0]).first(length);
    put.gate = std::move(gate);
    session.arriving.emplace(key, put.slot);
    return put;
  }

  Status EndPut(uint64_t connection, const BlockKey& key, Status received, uint64_t checksum) {
    auto s = sessions_.find(connection);
    if (s == sessions_.end()) return InternalError("no session for connection {}", connection);
    Session& session = s->second;
    auto it = session.arriving.find(key);
    if (it == session.arriving.end()) {
      return InternalError("block {} was not being stored by connection {}", key.ToString(),
                           connection);
    }
    const std::span<std::byte> slot = it->second;
    session.arriving.erase(it);
    if (session.closed && received.ok()) {
      // The client is gone and was never told: its bytes may be half written (a client copying
      // into a shared slot can die mid-copy), so the block is not kept.
      received = AbortedError("block {}: the client's session ended while it was being stored",
                              key.ToString());
    }
    if (received.ok() && checksum != 0 && Xxh3Hash64(slot) != checksum) {
      counters_.Add(NodeCounter::kChecksumFailures);
      received = DataLossError("block {}: checksum mismatch", key.ToString());
    }
    if (received.ok()) counters_.Add(NodeCounter::kBytesIn, slot.size());
    store_->CompleteStore(std::span(&key, 1), received.ok());
    counters_.Add(received.ok() ? NodeCounter::kBlocksStored : NodeCounter::kBlocksAborted);
    if (session.closed) {
      if (!received.ok()) counters_.Add(NodeCounter::kStoresAbortedOnClose);
      if (session.arriving.empty()) EndSession(connection);
    }
    return received;
  }

  std::vector<std::optional<size_t>> Load(uint64_t connection, std::span<const BlockKey> keys) {
    Session& session = sessions_[connection];
    std::vector<std::optional<size_t>> out;
    out.reserve(keys.size());
    std::vector<std::span<const std::byte>> blocks;
    uint64_t pinned = 0;
    for (const BlockKey& key : keys) {
      if (!store_->PrepareLoad(std::span(&key, 1), &blocks).ok()) {
        out.emplace_back();
        continue;
      }
      Pin& pin = session.pins[key];
      ++pin.count;
      pin.block = blocks[0];
      out.emplace_back(blocks[0].size());
      ++pinned;
    }
    counters_.Add(NodeCounter::kPinnedKeys, pinned);
    return out;
  }

  void Release(uint64_t connection, std::span<const BlockKey> keys) {
    auto s = sessions_.find(connection);
    if (s == sessions_.end()) return;
    for (const BlockKey& key : keys) {
      auto it = s->second.pins.find(key);
      if (it == s->second.pins.end()) continue;  // not pinned here: nothing to undo
      (void)store_->CompleteLoad(std::span(&key, 1));
      if (--it->second.count == 0) s->second.pins.erase(it);
    }
  }

  Result<Read> BeginGet(uint64_t connection, const BlockKey& key) {
    Session& session = sessions_[connection];
    if (auto it = session.pins.find(key); it != session.pins.end()) {
      return Read{it->second.block, false};
    }
    std::vector<std::span<const std::byte>> blocks;
    if (!store_->PrepareLoad(std::span(&key, 1), &blocks).ok()) {
      LookupResult found = LookupResult::kMiss;
      store_->Lookup(std::span(&key, 1), std::span(&found, 1));  // starts a promotion
      // A hit here means a promotion landed between the two calls: ask again too.
      if (found == LookupResult::kMiss) {
        return NotFoundError("block {} is not on this node", key.ToString());
      }
      return AbortedError("block {} is on SSD and being promoted; ask again", key.ToString());
    }
    return Read{blocks[0], true};
  }

  void EndGet(const BlockKey& key, const Read& read, const Status& sent) {
    if (read.pinned_for_read) (void)store_->CompleteLoad(std::span(&key, 1));
    if (!sent.ok()) return;
    counters_.Add(NodeCounter::kBlocksLoaded);
    counters_.Add(NodeCounter::kBytesOut, read.block.size());
  }

  void Loaded(size_t blocks, uint64_t bytes) {
    counters_.Add(NodeCounter::kBlocksLoaded, blocks);
    counters_.Add(NodeCounter::kBytesOut, bytes);
  }

  void ChecksumFailed() { counters_.Add(NodeCounter::kChecksumFailures); }

  bool HasSession(uint64_t connection) const {
    auto it = sessions_.find(connection);
    return it != sessions_.end() && !it->second.closed;
  }

  void EndSession(uint64_t connection) {
    auto it = sessions_.find(connection);
    if (it == sessions_.end()) return;
    Session& session = it->second;
    const uint64_t pins = ReleasePins(session);
    if (pins != 0) KVSTASH_LOG_INFO("connection {} ended: released {} pin(s)", connection, pins);
    counters_.Add(NodeCounter::kPinsReleasedOnClose, pins);
    if (!session.arriving.empty()) {
      session.closed = true;  // ends when the last bytes have arrived (or failed): EndPut
      return;
    }
    counters_.Add(NodeCounter::kSessionsClosed);
    sessions_.erase(it);
  }

  void ExpireLeases() {
    const Clock::time_point now = options_.clock();
    for (auto& [connection, session] : sessions_) {
      // Bytes still arriving: the transport's deadline ends them, and the session lives on.
      if (!session.arriving.empty() || now - session.last_seen < options_.lease_timeout ||
          session.pins.empty()) {
        continue;
      }
      const uint64_t pins = ReleasePins(session);
      KVSTASH_LOG_WARN("connection {}: lease expired after {} ms of silence: released {} pin(s)",
                       connection, options_.lease_timeout.count(), pins);
      counters_.Add(NodeCounter::kLeasesExpired);
      counters_.Add(NodeCounter::kPinsReleasedOnExpiry, pins);
    }
  }

  Status Flush() { return store_->Flush(); }

  std::map<std::string, uint64_t> Counters() const {
    CounterSnapshot snapshot;
    snapshot.node = &counters_;
    snapshot.store = SnapshotOf(*store_);
    return ReadCounters(snapshot);
  }

  std::vector<NamespaceStats> Namespaces() const {
    std::vector<NamespaceStats> out;
    std::unordered_map<NamespaceId, size_t> row;  // by id: its index in `out`
    {
      MutexLock lock(&names_mu_);
      for (const auto& [ns, known] : names_) {
        NamespaceStats& stats = out.emplace_back();
        stats.name = known.name;
        stats.quota_refusals = known.refusals;
        stats.cpu_quota_blocks = QuotaOf(known.name);
      }
      std::sort(out.begin(), out.end(),
                [](const NamespaceStats& a, const NamespaceStats& b) { return a.name < b.name; });
      for (size_t i = 0; i < out.size(); ++i) {
        if (std::optional<NamespaceId> ns = registry_->Find(out[i].name)) row[*ns] = i;
      }
      if (other_used_) {
        NamespaceStats& other = out.emplace_back();
        other.name = kOtherNamespaces;
        other.quota_refusals = other_refusals_;
      }
    }
    for (const store::NamespaceUsage& usage : store_->cpu().NamespaceUsages()) {
      auto it = row.find(usage.id);
      if (it != row.end()) {
        out[it->second].cpu_blocks = usage.blocks;
      } else if (usage.blocks != 0) {
        if (out.empty() || out.back().name != kOtherNamespaces) {
          out.emplace_back().name = kOtherNamespaces;
        }
        out.back().cpu_blocks += usage.blocks;
      }
    }
    return out;
  }

  store::TieredStore& store() { return *store_; }
  size_t sessions() const { return sessions_.size(); }

 private:
  struct Pin {
    uint32_t count = 0;
    std::span<const std::byte> block;
  };
  // What one connection holds.
  struct Session {
    NamespaceId ns = 0;
    std::string name;  // the namespace's
    // Stores whose bytes are arriving, into these slots.
    std::map<BlockKey, std::span<std::byte>> arriving;
    std::map<BlockKey, Pin> pins;
    bool closed = false;  // the connection ended; kept while bytes are still arriving
    Clock::time_point last_seen;
  };

  // Releases the session's pins; how many. (Stores whose bytes are arriving are left to their
  // EndPut, which aborts them once the transport is done with their slots: a slot is never
  // given to another block while bytes may still land in it.)
  uint64_t ReleasePins(Session& session) {
    uint64_t pins = 0;
    for (const auto& [key, pin] : session.pins) {
      for (uint32_t i = 0; i < pin.count; ++i) (void)store_->CompleteLoad(std::span(&key, 1));
      pins += pin.count;
    }
    session.pins.clear();
    return pins;
  }

  // Turns the quotas by name into the CPU tier's quotas by namespace id, and names them.
  Status SetUpQuotas() {
    const size_t capacity = options_.store.cpu_capacity_blocks;
    auto check = [capacity](std::string_view what, size_t blocks) -> Status {
      if (blocks == 0 || blocks > capacity) {
        return InvalidArgumentError("{}: {} blocks is outside 1..{} (the CPU tier)", what, blocks,
                                    capacity);
      }
      return Status::OK();
    };
    store::NamespaceQuotas& quotas = options_.store.cpu_quotas;
    quotas = {};
    MutexLock lock(&names_mu_);
    for (const auto& [name, blocks] : options_.namespace_quota_blocks) {
      KVSTASH_RETURN_IF_ERROR(check(fmt::format("quota of namespace '{}'", name), blocks));
      if (name == kOtherNamespaces) {
        return InvalidArgumentError(
            "namespace name '{}' is reserved: the metrics sum unnamed namespaces under it", name);
      }
      KVSTASH_ASSIGN_OR_RETURN(const NamespaceId ns, registry_->Register(name));
      quotas.blocks[ns] = blocks;
      names_[ns].name = name;
    }
    if (options_.default_namespace_quota_blocks) {
      KVSTASH_RETURN_IF_ERROR(
          check("default namespace quota", *options_.default_namespace_quota_blocks));
      quotas.default_blocks = options_.default_namespace_quota_blocks;
    }
    options_.store.count_namespaces = true;
    return Status::OK();
  }

  std::optional<uint64_t> QuotaOf(const std::string& name) const {
    if (auto it = options_.namespace_quota_blocks.find(name);
        it != options_.namespace_quota_blocks.end()) {
      return it->second;
    }
    return options_.default_namespace_quota_blocks;
  }

  // Remembers the name of a namespace seen at hello, while there is room for it.
  void NoteNamespace(NamespaceId ns, const std::string& name) {
    MutexLock lock(&names_mu_);
    if (names_.count(ns) != 0) return;
    if (seen_names_ >= kMaxNamedNamespaces || name == kOtherNamespaces) {
      other_used_ = true;
      return;
    }
    names_[ns].name = name;
    ++seen_names_;
  }

  // A store of `blocks` new blocks of the session's namespace was refused for its quota
  // (`why`: the store's answer). Counts it and returns the answer for the client, with the
  // namespace by name.
  Status QuotaRefusal(const Session& session, size_t blocks, const Status& why) {
    uint64_t total = 0;
    {
      MutexLock lock(&names_mu_);
      if (auto it = names_.find(session.ns); it != names_.end()) {
        it->second.refusals += blocks;
      } else {
        other_used_ = true;
        other_refusals_ += blocks;
      }
      total = quota_refusals_ += blocks;
    }
    // A tenant at its quota is refused on every store: log the 1st, 2nd, 4th, 8th ... time.
    if (std::has_single_bit(++quota_refused_calls_)) {
      KVSTASH_LOG_WARN(
          "namespace '{}': {} block(s) refused for its CPU quota ({} so far, all "
          "namespaces): {}",
          session.name, blocks, total, why.message());
    }
    return Status(why.code(), fmt::format("namespace '{}': {}", session.name, why.message()));
  }

  NodeServiceOptions options_;
  // Before the store: the store's options hold a pointer to it while it opens.
  std::unique_ptr<NamespaceRegistry> registry_;
  std::unique_ptr<store::TieredStore> store_;
  std::unordered_map<uint64_t, Session> sessions_;  // by connection
  NodeCounters counters_;
  // Namespace names for the metrics: those with a named quota, then those seen at hello.
  struct KnownNamespace {
    std::string name;
    uint64_t refusals = 0;  // blocks refused for its quota
  };
  mutable Mutex names_mu_;
  std::unordered_map<NamespaceId, KnownNamespace> names_ GUARDED_BY(names_mu_);
  size_t seen_names_ GUARDED_BY(names_mu_) = 0;
  bool other_used_ GUARDED_BY(names_mu_) = false;  // a namespace went unnamed
  uint64_t other_refusals_ GUARDED_BY(names_mu_) = 0;
  uint64_t quota_refusals_ GUARDED_BY(names_mu_) = 0;
  uint64_t quota_refused_calls_ = 0;
};

Result<std::unique_ptr<NodeService>> NodeService::Create(NodeServiceOptions options) {
  auto impl = std::make_unique<Impl>(std::move(options));
  KVSTASH_RETURN_IF_ERROR(impl->Open());
  return std::unique_ptr<NodeService>(new NodeService(std::move(impl)));
}

NodeService::NodeService(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
NodeService::~NodeService() = default;

Status NodeService::AdmitNamespace(std::string_view name) { return impl_->AdmitNamespace(name); }
Result<NamespaceId> NodeService::BeginRequest(uint64_t connection, std::string_view key_namespace) {
  return impl_->BeginRequest(connection, key_namespace);
}
std::vector<LookupResult> NodeService::Lookup(std::span<const BlockKey> keys) {
  return impl_->Lookup(keys);
}
void NodeService::Touch(std::span<const BlockKey> keys, store::TouchKind kind) {
  impl_->Touch(keys, kind);
}
Result<NodeService::PutSlot> NodeService::BeginPut(uint64_t connection, const BlockKey& key,
                                                   size_t length, store::StoreHint hint) {
  return impl_->BeginPut(connection, key, length, hint);
}
Status NodeService::EndPut(uint64_t connection, const BlockKey& key, Status received,
                           uint64_t checksum) {
  return impl_->EndPut(connection, key, std::move(received), checksum);
}
std::vector<std::optional<size_t>> NodeService::Load(uint64_t connection,
                                                     std::span<const BlockKey> keys) {
  return impl_->Load(connection, keys);
}
void NodeService::Release(uint64_t connection, std::span<const BlockKey> keys) {
  impl_->Release(connection, keys);
}
Result<NodeService::Read> NodeService::BeginGet(uint64_t connection, const BlockKey& key) {
  return impl_->BeginGet(connection, key);
}
void NodeService::EndGet(const BlockKey& key, const Read& read, const Status& sent) {
  impl_->EndGet(key, read, sent);
}
void NodeService::Loaded(size_t blocks, uint64_t bytes) { impl_->Loaded(blocks, bytes); }
void NodeService::ChecksumFailed() { impl_->ChecksumFailed(); }
bool NodeService::HasSession(uint64_t connection) const { return impl_->HasSession(connection); }
void NodeService::EndSession(uint64_t connection) { impl_->EndSession(connection); }
void NodeService::ExpireLeases() { impl_->ExpireLeases(); }
Status NodeService::Flush() { return impl_->Flush(); }
std::map<std::string, uint64_t> NodeService::Counters() const { return impl_->Counters(); }
std::vector<NamespaceStats> NodeService::Namespaces() const { return impl_->Namespaces(); }
store::TieredStore& NodeService::store() { return impl_->store(); }
size_t NodeService::sessions() const { return impl_->sessions(); }
std::optional<std::string> NodeService::NamespaceName(NamespaceId ns) const {
  return impl_->NamespaceName(ns);
}

}  // namespace kvstash::node
