#pragma once

// The cluster client's own counters (BlockStoreCounters) and the logs of its nodes' health:
// every call's outcome goes through Accounting::Record. Shared with the callbacks of calls that
// outlive their caller (a lookup's late answers). Thread-safe.

#include <atomic>
#include <cstdint>

#include "cluster/node_health.h"
#include "kvstash/common/client_counters.h"
#include "kvstash/connector/block_store_client.h"

namespace kvstash::connector {

// Every call's outcome goes through Record: counters, and the logs that say when a node went
// down, came back, or refused something. Thread-safe.
class Accounting {
 public:
  void CallStarted() { counters_.Add(ClientCounter::kCalls); }
  void Touched(size_t keys) { counters_.Add(ClientCounter::kTouchedKeys, keys); }
  void Pinned(size_t keys) { counters_.Add(ClientCounter::kPinnedKeys, keys); }
  void Unserved(size_t keys) { counters_.Add(ClientCounter::kUnservedKeys, keys); }
  // A call not sent to a suspect node; a lookup's keys not answered within its budget.
  void Skipped() { counters_.Add(ClientCounter::kSkippedCalls); }
  void Probed() { counters_.Add(ClientCounter::kProbes); }
  // A call to a replica given up (cancelled) once another answered.
  void Abandoned() { counters_.Add(ClientCounter::kAbandonedCalls); }
  void Late(size_t keys) { counters_.Add(ClientCounter::kLateKeys, keys); }
  // A call refused here, before it went (what the node would refuse).
  void RefusedHere(NodeHealth& n, const Status& status) {
    counters_.Add(ClientCounter::kRefused);
    n.RefusedHere(status);
  }
  void Repaired(size_t blocks) { counters_.Add(ClientCounter::kRepairedBlocks, blocks); }
  void MembersChanged(size_t joined, size_t left) {
    counters_.Add(ClientCounter::kMembersJoined, joined);
    counters_.Add(ClientCounter::kMembersLeft, left);
  }

  // Records the outcome of a call to a node (NodeHealth::Record: up, down, suspect, and the
  // logs): unreachable ones and refusals are counted.
  void Record(NodeHealth& n, const Status& status) {
    if (Unreachable(status)) counters_.Add(ClientCounter::kUnreachable);
    if (n.Record(status)) counters_.Add(ClientCounter::kRefused);
  }

  BlockStoreCounters counters() const { return counters_.Snapshot(); }

 private:
  AtomicClientCounters counters_;  // kvstash/common/client_counters.h
};

}  // namespace kvstash::connector
