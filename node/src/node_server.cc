// NodeServer: the wire methods over the tiered store. Handlers and sessions live on the
// transport's progress thread; the store is thread-safe and is only ever called from there.

#include "kvstash/node/node_server.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <mutex>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include "kvstash/common/hash.h"
#include "kvstash/common/logging.h"
#include "kvstash/common/mutex.h"
#include "kvstash/proto/convert.h"

namespace kvstash::node {
namespace {
using Clock = std::chrono::steady_clock;
using transport::Bytes;
using transport::ServerCall;

// A client namespace's id in the store's keys: the low 32 bits of xxh3-64 of its name, so the
// same name maps to the same id across restarts (blocks on SSD stay with their namespace).
NamespaceId NamespaceIdOf(std::string_view name) {
  return static_cast<NamespaceId>(Xxh3Hash64(std::as_bytes(std::span(name))));
}

// The latencies of one method in the buckets of kLatencyBuckets. Lock-free: Record (on the
// progress thread, or wherever a reply completes) adds to relaxed atomics and a scrape reads
// them, so neither the request path nor a scrape ever waits for the other.
class LatencyHistogram {
 public:
  void Record(Clock::duration latency) {
    const int64_t ns =
        std::max<int64_t>(0, std::chrono::duration_cast<std::chrono::nanoseconds>(latency).count());
    size_t bucket = 0;
    while (bucket < kLatencyBuckets.size() &&
           ns > std::chrono::nanoseconds(kLatencyBuckets[bucket]).count()) {
      ++bucket;
    }
    buckets_[bucket].fetch_add(1, std::memory_order_relaxed);
    sum_ns_.fetch_add(static_cast<uint64_t>(ns), std::memory_order_relaxed);
  }

  // The count is the sum of the buckets read, so a scrape's buckets always add up to it.
  void Read(MethodLatency* out) const {
    out->count = 0;
    for (size_t i = 0; i < buckets_.size(); ++i) {
      out->buckets[i] = buckets_[i].load(std::memory_order_relaxed);
      out->count += out->buckets[i];
    }
    out->sum = std::chrono::nanoseconds(sum_ns_.load(std::memory_order_relaxed));
  }

 private:
  std::array<std::atomic<uint64_t>, kLatencyBuckets.size() + 1> buckets_{};
  std::atomic<uint64_t> sum_ns_{0};
};

// The time since a request's dispatch, recorded in its method's histogram when stopped. A
// plain value, so that the `sent` callback of a reply (a copyable std::function) can carry it.
struct Stopwatch {
  LatencyHistogram* histogram = nullptr;  // none: records nothing
  Clock::time_point start;

  void Stop() const {
    if (histogram != nullptr) histogram->Record(Clock::now() - start);
  }
};

// A request being served: the transport's ServerCall with its method's clock running since
// dispatch. Every reply goes through here, so every reply path of every handler is timed: Reply
// and ReplyError stop the clock just before the reply is handed to the transport (before, so
// that a client that has its answer sees it counted). A handler whose reply has a payload takes
// the clock (TakeStopwatch) and stops it in the reply's `sent` callback. Move-only; like
// ServerCall, used on the progress thread or from one completion at a time.
class TimedCall {
 public:
  TimedCall(ServerCall call, LatencyHistogram* histogram)
      : call_(std::move(call)), stopwatch_{histogram, Clock::now()} {}
  TimedCall(TimedCall&& other) noexcept
      : call_(std::move(other.call_)), stopwatch_(std::exchange(other.stopwatch_, {})) {}
  TimedCall& operator=(TimedCall&&) = delete;
  TimedCall(const TimedCall&) = delete;
  TimedCall& operator=(const TimedCall&) = delete;

  uint64_t connection_id() const { return call_.connection_id(); }
  const std::string& key_namespace() const { return call_.key_namespace(); }
  Bytes request() const { return call_.request(); }
  size_t payload_bytes() const { return call_.payload_bytes(); }

  void ReceivePayload(transport::MutableBytes dest, const transport::MemoryRegion* region,
                      std::function<void(Status)> done) {
    call_.ReceivePayload(dest, region, std::move(done));
  }
  void Reply(Bytes message, Bytes payload = {}, const transport::MemoryRegion* region = nullptr,
             std::function<void(Status)> sent = {}) {
    std::exchange(stopwatch_, {}).Stop();
    call_.Reply(message, payload, region, std::move(sent));
  }
  void ReplyError(const Status& status) {
    std::exchange(stopwatch_, {}).Stop();
    call_.ReplyError(status);
  }
  // The running clock, for the caller to stop later; the call's own replies no longer stop it.
  Stopwatch TakeStopwatch() { return std::exchange(stopwatch_, {}); }

