// NodeServer: the wire methods over the node service. Handlers run on the transport's progress
// thread, the one thread that calls the service (payload completions run there too).

#include "kvstash/node/node_server.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstring>
#include <mutex>
#include <optional>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include "counters.h"
#include "kv_event_pump.h"
#include "kvstash/common/hash.h"
#include "kvstash/common/logging.h"
#include "kvstash/common/memory_warmer.h"
#include "kvstash/common/mutex.h"
#include "kvstash/proto/convert.h"

namespace kvstash::node {
namespace {
using Clock = std::chrono::steady_clock;
using transport::Bytes;
using transport::ServerCall;

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
  const std::string& key_namespace() const { return call_.tenant(); }
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

// The free chunks of the memory that batched calls' payloads use (NodeServer::Impl's
// batch_region_): shared by the buffers that hold one, so a buffer released after the node
// stopped only puts its index back.
class BatchChunks {
 public:
  explicit BatchChunks(size_t count) {
    for (size_t i = count; i-- > 0;) free_.push_back(i);
  }
  std::optional<size_t> Take() {
    MutexLock lock(&mu_);
    if (free_.empty()) return std::nullopt;
    const size_t chunk = free_.back();
    free_.pop_back();
    return chunk;
  }
  void Give(size_t chunk) {
    MutexLock lock(&mu_);
    free_.push_back(chunk);
  }

 private:
  Mutex mu_;
  std::vector<size_t> free_ GUARDED_BY(mu_);
};

// A batched call's payload: a chunk of the batch memory when one is free (a client on the
// node's host copies into and out of it itself, so the batch moves in one round trip), else
// the heap (UCX moves it). The chunk goes back when the last holder lets go.
class BatchBuffer {
 public:
  BatchBuffer(std::shared_ptr<BatchChunks> chunks, const transport::MemoryRegion* region,
              size_t chunk_bytes, size_t bytes)
      : chunks_(std::move(chunks)) {
    std::optional<size_t> chunk;
    if (chunks_ && bytes <= chunk_bytes) chunk = chunks_->Take();
    if (chunk) {
      chunk_ = *chunk;
      region_ = region;
      bytes_ = region->bytes().subspan(*chunk * chunk_bytes, bytes);
    } else {
      heap_.resize(bytes);
      bytes_ = heap_;
    }
  }
  ~BatchBuffer() {
    if (chunk_) chunks_->Give(*chunk_);
  }
  BatchBuffer(const BatchBuffer&) = delete;
  BatchBuffer& operator=(const BatchBuffer&) = delete;

  transport::MutableBytes bytes() const { return bytes_; }
  // The region the bytes lie in (null: the heap).
  const transport::MemoryRegion* region() const { return region_; }

 private:
  std::shared_ptr<BatchChunks> chunks_;
  std::optional<size_t> chunk_;
  const transport::MemoryRegion* region_ = nullptr;
  std::vector<std::byte> heap_;
  transport::MutableBytes bytes_;
};

// What a put said of `key`'s block (wire.BlockMeta), checked: it comes from the network, and
// the node publishes it. InvalidArgument naming the block for tokens outside
// 1..kMaxBlockMetaTokens, or a parent of another group (vLLM's parent_block_hash is a block of
// the event's own group: a parent of another would chain blocks that no request chains).
Result<BlockMeta> CheckedMeta(const BlockKey& key, const wire::BlockMeta& meta) {
  if (meta.tokens() == 0 || meta.tokens() > kMaxBlockMetaTokens) {
    return InvalidArgumentError("block {}: metadata of {} tokens; a block holds 1..{}",
                                key.ToString(), meta.tokens(), kMaxBlockMetaTokens);
  }
  BlockMeta out;
  out.tokens = meta.tokens();
  if (!wire::BlockMeta::Kind_IsValid(meta.kind())) {
    return InvalidArgumentError("block {}: metadata of unknown group kind {}", key.ToString(),
                                static_cast<int>(meta.kind()));
  }
  out.kind = static_cast<BlockMeta::Kind>(meta.kind());
  if (meta.window_blocks() > kMaxBlockMetaTokens) {
    return InvalidArgumentError("block {}: metadata of a window of {} blocks; at most {}",
                                key.ToString(), meta.window_blocks(), kMaxBlockMetaTokens);
  }
  out.window_blocks = meta.window_blocks();
  out.at_hit_end = meta.at_hit_end();
  if (meta.has_parent()) {
    const BlockKey parent = wire::FromWire(meta.parent(), key.namespace_id);
    if (parent.group != key.group) {
      return InvalidArgumentError("block {}: its parent {} is in group {}, not the block's {}",
                                  key.ToString(), parent.ToString(), parent.group, key.group);
    }
    out.parent = parent.hash;
  }
  return out;
}

// How the node stores a block its put described (docs/semantics.md §4b).
store::StoreHint Hint(const std::optional<BlockMeta>& meta) {
  return meta && meta->spare() ? store::StoreHint::kSpare : store::StoreHint::kNormal;
}

}  // namespace

class NodeServer::Impl {
 public:
  explicit Impl(NodeOptions options) : options_(std::move(options)) {}

