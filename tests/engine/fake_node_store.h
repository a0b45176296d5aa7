#pragma once

// The offload nodes in memory, for engine tests that run the real connector without kvstashd:
// FakeNodeStore holds blocks by key (with faults to inject) and FakeStoreClient is the
// connector's view of it, one node.

#include <algorithm>
#include <chrono>
#include <map>
#include <mutex>
#include <set>
#include <span>
#include <thread>
#include <tuple>
#include <vector>

#include "kvstash/common/hash.h"
#include "kvstash/connector/block_store_client.h"
#include "kvstash/connector/block_transfer.h"
#include "kvstash/connector/offload_scheduler.h"

namespace kvstash::engine::fakes {

using KeySet = std::set<BlockKey>;

// The keys of blocks [from, to) of a request with these block hashes, in `groups` groups.
inline KeySet KeysOf(const std::vector<BlockHash>& hashes, size_t groups, size_t from, size_t to) {
  KeySet out;
  for (uint32_t g = 0; g < groups; ++g)
    for (size_t i = from; i < to && i < hashes.size(); ++i) out.insert(BlockKey{hashes[i], g});
  return out;
}

// The block index of `key` in a request with these hashes; -1 when it is not the request's.
inline int BlockIndexOf(const std::vector<BlockHash>& hashes, const BlockKey& key) {
  auto it = std::find(hashes.begin(), hashes.end(), key.hash);
  return it == hashes.end() ? -1 : static_cast<int>(it - hashes.begin());
}

// The offload nodes, in memory: they outlive the engines that use them, as nodes outlive
// engine processes. Faults make reads fail or return corrupt blocks; a delay keeps stores in
// flight. Thread-safe (the transfer thread stores and reads, the engine's thread looks up).
class FakeNodeStore {
 public:
  enum class Fault { kNone, kGetFails, kGetCorrupt };

  void set_block_bytes(size_t bytes) {
    std::lock_guard lock(mu_);
    block_bytes_ = bytes;
  }
  size_t block_bytes() const {
    std::lock_guard lock(mu_);
    return block_bytes_;
  }
  void set_fault(Fault fault) {
    std::lock_guard lock(mu_);
    fault_ = fault;
  }
  // What the client's counters() reports (all zero unless set).
  void set_counters(const connector::BlockStoreCounters& counters) {
    std::lock_guard lock(mu_);
    counters_ = counters;
  }
  connector::BlockStoreCounters counters() const {
    std::lock_guard lock(mu_);
    return counters_;
  }
  void set_put_delay(std::chrono::milliseconds delay) {
    std::lock_guard lock(mu_);
    put_delay_ = delay;
  }

  bool Holds(const BlockKey& key) const {
    std::lock_guard lock(mu_);
    return blocks_.contains(key);
  }
  // The node evicted it.
  void Erase(const BlockKey& key) {
    std::lock_guard lock(mu_);
    blocks_.erase(key);
  }
  // Every key offered to Put (held ones too), every key read, and the read calls, in order.
  std::vector<BlockKey> put_keys() const {
    std::lock_guard lock(mu_);
    return put_keys_;
  }
  std::vector<BlockKey> get_keys() const {
    std::lock_guard lock(mu_);
    return get_keys_;
  }
  size_t get_calls() const {
    std::lock_guard lock(mu_);
    return get_calls_;
  }
  // Every touch call, in order, with the number of blocks held when it came (so a test sees
  // whether it came before or after a store).
  struct TouchCall {
    std::vector<BlockKey> keys;
    size_t blocks_held = 0;
  };
  std::vector<TouchCall> touches() const {
    std::lock_guard lock(mu_);
    return touches_;
  }
  void ClearLog() {
    std::lock_guard lock(mu_);
    put_keys_.clear();
    get_keys_.clear();
    get_calls_ = 0;
    touches_.clear();
  }

  std::vector<LookupResult> Lookup(std::span<const BlockKey> keys) const {
    std::lock_guard lock(mu_);
    std::vector<LookupResult> out;
    for (const BlockKey& k : keys)
      out.push_back(blocks_.contains(k) ? LookupResult::kHit : LookupResult::kMiss);
    return out;
  }

