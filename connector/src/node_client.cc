#include "kvstash/connector/node_client.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <future>
#include <set>
#include <thread>

#include "kvstash/common/logging.h"
#include "kvstash/common/mutex.h"
#include "kvstash/proto/convert.h"
#include "kvstash/transport/call_group.h"

namespace kvstash::connector {
namespace {

using transport::Bytes;
using transport::CallOptions;
using transport::RpcClient;
using transport::ServerLimits;

// A call's outcome, copied out of the callback.
struct Outcome {
  Status status;
  std::vector<std::byte> reply;
  size_t payload_bytes = 0;
};

template <typename Reply>
Status ParseReply(const Outcome& outcome, Reply* reply) {
  if (!outcome.status.ok()) return outcome.status;
  if (reply != nullptr &&
      !reply->ParseFromArray(outcome.reply.data(), static_cast<int>(outcome.reply.size()))) {
    return InternalError("unparseable reply of {} bytes", outcome.reply.size());
  }
  return Status::OK();
}

// Down, slow past the deadline, or cut off while the call was out: the node did not answer.
bool Unreachable(const Status& status) {
  return status.code() == StatusCode::kUnavailable ||
         status.code() == StatusCode::kDeadlineExceeded || status.code() == StatusCode::kCancelled;
}

// A status naming the node it came from.
Status AtNode(const std::string& node, const Status& status) {
  return Status(status.code(), fmt::format("node {}: {}", node, status.message()));
}

// Indices of a node's keys in one call: [begin, end) of its list.
struct Chunk {
  size_t node = 0;
  size_t begin = 0, end = 0;
};

// Splits each node's key list into calls of at most `per_call[n]` keys. The chunks of a node
// come last chunk first, so that a node that applies them in arrival order (touches) applies
// the first keys last.
std::vector<Chunk> SplitLastFirst(const std::vector<std::vector<size_t>>& by_node,
                                  const std::vector<size_t>& per_call) {
  std::vector<Chunk> chunks;
  for (size_t n = 0; n < by_node.size(); ++n) {
    const size_t count = by_node[n].size();
    if (count == 0 || per_call[n] == 0) continue;
    const size_t calls = (count + per_call[n] - 1) / per_call[n];
    for (size_t c = calls; c-- > 0;) {
      chunks.push_back({n, c * per_call[n], std::min(count, (c + 1) * per_call[n])});
    }
  }
  return chunks;
}

}  // namespace

size_t KeysPerCall(const ServerLimits& limits) {
  // A node that states no key limit gets the daemon's default.
  size_t keys = limits.max_keys_per_request == 0 ? 4096 : limits.max_keys_per_request;
  if (limits.max_message_bytes != 0) {
    constexpr size_t kRequestOverhead = 64;  // the request's and the Lookup's own fields
    const size_t room = limits.max_message_bytes > kRequestOverhead
                            ? static_cast<size_t>(limits.max_message_bytes) - kRequestOverhead
                            : 0;
    keys = std::min(keys, room / kKeyWireBytes);
  }
  return std::max<size_t>(keys, 1);
}

Result<NodeAddress> ParseNodeAddress(std::string_view text) {
  const size_t colon = text.rfind(':');
  if (colon == std::string_view::npos || colon == 0) {
    return InvalidArgumentError("node '{}' is not HOST:PORT", text);
  }
  NodeAddress address;
  address.host = std::string(text.substr(0, colon));
  const std::string_view port = text.substr(colon + 1);
  unsigned value = 0;
  auto [end, ec] = std::from_chars(port.data(), port.data() + port.size(), value);
  if (port.empty() || ec != std::errc() || end != port.data() + port.size() || value == 0 ||
      value > 65535) {
    return InvalidArgumentError("node '{}' has no valid port (1..65535)", text);
  }
  address.port = static_cast<uint16_t>(value);
  return address;
}

Result<std::vector<NodeAddress>> ParseNodeAddresses(const std::vector<std::string>& texts) {
  std::vector<NodeAddress> out;
  out.reserve(texts.size());
  for (const std::string& text : texts) {
    KVSTASH_ASSIGN_OR_RETURN(NodeAddress address, ParseNodeAddress(text));
    out.push_back(std::move(address));
  }
  return out;
}

// Every call's outcome goes through Record: counters, and the logs that say when a node went
// down, came back, or refused something. Shared with the callbacks of asynchronous calls.
// Thread-safe.
class Accounting {
 public:
  explicit Accounting(std::vector<std::string> names)
      : names_(std::move(names)), nodes_(std::make_unique<Node[]>(names_.size())) {}

