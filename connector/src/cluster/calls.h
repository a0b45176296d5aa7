#pragma once

// What the cluster client's calls share: a call's outcome as its callback copied it, replies
// parsed, errors named by their node, and a node's keys split into calls within its limits.

#include <fmt/format.h>

#include <cstddef>
#include <string>
#include <vector>

#include "kvstash/common/status.h"
#include "kvstash/connector/block_store_client.h"
#include "kvstash/proto/convert.h"
#include "kvstash/transport/rpc.h"

namespace kvstash::connector {

// A call's outcome, copied out of the callback.
struct Outcome {
  Status status;
  std::vector<std::byte> reply;
  size_t payload_bytes = 0;
  transport::Clock::time_point ended;  // when the callback ran
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

// Each key's status in a batched call's outcome (GetBlocks, PutBlocks) of `keys` keys, the
// reply parsed into *reply: the call's error for every key, or each key's result as the node
// stated it; a reply that does not parse, or does not answer each key once, is an Internal
// error for every key.
template <typename Reply>
std::vector<Status> BatchStatuses(const Outcome& outcome, size_t keys, Reply* reply) {
  Status call = ParseReply(outcome, reply);
  if (call.ok() && static_cast<size_t>(reply->results_size()) != keys) {
    call = InternalError("a batch reply of {} results to a call of {} keys", reply->results_size(),
                         keys);
  }
  if (!call.ok()) return std::vector<Status>(keys, call);
  std::vector<Status> statuses;
  statuses.reserve(keys);
  for (const wire::BlockResult& result : reply->results()) {
    statuses.push_back(wire::StatusFromWire(result));
  }
  return statuses;
}

// A status naming the node it came from.
inline Status AtNode(const std::string& node, const Status& status) {
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
inline std::vector<Chunk> SplitLastFirst(const std::vector<std::vector<size_t>>& by_node,
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

// HIT over RETRY over MISS: the best of two replicas' answers.
inline LookupResult Better(LookupResult a, LookupResult b) {
  auto rank = [](LookupResult r) {
    return r == LookupResult::kHit ? 2 : r == LookupResult::kRetry ? 1 : 0;
  };
  return rank(b) > rank(a) ? b : a;
}

}  // namespace kvstash::connector