 private:
  ServerCall call_;
  Stopwatch stopwatch_;
};

template <typename Message>
void ReplyWith(TimedCall& call, const Message& message, Bytes payload = {},
               const transport::MemoryRegion* region = nullptr,
               std::function<void(Status)> sent = {}) {
  const std::string bytes = message.SerializeAsString();
  call.Reply(std::as_bytes(std::span(bytes)), payload, region, std::move(sent));
}

// The lookup kinds of wire.LookupMode and the results counted for each.
enum LookupKind : size_t { kPerKey, kPrefix, kWindow, kLookupKinds };
enum LookupCount : size_t { kHits, kMisses, kRetries, kLookupCounts };
constexpr const char* kLookupKindNames[kLookupKinds] = {"per_key", "prefix", "window"};

}  // namespace

class NodeServer::Impl {
 public:
  explicit Impl(NodeOptions options) : options_(std::move(options)) {}

  ~Impl() {
    // Handlers use the store and the CPU memory: stop serving first (sessions end there),
    // then close the store, then give the memory back while the transport still exists.
    if (server_) server_->Stop();
    store_.reset();
    cpu_region_ = transport::MemoryRegion();
    server_.reset();
  }

  Status Start() {
    KVSTASH_RETURN_IF_ERROR(SetUpQuotas());
    options_.server.block_bytes = options_.store.block_bytes;
    if (options_.listen) {
      KVSTASH_ASSIGN_OR_RETURN(server_, options_.listen(options_.server));
    } else {
      KVSTASH_ASSIGN_OR_RETURN(std::unique_ptr<transport::RpcServer> rpc,
                               transport::RpcServer::Create(options_.server));
      server_ = std::move(rpc);
    }
    KVSTASH_ASSIGN_OR_RETURN(const size_t cpu_bytes, store::CpuMemoryBytes(options_.store));
    Result<transport::MemoryRegion> region = server_->AllocateMemory(cpu_bytes);
    if (region.ok() && reinterpret_cast<uintptr_t>(region->data()) % 4096 == 0) {
      cpu_region_ = std::move(*region);
      options_.store.cpu_memory = cpu_region_.bytes().first(cpu_bytes);
    } else {
      KVSTASH_LOG_WARN(
          "cannot allocate the CPU tier's {} bytes through the transport ({}); the store maps "
          "its own and block payloads go by UCX rendezvous",
          cpu_bytes, region.ok() ? "unaligned" : region.status().ToString());
    }
    KVSTASH_ASSIGN_OR_RETURN(store_, store::TieredStore::Open(options_.store));
    Register();
    server_->OnDisconnect([this](uint64_t connection) { EndSession(connection); });
    KVSTASH_RETURN_IF_ERROR(server_->Start());
    StartLeaseSweeper();
    return Status::OK();
  }

  Status Shutdown() {
    server_->Stop();
    return store_->Flush();
  }

  uint16_t port() const { return server_->port(); }
  store::TieredStore& store() { return *store_; }
  bool shares_cpu_memory() const { return cpu_region_.size() != 0; }

  NodeStats stats() const {
    NodeStats s;
    s.lookups = lookups_.load();
    LookupCounts* kinds[kLookupKinds] = {&s.per_key, &s.prefix, &s.window};
    for (size_t kind = 0; kind < kLookupKinds; ++kind) {
      const auto& counts = lookup_counts_[kind];
      kinds[kind]->hits = counts[kHits].load(std::memory_order_relaxed);
      kinds[kind]->misses = counts[kMisses].load(std::memory_order_relaxed);
      kinds[kind]->retries = counts[kRetries].load(std::memory_order_relaxed);
      s.lookup_hits += kinds[kind]->hits;
      s.lookup_misses += kinds[kind]->misses;
      s.lookup_retries += kinds[kind]->retries;
    }
    s.blocks_stored = blocks_stored_.load();
    s.blocks_aborted = blocks_aborted_.load();
    s.blocks_loaded = blocks_loaded_.load();
    s.bytes_in = bytes_in_.load();
    s.bytes_out = bytes_out_.load();
    s.checksum_failures = checksum_failures_.load();
    s.sessions_closed = sessions_closed_.load();
    s.pins_released_on_close = pins_released_on_close_.load();
    s.stores_aborted_on_close = stores_aborted_on_close_.load();
    s.leases_expired = leases_expired_.load();
    s.pins_released_on_expiry = pins_released_on_expiry_.load();
    return s;
  }