  void CallStarted() { calls_.fetch_add(1, std::memory_order_relaxed); }
  void Touched(size_t keys) { touched_keys_.fetch_add(keys, std::memory_order_relaxed); }
  void Pinned(size_t keys) { pinned_keys_.fetch_add(keys, std::memory_order_relaxed); }

  // Records the outcome of a call to `node`: OK, or an answer (NotFound, Aborted) that is not
  // an error, marks the node up; Unavailable, DeadlineExceeded or Cancelled count it
  // unreachable; anything else is a refusal.
  void Record(size_t node, const Status& status) {
    const StatusCode code = status.code();
    Node& n = nodes_[node];
    if (Unreachable(status)) {
      unreachable_.fetch_add(1, std::memory_order_relaxed);
      if (n.state.exchange(kDown) != kDown) {
        KVSTASH_LOG_WARN(
            "offload node {} is unreachable ({}); its keys read as misses until it "
            "answers",
            names_[node], status.ToString());
      }
      return;
    }
    if (n.state.exchange(kUp) == kDown) {
      KVSTASH_LOG_INFO("offload node {} answers again", names_[node]);
    }
    if (status.ok() || code == StatusCode::kNotFound || code == StatusCode::kAborted) return;
    refused_.fetch_add(1, std::memory_order_relaxed);
    bool first = false;
    {
      MutexLock lock(&n.mu);
      first = n.logged_codes.insert(static_cast<int>(code)).second;
    }
    if (first) {
      KVSTASH_LOG_ERROR(
          "offload node {} refused a call: {} (logged once per node and code; "
          "every refusal is counted)",
          names_[node], status.ToString());
    }
  }

  BlockStoreCounters counters() const {
    BlockStoreCounters c;
    c.calls = calls_.load(std::memory_order_relaxed);
    c.unreachable = unreachable_.load(std::memory_order_relaxed);
    c.refused = refused_.load(std::memory_order_relaxed);
    c.touched_keys = touched_keys_.load(std::memory_order_relaxed);
    c.pinned_keys = pinned_keys_.load(std::memory_order_relaxed);
    return c;
  }

 private:
  enum : int { kUnknown = 0, kUp = 1, kDown = 2 };
  struct Node {
    std::atomic<int> state{kUnknown};
    Mutex mu;
    std::set<int> logged_codes GUARDED_BY(mu);
  };
  const std::vector<std::string> names_;
  std::unique_ptr<Node[]> nodes_;
  std::atomic<uint64_t> calls_{0}, unreachable_{0}, refused_{0}, touched_keys_{0}, pinned_keys_{0};
};

class NodeClient::Impl {
 public:
  static constexpr std::chrono::microseconds kMaxPause{10000};

  explicit Impl(NodeClientOptions options) : options_(std::move(options)) {}

  // Asynchronous calls in flight end by their deadline; their callbacks use this object.
  ~Impl() { WaitForTouches(); }

  void WaitForTouches() {
    MutexLock lock(&async_mu_);
    while (async_in_flight_ != 0) async_cv_.Wait(&async_mu_);
  }

  Status Init() {
    if (options_.nodes.empty()) return InvalidArgumentError("no nodes given");
    if (!options_.worker && !options_.connect) {
      KVSTASH_ASSIGN_OR_RETURN(options_.worker,
                               transport::ClientWorker::Create(options_.transport));
    }
    std::vector<std::string> names;
    for (const NodeAddress& node : options_.nodes) {
      transport::ClientOptions client;
      client.host = node.host;
      client.port = node.port;
      client.key_namespace = options_.key_namespace;
      client.auth_token = options_.auth_token;
      client.transport = options_.transport;
      client.connect_timeout = options_.connect_timeout;
      client.worker = options_.worker;
      if (options_.connect) {
        KVSTASH_ASSIGN_OR_RETURN(std::unique_ptr<transport::Channel> channel,
                                 options_.connect(client));
        clients_.push_back(std::move(channel));
      } else {
        KVSTASH_ASSIGN_OR_RETURN(std::unique_ptr<RpcClient> rpc, RpcClient::Create(client));
        clients_.push_back(std::move(rpc));
      }
      names.push_back(node.ToString());
      node_hashes_.push_back(Xxh3Hash64(std::as_bytes(std::span(names.back()))));
    }
    accounting_ = std::make_shared<Accounting>(std::move(names));
    return Status::OK();
  }

