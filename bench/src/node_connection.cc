#include "node_connection.h"

#include <utility>

#include "kvstash/transport/rpc.h"

namespace kvstash::bench {
namespace {

class NodeConnection final : public BlockConnection {
 public:
  explicit NodeConnection(std::unique_ptr<connector::NodeClient> client)
      : client_(std::move(client)) {}

  Status Put(std::span<const uint64_t> keys,
             std::span<const std::span<const std::byte>> blocks) override {
    return client_->Put(BlockKeys(keys), blocks);
  }

  std::vector<Result<size_t>> Get(std::span<const uint64_t> keys,
                                  std::span<const std::span<std::byte>> outs) override {
    return client_->Get(BlockKeys(keys), outs);
  }

 private:
  std::span<const BlockKey> BlockKeys(std::span<const uint64_t> keys) {
    keys_.resize(keys.size());
    for (size_t i = 0; i < keys.size(); ++i) keys_[i].hash.lo = keys[i];
    return keys_;
  }

  std::unique_ptr<connector::NodeClient> client_;
  std::vector<BlockKey> keys_;
};

}  // namespace

Result<ClientWorkers> ClientWorkers::Create(int count, const std::string& tls, int spin_us) {
  ClientWorkers workers;
  for (int i = 0; i < count; ++i) {
    transport::TransportOptions transport;
    transport.tls = tls;
    transport.spin_before_sleep = std::chrono::microseconds(spin_us);
    auto worker = transport::ClientWorker::Create(transport);
    if (!worker.ok()) return worker.status();
    workers.workers_.push_back(std::move(*worker));
  }
  return workers;
}

std::shared_ptr<transport::ClientWorker> ClientWorkers::Of(int client) const {
  return workers_.empty() ? nullptr : workers_[client % workers_.size()];
}

Result<std::unique_ptr<BlockConnection>> ConnectNodeClient(connector::NodeClientOptions options) {
  auto client = connector::NodeClient::Create(std::move(options));
  if (!client.ok()) return client.status();
  return std::unique_ptr<BlockConnection>(std::make_unique<NodeConnection>(std::move(*client)));
}

}  // namespace kvstash::bench