  std::map<std::string, uint64_t> Counters() const {
    const NodeStats n = stats();
    const store::TieredStoreStats t = store_->stats();
    const transport::TransportStats x = server_->stats();
    const store::SsdTierStats d =
        store_->ssd() != nullptr ? store_->ssd()->stats() : store::SsdTierStats();
    const uint64_t cpu_blocks = store_->cpu().resident_blocks();
    const uint64_t ssd_blocks = store_->ssd() != nullptr ? store_->ssd()->resident_blocks() : 0;
    std::map<std::string, uint64_t> counters = {
        {"node.lookups", n.lookups},
        {"node.lookup_hits", n.lookup_hits},
        {"node.lookup_misses", n.lookup_misses},
        {"node.lookup_retries", n.lookup_retries},
        {"node.blocks_stored", n.blocks_stored},
        {"node.blocks_aborted", n.blocks_aborted},
        {"node.blocks_loaded", n.blocks_loaded},
        {"node.bytes_in", n.bytes_in},
        {"node.bytes_out", n.bytes_out},
        {"node.checksum_failures", n.checksum_failures},
        {"node.sessions_closed", n.sessions_closed},
        {"node.pins_released_on_close", n.pins_released_on_close},
        {"node.stores_aborted_on_close", n.stores_aborted_on_close},
        {"node.leases_expired", n.leases_expired},
        {"node.pins_released_on_expiry", n.pins_released_on_expiry},
        {"node.touched_keys", touched_keys_.load(std::memory_order_relaxed)},
        {"cpu.capacity_blocks", store_->cpu().capacity()},
        {"cpu.resident_blocks", cpu_blocks},
        {"cpu.resident_bytes", cpu_blocks * store_->block_bytes()},
        {"cpu.block_bytes", store_->block_bytes()},
        {"cpu.policy_arc", store_->cpu().policy() == store::EvictionPolicy::kArc ? 1u : 0u},
        {"ssd.capacity_blocks", store_->ssd() != nullptr ? store_->ssd()->capacity_blocks() : 0},
        {"ssd.resident_blocks", ssd_blocks},
        {"ssd.resident_bytes", ssd_blocks * store_->block_bytes()},
        {"ssd.evictions", d.evictions},
        {"ssd.checksum_failures", d.checksum_failures},
        {"store.cpu_evictions", t.cpu_evictions},
        {"store.promotions_done", t.promotions_done},
        {"store.promotion_failures", t.promotion_failures},
        {"store.promotions_deferred", t.promotions_deferred},
        {"store.cascades_deferred", t.cascades_deferred},
        {"store.cascades_done", t.cascades_done},
        {"store.cascade_failures", t.cascade_failures},
        {"store.quota_refusals", t.quota_refusals},
        {"transport.connections", server_->connection_count()},
        {"transport.calls", x.calls},
        {"transport.malformed_frames", x.malformed_frames},
        {"transport.mapped_payloads", x.mapped_payloads},
        {"transport.refused", x.refused},
    };
    if (store_->cpu().policy() == store::EvictionPolicy::kArc) {
      // ARC's lists: T2 grows as blocks are used again (a touch, a store of a held block).
      const store::PolicySizes arc = store_->cpu().policy_sizes();
      counters["cpu.arc_t1_blocks"] = arc.t1;
      counters["cpu.arc_t2_blocks"] = arc.t2;
      counters["cpu.arc_b1_ghosts"] = arc.b1;
      counters["cpu.arc_b2_ghosts"] = arc.b2;
      counters["cpu.arc_target_t1_blocks"] = static_cast<uint64_t>(arc.arc_target);
    }
    // By lookup kind: node.lookup_hits.per_key, node.lookup_retries.window, ...
    const LookupCounts* kinds[kLookupKinds] = {&n.per_key, &n.prefix, &n.window};
    for (size_t kind = 0; kind < kLookupKinds; ++kind) {
      const std::string suffix = std::string(".") + kLookupKindNames[kind];
      counters["node.lookup_hits" + suffix] = kinds[kind]->hits;
      counters["node.lookup_misses" + suffix] = kinds[kind]->misses;
      counters["node.lookup_retries" + suffix] = kinds[kind]->retries;
    }
    return counters;
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
      for (size_t i = 0; i < out.size(); ++i) row[NamespaceIdOf(out[i].name)] = i;
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

  std::vector<MethodLatency> Latencies() const {
    std::vector<MethodLatency> out;
    for (const Timed& timed : latencies_) {
      if (timed.name == nullptr) continue;  // no such method
      MethodLatency& latency = out.emplace_back();
      latency.method = timed.name;
      timed.histogram.Read(&latency);
    }
    return out;
  }

 private:
  struct Prepared {
    store::SlotId slot = 0;
    bool written = false;
    bool writing = false;  // a PutBlock payload is on its way into the slot
  };
  struct Pin {
    uint32_t count = 0;
    std::span<const std::byte> block;
  };
  // What one connection holds. Progress thread only.
  struct Session {
    NamespaceId ns = 0;
    std::map<BlockKey, Prepared> prepared;
    std::map<BlockKey, Pin> pins;
    bool closed = false;  // the connection ended; kept while payloads are still arriving
    uint32_t writes_in_flight = 0;
    Clock::time_point last_seen = Clock::now();
  };

  const transport::MemoryRegion* region() const {
    return cpu_region_.size() != 0 ? &cpu_region_ : nullptr;
  }

  // A wire method's name in metrics and its latencies; set by Register, before serving.
  struct Timed {
    const char* name = nullptr;
    LatencyHistogram histogram;
  };

  // Every request renews its session's lease.
  Session& SessionOf(const TimedCall& call) {
    auto [it, added] = sessions_.try_emplace(call.connection_id());
    if (added) {
      it->second.ns = NamespaceIdOf(call.key_namespace());
      NoteNamespace(it->second.ns, call.key_namespace());
    }
    it->second.last_seen = Clock::now();
    return it->second;
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
      const NamespaceId ns = NamespaceIdOf(name);
      if (auto it = names_.find(ns); it != names_.end()) {
        // They would share blocks too: a client's keys are (namespace id, block hash).
        return InvalidArgumentError("namespaces '{}' and '{}' have the same id {}; rename one",
                                    it->second.name, name, ns);
      }
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

  // A store of `blocks` new blocks of the call's namespace was refused for its quota (`why`:
  // the store's answer). Counts it and returns the answer for the client, with the namespace
  // by name.
  Status QuotaRefusal(const TimedCall& call, const Session& session, size_t blocks,
                      const Status& why) {
    const std::string& name = call.key_namespace();
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
          name, blocks, total, why.message());
    }
    return Status(why.code(), fmt::format("namespace '{}': {}", name, why.message()));
  }

