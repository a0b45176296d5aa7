// RpcClient::Impl: deadlines, one timer for every call of the client (progress thread).

#include <functional>
#include <utility>
#include <vector>

#include "rpc_client_impl.h"

namespace kvstash::transport {

// ---- deadlines -------------------------------------------------------------------------------

void RpcClient::Impl::ScheduleDeadline(Clock::time_point deadline, uint64_t id) {
  // Entries of finished calls stay until their deadline passes; at a high call rate with
  // long deadlines they would pile up, so the heap is rebuilt from the calls still here when
  // it holds more than twice as many.
  if (deadlines_.size() >= 1024 && deadlines_.size() > 2 * calls_.size()) {
    std::vector<Deadline> live;
    live.reserve(calls_.size());
    for (const auto& [call_id, call] : calls_) {
      // Resolved calls still here wait for a transfer: their deadline resets a stalled peer.
      if (call_id != id) live.emplace_back(call->deadline, call_id);
    }
    deadlines_ = decltype(deadlines_)(std::greater<>(), std::move(live));
  }
  deadlines_.emplace(deadline, id);
  if (!timer_armed_ || deadline < timer_at_) ArmTimer(deadline);
}

void RpcClient::Impl::ArmTimer(Clock::time_point at) {
  timer_armed_ = true;
  timer_at_ = at;
  timer_.expires_at(at);
  timer_.async_wait([this](const asio::error_code& error) {
    if (error == asio::error::operation_aborted) return;
    timer_armed_ = false;
    OnDeadlines();
  });
}

void RpcClient::Impl::OnDeadlines() {
  const auto now = Clock::now();
  size_t stuck = 0;
  while (!deadlines_.empty() && deadlines_.top().first <= now) {
    const uint64_t id = deadlines_.top().second;
    deadlines_.pop();
    auto it = calls_.find(id);
    if (it == calls_.end()) continue;
    PendingCall* call = it->second.get();
    if (!call->resolved) {
      if (call->sent && ep_) SendCancelFrame(id);
      Resolve(call,
              DeadlineExceededError("call {} (method {}) passed its deadline", id, call->method));
    }
    // Still here: a transfer the peer does not finish, or a copy its copier still has (which
    // completes the call when it runs: the copier must run it, and soon).
    if (auto left = calls_.find(id); left != calls_.end() && !left->second->copying) ++stuck;
  }
  if (stuck != 0) {
    Disconnect(UnavailableError("{}:{} stalled with {} transfer(s) in flight; connection reset",
                                options_.host, options_.port, stuck));
  }
  if (!deadlines_.empty()) ArmTimer(deadlines_.top().first);
}

}  // namespace kvstash::transport
