#include "kvstash/connector/node_client.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <future>
#include <thread>

#include "kvstash/proto/wire.pb.h"
#include "kvstash/store/lookup.h"

namespace kvstash::connector {
namespace {

using transport::Bytes;
using transport::CallOptions;
using transport::RpcClient;

wire::Key ToWire(const BlockKey& key) {
  wire::Key out;
  out.set_hash_lo(key.hash.lo);
  out.set_hash_hi(key.hash.hi);
  out.set_group(key.group);
  return out;
}

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
    return InternalError("unparseable reply from the node");
  }
  return Status::OK();
}

bool Unreachable(const Status& status) {
  return status.code() == StatusCode::kUnavailable ||
         status.code() == StatusCode::kDeadlineExceeded;
}

}  // namespace

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

class NodeClient::Impl {
 public:
  static constexpr std::chrono::microseconds kMaxPause{10000};

  explicit Impl(NodeClientOptions options) : options_(std::move(options)) {}

  Status Init() {
    if (options_.nodes.empty()) return InvalidArgumentError("no nodes given");
    if (!options_.worker) {
      KVSTASH_ASSIGN_OR_RETURN(options_.worker,
                               transport::ClientWorker::Create(options_.transport));
    }
    for (const NodeAddress& node : options_.nodes) {
      transport::ClientOptions client;
      client.host = node.host;
      client.port = node.port;
      client.key_namespace = options_.key_namespace;
      client.auth_token = options_.auth_token;
      client.transport = options_.transport;
      client.connect_timeout = options_.connect_timeout;
      client.worker = options_.worker;
      KVSTASH_ASSIGN_OR_RETURN(auto rpc, RpcClient::Create(client));
      clients_.push_back(std::move(rpc));
      const std::string name = node.ToString();
      node_hashes_.push_back(Xxh3Hash64(std::as_bytes(std::span(name))));
    }
    return Status::OK();
  }

  size_t node_count() const { return clients_.size(); }
  const NodeAddress& node(size_t i) const { return options_.nodes.at(i); }
  uint64_t unreachable() const { return unreachable_.load(); }

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

  // Starts a call; the future holds its outcome.
  template <typename Request>
  std::future<Outcome> Start(size_t node, wire::Method method, const Request& request,
                             CallOptions options = {}) {
    auto promise = std::make_shared<std::promise<Outcome>>();
    std::future<Outcome> future = promise->get_future();
    options.deadline = transport::Clock::now() + options_.timeout;
    const std::string bytes = request.SerializeAsString();
    clients_[node]->Call(
        static_cast<uint16_t>(method), std::as_bytes(std::span(bytes)), options,
        [promise](const transport::Response& response) {
          promise->set_value(
              Outcome{response.status,
                      std::vector<std::byte>(response.message.begin(), response.message.end()),
                      response.payload_bytes});
        });
    return future;
  }

  template <typename Request, typename Reply>
  Status CallSync(size_t node, wire::Method method, const Request& request, Reply* reply,
                  CallOptions options = {}, size_t* payload = nullptr) {
    Outcome outcome = Start(node, method, request, options).get();
    if (payload != nullptr) *payload = outcome.payload_bytes;
    Status status = ParseReply(outcome, reply);
    if (!status.ok()) {
      if (Unreachable(status)) unreachable_.fetch_add(1, std::memory_order_relaxed);
      return Status(status.code(), fmt::format("node {}: {}", node_name(node), status.message()));
    }
    return status;
  }

  std::string node_name(size_t node) const { return options_.nodes[node].ToString(); }

  std::vector<KeyState> Lookup(std::span<const BlockKey> keys) {
    std::vector<KeyState> states(keys.size(), KeyState::kMiss);
    std::vector<std::vector<size_t>> by_node(clients_.size());
    for (size_t i = 0; i < keys.size(); ++i) by_node[NodeOf(keys[i])].push_back(i);
    std::vector<std::pair<size_t, std::future<Outcome>>> calls;
    for (size_t n = 0; n < by_node.size(); ++n) {
      if (by_node[n].empty()) continue;
      wire::LookupRequest request;
      wire::Lookup* lookup = request.add_lookups();
      lookup->set_mode(wire::LOOKUP_MODE_PER_KEY);
      for (size_t i : by_node[n]) *lookup->add_keys() = ToWire(keys[i]);
      calls.emplace_back(n, Start(n, wire::METHOD_LOOKUP, request));
    }
    for (auto& [n, future] : calls) {
      wire::LookupReply reply;
      const Status status = ParseReply(future.get(), &reply);
      if (!status.ok() || reply.answers_size() != 1 ||
          reply.answers(0).results_size() != static_cast<int>(by_node[n].size())) {
        if (!status.ok() && Unreachable(status)) unreachable_.fetch_add(1);
        continue;  // misses
      }
      for (size_t j = 0; j < by_node[n].size(); ++j) {
        const int r = reply.answers(0).results(static_cast<int>(j));
        states[by_node[n][j]] = r == wire::LOOKUP_HIT     ? KeyState::kHit
                                : r == wire::LOOKUP_RETRY ? KeyState::kRetry
                                                          : KeyState::kMiss;
      }
    }
    return states;
  }

