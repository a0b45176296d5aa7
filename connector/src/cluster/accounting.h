#pragma once

// The cluster client's own counters (BlockStoreCounters) and the logs of its nodes' health:
// every call's outcome goes through Accounting::Record. Shared with the callbacks of calls that
// outlive their caller (a lookup's late answers). Thread-safe.

#include <atomic>
#include <cstdint>

#include "cluster/node_health.h"
#include "kvstash/connector/block_store_client.h"

namespace kvstash::connector {

// Every call's outcome goes through Record: counters, and the logs that say when a node went
// down, came back, or refused something. Thread-safe.
class Accounting {
 public:
  void CallStarted() { calls_.fetch_add(1, std::memory_order_relaxed); }
  void Touched(size_t keys) { touched_keys_.fetch_add(keys, std::memory_order_relaxed); }
  void Pinned(size_t keys) { pinned_keys_.fetch_add(keys, std::memory_order_relaxed); }
  void Unserved(size_t keys) { unserved_.fetch_add(keys, std::memory_order_relaxed); }
  // A call not sent to a suspect node; a lookup's keys not answered within its budget.
  void Skipped() { skipped_.fetch_add(1, std::memory_order_relaxed); }
  void Probed() { probes_.fetch_add(1, std::memory_order_relaxed); }
  // A call to a replica given up (cancelled) once another answered.
  void Abandoned() { abandoned_.fetch_add(1, std::memory_order_relaxed); }
  void Late(size_t keys) { late_keys_.fetch_add(keys, std::memory_order_relaxed); }
  // A call refused here, before it went (what the node would refuse).
  void RefusedHere(NodeHealth& n, const Status& status) {
    refused_.fetch_add(1, std::memory_order_relaxed);
    n.RefusedHere(status);
  }
  void Repaired(size_t blocks) { repaired_.fetch_add(blocks, std::memory_order_relaxed); }
  void MembersChanged(size_t joined, size_t left) {
    joined_.fetch_add(joined, std::memory_order_relaxed);
    left_.fetch_add(left, std::memory_order_relaxed);
  }

  // Records the outcome of a call to a node (NodeHealth::Record: up, down, suspect, and the
  // logs): unreachable ones and refusals are counted.
  void Record(NodeHealth& n, const Status& status) {
    if (Unreachable(status)) unreachable_.fetch_add(1, std::memory_order_relaxed);
    if (n.Record(status)) refused_.fetch_add(1, std::memory_order_relaxed);
  }

  BlockStoreCounters counters() const {
    BlockStoreCounters c;
    c.calls = calls_.load(std::memory_order_relaxed);
    c.unreachable = unreachable_.load(std::memory_order_relaxed);
    c.refused = refused_.load(std::memory_order_relaxed);
    c.touched_keys = touched_keys_.load(std::memory_order_relaxed);
    c.pinned_keys = pinned_keys_.load(std::memory_order_relaxed);
    c.unserved_keys = unserved_.load(std::memory_order_relaxed);
    c.repaired_blocks = repaired_.load(std::memory_order_relaxed);
    c.members_joined = joined_.load(std::memory_order_relaxed);
    c.members_left = left_.load(std::memory_order_relaxed);
    c.skipped_calls = skipped_.load(std::memory_order_relaxed);
    c.late_keys = late_keys_.load(std::memory_order_relaxed);
    c.probes = probes_.load(std::memory_order_relaxed);
    c.abandoned_calls = abandoned_.load(std::memory_order_relaxed);
    return c;
  }

 private:
  std::atomic<uint64_t> calls_{0}, unreachable_{0}, refused_{0}, touched_keys_{0}, pinned_keys_{0},
      unserved_{0}, repaired_{0}, joined_{0}, left_{0}, skipped_{0}, late_keys_{0}, probes_{0},
      abandoned_{0};
};

}  // namespace kvstash::connector