  size_t node_count() const { return clients_.size(); }
  const NodeAddress& node(size_t i) const { return options_.nodes.at(i); }
  BlockStoreCounters counters() const { return accounting_->counters(); }

  size_t NodeOf(const BlockKey& key) const {
    size_t best = 0;
    uint64_t best_score = 0;
    for (size_t i = 0; i < node_hashes_.size(); ++i) {
      const uint64_t score =
          Mix64(key.hash.lo ^ Mix64(key.hash.hi ^ Mix64(key.group ^ node_hashes_[i])));
      if (i == 0 || score > best_score) {
        best = i;
        best_score = score;
      }
    }
    return best;
  }

  std::string node_name(size_t node) const { return options_.nodes[node].ToString(); }

  // The limits of each node in `wanted` (by node index), connecting to those not yet connected,
  // all at once. A node that cannot be connected gets its error (recorded here).
  std::vector<Result<ServerLimits>> LimitsOf(const std::vector<bool>& wanted) {
    std::vector<Result<ServerLimits>> limits(clients_.size(), Result<ServerLimits>(ServerLimits{}));
    std::vector<std::pair<size_t, std::future<Status>>> connecting;
    for (size_t n = 0; n < clients_.size(); ++n) {
      if (!wanted[n]) continue;
      if (auto known = clients_[n]->server_limits()) {
        limits[n] = *known;
        continue;
      }
      auto promise = std::make_shared<std::promise<Status>>();
      connecting.emplace_back(n, promise->get_future());
      clients_[n]->ConnectAsync([promise](const Status& s) { promise->set_value(s); });
    }
    for (auto& [n, future] : connecting) {
      const Status connected = future.get();
      std::optional<ServerLimits> known = clients_[n]->server_limits();
      if (connected.ok() && known) {
        limits[n] = *known;
      } else {
        const Status error =
            connected.ok() ? InternalError("connected without a hello") : connected;
        accounting_->Record(n, error);
        limits[n] = AtNode(node_name(n), error);
      }
    }
    return limits;
  }

  Result<ServerLimits> Limits(size_t node) {
    if (node >= clients_.size()) return OutOfRangeError("no node {}", node);
    std::vector<bool> wanted(clients_.size(), false);
    wanted[node] = true;
    return std::move(LimitsOf(wanted)[node]);
  }

  // Starts a call; `done` runs once on the progress thread with its outcome.
  // With `group`, the call is counted in it (CallGroup::Track).
  template <typename Request>
  void StartWith(size_t node, wire::Method method, const Request& request, CallOptions options,
                 std::function<void(Outcome)> done, transport::CallGroup* group = nullptr) {
    options.deadline = transport::Clock::now() + options_.timeout;
    const std::string bytes = request.SerializeAsString();
    accounting_->CallStarted();
    transport::ResponseCallback callback =
        [done = std::move(done)](const transport::Response& response) {
          done(Outcome{response.status,
                       std::vector<std::byte>(response.message.begin(), response.message.end()),
                       response.payload_bytes});
        };
    clients_[node]->Call(static_cast<uint16_t>(method), std::as_bytes(std::span(bytes)), options,
                         group != nullptr ? group->Track(std::move(callback)) : callback);
  }

  // Starts a call; the future holds its outcome.
  template <typename Request>
  std::future<Outcome> Start(size_t node, wire::Method method, const Request& request,
                             CallOptions options = {}) {
    auto promise = std::make_shared<std::promise<Outcome>>();
    std::future<Outcome> future = promise->get_future();
    StartWith(node, method, request, options,
              [promise](Outcome outcome) { promise->set_value(std::move(outcome)); });
    return future;
  }

