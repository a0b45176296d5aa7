// The cluster client's lookups: per node, within the budget (semantics §14).

#include "cluster/lookup.h"

#include <algorithm>
#include <future>

#include "kvstash/proto/convert.h"

namespace kvstash::connector {

std::vector<LookupResult> ClusterLookup::Lookup(std::span<const BlockKey> keys, Status* refusal) {
  std::vector<LookupResult> states(keys.size(), LookupResult::kMiss);
  const auto topology = members_.snapshot();
  const Members& members = topology->members;
  std::vector<std::vector<size_t>> by_node;
  std::vector<bool> wanted;
  placer_.ByNode(members, keys, &by_node, &wanted);
  const std::vector<Result<NodeLimits>> limits = calls_.LimitsOf(members, wanted);
  // Nodes answer within the budget or their keys read as misses: never wait for the slowest.
  // A budget of the whole deadline waits for every call's outcome (each ends by then).
  const bool bounded = options_.lookup_budget < options_.timeout;
  const auto until = transport::Clock::now() + options_.lookup_budget;
  std::vector<size_t> per_call(members.size(), 0);
  for (size_t n = 0; n < members.size(); ++n) {
    if (!wanted[n]) continue;
    if (limits[n].ok()) {
      per_call[n] = KeysPerCall(*limits[n]);
    } else if (!Unreachable(limits[n].status()) && refusal->ok()) {
      *refusal = limits[n].status();
    }
  }
  const std::vector<Chunk> chunks = SplitLastFirst(by_node, per_call);
  // Per key: the replicas that answered MISS (with replicas, for repairs).
  std::vector<std::vector<std::shared_ptr<Member>>> missed_at(options_.replicas > 1 ? keys.size()
                                                                                    : 0);
  // Per key: a replica answered (or refused: counted as that); unserved keys otherwise.
  std::vector<bool> answered(keys.size(), false);
  for (size_t n = 0; n < members.size(); ++n) {
    if (wanted[n] && !limits[n].ok() && !Unreachable(limits[n].status())) {
      for (size_t i : by_node[n]) answered[i] = true;
    }
  }
  // Each call's transport outcome is recorded when it comes, also after the budget: a late
  // answer still says the node is there.
  std::vector<std::future<Outcome>> calls;
  calls.reserve(chunks.size());
  for (const Chunk& c : chunks) {
    wire::LookupRequest request;
    for (size_t j = c.begin; j < c.end; ++j) {
      wire::ToWire(keys[by_node[c.node][j]], request.add_keys());
    }
    auto promise = std::make_shared<std::promise<Outcome>>();
    calls.push_back(promise->get_future());
    calls_.StartWith(
        *members[c.node], wire::METHOD_LOOKUP, request, {},
        [accounting = accounting_, promise, state = members[c.node]->state](Outcome outcome) {
          accounting->Record(*state, outcome.status);
          promise->set_value(std::move(outcome));
        });
  }
  std::vector<bool> late(members.size(), false);
  for (size_t k = 0; k < chunks.size(); ++k) {
    const Chunk& c = chunks[k];
    Member& member = *members[c.node];
    const size_t count = c.end - c.begin;
    if (bounded && calls[k].wait_until(until) != std::future_status::ready) {
      // Misses unless another replica answers; the node is told once per lookup.
      if (!late[c.node]) member.state->Late();
      late[c.node] = true;
      accounting_->Late(count);
      continue;
    }
    const Outcome outcome = calls[k].get();
    if (!outcome.status.ok()) {
      if (Unreachable(outcome.status)) continue;  // misses unless another replica answers
      if (refusal->ok()) *refusal = AtNode(member.state->name(), outcome.status);
      for (size_t j = c.begin; j < c.end; ++j) answered[by_node[c.node][j]] = true;
      continue;  // misses, counted and logged
    }
    wire::LookupReply reply;
    Status status = ParseReply(outcome, &reply);
    if (status.ok() && reply.results_size() != static_cast<int>(count)) {
      status = InternalError("{} result(s) to a lookup of {} keys", reply.results_size(), count);
    }
    if (!status.ok()) {
      accounting_->Record(*member.state, status);
      if (refusal->ok()) *refusal = AtNode(member.state->name(), status);
      for (size_t j = c.begin; j < c.end; ++j) answered[by_node[c.node][j]] = true;
      continue;
    }
    for (size_t j = 0; j < count; ++j) {
      const size_t i = by_node[c.node][c.begin + j];
      const LookupResult result = wire::FromWire(reply.results(static_cast<int>(j)));
      answered[i] = true;
      states[i] = Better(states[i], result);
      if (result == LookupResult::kMiss && options_.replicas > 1) {
        missed_at[i].push_back(members[c.node]);
      }
    }
  }
  accounting_->Unserved(static_cast<size_t>(std::count(answered.begin(), answered.end(), false)));
  if (options_.replicas > 1) repair_.Note(keys, states, missed_at);
  return states;
}

}  // namespace kvstash::connector
