// The cluster client's reads: the best-ranked healthy replica, hedged to the next; read repair
// (docs/semantics.md §16, §17).

#include "cluster/read.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cstring>
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
  // Where batches land whose keys' buffers do not lie back to back: this thread's, kept between
  // reads (a read's calls have all ended when it returns) unless large.
  thread_local std::vector<std::byte> staging;
  struct Trim {
    ~Trim() {
      if (staging.capacity() > kMaxKeptStaging) std::vector<std::byte>().swap(staging);
    }
  } trim;
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
    std::vector<ReadCall> calls = PlanCalls(members, places, rank, ready, limits);
    Land(calls, limits, &staging);
    const auto started = transport::Clock::now();
    for (ReadCall& call : calls) {
      Member& member = *members[call.member];
      auto promise = std::make_shared<std::promise<Outcome>>();
      call.outcome = promise->get_future();
      auto done = [promise](Outcome outcome) { promise->set_value(std::move(outcome)); };
      transport::CallOptions options;
      if (call.batch) {
        // A batch's small blocks are copied on the progress thread as they come: handing the
        // copy to this thread and back costs more thread wake-ups than the copy takes.
        wire::GetBlocksRequest get;
        for (size_t i : call.keys) wire::ToWire(keys[i], get.add_keys());
        options.recv_payload = call.landing;
        call.id = calls_.StartWith(member, wire::METHOD_GET_BLOCKS, get, options, done, &group);
      } else {
        wire::GetBlockRequest get;
        *get.mutable_key() = wire::ToWire(keys[call.keys[0]]);
        options.recv_payload = outs[call.keys[0]];
        options.copier = &group;
        call.id = calls_.StartWith(member, wire::METHOD_GET_BLOCK, get, options, done, &group);
      }
    }
    std::vector<bool> hedged = Hedge(group, members, places, rank, calls, started);
    // The reads not hedged (a key's last replica) wait for their node while it is alive.
    std::vector<CallWatch::OutCall> watched;
    std::vector<size_t> watched_of;
    for (size_t j = 0; j < calls.size(); ++j) {
      if (hedged[j]) continue;
      watched.push_back({members[calls[j].member].get(), calls[j].id, &calls[j].outcome});
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
    for (size_t j = 0; j < calls.size(); ++j) {
      const Member& member = *members[calls[j].member];
      const Outcome outcome = calls[j].outcome.get();
      // A hedged read's node was told it was late (and its cancel is no answer of its own).
      if (!hedged[j] || outcome.status.ok()) accounting_.Record(*member.state, outcome.status);
      if (outcome.status.ok()) member.state->ReadTook(outcome.ended - started);
      const std::vector<std::pair<Status, size_t>> got =
          KeyOutcomes(calls[j], outcome, outs, *member.state);
      for (size_t k = 0; k < calls[j].keys.size(); ++k) {
        const size_t i = calls[j].keys[k];
        const Status& status = got[k].first;
        if (status.ok()) {
          results[i] = got[k].second;
          continue;
        }
        if (status.code() == StatusCode::kAborted && transport::Clock::now() + pause <= give_up) {
          pending.push_back(i);  // being promoted: the same replica again, after a pause
          wait = true;
          continue;
        }
        if (status.code() == StatusCode::kNotFound) {
          note_error(i, NotFoundError("node {} does not hold block {}", member.state->name(),
                                      keys[i].ToString()));
        } else {
          note_error(
              i, Status(status.code(), fmt::format("node {}: block {}: {}", member.state->name(),
                                                   keys[i].ToString(), status.message())));
        }
        const bool passes = status.code() == StatusCode::kNotFound || Unreachable(status);
        if (passes && ++rank[i] < places[i].count) {
          pending.push_back(i);
        } else {
          give_error(i);
        }
      }
    }
    if (pending.empty()) return results;
    if (wait) std::this_thread::sleep_for(pause);
  }
}

std::vector<ClusterRead::ReadCall> ClusterRead::PlanCalls(
    const Members& members, const std::vector<Placement>& places, const std::vector<uint32_t>& rank,
    const std::vector<size_t>& ready, const std::vector<Result<NodeLimits>>& limits) const {
  std::vector<ReadCall> calls;
  // Per member and whether the keys have another replica: the batch being filled (index in
  // calls, or none).
  constexpr size_t kNone = SIZE_MAX;
  std::vector<std::array<size_t, 2>> filling(members.size(), {kNone, kNone});
  for (size_t i : ready) {
    const size_t n = places[i].nodes[rank[i]];
    const size_t per_batch = BlocksPerBatch(*limits[n]);
    if (per_batch == 0) {
      ReadCall& call = calls.emplace_back();
      call.member = n;
      call.keys = {i};
      continue;
    }
    size_t& at = filling[n][rank[i] + 1 < places[i].count ? 1 : 0];
    if (at == kNone || calls[at].keys.size() >= per_batch) {
      at = calls.size();
      ReadCall& call = calls.emplace_back();
      call.member = n;
      call.batch = true;
    }
    calls[at].keys.push_back(i);
  }
  return calls;
}

