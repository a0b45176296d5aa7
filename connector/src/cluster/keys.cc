// The cluster client's calls of keys alone: touches, pins and their releases.

#include "cluster/keys.h"

#include <algorithm>
#include <future>
#include <utility>

namespace kvstash::connector {

void KeyCalls::Pin(std::span<const BlockKey> keys) {
  if (keys.empty()) return;
  const auto topology = members_.snapshot();
  const Members& members = topology->members;
  std::vector<std::vector<size_t>> by_node;
  std::vector<bool> wanted;
  std::vector<Placement> places;
  placer_.ByNode(members, keys, &by_node, &wanted, &places);
  {
    MutexLock lock(&pins_mu_);
    for (size_t i = 0; i < keys.size(); ++i) {
      std::vector<std::weak_ptr<Member>> at;
      const Placement& p = places[i];
      for (uint32_t r = 0; r < p.count; ++r) at.push_back(members[p.nodes[r]]);
      pins_[keys[i]].push_back(std::move(at));
    }
  }
  (void)StartKeyCalls<wire::LoadRequest>(
      members, by_node, wanted, keys, [this](Member& member, const wire::LoadRequest& request) {
        calls_.StartAsync(member, wire::METHOD_LOAD, request,
                          [this, state = member.state](const Outcome& outcome) {
                            wire::LoadReply reply;
                            const Status status = ParseReply(outcome, &reply);
                            accounting_.Record(*state, status);
                            if (status.ok()) {
                              accounting_.Pinned(static_cast<size_t>(
                                  std::count(reply.pinned().begin(), reply.pinned().end(), true)));
                            }
                          });
      });
}

void KeyCalls::Unpin(std::span<const BlockKey> keys) {
  if (keys.empty()) return;
  const auto topology = members_.snapshot();
  Members members;
  std::map<const Member*, size_t> index;
  std::vector<std::vector<size_t>> by_node;
  auto add = [&](const std::shared_ptr<Member>& member, size_t key) {
    auto [it, fresh] = index.emplace(member.get(), members.size());
    if (fresh) {
      members.push_back(member);
      by_node.emplace_back();
    }
    by_node[it->second].push_back(key);
  };
  {
    MutexLock lock(&pins_mu_);
    for (size_t i = 0; i < keys.size(); ++i) {
      auto it = pins_.find(keys[i]);
      if (it == pins_.end()) {
        const Placement p = placer_.Place(topology->members, keys[i]);
        for (uint32_t r = 0; r < p.count; ++r) add(topology->members[p.nodes[r]], i);
        continue;
      }
      for (const std::weak_ptr<Member>& weak : it->second.front()) {
        if (std::shared_ptr<Member> member = weak.lock()) add(member, i);
      }
      it->second.pop_front();
      if (it->second.empty()) pins_.erase(it);
    }
  }
  const std::vector<bool> wanted(members.size(), true);
  (void)StartKeyCalls<wire::ReleaseRequest>(
      members, by_node, wanted, keys, [this](Member& member, const wire::ReleaseRequest& request) {
        calls_.StartAsync(member, wire::METHOD_RELEASE, request,
                          [this, state = member.state](const Outcome& outcome) {
                            accounting_.Record(*state,
                                               ParseReply(outcome, (wire::ReleaseReply*)nullptr));
                          });
      });
}

void KeyCalls::Touch(std::span<const BlockKey> keys, bool refresh) {
  if (keys.empty()) return;
  (void)StartKeyCalls<wire::TouchRequest>(
      keys, [this, refresh](Member& member, const wire::TouchRequest& keys_only) {
        accounting_.Touched(static_cast<size_t>(keys_only.keys_size()));
        wire::TouchRequest request = keys_only;
        request.set_refresh(refresh);
        calls_.StartAsync(member, wire::METHOD_TOUCH, request,
                          [this, state = member.state](const Outcome& outcome) {
                            accounting_.Record(*state,
                                               ParseReply(outcome, (wire::TouchReply*)nullptr));
                          });
      });
}

Status KeyCalls::TouchSync(std::span<const BlockKey> keys) {
  std::vector<std::pair<std::shared_ptr<NodeHealth>, std::future<Outcome>>> calls;
  Status first = StartKeyCalls<wire::TouchRequest>(
      keys, [&](Member& member, const wire::TouchRequest& request) {
        accounting_.Touched(static_cast<size_t>(request.keys_size()));
        calls.emplace_back(member.state, calls_.Start(member, wire::METHOD_TOUCH, request));
      });
  for (auto& [state, future] : calls) {
    const Status status = ParseReply(future.get(), (wire::TouchReply*)nullptr);
    accounting_.Record(*state, status);
    if (!status.ok() && first.ok()) first = AtNode(state->name(), status);
  }
  return first;
}

}  // namespace kvstash::connector
