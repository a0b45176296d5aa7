// The cluster client's stores: every replica, done once one holds each block (docs/semantics.md
// §16).

#include "cluster/store.h"

#include <fmt/format.h>

#include <algorithm>
#include <future>
#include <memory>
#include <utility>
#include <vector>

#include "kvstash/proto/convert.h"

namespace kvstash::connector {

Status ClusterStore::Put(std::span<const BlockKey> keys, std::span<const transport::Bytes> blocks,
                         std::span<const BlockMeta> metas) {
  if (keys.size() != blocks.size()) {
    return InvalidArgumentError("{} keys for {} blocks", keys.size(), blocks.size());
  }
  if (!metas.empty() && metas.size() != keys.size()) {
    return InvalidArgumentError("{} keys with {} block metadata; give none or one per key",
                                keys.size(), metas.size());
  }
  if (keys.empty()) return Status::OK();
  const auto topology = members_.snapshot();
  const Members& members = topology->members;
  if (members.empty()) {
    accounting_.Unserved(keys.size());
    return UnavailableError("no live offload node in cluster {} for {} block(s)", options_.cluster,
                            keys.size());
  }
  std::vector<std::vector<size_t>> by_node;
  std::vector<bool> wanted;
  placer_.ByNode(members, keys, &by_node, &wanted);
  const std::vector<Result<NodeLimits>> limits = calls_.LimitsOf(members, wanted);
  Status refusal;                              // the first refusal, of any block
  std::vector<Status> unreached(keys.size());  // per block: a replica that did not answer
  std::vector<bool> stored(keys.size(), false);
  auto failed = [&](const Member& m, size_t i, const Status& status) {
    Status named(status.code(), fmt::format("node {}: block {}: {}", m.state->name(),
                                            keys[i].ToString(), status.message()));
    if (Unreachable(status)) {
      if (unreached[i].ok()) unreached[i] = std::move(named);
    } else if (refusal.ok()) {
      refusal = std::move(named);
    }
  };
  transport::CallGroup group;
  // Per block: its calls still out, and whether a replica holds it (written by the
  // callbacks, under settle_mu).
  struct Settle {
    Mutex mu;
    std::vector<uint32_t> out GUARDED_BY(mu);
    std::vector<bool> held GUARDED_BY(mu);
    size_t unsettled GUARDED_BY(mu) = 0;  // blocks with calls out and no replica holding them
  };
  auto settle = std::make_shared<Settle>();
  {
    MutexLock lock(&settle->mu);
    settle->out.assign(keys.size(), 0);
    settle->held.assign(keys.size(), false);
  }
  // A call's keys are settled by its outcome: each held once a replica took it, or once its
  // last call is out with none holding it. Run by the callbacks.
  auto settle_keys = [settle](const std::vector<size_t>& which, const std::vector<Status>& got) {
    MutexLock lock(&settle->mu);
    for (size_t k = 0; k < which.size(); ++k) {
      const size_t i = which[k];
      const bool was_unsettled = !settle->held[i];
      if (got[k].ok()) settle->held[i] = true;
      --settle->out[i];
      if (was_unsettled && (settle->held[i] || settle->out[i] == 0)) --settle->unsettled;
    }
  };
  // One PutBlock, or one PutBlocks of a member's small blocks (`staging` holding their bytes).
  struct PutCall {
    Member* member;
    std::vector<size_t> keys;
    uint64_t id = 0;
    std::future<Outcome> outcome;
    bool batch = false;
  };
  std::vector<PutCall> puts;
  puts.reserve(keys.size() * options_.replicas);
  // Per member: the keys whose blocks go batched, in the order they are placed.
  std::vector<std::vector<size_t>> batched(members.size());
  for (size_t i = keys.size(); i-- > 0;) {
    const Placement p = placer_.Place(members, keys[i]);
    for (uint32_t r = 0; r < p.count; ++r) {
      const size_t n = p.nodes[r];
      Member& member = *members[n];
      if (!limits[n].ok()) {
        // The node's name is in the status already.
        const Status& error = limits[n].status();
        if (Unreachable(error)) {
          if (unreached[i].ok()) {
            unreached[i] = Status(error.code(),
                                  fmt::format("{}: block {}", error.message(), keys[i].ToString()));
          }
        } else if (refusal.ok()) {
          refusal = Status(error.code(),
                           fmt::format("{}: block {}", error.message(), keys[i].ToString()));
        }
        continue;
      }
      // What the node would refuse is refused here, without moving the bytes.
      Status refused;
      if (limits[n]->block_bytes != 0 && blocks[i].size() != limits[n]->block_bytes) {
        refused = InvalidArgumentError("a block of {} bytes; the node's block size is {}",
                                       blocks[i].size(), limits[n]->block_bytes);
      } else if (limits[n]->max_payload_bytes != 0 &&
                 blocks[i].size() > limits[n]->max_payload_bytes) {
        refused = InvalidArgumentError("a block of {} bytes; the largest payload is {}",
                                       blocks[i].size(), limits[n]->max_payload_bytes);
      }
      if (!refused.ok()) {
        accounting_.RefusedHere(*member.state, refused);  // its health is unchanged
        failed(member, i, refused);
        continue;
      }
      {
        MutexLock lock(&settle->mu);
        if (settle->out[i]++ == 0 && !settle->held[i]) ++settle->unsettled;
      }
      if (BlocksPerPutBatch(*limits[n]) != 0) {
        batched[n].push_back(i);
        continue;
      }
      auto promise = std::make_shared<std::promise<Outcome>>();
      PutCall& call = puts.emplace_back();
      call.member = &member;
      call.keys = {i};
      call.outcome = promise->get_future();
      call.id =
          calls_.StartPut(group, member, keys[i], blocks[i], metas.empty() ? nullptr : &metas[i],
                          [settle_keys, i, promise](Outcome o) {
                            settle_keys({i}, {o.status});
                            promise->set_value(std::move(o));
                          });
    }
  }
  // A batch's blocks go back to back in staging memory of this thread's, kept between stores
  // (every call has ended when a store returns) unless large.
  thread_local std::vector<std::byte> staging;
  size_t staged = 0;
  for (size_t n = 0; n < members.size(); ++n) {
    for (size_t i : batched[n]) staged += blocks[i].size();
  }
  if (staging.size() < staged) staging.resize(staged);
  struct Trim {
    ~Trim() {
      if (staging.capacity() > kMaxKeptStaging) std::vector<std::byte>().swap(staging);
    }
  } trim;
  size_t at = 0;
  for (size_t n = 0; n < members.size(); ++n) {
    const size_t per_batch = batched[n].empty() ? 0 : BlocksPerPutBatch(*limits[n]);
    for (size_t begin = 0; begin < batched[n].size(); begin += per_batch) {
      const size_t end = std::min(batched[n].size(), begin + per_batch);
      auto promise = std::make_shared<std::promise<Outcome>>();
      PutCall& call = puts.emplace_back();
      call.member = members[n].get();
      call.keys.assign(batched[n].begin() + begin, batched[n].begin() + end);
      call.batch = true;
      call.outcome = promise->get_future();
      size_t bytes = 0;
      for (size_t i : call.keys) bytes += blocks[i].size();
      const transport::MutableBytes room = std::span(staging).subspan(at, bytes);
      at += bytes;
      call.id = calls_.StartPutBatch(group, *call.member, keys, blocks, metas, call.keys, room,
                                     [settle_keys, which = call.keys, promise](Outcome o) {
                                       wire::PutBlocksReply reply;
                                       settle_keys(which, BatchStatuses(o, which.size(), &reply));
                                       promise->set_value(std::move(o));
                                     });
    }
  }
  const std::vector<bool> abandoned = watch_.WaitForReplicas(group, puts, [settle] {
    MutexLock lock(&settle->mu);
    return settle->unsettled == 0;
  });
  for (size_t k = 0; k < puts.size(); ++k) {
    PutCall& call = puts[k];
    const Outcome outcome = call.outcome.get();
    std::vector<Status> statuses;
    if (call.batch) {
      wire::PutBlocksReply reply;
      statuses = BatchStatuses(outcome, call.keys.size(), &reply);
    } else {
      statuses = {ParseReply(outcome, (wire::PutBlockReply*)nullptr)};
    }
    const Status& status = call.batch ? outcome.status : statuses[0];
    // An abandoned call's node was told it was late; its cancel is no answer of its own.
    if (!abandoned[k] || status.ok()) accounting_.Record(*call.member->state, status);
    for (size_t j = 0; j < call.keys.size(); ++j) {
      const size_t i = call.keys[j];
      if (statuses[j].ok()) {
        stored[i] = true;
        continue;
      }
      // A batch's refusals of single keys count as the node's refusals of PutBlock would.
      if (call.batch && status.ok()) accounting_.Record(*call.member->state, statuses[j]);
      failed(*call.member, i, statuses[j]);
    }
  }
  Status lost;  // the first key no replica took, all unreachable
  size_t unserved = 0;
  for (size_t i = keys.size(); i-- > 0;) {
    if (!stored[i] && !unreached[i].ok()) {
      ++unserved;
      if (lost.ok()) lost = unreached[i];
    }
  }
  accounting_.Unserved(unserved);
  return refusal.ok() ? lost : refusal;
}

}  // namespace kvstash::connector