  ~Impl() {
    // Handlers use the service and the CPU memory: stop serving first (sessions end there),
    // then close the service and its store, then give the memory back while the transport
    // still exists. The warmer stops first (within one chunk), at any moment of its work.
    warmer_.reset();
    if (server_) server_->Stop();
    kv_events_.reset();  // drains the store's last events first
    service_.reset();
    cpu_region_ = transport::MemoryRegion();
    batch_region_ = transport::MemoryRegion();
    server_.reset();
  }

  Status Start() {
    // What the node states at hello, the transport carrying the bytes as they are.
    wire::NodeLimits limits;
    limits.set_block_bytes(options_.store.block_bytes);
    limits.set_max_keys_per_request(options_.max_keys_per_request);
    max_batch_bytes_ =
        std::min<uint64_t>(options_.max_batch_bytes, options_.server.transport.max_payload_bytes);
    limits.set_max_batch_bytes(max_batch_bytes_);
    options_.server.service_limits = limits.SerializeAsString();
    // A hello's tenant is this node's namespace: it gets its id (or its refusal) at once. Called
    // on the progress thread, which starts after the service exists.
    options_.server.admit_tenant = [this](std::string_view name) {
      MutexLock lock(&service_mu_);
      return service_->AdmitNamespace(name);
    };
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
      // The page size of the tier is the node's to choose, not the allocator's (UCX backs
      // memory for TCP alone with huge pages): set before any page is faulted in.
      AdviseHugePages(cpu_region_.bytes(), options_.store.huge_pages);
    } else if (!region.ok() && region.status().code() == StatusCode::kUnimplemented) {
      // A transport that shares no memory (the stream transport, the loopback): every payload
      // is copied through it anyway.
      KVSTASH_LOG_INFO("the transport shares no memory: the store maps its own CPU tier");
    } else {
      KVSTASH_LOG_WARN(
          "cannot allocate the CPU tier's {} bytes through the transport ({}); the store maps "
          "its own and block payloads go by UCX rendezvous",
          cpu_bytes, region.ok() ? "unaligned" : region.status().ToString());
    }
    if (max_batch_bytes_ != 0 && cpu_region_.size() != 0) {
      // Batched payloads in memory a client on the host copies into and out of itself (its pages
      // faulted in by their first batches). Without it they go by UCX.
      Result<transport::MemoryRegion> batch =
          server_->AllocateMemory(kBatchChunks * max_batch_bytes_);
      if (batch.ok()) {
        batch_region_ = std::move(*batch);
        AdviseHugePages(batch_region_.bytes(), options_.store.huge_pages);  // as the tier's
        batch_chunks_ = std::make_shared<BatchChunks>(kBatchChunks);
      }
    }
    // Memory shared through the transport is faulted in after the node listens, on threads
    // of its own (common/include/kvstash/common/memory_warmer.h), instead of page by page before: a
    // node of any size serves at once.
    const bool warm_later = options_.store.prefault && cpu_region_.size() != 0;
    if (warm_later) options_.store.prefault = false;
    const bool events = !options_.kv_events.publisher.endpoint.empty();
    if (events) options_.store.enable_events = true;
    KVSTASH_ASSIGN_OR_RETURN(service_,
                             NodeService::Create(static_cast<NodeServiceOptions&>(options_)));
    if (events) {
      // NodeService::NamespaceName may be called on any thread.
      KvEventPump::NameOf name_of = [this](NamespaceId ns) NO_THREAD_SAFETY_ANALYSIS {
        return service_->NamespaceName(ns);
      };
      metas_ = std::make_unique<BlockMetaTable>(options_.kv_events.max_block_metas);
      KVSTASH_ASSIGN_OR_RETURN(
          kv_events_,
          KvEventPump::Create(options_.kv_events, &service().store(), name_of, metas_.get()));
    }
    Register();
    server_->OnDisconnect([this](uint64_t connection) {
      MutexLock lock(&service_mu_);
      service_->EndSession(connection);
    });
    KVSTASH_RETURN_IF_ERROR(server_->Start());
    // Leases expire a few times per lease, on the progress thread.
    const auto period = std::max(options_.lease_timeout / 4, std::chrono::milliseconds(10));
    server_->RunEvery(period, [this] {
      MutexLock lock(&service_mu_);
      service_->ExpireLeases();
    });
    if (warm_later) {
      const size_t threads = std::clamp<size_t>(std::thread::hardware_concurrency() / 2, 1, 8);
      warmer_ = std::make_unique<MemoryWarmer>(cpu_region_.bytes().first(cpu_bytes), threads);
    }
    memory_bytes_ = cpu_bytes;
    memory_prefaulted_ = !warm_later && options_.store.prefault;
    return Status::OK();
  }

