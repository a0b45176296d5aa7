#pragma once

// BlockTransfer: the connector's worker side. Moves an engine's KV pages between its paged pool
// and offload nodes (a BlockStoreClient) off the engine's thread: a store job pushes offloaded
// blocks (each a run of pool pages) to the nodes, a load job pulls them into the pool pages the
// engine allocated.
//
// Every offloaded block travels with a trailer (BlockTrailer) naming its key, the engine's model
// and layout fingerprint, and an xxh3 of its bytes; a load accepts a block only when all three
// match, so a wrong, stale or corrupt block from a node is a miss (the engine recomputes those
// tokens), never KV in the cache. A block's identity and its checksums: docs/semantics.md §18.
//
// Stores copy their pages out of the pool when submitted (at memory speed), so the engine may
// reuse a page as soon as Submit returns: the fence of a store is its copy. Loads write pool
// pages from the transfer thread: the engine must not touch a load's pages until the job is
// reported finished. Loads run before queued stores. Touches (recency for the nodes) queue with
// the stores, in order: one is sent once the stores queued before it have ended, so a node
// sees it after their blocks are in.
//
// Thread-safe: Submit, Poll and Wait may be called from any thread; one transfer thread.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <span>
#include <thread>
#include <vector>

#include "kvstash/common/mutex.h"
#include "kvstash/common/status.h"
#include "kvstash/connector/block_store_client.h"

namespace kvstash::connector {

// The engine's pool as the transfer sees it.
struct PoolView {
  std::byte* base = nullptr;  // page 0's first byte
  size_t page_bytes = 0;
  size_t num_pages = 0;
};

// Bytes after the pages of every offloaded block.
struct BlockTrailer {
  static constexpr uint32_t kMagic = 0x6b767374;  // "kvst"
  uint32_t magic = kMagic;
  uint32_t pages = 0;
  uint64_t key_lo = 0, key_hi = 0;
  uint32_t group = 0;
  uint32_t reserved = 0;
  uint64_t fingerprint = 0;  // model, weights and layout of the engine that computed the block
  uint64_t checksum = 0;     // xxh3-64 of the pages, seeded with the fingerprint
  uint64_t reserved2 = 0;
};
static_assert(sizeof(BlockTrailer) == 56);

// The node block size an offloaded block of `pages` pages needs.
inline size_t OffloadedBlockBytes(size_t pages, size_t page_bytes) {
  return pages * page_bytes + sizeof(BlockTrailer);
}

struct BlockJob {
  enum class Kind : uint8_t { kStore, kLoad };
  uint64_t id = 0;
  Kind kind = Kind::kStore;
  std::vector<BlockKey> keys;  // one per offloaded block
  // The pool pages of each key's block, in token order (pages_per_block each).
  std::vector<std::vector<uint32_t>> pages;
  // A store's: none, or one per key, what its block holds (BlockStoreClient::PutWithMeta), for
  // the nodes' KV events.
  std::vector<BlockMeta> metas;
};

struct BlockJobResult {
  uint64_t id = 0;
  BlockJob::Kind kind = BlockJob::Kind::kStore;
  // Per key: stored, or loaded and verified into its pages. A load's failed key leaves its
  // pages undefined.
  std::vector<bool> ok;
  uint64_t bytes = 0;  // payload bytes moved (trailers excluded)
  std::chrono::nanoseconds elapsed{0};
  Status status;  // the first error (a store's node error, a load's rejected block), or OK
  size_t num_ok() const;
};

struct BlockTransferOptions {
  BlockStoreClient* client = nullptr;  // borrowed; outlives the transfer (NodeClient, a fake)
  PoolView pool;
  size_t pages_per_block = 1;
  uint64_t fingerprint = 0;
};

class BlockTransfer {
 public:
  // InvalidArgument for a bad pool view; FailedPrecondition naming the node when a node's
  // block size is not OffloadedBlockBytes(pages_per_block, page_bytes) (the message says the
  // --block-bytes to start kvstashd with). A node that does not answer is logged and skipped:
  // its blocks are misses.
  static Result<std::unique_ptr<BlockTransfer>> Create(BlockTransferOptions options);
  ~BlockTransfer();  // finishes queued jobs, then stops

  size_t block_bytes() const { return block_bytes_; }

  // Queues a job (a store copies its pages first). InvalidArgument, and nothing queued, for a
  // page outside the pool, a block with the wrong page count, or metadata that is not one per
  // key.
  Status Submit(BlockJob job);
  // Queues a touch of `keys` (BlockStoreClient::Touch, the first key most recent) behind the
  // stores queued so far. It has no result; WaitAll waits for it to be sent.
  // `after_store`: the step's touch after its stores (BlockStoreClient::TouchAfterStore).
  void SubmitTouch(std::vector<BlockKey> keys, bool after_store = false);
  // Results of the jobs finished since the last call.
  std::vector<BlockJobResult> Poll();
  // Blocks until each of these jobs has finished (unknown or polled ids count as finished),
  // then returns (their results stay for Poll).
  void Wait(std::span<const uint64_t> ids);
  void WaitAll();

 private:
  struct Pending;
  explicit BlockTransfer(BlockTransferOptions options, size_t block_bytes);
  void Run();
  BlockJobResult Execute(Pending& job);

  BlockTransferOptions options_;
  size_t block_bytes_;
  Mutex mu_;
  CondVar cv_;  // a job queued, started or finished; stop
  std::deque<std::unique_ptr<Pending>> loads_ GUARDED_BY(mu_), stores_ GUARDED_BY(mu_);
  std::vector<uint64_t> in_flight_ GUARDED_BY(mu_);  // queued or running ids
  size_t touches_in_flight_ GUARDED_BY(mu_) = 0;     // queued or being sent
  std::vector<BlockJobResult> finished_ GUARDED_BY(mu_);
  bool stop_ GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace kvstash::connector
