// How the cluster client waits for calls to nodes that may answer nothing: probes past the
// lookup budget, and connections reset when a probe finds the node unreachable.

#include "cluster/call_watch.h"

#include <algorithm>
#include <atomic>
#include <memory>

namespace kvstash::connector {

void CallWatch::WaitWatching(transport::CallGroup& group, const std::vector<OutCall>& calls,
                             const std::function<bool()>& settled,
                             transport::Clock::time_point started, std::vector<bool>* abandoned) {
  if (options_.lookup_budget >= options_.timeout) return;
  auto out = [&](size_t k) {
    return !(*abandoned)[k] &&
           calls[k].outcome->wait_for(std::chrono::seconds(0)) != std::future_status::ready;
  };
  if (group.WaitUntil(settled, started + options_.lookup_budget)) return;
  // The nodes of the calls still out, each probed once: 0 out, 1 answered, 2 unreachable.
  struct Probe {
    Member* member;
    std::shared_ptr<std::atomic<int>> state = std::make_shared<std::atomic<int>>(0);
    bool handled = false;
  };
  std::vector<Probe> probes;
  for (size_t k = 0; k < calls.size(); ++k) {
    if (!out(k)) continue;
    if (std::any_of(probes.begin(), probes.end(),
                    [&](const Probe& p) { return p.member == calls[k].member; })) {
      continue;
    }
    Probe probe{calls[k].member};
    calls_.StartProbe(*probe.member, [state = probe.state](bool answered) {
      state->store(answered ? 1 : 2, std::memory_order_release);
    });
    probes.push_back(std::move(probe));
  }
  auto failed = [&] {
    return std::any_of(probes.begin(), probes.end(), [](const Probe& p) {
      return !p.handled && p.state->load(std::memory_order_acquire) == 2;
    });
  };
  const auto give_up = started + options_.timeout;
  constexpr auto kSlice = std::chrono::milliseconds(10);  // how often the probes are looked at
  while (!settled()) {
    const auto now = transport::Clock::now();
    if (now >= give_up) return;
    if (group.WaitUntil([&] { return settled() || failed(); }, std::min(give_up, now + kSlice)) &&
        !failed()) {
      return;  // every call came back, or settled
    }
    for (Probe& probe : probes) {
      if (probe.handled || probe.state->load(std::memory_order_acquire) != 2) continue;
      probe.handled = true;
      for (size_t k = 0; k < calls.size(); ++k) {
        if (calls[k].member != probe.member || !out(k)) continue;
        (*abandoned)[k] = true;
        accounting_.Abandoned();
      }
      // Cancelled calls whose transfer is under way would hold their buffers to the deadline:
      // the connection goes, and every call out to the node with it.
      probe.member->channel->Reset(UnavailableError(
          "node {} answered neither its calls within {} ms nor a probe within {} ms; its "
          "connection is reset",
          probe.member->state->name(), options_.lookup_budget.count(),
          options_.probe_timeout.count()));
    }
  }
}

}  // namespace kvstash::connector
