#pragma once

// One offload node's health as this client's calls find it (docs/semantics.md §14):
//
//   up       calls go to it;
//   suspect  it failed, timed out or missed a caller's budget `suspect_after` times in a row
//            with no answer in between: calls skip it at once (its keys read as misses, stores
//            and reads go to the other replicas). The client probes it, one probe at a time,
//            started at most every `probe_interval` by a call that skips it: a call of its own
//            (an echo, deadline `probe_timeout`) that no engine call waits for. Any answer from
//            it (a probe's, or a late one of a call sent before) makes it up again.
//
// A node that answers slowly but answers is never suspect: each answer starts the count
// again. A node stopped or cut off answers nothing, and after `suspect_after` calls costs its
// callers nothing more. Says when a node goes down and comes back (once each way) and the first
// refusal of each code. Shared with the callbacks of calls in flight, so it outlives a member
// that left. Thread-safe.

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <set>
#include <string>

#include "kvstash/common/mutex.h"
#include "kvstash/common/status.h"

namespace kvstash::connector {

struct HealthOptions {
  uint32_t suspect_after = 2;
  std::chrono::milliseconds probe_interval{200};
  // A probe's deadline; a probe whose outcome was never told stops blocking the next one after
  // this long.
  std::chrono::milliseconds probe_timeout{1000};
};

// Down, slow past the deadline, or cut off while the call was out: the node did not answer.
bool Unreachable(const Status& status);

class NodeHealth {
 public:
  using Clock = std::chrono::steady_clock;

  NodeHealth(std::string name, HealthOptions options);

  const std::string& name() const { return name_; }
  bool suspect() const { return suspect_.load(std::memory_order_acquire); }

  enum class Admission {
    kGo,     // up: the call goes to the node
    kSkip,   // suspect: the call skips it
    kProbe,  // suspect, and this caller sends the probe (and skips it for its own call)
  };
  // Whether a call may go to the node now: always when up; when suspect, never, but one
  // caller gets kProbe when none is out and probe_interval passed since the last began. That
  // caller sends the probe and reports its outcome (Record), or the probe lapses after
  // probe_timeout.
  Admission Admit(Clock::time_point now);

  // The outcome of a call. An answer (OK, or one that is not an error: NotFound, Aborted) or
  // a refusal makes the node up; an unreachable status counts a failure. Returns whether it
  // was a refusal (counted by the caller), logged the first time for its code.
  bool Record(const Status& status);
  // A call that missed its caller's budget (it goes on): a failure, unless an answer comes.
  void Late();
  // How long a read it answered took; ReadP99: the 99th percentile of the recent ones (zero
  // before any).
  void ReadTook(std::chrono::nanoseconds took);
  std::chrono::nanoseconds ReadP99();

  // A member that its source no longer lists but that still answers (an etcd lease lapsed
  // while the node serves): its first failure makes it suspect, and the client drops it then.
  void SetLingering(bool lingering) { lingering_.store(lingering, std::memory_order_release); }
  bool lingering() const { return lingering_.load(std::memory_order_acquire); }

  // A refusal made here, before the call went (what the node would refuse): logged as the
  // node's refusals are (once per code), its health unchanged.
  void RefusedHere(const Status& status) { LogRefusal(status); }

 private:
  void Failure(const Status* why);
  void Answered();
  void LogRefusal(const Status& status);

  const std::string name_;
  HealthOptions options_;
  std::atomic<uint32_t> failures_{0};  // in a row, since the last answer
  std::atomic<bool> suspect_{false};
  std::atomic<bool> lingering_{false};
  std::atomic<bool> down_logged_{false};
  // Steady clock, since its epoch: the earliest next probe, and until when one is out.
  std::atomic<int64_t> next_probe_ns_{0};
  std::atomic<int64_t> probe_until_ns_{0};
  Mutex mu_;
  std::set<int> logged_codes_ GUARDED_BY(mu_);
  static constexpr size_t kReadSamples = 128;
  std::array<int64_t, kReadSamples> reads_ns_ GUARDED_BY(mu_){};
  size_t reads_ GUARDED_BY(mu_) = 0;  // ever; the latest kReadSamples are kept
};

}  // namespace kvstash::connector
