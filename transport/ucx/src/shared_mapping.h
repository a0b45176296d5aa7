#pragma once

// A process's mappings of servers' shared-memory regions, one per region whatever the number of
// connections that copy through it. Private to transport/ucx/src/; defined in
// shared_mapping.cc.

#include <ucp/api/ucp.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "kvstash/common/memory_warmer.h"
#include "kvstash/common/status.h"
#include "worker.h"

namespace kvstash::transport::internal {

// Which region of which server start: the server's hello cookie (random per start), the
// region's id, address and size in the server, and its packed key (the segment UCX maps). Two
// connections naming the same key name the same memory.
struct SharedRegionKey {
  uint64_t server_cookie = 0;
  uint64_t region_id = 0;
  uint64_t address = 0;
  uint64_t size = 0;
  std::string packed_rkey;
  bool operator==(const SharedRegionKey&) const = default;
};

// This process's mapping of one server region: the rkey UCX unpacked (with UCX 1.13's posix
// and System V shared memory, a mapping of the whole region, made at once and without
// faulting anything in) and a ChunkPopulator over it, so that the pages a copy reaches are
// faulted in a chunk at a time, once per process, instead of page by page.
//
// Ownership: shared (shared_ptr) by every connection of the process that names the region, and
// by each copy posted through it, so it is unmapped only once no connection holds it and no
// copy can still use it. It keeps the Worker whose endpoint unpacked its rkey: UCX returns a
// destroyed rkey to that worker's pool, so the rkey is destroyed on that worker's progress
// thread, or at once where the thread has exited (then nothing else uses the worker). An rkey
// outlives the endpoint that unpacked it (UCX 1.13's ucp_rkey_ptr and ucp_rkey_destroy use only
// the rkey and its worker), so the mapping outlives the connection that made it.
//
// Thread-safety: Local and Populate on any thread; the destructor on any thread.
class SharedMapping {
 public:
  ~SharedMapping();
  SharedMapping(const SharedMapping&) = delete;
  SharedMapping& operator=(const SharedMapping&) = delete;

  uint64_t address() const { return key_.address; }
  uint64_t size() const { return key_.size; }
  // Where the server's `address` (inside the region) is in this process.
  std::byte* Local(uint64_t address) const { return base_ + (address - key_.address); }
  // Faults in the chunks of [local, local + n) (inside the region) not yet faulted in.
  void Populate(const std::byte* local, size_t n) {
    populator_.Touch(static_cast<size_t>(local - base_), n);
  }

 private:
  friend class SharedMappings;
  SharedMapping(SharedRegionKey key, ucp_rkey_h rkey, std::byte* base,
                std::shared_ptr<Worker> worker)
      : key_(std::move(key)),
        rkey_(rkey),
        base_(base),
        worker_(std::move(worker)),
        populator_({base, key_.size}) {}

  const SharedRegionKey key_;
  ucp_rkey_h rkey_;
  std::byte* const base_;
  std::shared_ptr<Worker> worker_;  // the worker rkey_ belongs to
  ChunkPopulator populator_;
};

// The process's registry of live SharedMappings, keyed by SharedRegionKey. Thread-safe.
class SharedMappings {
 public:
  // The process's live mapping of `key`, or a new one made by unpacking its packed key on
  // `ep`, an endpoint of `worker`. On `worker`'s progress thread. Fails (Internal, Unavailable,
  // ...) when UCX cannot unpack or map the key.
  static Result<std::shared_ptr<SharedMapping>> Acquire(const SharedRegionKey& key, ucp_ep_h ep,
                                                        const std::shared_ptr<Worker>& worker);

 private:
  friend class SharedMapping;
  static void Forget(const SharedRegionKey& key);
};

}  // namespace kvstash::transport::internal
