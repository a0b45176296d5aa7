#pragma once

// The cluster client's calls of keys alone: touches, pins and their releases.

#include <deque>
#include <map>
#include <memory>
#include <span>
#include <vector>

#include "cluster/accounting.h"
#include "cluster/calls.h"
#include "cluster/members.h"
#include "cluster/node_calls.h"
#include "cluster/placer.h"
#include "kvstash/common/block_key.h"
#include "kvstash/common/mutex.h"
#include "kvstash/connector/node_client.h"
#include "kvstash/proto/convert.h"

namespace kvstash::connector {

// Sends keys alone to their replicas: touches (asynchronous, or waited for), pins and their
// releases (asynchronous: NodeCalls::StartAsync), each member's keys split to its limits.
// Owns where each pinned key's pins went: per key, the members of each Pin not yet released,
// oldest first, held weakly, so that a release goes where its pin went even after the members
// changed (a member that has since closed released the pin with its connection). Borrows the
// members, the placer, the calls and the counters, which outlive it. Thread-safe.
class KeyCalls {
 public:
  KeyCalls(Accounting& accounting, const MemberSet& members, const Placer& placer, NodeCalls& calls)
      : accounting_(accounting), members_(members), placer_(placer), calls_(calls) {}

  // Pins each key at its replicas, and remembers where.
  void Pin(std::span<const BlockKey> keys);
  // Releases each key where its oldest outstanding Pin went; a key never pinned goes to its
  // replicas now.
  void Unpin(std::span<const BlockKey> keys);
  // Touches each key at its replicas, not waiting.
  // `refresh`: the request's touch after its stores (TouchRequest.refresh).
  void Touch(std::span<const BlockKey> keys, bool refresh = false);
  // The same, waiting for the answers: the first error, naming the node.
  Status TouchSync(std::span<const BlockKey> keys);

 private:
  // The calls of a Request of `keys` (TouchRequest, LoadRequest, ReleaseRequest) to the
  // members of `by_node`: per member, split to its limits, each member's chunks last first (a
  // node applies them in arrival order, so a touch's first keys end most recent). `start`
  // starts each call; members that cannot be reached are skipped (recorded by LimitsOf).
  template <typename Request, typename StartFn>
  Status StartKeyCalls(const Members& members, const std::vector<std::vector<size_t>>& by_node,
                       const std::vector<bool>& wanted, std::span<const BlockKey> keys,
                       StartFn start) {
    const std::vector<Result<NodeLimits>> limits = calls_.LimitsOf(members, wanted);
    Status first;
    std::vector<size_t> per_call(members.size(), 0);
    for (size_t n = 0; n < members.size(); ++n) {
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
      start(*members[c.node], request);
    }
    return first;
  }

  // As above, to each key's replicas among the members live now.
  template <typename Request, typename StartFn>
  Status StartKeyCalls(std::span<const BlockKey> keys, StartFn start) {
    const auto topology = members_.snapshot();
    std::vector<std::vector<size_t>> by_node;
    std::vector<bool> wanted;
    placer_.ByNode(topology->members, keys, &by_node, &wanted);
    return StartKeyCalls<Request>(topology->members, by_node, wanted, keys, start);
  }

  Accounting& accounting_;
  const MemberSet& members_;
  const Placer& placer_;
  NodeCalls& calls_;
  Mutex pins_mu_;
  std::map<BlockKey, std::deque<std::vector<std::weak_ptr<Member>>>> pins_ GUARDED_BY(pins_mu_);
};

}  // namespace kvstash::connector