void ClusterRead::Land(std::vector<ReadCall>& calls, const std::vector<Result<NodeLimits>>& limits,
                       std::vector<std::byte>* staging) {
  size_t staged = 0;
  for (const ReadCall& call : calls) {
    if (call.batch) staged += call.keys.size() * limits[call.member]->block_bytes;
  }
  if (staging->size() < staged) staging->resize(staged);
  size_t at = 0;
  for (ReadCall& call : calls) {
    if (!call.batch) continue;
    const size_t bytes = call.keys.size() * limits[call.member]->block_bytes;
    call.landing = std::span(*staging).subspan(at, bytes);
    at += bytes;
  }
}

std::vector<std::pair<Status, size_t>> ClusterRead::KeyOutcomes(
    ReadCall& call, const Outcome& outcome, std::span<const transport::MutableBytes> outs,
    NodeHealth& health) {
  std::vector<std::pair<Status, size_t>> got(call.keys.size(), {outcome.status, 0});
  if (!call.batch || !outcome.status.ok()) {
    if (outcome.status.ok()) got[0].second = outcome.payload_bytes;
    return got;
  }
  wire::GetBlocksReply reply;
  const std::vector<Status> statuses = BatchStatuses(outcome, call.keys.size(), &reply);
  // The blocks lie back to back where the payload landed (this thread's staging), as long as
  // the reply says; a reply that says more than came, or more than a key's buffer holds, is the
  // node's error, not a block.
  size_t offset = 0;
  for (size_t k = 0; k < call.keys.size(); ++k) {
    got[k].first = statuses[k];
    if (!statuses[k].ok()) {
      accounting_.Record(health, statuses[k]);
      continue;
    }
    const uint64_t length = reply.results(static_cast<int>(k)).length();
    const size_t room = outs[call.keys[k]].size();
    if (length > outcome.payload_bytes - offset || length > room) {
      got[k].first = InternalError(
          "a batch reply states a block of {} bytes at payload offset {}: {} bytes came, the "
          "buffer holds {}",
          length, offset, outcome.payload_bytes, room);
      accounting_.Record(health, got[k].first);
      offset = outcome.payload_bytes;  // nothing after it can be placed
      continue;
    }
    std::memcpy(outs[call.keys[k]].data(), call.landing.data() + offset, length);
    offset += length;
    got[k].second = length;
  }
  return got;
}

std::vector<bool> ClusterRead::Hedge(transport::CallGroup& group, const Members& members,
                                     const std::vector<Placement>& places,
                                     const std::vector<uint32_t>& rank,
                                     const std::vector<ReadCall>& calls,
                                     transport::Clock::time_point started) {
  std::vector<bool> hedged(calls.size(), false);
  if (options_.lookup_budget >= options_.timeout) return hedged;
  // When each call whose keys have another replica to go to is hedged (a batch's keys all have
  // one, or none has: PlanCalls).
  std::vector<std::pair<transport::Clock::time_point, size_t>> at;
  for (size_t j = 0; j < calls.size(); ++j) {
    const size_t i = calls[j].keys[0];
    if (rank[i] + 1 >= places[i].count) continue;
    const auto p99 = members[calls[j].member]->state->ReadP99();
    at.emplace_back(started + std::max<transport::Clock::duration>(options_.lookup_budget, p99), j);
  }
  std::sort(at.begin(), at.end());
  std::set<NodeHealth*> late;
  for (const auto& [when, j] : at) {
    if (group.WaitUntil([] { return false; }, when)) break;  // every call came back
    if (calls[j].outcome.wait_for(std::chrono::seconds(0)) == std::future_status::ready) continue;
    Member& member = *members[calls[j].member];
    member.channel->Cancel(calls[j].id);
    hedged[j] = true;
    accounting_.Abandoned();
    if (late.insert(member.state.get()).second) member.state->Late();
  }
  return hedged;
}

}  // namespace kvstash::connector
