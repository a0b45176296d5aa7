#pragma once

// The engine's KV offload over offload nodes (kvstash::engine_offload): engine::KvOffload on
// connector::KvConnector. A separate library so the engine itself needs no transport.

#include <functional>
#include <memory>

#include "kvstash/connector/block_store_client.h"
#include "kvstash/connector/node_client.h"
#include "kvstash/connector/offload_scheduler.h"
#include "kvstash/engine/offload.h"

namespace kvstash::engine {

// Builds the engine's offload over the nodes of `client` (EngineOptions::offload). Creating
// it fails with FailedPrecondition when a node's block size does not fit the engine's page
// (the message says which --block-bytes to start kvstashd with).
KvOffloadFactory NodeOffload(connector::NodeClientOptions client);

// What the connector runs over instead of a NodeClient: a store (an in-memory fake in tests)
// and optionally the scheduler side's manager (null: the nodes' own, over `client`).
struct ConnectorParts {
  std::unique_ptr<connector::BlockStoreClient> client;
  std::unique_ptr<connector::OffloadManager> manager;
};
using ConnectorPartsFactory = std::function<Result<ConnectorParts>(const OffloadContext&)>;

// The same offload (the engine's adapter over connector::KvConnector) over the parts that
// `make_parts` builds for the engine; its errors are the engine's Create errors.
KvOffloadFactory NodeOffload(ConnectorPartsFactory make_parts);

}  // namespace kvstash::engine
