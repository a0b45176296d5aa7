#pragma once

// Mapped payloads of an RpcClient's connection (a client on the server's host copies payloads
// through the server's shared memory instead of sending them). Private to transport/ucx/src/;
// defined in rpc_client_mapped.cc.

#include <ucp/api/ucp.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "kvstash/common/memory_warmer.h"
#include "kvstash/common/status.h"
#include "kvstash/proto/wire.pb.h"
#include "kvstash/transport/frame.h"
#include "rpc_client_calls.h"
#include "worker.h"

namespace kvstash::transport::internal {

// The server's shared-memory regions one connection has mapped, and the copies through them:
// a held request payload the server pulls (kPull) is copied into the server's memory (or, when
// the server names no region, sent as a kPayload frame), and a mapped reply is copied out of
// it; each is answered (kPullDone, kAck) once its copy is made or skipped, so that the server
// may reuse the memory. A copy runs on the call's copier when it has one, else inline.
//
// Invariants: a region is unmapped (its key destroyed) only when no copy posted to a copier can
// still use it: regions retired while copies are out wait until the last reports back. Every
// pull is answered exactly once (kPullDone, or the payload as a kPayload frame) and every
// mapped reply too (kAck), after its copy: an ack sent first let a concurrent store overwrite
// a block mid-copy. mapped() is true only between a probe that read back and the next Reset.
//
// Thread-safety: progress thread, but mapped() (atomic) anywhere; a copy runs on its copier's
// thread and reports back through the progress thread. The calls it copies for belong to the
// CallTable; a copy out keeps its call live or abandoned until it reports back.
class MappedPayloads {
 public:
  MappedPayloads(std::shared_ptr<Worker> worker, CallTable& calls, ClientEndpoint& endpoint,
                 ClientCounters& counters)
      : worker_(std::move(worker)), calls_(calls), endpoint_(endpoint), counters_(counters) {}

  // This connection copies payloads from and into the server's memory.
  bool mapped() const { return mapped_.load(std::memory_order_relaxed); }
  // No copy is out (so nothing of this client runs on a copier).
  bool quiet() const { return copies_out_ == 0; }

  // Tries the probe region of the hello reply: mapped payloads when its cookie reads back.
  // `server` names the server in the log.
  void Probe(const wire::HelloReply& reply, const std::string& server);
  // The server sends each shared region's key once per connection, with its first use.
  void AddRegion(const MappedRef& ref, Bytes rkey);
  // The server wants a held payload: copied into its shared memory, or sent as data.
  void OnPull(const FrameView& frame);
  // A reply whose payload is in the server's shared memory: copied out, then acknowledged
  // (always, so the server may reuse the memory).
  void OnMappedReply(const FrameView& frame);
  // The connection is gone: payloads are no longer mapped and every region is retired.
  void Reset();

 private:
  struct Region {
    ucp_rkey_h rkey = nullptr;
    uint64_t address = 0;
    uint64_t size = 0;
    // Faults this process's mapping of the region in, behind the copies: a mapping is this
    // process's page tables, so the server's warm memory still faults here page by page.
    std::unique_ptr<MemoryWarmer> warmer;
  };

  // Where `ref` is in this process (the server's shared memory, mapped).
  Result<std::byte*> Map(const MappedRef& ref);
  // Hands a mapped copy of `call` (dst <- src, n bytes) to its copier; OnCopied follows.
  void PostCopy(PendingCall* call, std::byte* dst, const std::byte* src, size_t n, bool pull);
  // The copier made (or skipped) the copy of call `id`: tells the server (kPullDone or kAck)
  // and completes a mapped reply.
  void OnCopied(uint64_t id, bool copied, bool pull, size_t n);
  // Unmaps a region now, or once no copy can still use it.
  void Retire(Region region);
  // Stops the region's warmer, then unmaps it.
  static void Release(Region& region);

  std::shared_ptr<Worker> worker_;
  CallTable& calls_;
  ClientEndpoint& endpoint_;
  ClientCounters& counters_;
  std::atomic<bool> mapped_{false};  // written on the progress thread, read anywhere
  std::unordered_map<uint64_t, Region> regions_;
  size_t copies_out_ = 0;        // posted to copiers, not yet reported back
  std::vector<Region> retired_;  // unmapped once copies_out_ is 0
};

}  // namespace kvstash::transport::internal