  Status Put(std::span<const BlockKey> keys, std::span<const std::span<const std::byte>> blocks) {
    std::chrono::milliseconds delay;
    {
      std::lock_guard lock(mu_);
      delay = put_delay_;
    }
    std::this_thread::sleep_for(delay);
    std::lock_guard lock(mu_);
    Status first;
    for (size_t i = 0; i < keys.size(); ++i) {
      put_keys_.push_back(keys[i]);
      if (blocks[i].size() != block_bytes_) {
        if (first.ok())
          first = InvalidArgumentError("block of {} bytes, not {}", blocks[i].size(), block_bytes_);
        continue;
      }
      if (blocks_.contains(keys[i])) continue;  // a node skips a block it holds
      blocks_[keys[i]].assign(blocks[i].begin(), blocks[i].end());
    }
    return first;
  }

  void Touch(std::span<const BlockKey> keys) {
    std::lock_guard lock(mu_);
    touches_.push_back({std::vector<BlockKey>(keys.begin(), keys.end()), blocks_.size()});
  }

  // Pins held by clients: a key's count (a real node would not evict them; Erase still can, as
  // a node restart would lose them).
  void Pin(std::span<const BlockKey> keys) {
    std::lock_guard lock(mu_);
    for (const BlockKey& key : keys) ++pins_[key];
  }
  void Unpin(std::span<const BlockKey> keys) {
    std::lock_guard lock(mu_);
    for (const BlockKey& key : keys) {
      if (auto it = pins_.find(key); it != pins_.end() && --it->second == 0) pins_.erase(it);
    }
  }
  std::map<BlockKey, int> pins() const {
    std::lock_guard lock(mu_);
    return pins_;
  }
  // Keys read while a client pinned them.
  size_t pinned_gets() const {
    std::lock_guard lock(mu_);
    return pinned_gets_;
  }

  std::vector<Result<size_t>> Get(std::span<const BlockKey> keys,
                                  std::span<const std::span<std::byte>> outs) {
    std::lock_guard lock(mu_);
    ++get_calls_;
    std::vector<Result<size_t>> out;
    for (size_t i = 0; i < keys.size(); ++i) {
      get_keys_.push_back(keys[i]);
      if (pins_.contains(keys[i])) ++pinned_gets_;
      auto it = blocks_.find(keys[i]);
      if (fault_ == Fault::kGetFails) {
        out.push_back(UnavailableError("fake node down"));
      } else if (it == blocks_.end()) {
        out.push_back(NotFoundError("no block {}", keys[i].ToString()));
      } else if (it->second.size() > outs[i].size()) {
        out.push_back(InvalidArgumentError("block does not fit"));
      } else {
        std::copy(it->second.begin(), it->second.end(), outs[i].begin());
        if (fault_ == Fault::kGetCorrupt) outs[i][0] ^= std::byte{0x40};  // a flipped bit
        out.push_back(it->second.size());
      }
    }
    return out;
  }

 private:
  mutable std::mutex mu_;
  size_t block_bytes_ = 0;
  Fault fault_ = Fault::kNone;
  std::chrono::milliseconds put_delay_{0};
  std::map<BlockKey, std::vector<std::byte>> blocks_;
  std::vector<BlockKey> put_keys_, get_keys_;
  size_t get_calls_ = 0;
  size_t pinned_gets_ = 0;
  std::vector<TouchCall> touches_;
  std::map<BlockKey, int> pins_;
  connector::BlockStoreCounters counters_;
};

// The connector's view of a FakeNodeStore: one node.
class FakeStoreClient : public connector::BlockStoreClient {
 public:
  explicit FakeStoreClient(FakeNodeStore* store) : store_(store) {}
  std::vector<connector::NodeAddress> nodes() const override { return {address_}; }
  Result<uint64_t> BlockBytes(const connector::NodeAddress&) override {
    return store_->block_bytes();
  }
  std::vector<LookupResult> Lookup(std::span<const BlockKey> keys) override {
    return store_->Lookup(keys);
  }
  Status Put(std::span<const BlockKey> keys,
             std::span<const std::span<const std::byte>> blocks) override {
    return store_->Put(keys, blocks);
  }
  std::vector<Result<size_t>> Get(std::span<const BlockKey> keys,
                                  std::span<const std::span<std::byte>> outs) override {
    return store_->Get(keys, outs);
  }
  void Touch(std::span<const BlockKey> keys) override { store_->Touch(keys); }
  void Pin(std::span<const BlockKey> keys) override { store_->Pin(keys); }
  void Unpin(std::span<const BlockKey> keys) override { store_->Unpin(keys); }
  connector::BlockStoreCounters counters() const override { return store_->counters(); }

 private:
  FakeNodeStore* store_;
  connector::NodeAddress address_{"fake-node", 1};
};

}  // namespace kvstash::engine::fakes