  // Starts a call of `group`, whose Wait makes its same-host copies on the waiting thread (so
  // that every thread of the engine copies its own blocks); the future holds its outcome, ready
  // once the group's Wait returns.
  template <typename Request>
  std::future<Outcome> Start(transport::CallGroup& group, size_t node, wire::Method method,
                             const Request& request, CallOptions options) {
    auto promise = std::make_shared<std::promise<Outcome>>();
    std::future<Outcome> future = promise->get_future();
    options.copier = &group;
    StartWith(
        node, method, request, options,
        [promise](Outcome outcome) { promise->set_value(std::move(outcome)); }, &group);
    return future;
  }

  // The keys of `keys` by node, in key order within each node; which nodes have any.
  void ByNode(std::span<const BlockKey> keys, std::vector<std::vector<size_t>>* by_node,
              std::vector<bool>* wanted) const {
    by_node->assign(clients_.size(), {});
    wanted->assign(clients_.size(), false);
    for (size_t i = 0; i < keys.size(); ++i) {
      const size_t n = NodeOf(keys[i]);
      (*by_node)[n].push_back(i);
      (*wanted)[n] = true;
    }
  }

  // Per-key lookups; *refusal gets the first error that is not an unreachable node.
  std::vector<LookupResult> Lookup(std::span<const BlockKey> keys, Status* refusal) {
    std::vector<LookupResult> states(keys.size(), LookupResult::kMiss);
    std::vector<std::vector<size_t>> by_node;
    std::vector<bool> wanted;
    ByNode(keys, &by_node, &wanted);
    const std::vector<Result<ServerLimits>> limits = LimitsOf(wanted);
    std::vector<size_t> per_call(clients_.size(), 0);
    for (size_t n = 0; n < clients_.size(); ++n) {
      if (!wanted[n]) continue;
      if (limits[n].ok()) {
        per_call[n] = KeysPerCall(*limits[n]);
      } else if (!Unreachable(limits[n].status()) && refusal->ok()) {
        *refusal = limits[n].status();
      }
    }
    const std::vector<Chunk> chunks = SplitLastFirst(by_node, per_call);
    std::vector<std::future<Outcome>> calls;
    calls.reserve(chunks.size());
    for (const Chunk& c : chunks) {
      wire::LookupRequest request;
      for (size_t j = c.begin; j < c.end; ++j) {
        wire::ToWire(keys[by_node[c.node][j]], request.add_keys());
      }
      calls.push_back(Start(c.node, wire::METHOD_LOOKUP, request));
    }
    for (size_t k = 0; k < chunks.size(); ++k) {
      const Chunk& c = chunks[k];
      const size_t count = c.end - c.begin;
      wire::LookupReply reply;
      Status status = ParseReply(calls[k].get(), &reply);
      if (status.ok() && reply.results_size() != static_cast<int>(count)) {
        status = InternalError("{} result(s) to a lookup of {} keys", reply.results_size(), count);
      }
      accounting_->Record(c.node, status);
      if (!status.ok()) {
        if (!Unreachable(status) && refusal->ok()) *refusal = AtNode(node_name(c.node), status);
        continue;  // misses, counted and logged
      }
      for (size_t j = 0; j < count; ++j) {
        states[by_node[c.node][c.begin + j]] = wire::FromWire(reply.results(static_cast<int>(j)));
      }
    }
    return states;
  }

