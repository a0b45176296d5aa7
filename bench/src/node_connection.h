#pragma once

// kvstash's side of the block load (block_load.h): a node client per load client, on UCX
// workers the clients share, as `kvstash bench node` and `kvstash bench peer` run it.

#include <memory>
#include <string>
#include <vector>

#include "block_load.h"
#include "kvstash/connector/node_client.h"

namespace kvstash::bench {

// The clients' UCX workers: `count` shared ones, clients spread over them round-robin, or (0)
// none, and each client's node client makes its own. Owned by the caller; thread-safe (the
// workers are).
class ClientWorkers {
 public:
  // Unavailable (UCX's message) when a worker cannot be made.
  static Result<ClientWorkers> Create(int count, const std::string& tls, int spin_us);
  // The worker of client `client`; null with no shared workers.
  std::shared_ptr<transport::ClientWorker> Of(int client) const;

 private:
  std::vector<std::shared_ptr<transport::ClientWorker>> workers_;
};

// A node client made from `options` (its worker set by the caller) as a BlockConnection: key k
// is the block key whose hash is k. The node client's error when it cannot be made.
Result<std::unique_ptr<BlockConnection>> ConnectNodeClient(connector::NodeClientOptions options);

}  // namespace kvstash::bench
