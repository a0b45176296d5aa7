#pragma once

// How the cluster client waits for calls to several nodes without waiting on one that answers
// nothing (docs/semantics.md §14).

#include <chrono>
#include <cstdint>
#include <functional>
#include <future>
#include <set>
#include <vector>

#include "cluster/accounting.h"
#include "cluster/calls.h"
#include "cluster/members.h"
#include "cluster/node_calls.h"
#include "kvstash/connector/node_client.h"
#include "kvstash/transport/call_group.h"

namespace kvstash::connector {

// Waits for a caller's group of calls within the lookup budget: past it, the node of each call
// still out is probed, and a node that answers neither its calls nor its probe has its
// connection reset (its calls fail, transfers under way included); calls to a replica still
// out once the caller is settled by the others are cancelled and their node told it was late.
// With a budget of the whole timeout (lookup_budget >= timeout) it simply waits. Keeps nothing
// between waits: borrows the options, the calls (for probes) and the counters, which outlive
// it. Thread-safe: each wait is its caller's.
class CallWatch {
 public:
  CallWatch(const NodeClientOptions& options, NodeCalls& calls, Accounting& accounting)
      : options_(options), calls_(calls), accounting_(accounting) {}

  // A call of a group, as WaitWatching sees it.
  struct OutCall {
    Member* member;
    uint64_t id;
    const std::future<Outcome>* outcome;
  };
  // Waits for `group` until its calls are done or `settled` holds; within a budget
  // (lookup_budget < timeout), past `started` + lookup_budget, the node of each call still out
  // is probed (an echo, deadline probe_timeout) and the connection of a node whose probe finds
  // it unreachable (stopped, cut off) is reset, failing every call out to it, transfers under
  // way included: (*abandoned)[k] set for each of these. A node that answers its probe is alive
  // and slow: its calls are waited for, to their deadline.
  void WaitWatching(transport::CallGroup& group, const std::vector<OutCall>& calls,
                    const std::function<bool()>& settled, transport::Clock::time_point started,
                    std::vector<bool>* abandoned);

  // Waits for the calls of `group` (each with a `member`, an `id` and its `outcome`): all of
  // them, or, within a budget (lookup_budget < timeout), until `settled` holds (the calls of
  // nodes that answer nothing cancelled: WaitWatching) and then at most lookup_budget more for
  // the rest. Calls still out then (a replica that did not answer while another did) are
  // cancelled and their nodes told (NodeHealth::Late). Every call's callback has run when it
  // returns: the transport touches none of their buffers then (a cancelled one's at once unless
  // a transfer is under way, then by its deadline). Which calls were abandoned so.
  template <typename Calls>
  std::vector<bool> WaitForReplicas(transport::CallGroup& group, Calls& calls,
                                    const std::function<bool()>& settled) {
    std::vector<bool> abandoned(calls.size(), false);
    if (options_.lookup_budget >= options_.timeout) {
      group.Wait();
      return abandoned;
    }
    std::vector<OutCall> out;
    out.reserve(calls.size());
    for (auto& call : calls) out.push_back({call.member, call.id, &call.outcome});
    WaitWatching(group, out, settled, transport::Clock::now(), &abandoned);
    if (group.WaitUntil([] { return false; }, transport::Clock::now() + options_.lookup_budget)) {
      group.Wait();
      return abandoned;
    }
    std::set<Member*> late;
    for (size_t k = 0; k < calls.size(); ++k) {
      auto& call = calls[k];
      if (abandoned[k] ||
          call.outcome.wait_for(std::chrono::seconds(0)) == std::future_status::ready) {
        continue;
      }
      call.member->channel->Cancel(call.id);
      abandoned[k] = true;
      if (late.insert(call.member).second) call.member->state->Late();
      accounting_.Abandoned();
    }
    group.Wait();
    return abandoned;
  }

 private:
  const NodeClientOptions& options_;
  NodeCalls& calls_;
  Accounting& accounting_;
};

}  // namespace kvstash::connector
