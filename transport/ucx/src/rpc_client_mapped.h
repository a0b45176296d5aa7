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

#include "kvstash/common/status.h"
#include "kvstash/proto/wire.pb.h"
#include "kvstash/transport/frame.h"
#include "rpc_client_calls.h"
#include "shared_mapping.h"
#include "worker.h"

namespace kvstash::transport::internal {

// The server's shared-memory regions one connection copies through, and the copies through
// them: a held request payload the server pulls (kPull) is copied into the server's memory (or,
// when the server names no region, sent as a kPayload frame), and a mapped reply is copied out
// of it; each is answered (kPullDone, kAck) once its copy is made or skipped, so that the server
// may reuse the memory. A copy runs on the call's copier when it has one, else inline. A region
// is this process's SharedMapping of it (shared_mapping.h): every connection of the process to
// that server start shares one mapping, and a copy faults in only the chunks it reaches.
//
// Invariants: a region is unmapped only when no copy can still use it: each copy posted to a
// copier holds its SharedMapping until the copy is destroyed, and the mapping goes with its
// last holder. Every pull is answered exactly once (kPullDone, or the payload as a kPayload
// frame) and every mapped reply too (kAck), after its copy: an ack sent first let a concurrent
// store overwrite a block mid-copy. mapped() is true only between a probe that read back and
// the next Reset.
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
  // `probing`: the hello's probe, which fails quietly where memory cannot be shared.
  void AddRegion(const MappedRef& ref, Bytes rkey, bool probing = false);
  // The server wants a held payload: copied into its shared memory, or sent as data.
  void OnPull(const FrameView& frame);
  // A reply whose payload is in the server's shared memory: copied out, then acknowledged
  // (always, so the server may reuse the memory).
  void OnMappedReply(const FrameView& frame);
  // The connection is gone: payloads are no longer mapped and every region is retired.
  void Reset();

 private:
  // Where `ref` is in this process (the server's shared memory, mapped), and its mapping.
  Result<std::byte*> Map(const MappedRef& ref, std::shared_ptr<SharedMapping>* mapping = nullptr);
  // Hands a mapped copy of `call` (dst <- src, n bytes) through `mapping` to its copier;
  // OnCopied follows.
  void PostCopy(PendingCall* call, std::shared_ptr<SharedMapping> mapping, std::byte* dst,
                const std::byte* src, size_t n, bool pull);
  // The copier made (or skipped) the copy of call `id`: tells the server (kPullDone or kAck)
  // and completes a mapped reply.
  void OnCopied(uint64_t id, bool copied, bool pull, size_t n);

  std::shared_ptr<Worker> worker_;
  CallTable& calls_;
  ClientEndpoint& endpoint_;
  ClientCounters& counters_;
  std::atomic<bool> mapped_{false};  // written on the progress thread, read anywhere
  uint64_t server_cookie_ = 0;       // of the server start the probe came from
  std::unordered_map<uint64_t, std::shared_ptr<SharedMapping>> regions_;  // by region id
  size_t copies_out_ = 0;  // posted to copiers, not yet reported back
};

}  // namespace kvstash::transport::internal
