#pragma once

// The engine's KV offload over offload nodes (kvstash::engine_offload): engine::KvOffload on
// connector::KvConnector. A separate library so the engine itself needs no transport.

#include "kvstash/connector/node_client.h"
#include "kvstash/engine/offload.h"

namespace kvstash::engine {

// Builds the engine's offload over the nodes of `client` (EngineOptions::offload). Creating
// it fails with FailedPrecondition when a node's block size does not fit the engine's page
// (the message says which --block-bytes to start kvstashd with).
KvOffloadFactory NodeOffload(connector::NodeClientOptions client);

}  // namespace kvstash::engine
