#pragma once

// The cluster client's calls to one member at a time (docs/architecture.md, "the cluster
// client"): a call started on the member's channel with its deadline, the member's limits
// (connecting first), probes of suspect members, and the asynchronous calls no caller waits for.

#include <chrono>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "cluster/accounting.h"
#include "cluster/calls.h"
#include "cluster/members.h"
#include "kvstash/common/mutex.h"
#include "kvstash/connector/node_client.h"
#include "kvstash/proto/convert.h"
#include "kvstash/transport/call_group.h"

namespace kvstash::connector {

// Starts the client's calls on its members' channels: each with a deadline (the client's
// timeout unless given) and counted (Accounting); a member's limits, connecting to it first
// (admitting a suspect member only to probe it, and leaving out of the members one whose block
// size is not this client's); probes; and the asynchronous calls (touches, pins, releases,
// probes) whose outcome no caller waits for.
//
// Owns the count of asynchronous calls out: StartAsync raises it before the call starts and
// its callback lowers it once `done` has run, under the lock, so that once WaitForAsync returns
// no callback of one runs or will run (the objects they use may go then). Borrows the options,
// the counters and the members, which outlive it. Thread-safe.
class NodeCalls {
 public:
  NodeCalls(const NodeClientOptions& options, Accounting& accounting, MemberSet& members)
      : options_(options), accounting_(accounting), members_(members) {}
  // Waits for the asynchronous calls still out (each ends by its deadline).
  ~NodeCalls() { WaitForAsync(); }
  NodeCalls(const NodeCalls&) = delete;
  NodeCalls& operator=(const NodeCalls&) = delete;

  // Waits for the asynchronous calls (touches, pins, releases, probes) still out.
  void WaitForAsync() {
    MutexLock lock(&async_mu_);
    while (async_in_flight_ != 0) async_cv_.Wait(&async_mu_);
  }

  // The limits of each member in `wanted` (by index), connecting to those not yet connected,
  // all at once (a first connection is waited for, at most connect_timeout, also by a lookup:
  // its budget counts from the calls). A suspect member that is not admitted (NodeHealth::Admit:
  // not its turn to be probed) gets Unavailable at once, unrecorded. A member that cannot be
  // connected gets its error (recorded here).
  std::vector<Result<NodeLimits>> LimitsOf(const Members& members, const std::vector<bool>& wanted);

  // Probes a suspect member: an echo with a deadline of its own (probe_timeout) that no
  // caller waits for; its outcome tells the member's health (an answer makes it up).
  void StartProbe(Member& member, std::function<void(bool answered)> done = {});

  // The member's counters (wire.StatsReply), waiting for its answer.
  Result<std::map<std::string, uint64_t>> Stats(Member& member);

  // Starts the PutBlock call of `block` under `key` to `member` in `group`, with `meta` (none:
  // null); `done` gets its outcome. Returns the call's id.
  uint64_t StartPut(transport::CallGroup& group, Member& member, const BlockKey& key,
                    transport::Bytes block, const BlockMeta* meta,
                    std::function<void(Outcome)> done);
  // The same, the future holding its outcome.
  std::future<Outcome> StartPut(transport::CallGroup& group, Member& member, const BlockKey& key,
                                transport::Bytes block);

  // Starts the PutBlocks call of blocks[i] under keys[i] (with metas[i] unless `metas` is
  // empty) for each i of `which`, in that order, to `member` in `group`: their bytes copied back
  // to back into `staging` (exactly their size), which must outlive the call. `done` gets its
  // outcome. Returns the call's id.
  uint64_t StartPutBatch(transport::CallGroup& group, Member& member,
                         std::span<const BlockKey> keys, std::span<const transport::Bytes> blocks,
                         std::span<const BlockMeta> metas, const std::vector<size_t>& which,
                         transport::MutableBytes staging, std::function<void(Outcome)> done);

  // Starts a call; `done` runs once on the progress thread with its outcome. Its deadline is
  // `timeout` from now (zero: the client's timeout). With `group`, the call is counted in it
  // (CallGroup::Track). Returns the call's id (for Channel::Cancel).
  template <typename Request>
  uint64_t StartWith(Member& member, wire::Method method, const Request& request,
                     transport::CallOptions options, std::function<void(Outcome)> done,
                     transport::CallGroup* group = nullptr,
                     std::chrono::milliseconds timeout = {}) {
    options.deadline = transport::Clock::now() + (timeout.count() > 0 ? timeout : options_.timeout);
    const std::string bytes = request.SerializeAsString();
    accounting_.CallStarted();
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
                             transport::CallOptions options = {}) {
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
                             const Request& request, transport::CallOptions options) {
    auto promise = std::make_shared<std::promise<Outcome>>();
    std::future<Outcome> future = promise->get_future();
    options.copier = &group;
    StartWith(
        member, method, request, options,
        [promise](Outcome outcome) { promise->set_value(std::move(outcome)); }, &group);
    return future;
  }

  // Starts `method` with `request` on `member` without waiting: `done` gets the outcome, and
  // WaitForAsync (the destructor) waits for it.
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
          // Under the lock: WaitForAsync cannot return until this callback is done with *this.
          MutexLock lock(&async_mu_);
          --async_in_flight_;
          async_cv_.SignalAll();
        },
        nullptr, timeout);
  }

 private:
  // The limits a member stated at hello, or its refusal here when they do not parse.
  Result<NodeLimits> StatedBy(NodeHealth& health, const transport::ServerLimits& stated);

  const NodeClientOptions& options_;
  Accounting& accounting_;
  MemberSet& members_;  // a member whose block size is not this client's is excluded
  Mutex async_mu_;
  CondVar async_cv_;
  size_t async_in_flight_ GUARDED_BY(async_mu_) = 0;
};

}  // namespace kvstash::connector
