// A thread that runs tasks and timers in order, for the transports that keep their own thread
// (the loopback network, the fault channel's timers).
#pragma once

#include <atomic>
#include <functional>
#include <map>
#include <thread>
#include <vector>

#include "kvstash/common/mutex.h"
#include "kvstash/transport/channel.h"

namespace kvstash::transport {

// Runs tasks and timers on one thread, in order. Tasks queued when it stops still run; timers
// not yet due are dropped. Thread-safe.
class Executor {
 public:
  Executor() : thread_([this] { Loop(); }) {}
  ~Executor() {
    {
      MutexLock lock(&mu_);
      stop_ = true;
    }
    cv_.SignalAll();
    thread_.join();
  }

  void Run(std::function<void()> fn) {
    {
      MutexLock lock(&mu_);
      ready_.push_back(std::move(fn));
    }
    cv_.Signal();
  }
  void RunAt(Clock::time_point at, std::function<void()> fn) {
    {
      MutexLock lock(&mu_);
      timers_.emplace(at, std::move(fn));
    }
    cv_.Signal();
  }
  bool OnThread() const { return std::this_thread::get_id() == id_.load(); }

 private:
  void Loop() {
    id_ = std::this_thread::get_id();
    for (;;) {
      std::function<void()> fn;
      {
        MutexLock lock(&mu_);
        for (;;) {
          if (!ready_.empty()) {
            fn = std::move(ready_.front());
            ready_.erase(ready_.begin());
            break;
          }
          const auto now = Clock::now();
          if (!timers_.empty() && timers_.begin()->first <= now) {
            fn = std::move(timers_.begin()->second);
            timers_.erase(timers_.begin());
            break;
          }
          if (stop_) return;
          if (timers_.empty()) {
            cv_.Wait(&mu_);
          } else {
            cv_.WaitFor(&mu_, timers_.begin()->first - now);
          }
        }
      }
      fn();
    }
  }

  Mutex mu_;
  CondVar cv_;
  std::vector<std::function<void()>> ready_ GUARDED_BY(mu_);
  std::multimap<Clock::time_point, std::function<void()>> timers_ GUARDED_BY(mu_);
  bool stop_ GUARDED_BY(mu_) = false;
  std::atomic<std::thread::id> id_{};
  std::thread thread_;  // last: starts once the rest is constructed
};

}  // namespace kvstash::transport