  // Parses the request into *message, or answers InvalidArgument.
  template <typename Message>
  static bool Parse(TimedCall& call, Message* message, std::string_view what) {
    const Bytes bytes = call.request();
    if (!message->ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) {
      call.ReplyError(InvalidArgumentError("unparseable {} of {} bytes", what, bytes.size()));
      return false;
    }
    return true;
  }

  // The keys of a request in this session's namespace, or an InvalidArgument answer.
  bool Keys(TimedCall& call, const Session& session,
            const google::protobuf::RepeatedPtrField<wire::Key>& keys, std::vector<BlockKey>* out) {
    if (static_cast<size_t>(keys.size()) > options_.server.max_keys_per_request) {
      call.ReplyError(InvalidArgumentError("{} keys in one request; the limit is {}", keys.size(),
                                           options_.server.max_keys_per_request));
      return false;
    }
    out->clear();
    out->reserve(keys.size());
    for (const wire::Key& key : keys) out->push_back(wire::FromWire(key, session.ns));
    return true;
  }

  // Every handler gets its call with the clock of its method's latency histogram running.
  void Register() {
    using M = wire::Method;
    auto handle = [this](M method, const char* name, void (Impl::*fn)(TimedCall)) {
      Timed& timed = latencies_.at(method);
      timed.name = name;
      server_->Handle(static_cast<uint16_t>(method), [this, fn, &timed](ServerCall call) {
        (this->*fn)(TimedCall(std::move(call), &timed.histogram));
      });
    };
    handle(wire::METHOD_LOOKUP, "lookup", &Impl::OnLookup);
    handle(wire::METHOD_PREPARE_STORE, "prepare_store", &Impl::OnPrepareStore);
    handle(wire::METHOD_PUT_BLOCK, "put_block", &Impl::OnPutBlock);
    handle(wire::METHOD_COMMIT, "commit", &Impl::OnCommit);
    handle(wire::METHOD_LOAD, "load", &Impl::OnLoad);
    handle(wire::METHOD_GET_BLOCK, "get_block", &Impl::OnGetBlock);
    handle(wire::METHOD_RELEASE, "release", &Impl::OnRelease);
    handle(wire::METHOD_TOUCH, "touch", &Impl::OnTouch);
    handle(wire::METHOD_STATS, "stats", &Impl::OnStats);
    handle(wire::METHOD_ECHO, "echo", &Impl::OnEcho);
  }

