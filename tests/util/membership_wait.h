#pragma once

// Waiting for a MembershipWatcher to see a number of members, for tests of membership.

#include <chrono>
#include <thread>

#include "kvstash/membership/membership.h"

namespace kvstash::testing {

// Waits up to `timeout` for `watcher` to see `count` members: whether it did.
inline bool WaitForMembers(const membership::MembershipWatcher& watcher, size_t count,
                           std::chrono::milliseconds timeout) {
  const auto until = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < until) {
    if (watcher.members().size() == count) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return watcher.members().size() == count;
}

}  // namespace kvstash::testing
