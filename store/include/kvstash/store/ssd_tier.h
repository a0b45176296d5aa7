// SsdTier: whole KV blocks on a local SSD, with RocksDB as the persistent index.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kvstash/common/block_key.h"
#include "kvstash/common/status.h"
#include "kvstash/store/block_manager.h"

namespace kvstash::store {

struct SsdTierOptions {
  // The tier's directory; created if missing. It holds `blocks.dat` (the block slots) and
  // `index/` (the RocksDB index). One process at a time (RocksDB's lock file enforces it).
  std::string dir;
  // Bytes of block slots; rounded down to whole slots. At least one slot.
  uint64_t capacity_bytes = 0;
  // The largest block the tier holds. Each block takes one slot of this size rounded up to
  // 4 KiB. A directory keeps the block size it was created with; reopening it with another is
  // an error.
  size_t block_bytes = 0;
  EvictionPolicy policy = EvictionPolicy::kLru;
  // O_DIRECT on the slot file (no page cache: the CPU tier is the cache). Falls back to buffered
  // I/O, with a warning, on file systems that refuse it (tmpfs).
  bool direct_io = true;
  // Reserve the slot file's full size on the disk at open (fallocate), so the capacity is
  // guaranteed. Off by default: on the development VM's ext4, blocks written into reserved
  // (unwritten) extents read back 20-35% slower than blocks the file system allocated as they
  // were written (`kvstash bench ssd`, same run). Where the disk lacks the space, the file
  // stays sparse with a warning. Sparse or not, a store that finds the disk full fails cleanly.
  bool preallocate = false;
  // fdatasync the slot file and sync RocksDB's log before a store returns. Off: a committed
  // block survives a process crash (kill -9) but not a power loss.
  bool sync = false;
  // Which namespaces' blocks Create keeps when it rebuilds the index; the others' are dropped
  // (counted in dropped_records). Empty: all. A node keeps only namespaces its table still
  // names, so an id never reaches a namespace other than the one that stored the block.
  std::function<bool(NamespaceId)> keep_namespace;
  // Record the tier's stored and removed blocks for TakeEvents (BlockManagerOptions'
  // enable_events and max_pending_event_keys). The blocks Create finds are not events:
  // ResidentKeys lists them.
  bool enable_events = false;
  size_t max_pending_event_keys = 0;
};

// Counters since Create. Monotonic; read without a lock.
struct SsdTierStats {
  uint64_t blocks_written = 0;
  uint64_t bytes_written = 0;
  uint64_t blocks_read = 0;
  uint64_t bytes_read = 0;
  uint64_t write_failures = 0;     // stores that failed (no space, I/O error); nothing kept
  uint64_t checksum_failures = 0;  // reads whose bytes did not match the record: a miss
  uint64_t read_errors = 0;        // reads that failed or came back short: a miss
  uint64_t evictions = 0;
  uint64_t restored_blocks = 0;  // index records recovered by Create
  uint64_t dropped_records = 0;  // index records Create found bad, duplicate or out of range
};

// One block to write into a slot reserved by PrepareStore.
struct SsdWrite {
  BlockKey key;
  SlotId slot;
  std::span<const std::byte> data;  // at most block_bytes
};

// A tier of fixed-size block slots in one file, indexed by RocksDB and managed (capacity,
// LRU/ARC eviction, two-phase stores, pins) by a BlockManager.
//
// Layout, chosen by measurement (see ssd_tier.cc): block bytes go to `blocks.dat` at
// slot * stride with direct I/O; RocksDB holds only a small index record per block (slot,
// length, sequence number, checksum). Every read verifies the block's checksum, which also
// covers the key and the sequence number, so a torn, stale or corrupt slot is never served: it
// reads as a miss, is dropped and counted (docs/semantics.md §18: which checksum covers what).
//
// Crash safety: a block's index record is written only after its bytes are in the slot file,
// and an evicted block's record is deleted before its slot is reused; Create rebuilds the index
// from the records, least recently written first.
//
// Thread-safe. I/O runs on the calling thread, outside every lock.
class SsdTier {
 public:
  // Opens or creates the tier in `options.dir` and rebuilds its index. InvalidArgument for bad
  // options or a directory created with another block size; the I/O error otherwise.
  static Result<std::unique_ptr<SsdTier>> Create(const SsdTierOptions& options);
  ~SsdTier();
  SsdTier(const SsdTier&) = delete;
  SsdTier& operator=(const SsdTier&) = delete;