  // One PutBlock call per block (prepare and commit included), all in flight at once across
  // the nodes; the caller waits for the last.
  Status Put(std::span<const BlockKey> keys, std::span<const Bytes> blocks) {
    if (keys.size() != blocks.size()) {
      return InvalidArgumentError("{} keys for {} blocks", keys.size(), blocks.size());
    }
    std::vector<std::pair<size_t, std::future<Outcome>>> puts;
    puts.reserve(keys.size());
    for (size_t i = 0; i < keys.size(); ++i) {
      const size_t n = NodeOf(keys[i]);
      wire::PutBlockRequest put;
      *put.mutable_key() = ToWire(keys[i]);
      put.set_length(blocks[i].size());
      put.set_checksum(Xxh3Hash64(blocks[i]));
      put.set_prepare(true);
      put.set_commit(true);
      CallOptions options;
      options.send_payload = blocks[i];
      puts.emplace_back(n, Start(n, wire::METHOD_PUT_BLOCK, put, options));
    }
    Status first;
    for (size_t i = 0; i < puts.size(); ++i) {
      auto& [n, future] = puts[i];
      const Status status = ParseReply(future.get(), (wire::PutBlockReply*)nullptr);
      if (status.ok()) continue;
      if (Unreachable(status)) unreachable_.fetch_add(1, std::memory_order_relaxed);
      if (first.ok()) {
        first = Status(status.code(), fmt::format("node {}: block {}: {}", node_name(n),
                                                  keys[i].ToString(), status.message()));
      }
    }
    return first;
  }

  // One GetBlock per key that pins the block for its transfer, all in flight at once. Blocks
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
    std::vector<size_t> pending(keys.size());
    for (size_t i = 0; i < keys.size(); ++i) pending[i] = i;
    const auto give_up = transport::Clock::now() + options_.timeout;
    for (auto pause = std::chrono::microseconds(100);; pause = std::min(pause * 2, kMaxPause)) {
      std::vector<std::future<Outcome>> calls;
      calls.reserve(pending.size());
      for (size_t i : pending) {
        wire::GetBlockRequest get;
        *get.mutable_key() = ToWire(keys[i]);
        get.set_pin(true);
        CallOptions options;
        options.recv_payload = outs[i];
        calls.push_back(Start(NodeOf(keys[i]), wire::METHOD_GET_BLOCK, get, options));
      }
      std::vector<size_t> again;
      for (size_t j = 0; j < pending.size(); ++j) {
        const size_t i = pending[j];
        const size_t n = NodeOf(keys[i]);
        const Outcome outcome = calls[j].get();
        const Status& got = outcome.status;
        if (got.ok()) {
          results[i] = outcome.payload_bytes;
        } else if (got.code() == StatusCode::kNotFound) {
          results[i] =
              NotFoundError("node {} does not hold block {}", node_name(n), keys[i].ToString());
        } else if (got.code() == StatusCode::kAborted &&
                   transport::Clock::now() + pause <= give_up) {
          again.push_back(i);
        } else {
          if (Unreachable(got)) unreachable_.fetch_add(1, std::memory_order_relaxed);
          results[i] = Status(got.code(), fmt::format("node {}: block {}: {}", node_name(n),
                                                      keys[i].ToString(), got.message()));
        }
      }
      if (again.empty()) return results;
      pending = std::move(again);
      std::this_thread::sleep_for(pause);
    }
  }

  Result<std::map<std::string, uint64_t>> Stats(size_t node) {
    if (node >= clients_.size()) return OutOfRangeError("no node {}", node);
    wire::StatsReply reply;
    KVSTASH_RETURN_IF_ERROR(CallSync(node, wire::METHOD_STATS, wire::StatsRequest(), &reply));
    return std::map<std::string, uint64_t>(reply.counters().begin(), reply.counters().end());
  }

 private:
  NodeClientOptions options_;
  std::vector<std::unique_ptr<RpcClient>> clients_;
  std::vector<uint64_t> node_hashes_;
  std::atomic<uint64_t> unreachable_{0};
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
std::vector<KeyState> NodeClient::Lookup(std::span<const BlockKey> keys) {
  return impl_->Lookup(keys);
}

std::optional<size_t> NodeClient::LookupPrefix(std::span<const BlockKey> keys) {
  const std::vector<KeyState> states = impl_->Lookup(keys);
  return store::MaximalPrefix(states.size(), [&](size_t i) {
    switch (states[i]) {
      case KeyState::kHit:
        return store::LookupResult::kHit;
      case KeyState::kRetry:
        return store::LookupResult::kRetry;
      case KeyState::kMiss:
        break;
    }
    return store::LookupResult::kMiss;
  });
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
Result<std::map<std::string, uint64_t>> NodeClient::Stats(size_t node) {
  return impl_->Stats(node);
}
Result<uint64_t> NodeClient::BlockBytes(size_t node) {
  KVSTASH_ASSIGN_OR_RETURN(auto counters, impl_->Stats(node));
  auto it = counters.find("cpu.block_bytes");
  if (it == counters.end()) return InternalError("node {} reports no block size", node);
  return it->second;
}
uint64_t NodeClient::unreachable() const { return impl_->unreachable(); }

}  // namespace kvstash::connector
