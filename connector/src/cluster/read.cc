// The cluster client's reads: the best-ranked healthy replica, hedged to the next; read repair
// (docs/semantics.md §16, §17).

#include "cluster/read.h"

#include <fmt/format.h>

#include <algorithm>
#include <memory>
#include <set>
#include <thread>
#include <utility>

#include "kvstash/proto/convert.h"

namespace kvstash::connector {

std::vector<Result<size_t>> ClusterRead::Get(std::span<const BlockKey> keys,
                                             std::span<const transport::MutableBytes> outs) {
  std::vector<Result<size_t>> results = ReadReplicas(keys, outs);
  if (keys.size() == outs.size()) repair_.Repair(keys, outs, results);
  return results;
}

std::vector<Result<size_t>> ClusterRead::ReadReplicas(
    std::span<const BlockKey> keys, std::span<const transport::MutableBytes> outs) {
  std::vector<Result<size_t>> results(keys.size(), Result<size_t>(size_t{0}));
  if (keys.size() != outs.size()) {
    for (auto& r : results) {
      r = InvalidArgumentError("{} keys for {} buffers", keys.size(), outs.size());
    }
    return results;
  }
  const auto topology = members_.snapshot();
  const Members& members = topology->members;
  std::vector<Placement> places(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) places[i] = placer_.Place(members, keys[i]);
  // Each member's limits, asked (connecting) only once a key's read comes to it.
  std::vector<Result<NodeLimits>> limits(members.size(), Result<NodeLimits>(NodeLimits{}));
  std::vector<bool> asked(members.size(), false);
  // Per key: the replica asked next, and the error to give if none has the block.
  std::vector<uint32_t> rank(keys.size(), 0);
  std::vector<Status> errors(keys.size());
  // The error a read gives when no replica has the block: a refusal, else a replica that
  // answered it does not hold it (a miss, whatever the others), else unreachable replicas.
  auto weight = [](const Status& s) {
    return s.ok() ? 0 : Unreachable(s) ? 1 : s.code() == StatusCode::kNotFound ? 2 : 3;
  };
  auto note_error = [&](size_t i, Status error) {
    if (weight(error) > weight(errors[i])) errors[i] = std::move(error);
  };
  // The end of key i's read without its block.
  auto give_error = [&](size_t i) {
    if (Unreachable(errors[i])) accounting_.Unserved(1);
    results[i] = errors[i];
  };
  std::vector<size_t> pending;
  for (size_t i = 0; i < keys.size(); ++i) {
    if (places[i].count == 0) {
      accounting_.Unserved(1);
      results[i] = UnavailableError("no live offload node in cluster {} for block {}",
                                    options_.cluster, keys[i].ToString());
    } else {
      pending.push_back(i);
    }
  }
  const auto give_up = transport::Clock::now() + options_.timeout;
  for (auto pause = std::chrono::microseconds(100);; pause = std::min(pause * 2, kMaxPause)) {
    // Members not yet asked are asked, all at once; keys whose replica at their rank cannot be
    // connected move on to the next rank.
    std::vector<size_t> ready;
    while (!pending.empty()) {
      std::vector<size_t> next;
      std::vector<bool> more(members.size(), false);
      bool any_more = false;
      for (size_t i : pending) {
        const size_t n = places[i].nodes[rank[i]];
        if (!asked[n]) {
          more[n] = true;
          any_more = true;
          next.push_back(i);
          continue;
        }
        if (limits[n].ok()) {
          ready.push_back(i);
          continue;
        }
        const Status& error = limits[n].status();
        note_error(i, Status(error.code(),
                             fmt::format("{}: block {}", error.message(), keys[i].ToString())));
        if (Unreachable(error) && ++rank[i] < places[i].count) {
          next.push_back(i);
        } else {
          give_error(i);
        }
      }
      if (any_more) {
        std::vector<Result<NodeLimits>> got = calls_.LimitsOf(members, more);
        for (size_t n = 0; n < members.size(); ++n) {
          if (more[n]) {
            limits[n] = std::move(got[n]);
            asked[n] = true;
          }
        }
      }
      pending = std::move(next);
    }
    if (ready.empty()) return results;
    transport::CallGroup group;
    std::vector<std::future<Outcome>> calls;
    std::vector<uint64_t> ids;
    calls.reserve(ready.size());
    const auto started = transport::Clock::now();
    for (size_t i : ready) {
      wire::GetBlockRequest get;
      *get.mutable_key() = wire::ToWire(keys[i]);
      transport::CallOptions options;
      options.recv_payload = outs[i];
      options.copier = &group;
      auto promise = std::make_shared<std::promise<Outcome>>();
      calls.push_back(promise->get_future());
      ids.push_back(calls_.StartWith(
          *members[places[i].nodes[rank[i]]], wire::METHOD_GET_BLOCK, get, options,
          [promise](Outcome outcome) { promise->set_value(std::move(outcome)); }, &group));
    }
    std::vector<bool> hedged = Hedge(group, members, places, rank, ready, calls, ids, started);
    // The reads not hedged (a key's last replica) wait for their node while it is alive.
    std::vector<CallWatch::OutCall> watched;
    std::vector<size_t> watched_of;
    for (size_t j = 0; j < ready.size(); ++j) {
      if (hedged[j]) continue;
      watched.push_back({members[places[ready[j]].nodes[rank[ready[j]]]].get(), ids[j], &calls[j]});
      watched_of.push_back(j);
    }
    std::vector<bool> abandoned(watched.size(), false);
    watch_.WaitWatching(
        group, watched, [] { return false; }, started, &abandoned);
    for (size_t w = 0; w < watched.size(); ++w) {
      if (abandoned[w]) hedged[watched_of[w]] = true;
    }
    group.Wait();
    bool wait = false;
    for (size_t j = 0; j < ready.size(); ++j) {
      const size_t i = ready[j];
      const Member& member = *members[places[i].nodes[rank[i]]];
      const Outcome outcome = calls[j].get();
      const Status& got = outcome.status;
      // A hedged read's node was told it was late (and its cancel is no answer of its own).
      if (!hedged[j] || got.ok()) accounting_.Record(*member.state, got);
      if (got.ok()) {
        member.state->ReadTook(outcome.ended - started);
        results[i] = outcome.payload_bytes;
        continue;
      }
      if (got.code() == StatusCode::kAborted && transport::Clock::now() + pause <= give_up) {
        pending.push_back(i);  // being promoted: the same replica again, after a pause
        wait = true;
        continue;
      }
      if (got.code() == StatusCode::kNotFound) {
        note_error(i, NotFoundError("node {} does not hold block {}", member.state->name(),
                                    keys[i].ToString()));
      } else {
        note_error(i, Status(got.code(), fmt::format("node {}: block {}: {}", member.state->name(),
                                                     keys[i].ToString(), got.message())));
      }
      const bool passes = got.code() == StatusCode::kNotFound || Unreachable(got);
      if (passes && ++rank[i] < places[i].count) {
        pending.push_back(i);
      } else {
        give_error(i);
      }
    }
    if (pending.empty()) return results;
    if (wait) std::this_thread::sleep_for(pause);
  }
}

std::vector<bool> ClusterRead::Hedge(transport::CallGroup& group, const Members& members,
                                     const std::vector<Placement>& places,
                                     const std::vector<uint32_t>& rank,
                                     const std::vector<size_t>& ready,
                                     const std::vector<std::future<Outcome>>& calls,
                                     const std::vector<uint64_t>& ids,
                                     transport::Clock::time_point started) {
  std::vector<bool> hedged(ready.size(), false);
  if (options_.lookup_budget >= options_.timeout) return hedged;
  // When each call with another replica to go to is hedged.
  std::vector<std::pair<transport::Clock::time_point, size_t>> at;
  for (size_t j = 0; j < ready.size(); ++j) {
    const size_t i = ready[j];
    if (rank[i] + 1 >= places[i].count) continue;
    const auto p99 = members[places[i].nodes[rank[i]]]->state->ReadP99();
    at.emplace_back(started + std::max<transport::Clock::duration>(options_.lookup_budget, p99), j);
  }
  std::sort(at.begin(), at.end());
  std::set<NodeHealth*> late;
  for (const auto& [when, j] : at) {
    if (group.WaitUntil([] { return false; }, when)) break;  // every call came back
    if (calls[j].wait_for(std::chrono::seconds(0)) == std::future_status::ready) continue;
    Member& member = *members[places[ready[j]].nodes[rank[ready[j]]]];
    member.channel->Cancel(ids[j]);
    hedged[j] = true;
    accounting_.Abandoned();
    if (late.insert(member.state.get()).second) member.state->Late();
  }
  return hedged;
}

}  // namespace kvstash::connector