  void OnLookup(TimedCall call) {
    wire::LookupRequest request;
    if (!Parse(call, &request, "lookup request")) return;
    Session& session = SessionOf(call);
    wire::LookupReply reply;
    std::vector<BlockKey> keys;
    for (const wire::Lookup& lookup : request.lookups()) {
      if (!Keys(call, session, lookup.keys(), &keys)) return;
      lookups_.fetch_add(keys.size(), std::memory_order_relaxed);
      wire::LookupAnswer* answer = reply.add_answers();
      switch (lookup.mode()) {
        case wire::LOOKUP_MODE_PER_KEY: {
          std::vector<LookupResult> results(keys.size());
          store_->Lookup(keys, results);
          uint64_t counts[kLookupCounts] = {};
          for (LookupResult r : results) {
            answer->add_results(wire::ToWire(r));
            ++counts[r == LookupResult::kHit    ? kHits
                     : r == LookupResult::kMiss ? kMisses
                                                : kRetries];
          }
          Count(kPerKey, counts);
          break;
        }
        case wire::LOOKUP_MODE_PREFIX:
        case wire::LOOKUP_MODE_WINDOW: {
          const bool prefix = lookup.mode() == wire::LOOKUP_MODE_PREFIX;
          const ScanResult scan = prefix ? store_->LookupPrefix(keys)
                                         : store_->LookupWindow(keys, lookup.window_size());
          answer->set_hit_length(static_cast<uint32_t>(scan.value_or(0)));
          answer->set_retry(!scan.has_value());
          // A scan has no per-key results: its hit_length keys count as hits and the others as
          // misses, or it counts one retry.
          uint64_t counts[kLookupCounts] = {};
          if (!scan.has_value()) {
            counts[kRetries] = 1;
          } else {
            counts[kHits] = *scan;
            counts[kMisses] = keys.size() - *scan;
          }
          Count(prefix ? kPrefix : kWindow, counts);
          break;
        }
        default:
          call.ReplyError(InvalidArgumentError("lookup mode {} is not per-key, prefix or window",
                                               static_cast<int>(lookup.mode())));
          return;
      }
    }
    ReplyWith(call, reply);
  }

  // One atomic add per counted result of a lookup, not one per key.
  void Count(LookupKind kind, const uint64_t (&counts)[kLookupCounts]) {
    for (size_t i = 0; i < kLookupCounts; ++i) {
      if (counts[i] != 0) lookup_counts_[kind][i].fetch_add(counts[i], std::memory_order_relaxed);
    }
  }

  void OnPrepareStore(TimedCall call) {
    wire::PrepareStoreRequest request;
    if (!Parse(call, &request, "prepare-store request")) return;
    Session& session = SessionOf(call);
    std::vector<BlockKey> keys;
    if (!Keys(call, session, request.keys(), &keys)) return;
    store::StorePlan plan;
    const Status prepared = store_->PrepareStore(keys, &plan);
    if (!prepared.ok()) {
      call.ReplyError(plan.quota_refused != 0
                          ? QuotaRefusal(call, session, plan.quota_refused, prepared)
                          : prepared);
      return;
    }
    std::map<BlockKey, store::SlotId> to_store;
    for (size_t i = 0; i < plan.keys_to_store.size(); ++i) {
      to_store.emplace(plan.keys_to_store[i], plan.slots[i]);
      session.prepared[plan.keys_to_store[i]] = Prepared{plan.slots[i]};
    }
    wire::PrepareStoreReply reply;
    std::vector<BlockKey> held;  // a store of a block held already is a use of it
    for (const BlockKey& key : keys) {
      const bool store = to_store.count(key) != 0;
      reply.add_store(store);
      if (!store) held.push_back(key);
    }
    if (!held.empty()) {
      store_->Touch(held);
      touched_keys_.fetch_add(held.size(), std::memory_order_relaxed);
    }
    // Only this namespace's evictions are the client's business.
    for (const BlockKey& key : plan.evicted) {
      if (key.namespace_id == session.ns) wire::ToWire(key, reply.add_evicted());
    }
    ReplyWith(call, reply);
  }

