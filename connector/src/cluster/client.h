#pragma once

// NodeClient::Impl, the cluster client behind the NodeClient facade (docs/architecture.md, "the
// cluster client"). Its rooms:
//
//   members.h     where the nodes come from, and the immutable snapshot a call works with;
//   placement.h   which members hold a key (rendezvous, replicas in distinct zones);
//   node_health.h each member's health as the calls find it (suspect nodes skipped, probed);
//   calls.h       a call's outcome; this class starts the calls on each member's channel;
//   lookup.cc, store.cc, read.cc, keys.cc: the operations, each fanning out per node with its
//                 own deadline and using each node's answer as it comes (semantics §14).

#include <atomic>
#include <chrono>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "cluster/accounting.h"
#include "cluster/calls.h"
#include "cluster/members.h"
#include "cluster/node_health.h"
#include "cluster/placement.h"
#include "kvstash/common/mutex.h"
#include "kvstash/connector/node_client.h"
#include "kvstash/proto/convert.h"
#include "kvstash/transport/call_group.h"

namespace kvstash::connector {

using transport::Bytes;
using transport::CallOptions;
using transport::ServerLimits;

class NodeClient::Impl {
 public:
  static constexpr std::chrono::microseconds kMaxPause{10000};

  explicit Impl(NodeClientOptions options);
  // The members go first (an etcd watcher's callback changes them); asynchronous calls in
  // flight end by their deadline, and their callbacks use this object.
  ~Impl();
  Status Init();

  // Waits for the asynchronous calls (touches, pins, releases, probes) still out.
  void WaitForTouches() {
    MutexLock lock(&async_mu_);
    while (async_in_flight_ != 0) async_cv_.Wait(&async_mu_);
  }

  std::vector<NodeAddress> nodes() const;
  BlockStoreCounters counters() const { return accounting_->counters(); }
  size_t replicas() const { return options_.replicas; }
  // The places of `key` among `members`: `replicas` of them, best-ranked first, in distinct
  // zones while there are enough (fewer when fewer are live).
  Placement Place(const Members& members, const BlockKey& key) const;
  std::vector<NodeAddress> PlacesOf(const BlockKey& key) const;

  Result<ServerLimits> Limits(const NodeAddress& address);
  Result<std::map<std::string, uint64_t>> Stats(const NodeAddress& address);

  // The limits of each member in `wanted` (by index), connecting to those not yet connected,
  // all at once (a first connection is waited for, at most connect_timeout, also by a lookup:
  // its budget counts from the calls). A suspect member that is not admitted (NodeHealth::Admit:
  // not its turn to be probed) gets Unavailable at once, unrecorded. A member that cannot be
  // connected gets its error (recorded here).
  std::vector<Result<ServerLimits>> LimitsOf(const Members& members,
                                             const std::vector<bool>& wanted);

  // Probes a suspect member: an echo with a deadline of its own (probe_timeout) that no
  // caller waits for; its outcome tells the member's health (an answer makes it up).
  void StartProbe(Member& member, std::function<void(bool answered)> done = {});

  // The keys of `keys` by member (each key at each of its replicas), in key order within each
  // member; which members have any.
  void ByNode(const Members& members, std::span<const BlockKey> keys,
              std::vector<std::vector<size_t>>* by_node, std::vector<bool>* wanted,
              std::vector<Placement>* places = nullptr) const;

  // Per-key lookups, the best answer of each key's replicas; *refusal gets the first error that
  // is not an unreachable node.
  std::vector<LookupResult> Lookup(std::span<const BlockKey> keys, Status* refusal);

  // Keys a lookup found on some of their replicas and missing on others (a node that joined,
  // or one that evicted its copy): the next read of each copies it to those others.
  void NoteRepairs(std::span<const BlockKey> keys, const std::vector<LookupResult>& states,
                   std::vector<std::vector<std::shared_ptr<Member>>>& missed_at);