  // One PutBlock call per block (the whole store), all in flight at once across
  // the nodes, last key first; the caller waits for the last.
  Status Put(std::span<const BlockKey> keys, std::span<const Bytes> blocks) {
    if (keys.size() != blocks.size()) {
      return InvalidArgumentError("{} keys for {} blocks", keys.size(), blocks.size());
    }
    std::vector<std::vector<size_t>> by_node;
    std::vector<bool> wanted;
    ByNode(keys, &by_node, &wanted);
    const std::vector<Result<ServerLimits>> limits = LimitsOf(wanted);
    Status first;
    auto fail = [&](size_t n, size_t i, const Status& status) {
      if (first.ok()) {
        first = Status(status.code(), fmt::format("node {}: block {}: {}", node_name(n),
                                                  keys[i].ToString(), status.message()));
      }
    };
    transport::CallGroup group;
    std::vector<std::tuple<size_t, size_t, std::future<Outcome>>> puts;  // node, key, call
    puts.reserve(keys.size());
    for (size_t i = keys.size(); i-- > 0;) {
      const size_t n = NodeOf(keys[i]);
      if (!limits[n].ok()) {
        fail(n, i, limits[n].status());
        continue;
      }
      // What the node would refuse is refused here, without moving the bytes.
      Status refused;
      if (limits[n]->block_bytes != 0 && blocks[i].size() != limits[n]->block_bytes) {
        refused = InvalidArgumentError("a block of {} bytes; the node's block size is {}",
                                       blocks[i].size(), limits[n]->block_bytes);
      } else if (limits[n]->max_payload_bytes != 0 &&
                 blocks[i].size() > limits[n]->max_payload_bytes) {
        refused = InvalidArgumentError("a block of {} bytes; the largest payload is {}",
                                       blocks[i].size(), limits[n]->max_payload_bytes);
      }
      if (!refused.ok()) {
        accounting_->Record(n, refused);
        fail(n, i, refused);
        continue;
      }
      wire::PutBlockRequest put;
      *put.mutable_key() = wire::ToWire(keys[i]);
      put.set_length(blocks[i].size());
      // Over a network the node checks the bytes against this; a client on the node's host
      // copies them into the node's memory itself, where a checksum would guard nothing and
      // cost a hash of every block on both sides.
      if (!clients_[n]->payloads_mapped()) put.set_checksum(Xxh3Hash64(blocks[i]));
      CallOptions options;
      options.send_payload = blocks[i];
      puts.emplace_back(n, i, Start(group, n, wire::METHOD_PUT_BLOCK, put, options));
    }
    group.Wait();
    for (auto& [n, i, future] : puts) {
      const Status status = ParseReply(future.get(), (wire::PutBlockReply*)nullptr);
      accounting_->Record(n, status);
      if (!status.ok()) fail(n, i, status);
    }
    return first;
  }

  // One GetBlock per key (read from this client's pin, or pinned for the transfer by the node),
  // all in flight at once. Blocks
  // a node is promoting from SSD are asked for again until the timeout.
  std::vector<Result<size_t>> Get(std::span<const BlockKey> keys,
                                  std::span<const transport::MutableBytes> outs) {
    std::vector<Result<size_t>> results(keys.size(), Result<size_t>(size_t{0}));
    if (keys.size() != outs.size()) {
      for (auto& r : results) {
        r = InvalidArgumentError("{} keys for {} buffers", keys.size(), outs.size());
      }
      return results;
    }
    std::vector<std::vector<size_t>> by_node;
    std::vector<bool> wanted;
    ByNode(keys, &by_node, &wanted);
    const std::vector<Result<ServerLimits>> limits = LimitsOf(wanted);
    std::vector<size_t> pending;
    for (size_t i = 0; i < keys.size(); ++i) {
      const size_t n = NodeOf(keys[i]);
      if (limits[n].ok()) {
        pending.push_back(i);
      } else {
        results[i] =
            Status(limits[n].status().code(),
                   fmt::format("{}: block {}", limits[n].status().message(), keys[i].ToString()));
      }
    }
    const auto give_up = transport::Clock::now() + options_.timeout;
    for (auto pause = std::chrono::microseconds(100);; pause = std::min(pause * 2, kMaxPause)) {
      transport::CallGroup group;
      std::vector<std::future<Outcome>> calls;
      calls.reserve(pending.size());
      for (size_t i : pending) {
        wire::GetBlockRequest get;
        *get.mutable_key() = wire::ToWire(keys[i]);
        CallOptions options;
        options.recv_payload = outs[i];
        calls.push_back(Start(group, NodeOf(keys[i]), wire::METHOD_GET_BLOCK, get, options));
      }
      group.Wait();
      std::vector<size_t> again;
      for (size_t j = 0; j < pending.size(); ++j) {
        const size_t i = pending[j];
        const size_t n = NodeOf(keys[i]);
        const Outcome outcome = calls[j].get();
        const Status& got = outcome.status;
        accounting_->Record(n, got);
        if (got.ok()) {
          results[i] = outcome.payload_bytes;
        } else if (got.code() == StatusCode::kNotFound) {
          results[i] =
              NotFoundError("node {} does not hold block {}", node_name(n), keys[i].ToString());
        } else if (got.code() == StatusCode::kAborted &&
                   transport::Clock::now() + pause <= give_up) {
          again.push_back(i);
        } else {
          results[i] = Status(got.code(), fmt::format("node {}: block {}: {}", node_name(n),
                                                      keys[i].ToString(), got.message()));
        }
      }
      if (again.empty()) return results;
      pending = std::move(again);
      std::this_thread::sleep_for(pause);
    }
  }