  void OnPutBlock(TimedCall call) {
    wire::PutBlockRequest request;
    if (!Parse(call, &request, "put-block request")) return;
    Session& session = SessionOf(call);
    const BlockKey key = wire::FromWire(request.key(), session.ns);
    const size_t bytes = call.payload_bytes();
    if (bytes != store_->block_bytes() || request.length() != bytes) {
      call.ReplyError(
          InvalidArgumentError("block {} of {} bytes (payload {}); this node's block size is {}",
                               key.ToString(), request.length(), bytes, store_->block_bytes()));
      return;
    }
    wire::PutBlockReply reply;
    auto it = session.prepared.find(key);
    if (it == session.prepared.end() && request.prepare()) {
      store::StorePlan plan;
      const Status prepared = store_->PrepareStore(std::span(&key, 1), &plan);
      if (!prepared.ok()) {
        call.ReplyError(plan.quota_refused != 0
                            ? QuotaRefusal(call, session, plan.quota_refused, prepared)
                            : prepared);
        return;
      }
      for (const BlockKey& evicted : plan.evicted) {
        if (evicted.namespace_id == session.ns) wire::ToWire(evicted, reply.add_evicted());
      }
      if (plan.keys_to_store.empty()) {
        // Held or being stored already: the bytes are not taken, and the store counts as a use
        // of the block (as the connector's touch after a store, docs/semantics.md §7.6).
        store_->Touch(std::span(&key, 1));
        touched_keys_.fetch_add(1, std::memory_order_relaxed);
        reply.set_skipped(true);
        ReplyWith(call, reply);
        return;
      }
      it = session.prepared.emplace(key, Prepared{plan.slots[0]}).first;
    }
    if (it == session.prepared.end()) {
      call.ReplyError(FailedPreconditionError(
          "block {} was not prepared for storing by this client (PrepareStore first)",
          key.ToString()));
      return;
    }
    Prepared& slot = it->second;
    if (slot.written || slot.writing) {
      call.ReplyError(AlreadyExistsError("block {} was already sent", key.ToString()));
      return;
    }
    slot.writing = true;
    ++session.writes_in_flight;
    const std::span<std::byte> dest = store_->CpuSlot(slot.slot).first(bytes);
    const uint64_t connection = call.connection_id();
    const uint64_t checksum = request.checksum();
    const bool commit = request.commit();
    auto shared = std::make_shared<TimedCall>(std::move(call));
    shared->ReceivePayload(dest, region(),
                           [this, shared, connection, key, dest, checksum, commit,
                            reply = std::move(reply)](Status status) {
                             if (status.ok() && checksum != 0 && Xxh3Hash64(dest) != checksum) {
                               checksum_failures_.fetch_add(1, std::memory_order_relaxed);
                               status =
                                   DataLossError("block {}: checksum mismatch", key.ToString());
                             }
                             if (status.ok()) {
                               bytes_in_.fetch_add(dest.size(), std::memory_order_relaxed);
                             }
                             FinishWrite(connection, key, status.ok(), commit);
                             if (status.ok()) {
                               ReplyWith(*shared, reply);
                             } else {
                               shared->ReplyError(status);
                             }
                           });
  }

  // A PutBlock's bytes are in (ok) or failed. With `commit`, the block is committed (or
  // aborted) at once, as a Commit of it would.
  void FinishWrite(uint64_t connection, const BlockKey& key, bool ok, bool commit) {
    auto s = sessions_.find(connection);
    if (s == sessions_.end()) return;
    Session& session = s->second;
    --session.writes_in_flight;
    auto it = session.prepared.find(key);
    if (it != session.prepared.end()) {
      it->second.writing = false;
      it->second.written = ok;
      if (commit) {
        session.prepared.erase(it);
        store_->CompleteStore(std::span(&key, 1), ok);
        (ok ? blocks_stored_ : blocks_aborted_).fetch_add(1, std::memory_order_relaxed);
      }
    }
    if (session.closed && session.writes_in_flight == 0) EndSession(connection);
  }

  void OnCommit(TimedCall call) {
    wire::CommitRequest request;
    if (!Parse(call, &request, "commit request")) return;
    Session& session = SessionOf(call);
    std::vector<BlockKey> keys;
    if (!Keys(call, session, request.keys(), &keys)) return;
    std::vector<BlockKey> commit, abort;
    wire::CommitReply reply;
    auto fail = [&](const BlockKey& key, const Status& why) {
      wire::Error* error = reply.add_failed();
      error->set_code(static_cast<wire::Code>(why.code()));
      error->set_message(std::string(why.message()));
    };
    for (const BlockKey& key : keys) {
      auto it = session.prepared.find(key);
      if (it == session.prepared.end()) {
        fail(key, NotFoundError("block {} is not being stored by this client", key.ToString()));
        continue;
      }
      if (it->second.writing) {
        fail(key, FailedPreconditionError("block {} is still arriving; commit after its PutBlock "
                                          "completes",
                                          key.ToString()));
        continue;
      }
      if (request.success() && it->second.written) {
        commit.push_back(key);
      } else {
        if (request.success()) {
          fail(key, FailedPreconditionError("block {} was never sent; aborted", key.ToString()));
        }
        abort.push_back(key);
      }
      session.prepared.erase(it);
    }
    if (!commit.empty()) store_->CompleteStore(commit, true);
    if (!abort.empty()) store_->CompleteStore(abort, false);
    blocks_stored_.fetch_add(commit.size(), std::memory_order_relaxed);
    blocks_aborted_.fetch_add(abort.size(), std::memory_order_relaxed);
    ReplyWith(call, reply);
  }

  void OnLoad(TimedCall call) {
    wire::LoadRequest request;
    if (!Parse(call, &request, "load request")) return;
    Session& session = SessionOf(call);
    std::vector<BlockKey> keys;
    if (!Keys(call, session, request.keys(), &keys)) return;
    wire::LoadReply reply;
    std::vector<std::span<const std::byte>> blocks;
    for (const BlockKey& key : keys) {
      const Status pinned = store_->PrepareLoad(std::span(&key, 1), &blocks);
      reply.add_pinned(pinned.ok());
      reply.add_length(pinned.ok() ? blocks[0].size() : 0);
      if (pinned.ok()) {
        Pin& pin = session.pins[key];
        ++pin.count;
        pin.block = blocks[0];
      }
    }
    ReplyWith(call, reply);
  }