  // After a read: the blocks read whose key a lookup found missing on some replicas are stored
  // there, all at once, the caller waiting (only reads after a change of members pay this).
  void Repair(std::span<const BlockKey> keys, std::span<const transport::MutableBytes> outs,
              const std::vector<Result<size_t>>& results);

  // One PutBlock call per block and replica (the whole store), all in flight at once across
  // the nodes, last key first; the caller waits for the last. A block is stored once one of
  // its replicas holds it; a replica that cannot be reached is counted, not returned, while
  // another holds the block. A refusal is always returned.
  Status Put(std::span<const BlockKey> keys, std::span<const Bytes> blocks);

  // One GetBlock per key (read from this client's pin, or pinned for the transfer by the node),
  // all in flight at once, from each key's best-ranked replica; a replica that does not hold
  // the block or cannot be reached passes the read to the next. Blocks a node is promoting from
  // SSD are asked for again until the timeout.
  std::vector<Result<size_t>> Get(std::span<const BlockKey> keys,
                                  std::span<const transport::MutableBytes> outs);

  std::vector<Result<size_t>> ReadReplicas(std::span<const BlockKey> keys,
                                           std::span<const transport::MutableBytes> outs);

  // Reads slower than their node's recent p99 (at least lookup_budget), of keys with another
  // replica to ask, are cancelled (their nodes told they were late) and go to that replica:
  // which of `ready` were. Calls that are not hedged are left to end by their deadline; the
  // caller waits for every callback (the transport no longer touches a cancelled call's buffer
  // once its callback ran).
  std::vector<bool> Hedge(transport::CallGroup& group, const Members& members,
                          const std::vector<Placement>& places, const std::vector<uint32_t>& rank,
                          const std::vector<size_t>& ready,
                          const std::vector<std::future<Outcome>>& calls,
                          const std::vector<uint64_t>& ids, transport::Clock::time_point started);

  // Pins each key at its replicas, and remembers where: the release goes there even if the
  // members have changed since.
  void Pin(std::span<const BlockKey> keys);

  // Releases each key where its oldest outstanding Pin went (members that have since closed
  // released it with their connection); a key never pinned goes to its replicas now.
  void Unpin(std::span<const BlockKey> keys);

  void Touch(std::span<const BlockKey> keys);

  Status TouchSync(std::span<const BlockKey> keys);

  Result<std::map<std::string, uint64_t>> StatsOf(Member& member);

  // Starts the PutBlock call of `block` under `key` to `member` in `group`; `done` gets its
  // outcome. Returns the call's id.
  uint64_t StartPut(transport::CallGroup& group, Member& member, const BlockKey& key, Bytes block,
                    std::function<void(Outcome)> done);
  // The same, the future holding its outcome.
  std::future<Outcome> StartPut(transport::CallGroup& group, Member& member, const BlockKey& key,
                                Bytes block);

  // Starts a call; `done` runs once on the progress thread with its outcome. Its deadline is
  // `timeout` from now (zero: the client's timeout). With `group`, the call is counted in it
  // (CallGroup::Track).
  template <typename Request>
  uint64_t StartWith(Member& member, wire::Method method, const Request& request,
                     CallOptions options, std::function<void(Outcome)> done,
                     transport::CallGroup* group = nullptr,
                     std::chrono::milliseconds timeout = {}) {
    options.deadline = transport::Clock::now() + (timeout.count() > 0 ? timeout : options_.timeout);
    const std::string bytes = request.SerializeAsString();
    accounting_->CallStarted();
    transport::ResponseCallback callback =
        [done = std::move(done)](const transport::Response& response) {
          done(Outcome{response.status,
                       std::vector<std::byte>(response.message.begin(), response.message.end()),
                       response.payload_bytes, transport::Clock::now()});
        };
    return member.channel->Call(static_cast<uint16_t>(method), std::as_bytes(std::span(bytes)),
                                options,
                                group != nullptr ? group->Track(std::move(callback)) : callback);
  }