  // The calls of a Request of `keys` (TouchRequest, LoadRequest, ReleaseRequest): per node,
  // split to its limits, each node's chunks last first (a node applies them in arrival order,
  // so a touch's first keys end most recent). `start` starts each call; nodes that cannot be
  // reached are skipped (recorded by LimitsOf).
  template <typename Request, typename StartFn>
  Status StartKeyCalls(std::span<const BlockKey> keys, StartFn start) {
    std::vector<std::vector<size_t>> by_node;
    std::vector<bool> wanted;
    ByNode(keys, &by_node, &wanted);
    const std::vector<Result<ServerLimits>> limits = LimitsOf(wanted);
    Status first;
    std::vector<size_t> per_call(clients_.size(), 0);
    for (size_t n = 0; n < clients_.size(); ++n) {
      if (!wanted[n]) continue;
      if (limits[n].ok()) {
        per_call[n] = KeysPerCall(*limits[n]);
      } else if (first.ok()) {
        first = limits[n].status();
      }
    }
    for (const Chunk& c : SplitLastFirst(by_node, per_call)) {
      Request request;
      for (size_t j = c.begin; j < c.end; ++j) {
        wire::ToWire(keys[by_node[c.node][j]], request.add_keys());
      }
      start(c.node, request);
    }
    return first;
  }

  // Starts `method` with `request` on `node` without waiting: `done` gets the outcome, and the
  // destructor (WaitForTouches) waits for it.
  template <typename Request>
  void StartAsync(size_t node, wire::Method method, const Request& request,
                  std::function<void(const Outcome&)> done) {
    {
      MutexLock lock(&async_mu_);
      ++async_in_flight_;
    }
    StartWith(node, method, request, {}, [this, done = std::move(done)](Outcome outcome) {
      done(outcome);
      // Under the lock: the destructor cannot go on until this callback is done with *this.
      MutexLock lock(&async_mu_);
      --async_in_flight_;
      async_cv_.SignalAll();
    });
  }

  void Pin(std::span<const BlockKey> keys) {
    if (keys.empty()) return;
    (void)StartKeyCalls<wire::LoadRequest>(
        keys, [this](size_t node, const wire::LoadRequest& request) {
          StartAsync(node, wire::METHOD_LOAD, request, [this, node](const Outcome& outcome) {
            wire::LoadReply reply;
            const Status status = ParseReply(outcome, &reply);
            accounting_->Record(node, status);
            if (status.ok()) {
              accounting_->Pinned(static_cast<size_t>(
                  std::count(reply.pinned().begin(), reply.pinned().end(), true)));
            }
          });
        });
  }

  void Unpin(std::span<const BlockKey> keys) {
    if (keys.empty()) return;
    (void)StartKeyCalls<wire::ReleaseRequest>(
        keys, [this](size_t node, const wire::ReleaseRequest& request) {
          StartAsync(node, wire::METHOD_RELEASE, request, [this, node](const Outcome& outcome) {
            accounting_->Record(node, ParseReply(outcome, (wire::ReleaseReply*)nullptr));
          });
        });
  }

  void Touch(std::span<const BlockKey> keys) {
    if (keys.empty()) return;
    (void)StartKeyCalls<wire::TouchRequest>(
        keys, [this](size_t node, const wire::TouchRequest& request) {
          accounting_->Touched(static_cast<size_t>(request.keys_size()));
          StartAsync(node, wire::METHOD_TOUCH, request, [this, node](const Outcome& outcome) {
            accounting_->Record(node, ParseReply(outcome, (wire::TouchReply*)nullptr));
          });
        });
  }

  Status TouchSync(std::span<const BlockKey> keys) {
    std::vector<std::pair<size_t, std::future<Outcome>>> calls;
    Status first = StartKeyCalls<wire::TouchRequest>(
        keys, [&](size_t node, const wire::TouchRequest& request) {
          accounting_->Touched(static_cast<size_t>(request.keys_size()));
          calls.emplace_back(node, Start(node, wire::METHOD_TOUCH, request));
        });
    for (auto& [n, future] : calls) {
      const Status status = ParseReply(future.get(), (wire::TouchReply*)nullptr);
      accounting_->Record(n, status);
      if (!status.ok() && first.ok()) first = AtNode(node_name(n), status);
    }
    return first;
  }

