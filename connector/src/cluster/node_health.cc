#include "node_health.h"

#include <algorithm>

#include "kvstash/common/logging.h"

namespace kvstash::connector {

bool Unreachable(const Status& status) {
  return status.code() == StatusCode::kUnavailable ||
         status.code() == StatusCode::kDeadlineExceeded || status.code() == StatusCode::kCancelled;
}

NodeHealth::NodeHealth(std::string name, HealthOptions options)
    : name_(std::move(name)), options_(options) {
  if (options_.suspect_after == 0) options_.suspect_after = 1;
}

NodeHealth::Admission NodeHealth::Admit(Clock::time_point now) {
  if (!suspect_.load(std::memory_order_acquire)) return Admission::kGo;
  const int64_t at = now.time_since_epoch().count();
  if (at < probe_until_ns_.load(std::memory_order_acquire)) return Admission::kSkip;  // one out
  int64_t next = next_probe_ns_.load(std::memory_order_relaxed);
  if (at < next) return Admission::kSkip;
  // One caller wins the probe.
  const auto ns = [](std::chrono::milliseconds d) {
    return std::chrono::duration_cast<Clock::duration>(d).count();
  };
  if (!next_probe_ns_.compare_exchange_strong(next, at + ns(options_.probe_interval),
                                              std::memory_order_acq_rel)) {
    return Admission::kSkip;
  }
  probe_until_ns_.store(at + ns(options_.probe_timeout), std::memory_order_release);
  return Admission::kProbe;
}

bool NodeHealth::Record(const Status& status) {
  if (Unreachable(status)) {
    probe_until_ns_.store(0, std::memory_order_release);
    Failure(&status);
    return false;
  }
  Answered();
  const StatusCode code = status.code();
  if (status.ok() || code == StatusCode::kNotFound || code == StatusCode::kAborted) return false;
  LogRefusal(status);
  return true;
}

void NodeHealth::LogRefusal(const Status& status) {
  bool first = false;
  {
    MutexLock lock(&mu_);
    first = logged_codes_.insert(static_cast<int>(status.code())).second;
  }
  if (first) {
    KVSTASH_LOG_ERROR(
        "offload node {} refused a call: {} (logged once per node and code; every refusal is "
        "counted)",
        name_, status.ToString());
  }
}

void NodeHealth::Late() { Failure(nullptr); }

void NodeHealth::ReadTook(std::chrono::nanoseconds took) {
  MutexLock lock(&mu_);
  reads_ns_[reads_++ % kReadSamples] = took.count();
}

std::chrono::nanoseconds NodeHealth::ReadP99() {
  std::array<int64_t, kReadSamples> samples;
  size_t n = 0;
  {
    MutexLock lock(&mu_);
    n = std::min(reads_, kReadSamples);
    samples = reads_ns_;
  }
  if (n == 0) return std::chrono::nanoseconds(0);
  const size_t rank = (n * 99 + 99) / 100 - 1;  // ceil(0.99 n) - 1
  std::nth_element(samples.begin(), samples.begin() + static_cast<ptrdiff_t>(rank),
                   samples.begin() + static_cast<ptrdiff_t>(n));
  return std::chrono::nanoseconds(samples[rank]);
}

void NodeHealth::Failure(const Status* why) {
  const uint32_t failures = failures_.fetch_add(1, std::memory_order_acq_rel) + 1;
  if (why != nullptr && !down_logged_.exchange(true, std::memory_order_acq_rel)) {
    KVSTASH_LOG_WARN(
        "offload node {} is unreachable ({}); its keys read as misses until it answers", name_,
        why->ToString());
  }
  const uint32_t threshold = lingering() ? 1 : options_.suspect_after;
  if (failures >= threshold && !suspect_.exchange(true, std::memory_order_acq_rel)) {
    next_probe_ns_.store((Clock::now() + options_.probe_interval).time_since_epoch().count(),
                         std::memory_order_relaxed);
    if (!down_logged_.exchange(true, std::memory_order_acq_rel)) {
      KVSTASH_LOG_WARN(
          "offload node {} did not answer {} call(s) within their budget; calls skip it (its "
          "keys read as misses) and it is probed every {} ms until it answers",
          name_, failures, options_.probe_interval.count());
    }
  }
}

void NodeHealth::Answered() {
  probe_until_ns_.store(0, std::memory_order_release);
  failures_.store(0, std::memory_order_release);
  suspect_.store(false, std::memory_order_release);
  if (down_logged_.exchange(false, std::memory_order_acq_rel)) {
    KVSTASH_LOG_INFO("offload node {} answers again", name_);
  }
}

}  // namespace kvstash::connector