  void OnGetBlock(TimedCall call) {
    wire::GetBlockRequest request;
    if (!Parse(call, &request, "get-block request")) return;
    Session& session = SessionOf(call);
    const BlockKey key = wire::FromWire(request.key(), session.ns);
    std::span<const std::byte> block;
    bool pinned_here = false;  // pinned for this transfer only (request.pin)
    if (auto it = session.pins.find(key); it != session.pins.end()) {
      block = it->second.block;
    } else if (request.pin()) {
      std::vector<std::span<const std::byte>> blocks;
      if (!store_->PrepareLoad(std::span(&key, 1), &blocks).ok()) {
        LookupResult found = LookupResult::kMiss;
        store_->Lookup(std::span(&key, 1), std::span(&found, 1));  // starts a promotion
        // A hit here means a promotion landed between the two calls: ask again too.
        call.ReplyError(
            found == LookupResult::kMiss
                ? NotFoundError("block {} is not on this node", key.ToString())
                : AbortedError("block {} is on SSD and being promoted; ask again", key.ToString()));
        return;
      }
      block = blocks[0];
      pinned_here = true;
    } else {
      call.ReplyError(FailedPreconditionError("block {} is not pinned by this client (Load first)",
                                              key.ToString()));
      return;
    }
    wire::GetBlockReply reply;
    reply.set_length(block.size());
    // Timed until the block has left (or, over shared memory, the client copied it).
    ReplyWith(call, reply, block, region(),
              [this, size = block.size(), key, pinned_here,
               stopwatch = call.TakeStopwatch()](Status status) {
                stopwatch.Stop();
                if (pinned_here) (void)store_->CompleteLoad(std::span(&key, 1));
                if (!status.ok()) return;
                blocks_loaded_.fetch_add(1, std::memory_order_relaxed);
                bytes_out_.fetch_add(size, std::memory_order_relaxed);
              });
  }

  void OnRelease(TimedCall call) {
    wire::ReleaseRequest request;
    if (!Parse(call, &request, "release request")) return;
    Session& session = SessionOf(call);
    std::vector<BlockKey> keys;
    if (!Keys(call, session, request.keys(), &keys)) return;
    for (const BlockKey& key : keys) {
      auto it = session.pins.find(key);
      if (it == session.pins.end()) continue;  // not pinned here: nothing to undo
      (void)store_->CompleteLoad(std::span(&key, 1));
      if (--it->second.count == 0) session.pins.erase(it);
    }
    ReplyWith(call, wire::ReleaseReply());
  }

  void OnTouch(TimedCall call) {
    wire::TouchRequest request;
    if (!Parse(call, &request, "touch request")) return;
    Session& session = SessionOf(call);
    std::vector<BlockKey> keys;
    if (!Keys(call, session, request.keys(), &keys)) return;
    store_->Touch(keys);
    touched_keys_.fetch_add(keys.size(), std::memory_order_relaxed);
    ReplyWith(call, wire::TouchReply());
  }

  void OnStats(TimedCall call) {
    wire::StatsReply reply;
    for (const auto& [name, value] : Counters()) (*reply.mutable_counters())[name] = value;
    ReplyWith(call, reply);
  }

  void OnEcho(TimedCall call) {
    auto request = std::make_shared<wire::EchoRequest>();
    if (!Parse(call, request.get(), "echo request")) return;
    if (request->payload_bytes() > options_.server.transport.max_payload_bytes) {
      call.ReplyError(InvalidArgumentError("echo of {} payload bytes; the limit is {}",
                                           request->payload_bytes(),
                                           options_.server.transport.max_payload_bytes));
      return;
    }
    // A request payload is received (and dropped); payload_bytes come back as the reply's.
    auto scratch = std::make_shared<std::vector<std::byte>>(
        std::max<size_t>(call.payload_bytes(), request->payload_bytes()));
    auto shared = std::make_shared<TimedCall>(std::move(call));
    auto reply = [shared, request, scratch] {
      wire::EchoReply echo;
      echo.set_body(request->body());
      // Timed until the reply and its payload have left, as GetBlock.
      ReplyWith(*shared, echo, std::span<const std::byte>(*scratch).first(request->payload_bytes()),
                nullptr,
                [scratch, stopwatch = shared->TakeStopwatch()](Status) { stopwatch.Stop(); });
    };
    if (shared->payload_bytes() == 0) {
      reply();
      return;
    }
    shared->ReceivePayload(*scratch, nullptr, [shared, reply](Status status) {
      if (!status.ok()) {
        shared->ReplyError(status);
        return;
      }
      reply();
    });
  }