  Result<std::map<std::string, uint64_t>> Stats(size_t node) {
    if (node >= clients_.size()) return OutOfRangeError("no node {}", node);
    wire::StatsReply reply;
    const Status status =
        ParseReply(Start(node, wire::METHOD_STATS, wire::StatsRequest()).get(), &reply);
    accounting_->Record(node, status);
    if (!status.ok()) return AtNode(node_name(node), status);
    return std::map<std::string, uint64_t>(reply.counters().begin(), reply.counters().end());
  }

 private:
  NodeClientOptions options_;
  std::vector<std::unique_ptr<transport::Channel>> clients_;
  std::vector<uint64_t> node_hashes_;
  std::shared_ptr<Accounting> accounting_;
  // Asynchronous calls (touches, pins, releases) still out.
  Mutex async_mu_;
  CondVar async_cv_;
  size_t async_in_flight_ GUARDED_BY(async_mu_) = 0;
};

Result<std::unique_ptr<NodeClient>> NodeClient::Create(NodeClientOptions options) {
  auto impl = std::make_unique<Impl>(std::move(options));
  KVSTASH_RETURN_IF_ERROR(impl->Init());
  return std::unique_ptr<NodeClient>(new NodeClient(std::move(impl)));
}

NodeClient::NodeClient(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
NodeClient::~NodeClient() = default;

size_t NodeClient::node_count() const { return impl_->node_count(); }
const NodeAddress& NodeClient::node(size_t i) const { return impl_->node(i); }
size_t NodeClient::NodeOf(const BlockKey& key) const { return impl_->NodeOf(key); }
Result<transport::ServerLimits> NodeClient::Limits(size_t node) { return impl_->Limits(node); }

std::vector<LookupResult> NodeClient::Lookup(std::span<const BlockKey> keys) {
  Status refusal;
  return impl_->Lookup(keys, &refusal);  // counted and logged by the client
}

Result<std::vector<LookupResult>> NodeClient::LookupStrict(std::span<const BlockKey> keys) {
  Status refusal;
  std::vector<LookupResult> states = impl_->Lookup(keys, &refusal);
  if (!refusal.ok()) return refusal;
  return states;
}

std::optional<size_t> NodeClient::LookupPrefix(std::span<const BlockKey> keys) {
  const std::vector<LookupResult> states = Lookup(keys);
  return MaximalPrefix(states.size(), [&](size_t i) { return states[i]; });
}

Status NodeClient::Put(std::span<const BlockKey> keys, std::span<const transport::Bytes> blocks) {
  return impl_->Put(keys, blocks);
}
Result<size_t> NodeClient::Get(const BlockKey& key, transport::MutableBytes out) {
  return std::move(impl_->Get(std::span(&key, 1), std::span(&out, 1))[0]);
}
std::vector<Result<size_t>> NodeClient::Get(std::span<const BlockKey> keys,
                                            std::span<const transport::MutableBytes> outs) {
  return impl_->Get(keys, outs);
}
void NodeClient::Touch(std::span<const BlockKey> keys) { impl_->Touch(keys); }
void NodeClient::Pin(std::span<const BlockKey> keys) { impl_->Pin(keys); }
void NodeClient::Unpin(std::span<const BlockKey> keys) { impl_->Unpin(keys); }
Status NodeClient::TouchSync(std::span<const BlockKey> keys) { return impl_->TouchSync(keys); }
void NodeClient::WaitForTouches() { impl_->WaitForTouches(); }
Result<std::map<std::string, uint64_t>> NodeClient::Stats(size_t node) {
  return impl_->Stats(node);
}
Result<uint64_t> NodeClient::BlockBytes(size_t node) {
  KVSTASH_ASSIGN_OR_RETURN(const transport::ServerLimits limits, impl_->Limits(node));
  if (limits.block_bytes == 0) {
    return FailedPreconditionError("node {} stores no blocks (a bare transport)",
                                   impl_->node_name(node));
  }
  return limits.block_bytes;
}
BlockStoreCounters NodeClient::counters() const { return impl_->counters(); }
uint64_t NodeClient::unreachable() const { return impl_->counters().unreachable; }

}  // namespace kvstash::connector