  // Starts a call; the future holds its outcome.
  template <typename Request>
  std::future<Outcome> Start(Member& member, wire::Method method, const Request& request,
                             CallOptions options = {}) {
    auto promise = std::make_shared<std::promise<Outcome>>();
    std::future<Outcome> future = promise->get_future();
    StartWith(member, method, request, options,
              [promise](Outcome outcome) { promise->set_value(std::move(outcome)); });
    return future;
  }

  // Starts a call of `group`, whose Wait makes its same-host copies on the waiting thread (so
  // that every thread of the engine copies its own blocks); the future holds its outcome, ready
  // once the group's Wait returns.
  template <typename Request>
  std::future<Outcome> Start(transport::CallGroup& group, Member& member, wire::Method method,
                             const Request& request, CallOptions options) {
    auto promise = std::make_shared<std::promise<Outcome>>();
    std::future<Outcome> future = promise->get_future();
    options.copier = &group;
    StartWith(
        member, method, request, options,
        [promise](Outcome outcome) { promise->set_value(std::move(outcome)); }, &group);
    return future;
  }

  // Starts `method` with `request` on `member` without waiting: `done` gets the outcome, and
  // the destructor (WaitForTouches) waits for it.
  template <typename Request>
  void StartAsync(Member& member, wire::Method method, const Request& request,
                  std::function<void(const Outcome&)> done,
                  std::chrono::milliseconds timeout = {}) {
    {
      MutexLock lock(&async_mu_);
      ++async_in_flight_;
    }
    StartWith(
        member, method, request, {},
        [this, done = std::move(done)](Outcome outcome) {
          done(outcome);
          // Under the lock: the destructor cannot go on until this callback is done with *this.
          MutexLock lock(&async_mu_);
          --async_in_flight_;
          async_cv_.SignalAll();
        },
        nullptr, timeout);
  }

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
      accounting_->Abandoned();
    }
    group.Wait();
    return abandoned;
  }

  // The calls of a Request of `keys` (TouchRequest, LoadRequest, ReleaseRequest) to the
  // members of `by_node`: per member, split to its limits, each member's chunks last first (a
  // node applies them in arrival order, so a touch's first keys end most recent). `start`
  // starts each call; members that cannot be reached are skipped (recorded by LimitsOf).
  template <typename Request, typename StartFn>
  Status StartKeyCalls(const Members& members, const std::vector<std::vector<size_t>>& by_node,
                       const std::vector<bool>& wanted, std::span<const BlockKey> keys,
                       StartFn start) {
    const std::vector<Result<ServerLimits>> limits = LimitsOf(members, wanted);
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

  // As above, to each key's replicas in the live set.
  template <typename Request, typename StartFn>
  Status StartKeyCalls(std::span<const BlockKey> keys, StartFn start) {
    const auto topology = members_.snapshot();
    std::vector<std::vector<size_t>> by_node;
    std::vector<bool> wanted;
    ByNode(topology->members, keys, &by_node, &wanted);
    return StartKeyCalls<Request>(topology->members, by_node, wanted, keys, start);
  }

 private:
  NodeClientOptions options_;
  // Shared with the callbacks of calls that outlive their caller (a lookup's late answers).
  std::shared_ptr<Accounting> accounting_ = std::make_shared<Accounting>();
  // Blocks to copy to replicas that lack them at their next read (NoteRepairs), at most
  // kMaxRepairs keys.
  static constexpr size_t kMaxRepairs = 1 << 16;
  Mutex repairs_mu_;
  std::map<BlockKey, std::vector<std::weak_ptr<Member>>> repairs_ GUARDED_BY(repairs_mu_);
  std::atomic<bool> repairs_pending_{false};
  // Where each pinned key's Pins went, oldest first.
  Mutex pins_mu_;
  std::map<BlockKey, std::deque<std::vector<std::weak_ptr<Member>>>> pins_ GUARDED_BY(pins_mu_);
  // Asynchronous calls (touches, pins, releases, probes) still out.
  Mutex async_mu_;
  CondVar async_cv_;
  size_t async_in_flight_ GUARDED_BY(async_mu_) = 0;
  MemberSet members_;  // last: it goes first
};

}  // namespace kvstash::connector