  // One-call operations (tools, tests, the benchmark).
  //
  // Stores `data` under `key`, evicting idle blocks if needed. OK without writing if the key is
  // already stored. Unavailable while another store of the key is in flight; ResourceExhausted
  // when nothing can be evicted or the disk is full; nothing is kept on failure.
  Status Put(const BlockKey& key, std::span<const std::byte> data);
  // Reads the block into `out` (resized to the block's length). NotFound if absent, Unavailable
  // while being written, DataLoss if its bytes are corrupt (the block is dropped).
  Status Get(const BlockKey& key, std::vector<std::byte>* out);
  // NotFound if absent; FailedPrecondition while it is pinned or being written.
  Status Delete(const BlockKey& key);

  // The two-phase protocol of BlockManager, for the tiered store.
  LookupResult Lookup(const BlockKey& key) { return index_->Lookup(key); }
  void Touch(std::span<const BlockKey> keys, TouchKind kind = TouchKind::kUse) {
    index_->Touch(keys, kind);
  }
  // Reserves slots as BlockManager::PrepareStore does; the records of evicted blocks are
  // deleted before this returns, so their slots may be overwritten.
  Status PrepareStore(std::span<const BlockKey> keys, StorePlan* plan);
  // Writes the blocks into their reserved slots and commits them (lookups HIT) with one index
  // batch. On any failure nothing of the call is committed: every key is aborted, its slot freed.
  Status WriteAndCommit(std::span<const SsdWrite> writes);
  // Drops reserved keys without writing them.
  void Abort(std::span<const BlockKey> keys) { index_->CompleteStore(keys, false); }
  Status PrepareLoad(std::span<const BlockKey> keys, std::vector<SlotId>* slots) {
    return index_->PrepareLoad(keys, slots);
  }
  // Reads the pinned block in `slot` into `out` (at least block_bytes). Returns its length.
  // DataLoss for a checksum mismatch, Unavailable for a failed or short read; either way the
  // caller unpins and calls Remove.
  Result<size_t> Read(const BlockKey& key, SlotId slot, std::span<std::byte> out);
  Status CompleteLoad(std::span<const BlockKey> keys) { return index_->CompleteLoad(keys); }
  // Drops idle stored keys and their index records. Returns how many were dropped.
  size_t Remove(std::span<const BlockKey> keys);

  size_t block_bytes() const { return block_bytes_; }
  size_t slot_stride() const { return stride_; }
  size_t capacity_blocks() const { return index_->capacity(); }
  size_t resident_blocks() const { return index_->resident_blocks(); }
  // The blocks stored since the last call, and removed (BlockManager::TakeEvents).
  std::vector<OffloadEvent> TakeEvents() { return index_->TakeEvents(); }
  void TakeEvents(OffloadEventLog* log) { index_->TakeEvents(log); }
  // Every readable block's key, least recent first within each policy list. O(n log n) under
  // the index's lock: for a snapshot at start, not for the data path.
  std::vector<BlockKey> ResidentKeys() const;
  bool direct_io() const { return direct_io_; }
  SsdTierStats stats() const;

 private:
  struct Impl;
  SsdTier(std::unique_ptr<Impl> impl, std::unique_ptr<BlockManager> index, size_t block_bytes,
          size_t stride, bool direct_io);

  // Deletes the index records of `keys` (evicted or dropped blocks).
  Status DeleteRecords(std::span<const BlockKey> keys);

  std::unique_ptr<Impl> impl_;
  std::unique_ptr<BlockManager> index_;
  const size_t block_bytes_;
  const size_t stride_;
  const bool direct_io_;
};

}  // namespace kvstash::store
