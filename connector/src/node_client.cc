#include "kvstash/connector/node_client.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>

#include "cluster/client.h"
#include "kvstash/membership/membership.h"
#include "kvstash/proto/wire.pb.h"

namespace kvstash::connector {
Result<NodeLimits> NodeLimitsFrom(const transport::ServerLimits& stated) {
  wire::NodeLimits node;
  if (!node.ParseFromString(stated.service_limits)) {
    return InvalidArgumentError("the limits stated at hello do not parse ({} bytes)",
                                stated.service_limits.size());
  }
  NodeLimits limits;
  limits.block_bytes = node.block_bytes();
  limits.max_keys_per_request = node.max_keys_per_request();
  limits.max_message_bytes = stated.max_message_bytes;
  limits.max_payload_bytes = stated.max_payload_bytes;
  limits.max_batch_bytes = node.max_batch_bytes();
  return limits;
}

size_t KeysPerCall(const NodeLimits& limits) {
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

size_t BlocksPerBatch(const NodeLimits& limits) {
  if (limits.block_bytes == 0 || limits.block_bytes > kBatchedBlockBytes ||
      limits.max_batch_bytes < limits.block_bytes) {
    return 0;
  }
  uint64_t bytes = limits.max_batch_bytes;
  if (limits.max_payload_bytes != 0) bytes = std::min(bytes, limits.max_payload_bytes);
  return std::max<size_t>(
      1, std::min<size_t>(KeysPerCall(limits), static_cast<size_t>(bytes / limits.block_bytes)));
}

size_t BlocksPerPutBatch(const NodeLimits& limits) {
  const size_t blocks = BlocksPerBatch(limits);
  if (blocks == 0) return 0;
  return std::min(blocks, kPutBlocksMessageBytes / kPutBlockWireBytes);
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

Status ApplyNodeSource(const NodeSource& source, NodeClientOptions* options) {
  const bool listed = !source.nodes.empty();
  if (listed && !source.etcd.empty()) {
    return InvalidArgumentError("give either --node(s) or --etcd with --cluster, not both");
  }
  if (source.etcd.empty() && !source.cluster.empty()) {
    return InvalidArgumentError("--cluster needs --etcd URL");
  }
  if (!listed && source.etcd.empty()) {
    return InvalidArgumentError(
        "no offload nodes: give --node(s) HOST:PORT, or --etcd URL with --cluster NAME");
  }
  if (!source.etcd.empty() && source.cluster.empty()) {
    return InvalidArgumentError("--etcd needs --cluster NAME (the nodes' kvstashd --cluster)");
  }
  if (source.replicas == 0 || source.replicas > kMaxReplicas) {
    return InvalidArgumentError("--replicas: {} is not within 1..{}", source.replicas,
                                kMaxReplicas);
  }
  options->nodes.clear();
  for (const std::string& item : source.nodes) {
    for (size_t begin = 0; begin <= item.size();) {
      const size_t comma = std::min(item.find(',', begin), item.size());
      KVSTASH_ASSIGN_OR_RETURN(
          NodeAddress node, ParseNodeAddress(std::string_view(item).substr(begin, comma - begin)));
      options->nodes.push_back(std::move(node));
      begin = comma + 1;
    }
  }
  if (!source.etcd.empty()) {
    if (auto endpoints = membership::ParseEtcdEndpoints(source.etcd); !endpoints.ok()) {
      return InvalidArgumentError("--etcd: {}", endpoints.status().message());
    }
    if (Status valid = membership::ValidateClusterName(source.cluster); !valid.ok()) {
      return InvalidArgumentError("--cluster: {}", valid.message());
    }
  }
  options->etcd = source.etcd;
  options->cluster = source.cluster;
  options->replicas = source.replicas;
  return Status::OK();
}

Result<std::unique_ptr<NodeClient>> NodeClient::Create(NodeClientOptions options) {
  auto impl = std::make_unique<Impl>(std::move(options));
  KVSTASH_RETURN_IF_ERROR(impl->Init());
  return std::unique_ptr<NodeClient>(new NodeClient(std::move(impl)));
}

NodeClient::NodeClient(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
NodeClient::~NodeClient() = default;

std::vector<NodeAddress> NodeClient::nodes() const { return impl_->nodes(); }
size_t NodeClient::replicas() const { return impl_->replicas(); }
std::vector<NodeAddress> NodeClient::PlacesOf(const BlockKey& key) const {
  return impl_->PlacesOf(key);
}

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
  return impl_->Put(keys, blocks, {});
}
Status NodeClient::PutWithMeta(std::span<const BlockKey> keys,
                               std::span<const transport::Bytes> blocks,
                               std::span<const BlockMeta> metas) {
  return impl_->Put(keys, blocks, metas);
}
Result<size_t> NodeClient::Get(const BlockKey& key, transport::MutableBytes out) {
  return std::move(impl_->Get(std::span(&key, 1), std::span(&out, 1))[0]);
}
std::vector<Result<size_t>> NodeClient::Get(std::span<const BlockKey> keys,
                                            std::span<const transport::MutableBytes> outs) {
  return impl_->Get(keys, outs);
}
void NodeClient::Touch(std::span<const BlockKey> keys) { impl_->Touch(keys); }
void NodeClient::TouchAfterStore(std::span<const BlockKey> keys) {
  impl_->Touch(keys, /*refresh=*/true);
}
void NodeClient::Pin(std::span<const BlockKey> keys) { impl_->Pin(keys); }
void NodeClient::Unpin(std::span<const BlockKey> keys) { impl_->Unpin(keys); }
Status NodeClient::TouchSync(std::span<const BlockKey> keys) { return impl_->TouchSync(keys); }
void NodeClient::WaitForTouches() { impl_->WaitForTouches(); }
Result<std::map<std::string, uint64_t>> NodeClient::Stats(const NodeAddress& node) {
  return impl_->Stats(node);
}
Result<NodeLimits> NodeClient::Limits(const NodeAddress& node) { return impl_->Limits(node); }
Result<uint64_t> NodeClient::BlockBytes(const NodeAddress& node) {
  KVSTASH_ASSIGN_OR_RETURN(const NodeLimits limits, impl_->Limits(node));
  if (limits.block_bytes == 0) {
    return FailedPreconditionError("node {} stores no blocks (a bare transport)", node.ToString());
  }
  return limits.block_bytes;
}
BlockStoreCounters NodeClient::counters() const { return impl_->counters(); }
uint64_t NodeClient::unreachable() const { return impl_->counters()[ClientCounter::kUnreachable]; }

}  // namespace kvstash::connector