  Status Shutdown() {
    server_->Stop();
    MutexLock lock(&service_mu_);
    return service_->Flush();
  }

  uint16_t port() const { return server_->port(); }
  // For tests and the daemon, which call what NodeService lets any thread call (Counters,
  // Namespaces) or drive it while nothing serves.
  NodeService& service() NO_THREAD_SAFETY_ANALYSIS { return *service_; }
  const events::EventPublisher* kv_events() const {
    return kv_events_ ? &kv_events_->publisher() : nullptr;
  }
  bool shares_cpu_memory() const { return cpu_region_.size() != 0; }
  double memory_faulted_share() const {
    if (memory_bytes_ == 0) return 1;
    if (!warmer_) return memory_prefaulted_ ? 1 : 0;
    return static_cast<double>(warmer_->faulted_bytes()) / static_cast<double>(memory_bytes_);
  }

  std::map<std::string, uint64_t> Counters() const {
    // NodeService::Counters may run on any thread at any time.
    std::map<std::string, uint64_t> counters = [this]() NO_THREAD_SAFETY_ANALYSIS {
      return service_->Counters();
    }();
    CounterSnapshot snapshot;
    snapshot.transport = CounterSnapshot::Transport{server_->stats(), server_->connection_count()};
    snapshot.memory =
        CounterSnapshot::Memory{memory_bytes_, warmer_ ? warmer_->faulted_bytes()
                                                       : (memory_prefaulted_ ? memory_bytes_ : 0)};
    if (kv_events_) {
      const KvEventPumpStats e = kv_events_->stats();
      snapshot.events = CounterSnapshot::Events{
          e.publisher.batches_sent,   e.publisher.batches_dropped, e.publisher.batches_replayed,
          e.publisher.replays_served, e.publisher.replays_refused, e.rounds_lost,
          e.block_metas_dropped};
    }
    counters.merge(ReadCounters(snapshot));
    return counters;
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
  // A wire method's name in metrics and its latencies; set by Register, before serving.
  struct Timed {
    const char* name = nullptr;
    LatencyHistogram histogram;
  };

  // Chunks of max_batch_bytes_ in batch_region_.
  static constexpr size_t kBatchChunks = 16;

  std::shared_ptr<BatchBuffer> NewBatchBuffer(size_t bytes) {
    return std::make_shared<BatchBuffer>(batch_chunks_, &batch_region_, max_batch_bytes_, bytes);
  }

  const transport::MemoryRegion* region() const {
    return cpu_region_.size() != 0 ? &cpu_region_ : nullptr;
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

  // Parses the request and begins it with the service: the namespace of its keys, or nullopt
  // once answered with an error (InvalidArgument, or the namespace's).
  template <typename Message>
  std::optional<NamespaceId> Begin(TimedCall& call, Message* message, std::string_view what) {
    if (!Parse(call, message, what)) return std::nullopt;
    Result<NamespaceId> ns = [&] {
      MutexLock lock(&service_mu_);
      return service_->BeginRequest(call.connection_id(), call.key_namespace());
    }();
    if (!ns.ok()) {
      call.ReplyError(ns.status());
      return std::nullopt;
    }
    return *ns;
  }

  // The keys of a request in namespace `ns`, or an InvalidArgument answer.
  bool Keys(TimedCall& call, NamespaceId ns,
            const google::protobuf::RepeatedPtrField<wire::Key>& keys,
            std::vector<BlockKey>* out) const {
    if (static_cast<size_t>(keys.size()) > options_.max_keys_per_request) {
      call.ReplyError(InvalidArgumentError("{} keys in one request; the limit is {}", keys.size(),
                                           options_.max_keys_per_request));
      return false;
    }
    out->clear();
    out->reserve(keys.size());
    for (const wire::Key& key : keys) out->push_back(wire::FromWire(key, ns));
    return true;
  }

  // Records what a put said of `key`'s block for the KV events (KvEventPump::metas): true when
  // recorded, false when the node publishes no events (nothing to say it in).
  bool NoteMeta(const BlockKey& key, const BlockMeta& meta) {
    if (!metas_) return false;
    metas_->Record(key, meta);
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
    handle(wire::METHOD_PUT_BLOCK, "put_block", &Impl::OnPutBlock);
    handle(wire::METHOD_LOAD, "load", &Impl::OnLoad);
    handle(wire::METHOD_GET_BLOCK, "get_block", &Impl::OnGetBlock);
    handle(wire::METHOD_RELEASE, "release", &Impl::OnRelease);
    handle(wire::METHOD_TOUCH, "touch", &Impl::OnTouch);
    handle(wire::METHOD_STATS, "stats", &Impl::OnStats);
    handle(wire::METHOD_ECHO, "echo", &Impl::OnEcho);
    if (max_batch_bytes_ != 0) {
      handle(wire::METHOD_GET_BLOCKS, "get_blocks", &Impl::OnGetBlocks);
      handle(wire::METHOD_PUT_BLOCKS, "put_blocks", &Impl::OnPutBlocks);
    }
  }

  void OnLookup(TimedCall call) {
    wire::LookupRequest request;
    const std::optional<NamespaceId> ns = Begin(call, &request, "lookup request");
    std::vector<BlockKey> keys;
    if (!ns || !Keys(call, *ns, request.keys(), &keys)) return;
    wire::LookupReply reply;
    std::vector<LookupResult> results;
    {
      MutexLock lock(&service_mu_);
      results = service_->Lookup(keys);
    }
    for (LookupResult r : results) reply.add_results(wire::ToWire(r));
    ReplyWith(call, reply);
  }

  void OnPutBlock(TimedCall call) {
    wire::PutBlockRequest request;
    const std::optional<NamespaceId> ns = Begin(call, &request, "put-block request");
    if (!ns) return;
    const BlockKey key = wire::FromWire(request.key(), *ns);
    const size_t bytes = call.payload_bytes();
    if (request.length() != bytes) {
      call.ReplyError(InvalidArgumentError("block {}: length {} but a payload of {} bytes",
                                           key.ToString(), request.length(), bytes));
      return;
    }
    std::optional<BlockMeta> meta;
    if (request.has_meta()) {
      Result<BlockMeta> checked = CheckedMeta(key, request.meta());
      if (!checked.ok()) {
        call.ReplyError(checked.status());
        return;
      }
      meta = *checked;
    }
    Result<NodeService::PutSlot> put = [&] {
      MutexLock lock(&service_mu_);
      return service_->BeginPut(call.connection_id(), key, bytes, Hint(meta));
    }();
    if (!put.ok()) {
      call.ReplyError(put.status());
      return;
    }
    wire::PutBlockReply reply;
    for (const BlockKey& evicted : put->evicted) wire::ToWire(evicted, reply.add_evicted());
    if (put->skipped) {
      reply.set_skipped(true);
      ReplyWith(call, reply);
      return;
    }
    const uint64_t connection = call.connection_id();
    const uint64_t checksum = request.checksum();
    // Before the store commits, so that the round that publishes the block finds it.
    const bool noted = meta.has_value() && NoteMeta(key, *meta);
    auto shared = std::make_shared<TimedCall>(std::move(call));
    auto receive = [this, shared, connection, key, checksum, noted, slot = put->slot,
                    reply = std::move(reply)]() mutable {
      shared->ReceivePayload(slot, region(),
                             [this, shared, connection, key, checksum, noted,
                              reply = std::move(reply)](Status received) {
                               const Status stored = [&] {
                                 MutexLock lock(&service_mu_);
                                 return service_->EndPut(connection, key, std::move(received),
                                                         checksum);
                               }();
                               if (noted && !stored.ok()) metas_->Erase(key);
                               if (stored.ok()) {
                                 ReplyWith(*shared, reply);
                               } else {
                                 shared->ReplyError(stored);
                               }
                             });
    };
    if (put->gate) {
      // The slot's old block is still being written to SSD (write-back, staging all busy): the
      // bytes are taken once it is, from the I/O thread that opens the gate (ReceivePayload
      // hands itself to the progress thread), so this thread goes on serving meanwhile.
      put->gate->WhenOpen(std::move(receive));
    } else {
      receive();
    }
  }

  void OnLoad(TimedCall call) {
    wire::LoadRequest request;
    const std::optional<NamespaceId> ns = Begin(call, &request, "load request");
    std::vector<BlockKey> keys;
    if (!ns || !Keys(call, *ns, request.keys(), &keys)) return;
    wire::LoadReply reply;
    std::vector<std::optional<size_t>> lengths;
    {
      MutexLock lock(&service_mu_);
      lengths = service_->Load(call.connection_id(), keys);
    }
    for (const std::optional<size_t>& length : lengths) {
      reply.add_pinned(length.has_value());
      reply.add_length(length.value_or(0));
    }
    ReplyWith(call, reply);
  }

  void OnGetBlock(TimedCall call) {
    wire::GetBlockRequest request;
    const std::optional<NamespaceId> ns = Begin(call, &request, "get-block request");
    if (!ns) return;
    const BlockKey key = wire::FromWire(request.key(), *ns);
    Result<NodeService::Read> read = [&] {
      MutexLock lock(&service_mu_);
      return service_->BeginGet(call.connection_id(), key);
    }();
    if (!read.ok()) {
      call.ReplyError(read.status());
      return;
    }
    wire::GetBlockReply reply;
    reply.set_length(read->block.size());
    // Timed until the block has left (or, over shared memory, the client copied it).
    ReplyWith(call, reply, read->block, region(),
              [this, key, read = *read, stopwatch = call.TakeStopwatch()](Status sent) {
                stopwatch.Stop();
                MutexLock lock(&service_mu_);
                service_->EndGet(key, read, sent);
              });
  }

  // GetBlock of each key, the blocks read copied back to back into the reply's payload under
  // the lock (their pins last only the copy), the reply timed until its payload has left.
  void OnGetBlocks(TimedCall call) {
    wire::GetBlocksRequest request;
    const std::optional<NamespaceId> ns = Begin(call, &request, "get-blocks request");
    std::vector<BlockKey> keys;
    if (!ns || !Keys(call, *ns, request.keys(), &keys)) return;
    auto buffer = NewBatchBuffer(
        std::min<uint64_t>(max_batch_bytes_, keys.size() * options_.store.block_bytes));
    const transport::MutableBytes room = buffer->bytes();
    size_t used = 0;
    wire::GetBlocksReply reply;
    size_t blocks = 0;
    {
      MutexLock lock(&service_mu_);
      for (const BlockKey& key : keys) {
        wire::BlockResult* result = reply.add_results();
        Result<NodeService::Read> read = service_->BeginGet(call.connection_id(), key);
        if (!read.ok()) {
          wire::ToWire(read.status(), result);
          continue;
        }
        const size_t length = read->block.size();
        if (length > room.size() - used) {
          wire::ToWire(OutOfRangeError("block {}: {} bytes of blocks read before it in this "
                                       "call; a call's blocks may add up to {} bytes",
                                       key.ToString(), used, room.size()),
                       result);
        } else {
          std::memcpy(room.data() + used, read->block.data(), length);
          used += length;
          result->set_length(length);
          ++blocks;
        }
        // Counted once the reply's payload has left (Loaded).
        service_->EndGet(key, *read, CancelledError("copied into a batch"));
      }
    }
    ReplyWith(call, reply, room.first(used), buffer->region(),
              [this, buffer, blocks, used, stopwatch = call.TakeStopwatch()](Status sent) {
                stopwatch.Stop();
                if (!sent.ok()) return;
                MutexLock lock(&service_mu_);
                service_->Loaded(blocks, used);
              });
  }

  // The whole payload first, checked against the request's checksum, then PutBlock of each
  // key in order (BeginPut, a copy into the slot, EndPut) under the lock; the reply once every
  // block is stored or refused.
  void OnPutBlocks(TimedCall call) {
    auto request = std::make_shared<wire::PutBlocksRequest>();
    const std::optional<NamespaceId> ns = Begin(call, request.get(), "put-blocks request");
    auto keys = std::make_shared<std::vector<BlockKey>>();
    if (!ns || !Keys(call, *ns, request->keys(), keys.get())) return;
    if (request->lengths_size() != request->keys_size()) {
      call.ReplyError(InvalidArgumentError("put-blocks request of {} keys with {} lengths",
                                           request->keys_size(), request->lengths_size()));
      return;
    }
    if (request->metas_size() != 0 && request->metas_size() != request->keys_size()) {
      call.ReplyError(InvalidArgumentError(
          "put-blocks request of {} keys with {} block metadata; send none or one per key",
          request->keys_size(), request->metas_size()));
      return;
    }
    auto metas = std::make_shared<std::vector<BlockMeta>>();
    metas->reserve(request->metas_size());
    for (int i = 0; i < request->metas_size(); ++i) {
      Result<BlockMeta> checked = CheckedMeta((*keys)[i], request->metas(i));
      if (!checked.ok()) {
        call.ReplyError(checked.status());
        return;
      }
      metas->push_back(*checked);
    }
    uint64_t total = 0;
    for (const uint64_t length : request->lengths()) {
      if (length > max_batch_bytes_ - total) {
        call.ReplyError(InvalidArgumentError(
            "put-blocks request of more than {} bytes of blocks; a call's blocks may add up to {}",
            total, max_batch_bytes_));
        return;
      }
      total += length;
    }
    if (total != call.payload_bytes()) {
      call.ReplyError(InvalidArgumentError(
          "put-blocks request: lengths add up to {} bytes but the payload has {}", total,
          call.payload_bytes()));
      return;
    }
    std::shared_ptr<BatchBuffer> payload = NewBatchBuffer(total);
    auto shared = std::make_shared<TimedCall>(std::move(call));
    auto store = [this, shared, request, keys, metas, payload](Status received) {
      if (!received.ok()) {
        shared->ReplyError(received);
        return;
      }
      if (request->checksum() != 0 && Xxh3Hash64(payload->bytes()) != request->checksum()) {
        {
          MutexLock lock(&service_mu_);
          service_->ChecksumFailed();
        }
        shared->ReplyError(DataLossError(
            "put-blocks request: checksum mismatch over its {} payload bytes; no block stored",
            payload->bytes().size()));
        return;
      }
      StoreBatch(shared, *request, *keys, *metas, payload);
    };
    if (total == 0) {
      store(Status::OK());
    } else {
      shared->ReceivePayload(payload->bytes(), payload->region(), std::move(store));
    }
  }

  // Stores a PutBlocks call's blocks, all in `payload`, in key order, each as PutBlock would
  // (with metas[i] when there are any); answers once the last is stored: at once, or when the
  // last slot that a write-back to SSD still reads opens (on the I/O thread that opens it).
  void StoreBatch(const std::shared_ptr<TimedCall>& call, const wire::PutBlocksRequest& request,
                  const std::vector<BlockKey>& keys, const std::vector<BlockMeta>& metas,
                  const std::shared_ptr<BatchBuffer>& payload) {
    struct Batch {
      Mutex mu;
      wire::PutBlocksReply reply GUARDED_BY(mu);
      size_t waiting GUARDED_BY(mu) = 0;  // blocks whose slot is not open yet
    };
    struct Gated {
      int index;
      BlockKey key;
      std::span<std::byte> slot;
      Bytes bytes;
      std::shared_ptr<store::SlotGate> gate;
      bool noted;  // its metadata recorded
    };
    auto batch = std::make_shared<Batch>();
    std::vector<Gated> gated;
    const uint64_t connection = call->connection_id();
    {
      MutexLock batch_lock(&batch->mu);
      bool session = true;
      {
        MutexLock lock(&service_mu_);
        session = service_->HasSession(connection);
        size_t offset = 0;
        for (size_t i = 0; session && i < keys.size(); ++i) {
          wire::BlockResult* result = batch->reply.add_results();
          const Bytes bytes = payload->bytes().subspan(offset, request.lengths(i));
          offset += bytes.size();
          Result<NodeService::PutSlot> put =
              service_->BeginPut(connection, keys[i], bytes.size(),
                                 metas.empty() ? store::StoreHint::kNormal : Hint(metas[i]));
          if (!put.ok()) {
            wire::ToWire(put.status(), result);
            continue;
          }
          for (const BlockKey& evicted : put->evicted) {
            wire::ToWire(evicted, batch->reply.add_evicted());
          }
          if (put->skipped) {
            result->set_skipped(true);
            continue;
          }
          // Before the store commits, as PutBlock's.
          const bool noted = !metas.empty() && NoteMeta(keys[i], metas[i]);
          if (put->gate) {
            gated.push_back({static_cast<int>(i), keys[i], put->slot, bytes, put->gate, noted});
            continue;
          }
          std::memcpy(put->slot.data(), bytes.data(), bytes.size());
          const Status stored = service_->EndPut(connection, keys[i], Status::OK(), 0);
          if (noted && !stored.ok()) metas_->Erase(keys[i]);
          wire::ToWire(stored, result);
        }
      }
      // Answered outside the service's lock.
      if (!session) {
        // The connection ended while the payload arrived: nobody to store for, or to answer.
        call->ReplyError(AbortedError("the connection ended before its blocks were stored"));
        return;
      }
      batch->waiting = gated.size();
      if (gated.empty()) {
        ReplyWith(*call, batch->reply);
        return;
      }
    }
    for (Gated& g : gated) {
      g.gate->WhenOpen([this, call, batch, payload, connection, g] {
        std::memcpy(g.slot.data(), g.bytes.data(), g.bytes.size());
        const Status stored = [&] {
          MutexLock lock(&service_mu_);
          return service_->EndPut(connection, g.key, Status::OK(), 0);
        }();
        if (g.noted && !stored.ok()) metas_->Erase(g.key);
        MutexLock lock(&batch->mu);
        wire::ToWire(stored, batch->reply.mutable_results(g.index));
        if (--batch->waiting == 0) ReplyWith(*call, batch->reply);
      });
    }
  }

  void OnRelease(TimedCall call) {
    wire::ReleaseRequest request;
    const std::optional<NamespaceId> ns = Begin(call, &request, "release request");
    std::vector<BlockKey> keys;
    if (!ns || !Keys(call, *ns, request.keys(), &keys)) return;
    {
      MutexLock lock(&service_mu_);
      service_->Release(call.connection_id(), keys);
    }
    ReplyWith(call, wire::ReleaseReply());
  }

  void OnTouch(TimedCall call) {
    wire::TouchRequest request;
    const std::optional<NamespaceId> ns = Begin(call, &request, "touch request");
    std::vector<BlockKey> keys;
    if (!ns || !Keys(call, *ns, request.keys(), &keys)) return;
    {
      MutexLock lock(&service_mu_);
      service_->Touch(keys,
                      request.refresh() ? store::TouchKind::kRefresh : store::TouchKind::kUse);
    }
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

  NodeOptions options_;
  std::unique_ptr<transport::Listener> server_;
  transport::MemoryRegion cpu_region_;
  // NodeService is thread-compatible and the transport serves connections on several threads
  // (one per group of connections): every request's service work holds this, briefly; the
  // payload transfers run outside it. Counters and Namespaces need no lock (the service's own).
  mutable Mutex service_mu_;
  std::unique_ptr<NodeService> service_ PT_GUARDED_BY(service_mu_);
  std::unique_ptr<MemoryWarmer> warmer_;  // faulting the CPU memory in; null when not
  // What puts said of their blocks, for the pump; null when it is off. It outlives the pump
  // and the service (not reset in ~Impl): a put whose slot opens while they go still erases.
  std::unique_ptr<BlockMetaTable> metas_;
  std::unique_ptr<KvEventPump> kv_events_;  // publishing the store's events; null when off
  uint64_t max_batch_bytes_ = 0;            // of GetBlocks and PutBlocks; 0: not served
  // Batched calls' payloads, kBatchChunks of max_batch_bytes_; none (null chunks) where the
  // transport shares no memory: they use the heap then.
  transport::MemoryRegion batch_region_;
  std::shared_ptr<BatchChunks> batch_chunks_;
  size_t memory_bytes_ = 0;                              // the CPU tier's memory
  bool memory_prefaulted_ = false;                       // faulted in by the store before serving
  std::array<Timed, wire::Method_ARRAYSIZE> latencies_;  // by method
};

Result<std::unique_ptr<NodeServer>> NodeServer::Create(NodeOptions options) {
  auto impl = std::make_unique<Impl>(std::move(options));
  KVSTASH_RETURN_IF_ERROR(impl->Start());
  return std::unique_ptr<NodeServer>(new NodeServer(std::move(impl)));
}

NodeServer::NodeServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
NodeServer::~NodeServer() = default;

Status NodeServer::Shutdown() { return impl_->Shutdown(); }
uint16_t NodeServer::port() const { return impl_->port(); }
std::map<std::string, uint64_t> NodeServer::Counters() const { return impl_->Counters(); }
std::vector<MethodLatency> NodeServer::Latencies() const { return impl_->Latencies(); }
double NodeServer::memory_faulted_share() const { return impl_->memory_faulted_share(); }
std::vector<NamespaceStats> NodeServer::Namespaces() const { return impl_->service().Namespaces(); }
store::TieredStore& NodeServer::store() { return impl_->service().store(); }
bool NodeServer::shares_cpu_memory() const { return impl_->shares_cpu_memory(); }
const events::EventPublisher* NodeServer::kv_events() const { return impl_->kv_events(); }

}  // namespace kvstash::node