  // The connection ended: its pins are released and its unfinished stores aborted (once no
  // payload is still arriving into their slots).
  void EndSession(uint64_t connection) {
    auto it = sessions_.find(connection);
    if (it == sessions_.end()) return;
    Session& session = it->second;
    if (session.writes_in_flight != 0) {
      session.closed = true;
      return;
    }
    const auto [aborted, pins] = Undo(session);
    if (aborted != 0 || pins != 0) {
      KVSTASH_LOG_INFO("connection {} ended: aborted {} unfinished store(s), released {} pin(s)",
                       connection, aborted, pins);
    }
    stores_aborted_on_close_.fetch_add(aborted, std::memory_order_relaxed);
    pins_released_on_close_.fetch_add(pins, std::memory_order_relaxed);
    sessions_closed_.fetch_add(1, std::memory_order_relaxed);
    sessions_.erase(it);
  }

  // Aborts the session's unfinished stores and releases its pins: {stores, pins}.
  std::pair<size_t, uint64_t> Undo(Session& session) {
    std::vector<BlockKey> abort;
    for (const auto& [key, prepared] : session.prepared) abort.push_back(key);
    if (!abort.empty()) store_->CompleteStore(abort, false);
    uint64_t pins = 0;
    for (const auto& [key, pin] : session.pins) {
      for (uint32_t i = 0; i < pin.count; ++i) (void)store_->CompleteLoad(std::span(&key, 1));
      pins += pin.count;
    }
    session.prepared.clear();
    session.pins.clear();
    blocks_aborted_.fetch_add(abort.size(), std::memory_order_relaxed);
    return {abort.size(), pins};
  }

  // Sessions silent for longer than the lease lose their pins and unfinished stores (the
  // connection stays; its next request starts a new lease). On the progress thread.
  void ExpireLeases() {
    const auto now = Clock::now();
    for (auto& [connection, session] : sessions_) {
      if (session.writes_in_flight != 0 || now - session.last_seen < options_.lease_timeout ||
          (session.pins.empty() && session.prepared.empty())) {
        continue;
      }
      const auto [aborted, pins] = Undo(session);
      KVSTASH_LOG_WARN(
          "connection {}: lease expired after {} ms of silence: aborted {} unfinished store(s), "
          "released {} pin(s)",
          connection, options_.lease_timeout.count(), aborted, pins);
      leases_expired_.fetch_add(1, std::memory_order_relaxed);
      pins_released_on_expiry_.fetch_add(pins, std::memory_order_relaxed);
    }
  }

  // Expires leases a few times per lease, on the progress thread (a transport timer).
  void StartLeaseSweeper() {
    const auto period = std::max(options_.lease_timeout / 4, std::chrono::milliseconds(10));
    server_->RunEvery(period, [this] { ExpireLeases(); });
  }

  NodeOptions options_;
  std::unique_ptr<transport::Listener> server_;
  transport::MemoryRegion cpu_region_;
  std::unique_ptr<store::TieredStore> store_;
  std::unordered_map<uint64_t, Session> sessions_;       // progress thread only
  std::array<Timed, wire::Method_ARRAYSIZE> latencies_;  // by method
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
  uint64_t quota_refused_calls_ = 0;  // progress thread only
  std::array<std::array<std::atomic<uint64_t>, kLookupCounts>, kLookupKinds> lookup_counts_{};
  std::atomic<uint64_t> lookups_{0}, blocks_stored_{0}, blocks_aborted_{0}, blocks_loaded_{0},
      bytes_in_{0}, bytes_out_{0}, checksum_failures_{0}, sessions_closed_{0},
      pins_released_on_close_{0}, stores_aborted_on_close_{0}, leases_expired_{0},
      pins_released_on_expiry_{0}, touched_keys_{0};
};

Result<std::unique_ptr<NodeServer>> NodeServer::Start(NodeOptions options) {
  auto impl = std::make_unique<Impl>(std::move(options));
  KVSTASH_RETURN_IF_ERROR(impl->Start());
  return std::unique_ptr<NodeServer>(new NodeServer(std::move(impl)));
}

NodeServer::NodeServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
NodeServer::~NodeServer() = default;

Status NodeServer::Shutdown() { return impl_->Shutdown(); }
uint16_t NodeServer::port() const { return impl_->port(); }
NodeStats NodeServer::stats() const { return impl_->stats(); }
std::map<std::string, uint64_t> NodeServer::Counters() const { return impl_->Counters(); }
std::vector<MethodLatency> NodeServer::Latencies() const { return impl_->Latencies(); }
std::vector<NamespaceStats> NodeServer::Namespaces() const { return impl_->Namespaces(); }
store::TieredStore& NodeServer::store() { return impl_->store(); }
bool NodeServer::shares_cpu_memory() const { return impl_->shares_cpu_memory(); }

}  // namespace kvstash::node
