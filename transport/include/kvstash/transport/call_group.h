#pragma once

// CallGroup: waits for a group of calls on the calling thread and makes their same-host
// payload copies there meanwhile (see CopyExecutor), so that every client thread copies its own
// blocks and many copy at once.

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>

#include "kvstash/common/mutex.h"
#include "kvstash/transport/channel.h"

namespace kvstash::transport {

// Usage: set CallOptions::copier to the group and wrap each call's callback with Track, then
// Wait. Thread-safe; one thread waits. The destructor runs copies still posted (a call whose
// callback the transport ran early, as when a connection is lost, may leave one behind: it
// then skips the copy).
class CallGroup final : public CopyExecutor {
 public:
  CallGroup() = default;
  ~CallGroup() override;
  CallGroup(const CallGroup&) = delete;
  CallGroup& operator=(const CallGroup&) = delete;

  // Counts a call in the group: returns `done` wrapped so that its completion is counted.
  ResponseCallback Track(ResponseCallback done);
  void Post(std::function<void()> copy) override;
  // Makes the posted copies on this thread until every tracked call has completed.
  void Wait();
  // The same, until every tracked call has completed (true), or `enough` holds (true; asked
  // after each call's completion, never while a copy runs), or `until` passes (false). Calls
  // still out stay tracked: Cancel them and Wait before the buffers they use go away.
  bool WaitUntil(const std::function<bool()>& enough, std::chrono::steady_clock::time_point until);

 private:
  // Runs the copies posted so far.
  void Drain();

  std::atomic<uint64_t> events_{0};  // copies posted and calls completed, ever
  Mutex mu_;
  CondVar cv_;
  size_t outstanding_ GUARDED_BY(mu_) = 0;
  std::deque<std::function<void()>> copies_ GUARDED_BY(mu_);
};

}  // namespace kvstash::transport
