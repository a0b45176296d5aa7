#include "kvstash/transport/call_group.h"

#include <sched.h>

#include <algorithm>
#include <chrono>
#include <utility>

namespace kvstash::transport {
namespace {
constexpr auto kSpin = std::chrono::microseconds(50);
}  // namespace

CallGroup::~CallGroup() { Drain(); }

ResponseCallback CallGroup::Track(ResponseCallback done) {
  {
    MutexLock lock(&mu_);
    ++outstanding_;
  }
  return [this, done = std::move(done)](const Response& response) {
    if (done) done(response);
    MutexLock lock(&mu_);
    --outstanding_;
    events_.fetch_add(1, std::memory_order_release);
    cv_.Signal();
  };
}

void CallGroup::Post(std::function<void()> copy) {
  MutexLock lock(&mu_);
  copies_.push_back(std::move(copy));
  events_.fetch_add(1, std::memory_order_release);
  cv_.Signal();
}

void CallGroup::Wait() {
  (void)WaitUntil([] { return false; }, std::chrono::steady_clock::time_point::max());
}

bool CallGroup::WaitUntil(const std::function<bool()>& enough,
                          std::chrono::steady_clock::time_point until) {
  while (true) {
    std::function<void()> copy;
    uint64_t seen = 0;
    {
      MutexLock lock(&mu_);
      if (copies_.empty() && outstanding_ == 0) return true;
      if (!copies_.empty()) {
        copy = std::move(copies_.front());
        copies_.pop_front();
      } else {
        seen = events_.load(std::memory_order_relaxed);
      }
    }
    if (copy) {
      copy();
      continue;
    }
    if (enough()) return true;
    if (std::chrono::steady_clock::now() >= until) return false;
    const auto spin_until = std::min(until, std::chrono::steady_clock::now() + kSpin);
    while (events_.load(std::memory_order_acquire) == seen &&
           std::chrono::steady_clock::now() < spin_until) {
      sched_yield();
    }
    // The transport answers in microseconds: polled a while above before sleeping, as the
    // progress thread does, since a sleeping thread takes tens of microseconds to wake.
    MutexLock lock(&mu_);
    while (copies_.empty() && outstanding_ != 0 &&
           events_.load(std::memory_order_relaxed) == seen) {
      if (until == std::chrono::steady_clock::time_point::max()) {
        cv_.Wait(&mu_);
        continue;
      }
      const auto now = std::chrono::steady_clock::now();
      if (now >= until) break;
      cv_.WaitFor(&mu_, until - now);
    }
  }
}

void CallGroup::Drain() {
  while (true) {
    std::function<void()> copy;
    {
      MutexLock lock(&mu_);
      if (copies_.empty()) return;
      copy = std::move(copies_.front());
      copies_.pop_front();
    }
    copy();
  }
}

}  // namespace kvstash::transport
