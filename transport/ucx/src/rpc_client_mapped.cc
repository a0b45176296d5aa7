// MappedPayloads (rpc_client_mapped.h): a client on the server's host copies request and reply
// payloads through the server's shared memory instead of sending them.

#include "rpc_client_mapped.h"

#include <fmt/format.h>

#include <cstring>
#include <span>
#include <utility>

#include "kvstash/common/logging.h"
#include "kvstash/proto/wire.pb.h"
#include "kvstash/transport/frame.h"
#include "worker.h"

namespace kvstash::transport::internal {

void MappedPayloads::AddRegion(const MappedRef& ref, Bytes rkey, bool probing) {
  if (!endpoint_) return;
  SharedRegionKey key;
  key.server_cookie = server_cookie_;
  key.region_id = ref.region_id;
  key.address = ref.region_address;
  key.size = ref.region_size;
  key.packed_rkey.assign(reinterpret_cast<const char*>(rkey.data()), rkey.size());
  auto mapping = SharedMappings::Acquire(key, endpoint_.get(), worker_);
  if (!mapping.ok()) {
    // The probe fails wherever the server is on another host or the transports share no
    // memory (TCP): mapped payloads are then off, as they should be. Later, a failure is news.
    if (probing) {
      KVSTASH_LOG_DEBUG("cannot map the server's probe region: {}", mapping.status().ToString());
    } else {
      KVSTASH_LOG_WARN("cannot map the server's shared region {}: {}", ref.region_id,
                       mapping.status().ToString());
    }
    return;
  }
  // A key sent again replaces the region's mapping; copies out keep the one they use.
  regions_[ref.region_id] = std::move(*mapping);
}

void MappedPayloads::Reset() {
  mapped_.store(false);
  regions_.clear();  // copies still out hold the mappings they use
}

Result<std::byte*> MappedPayloads::Map(const MappedRef& ref,
                                       std::shared_ptr<SharedMapping>* mapping) {
  auto it = regions_.find(ref.region_id);
  if (it == regions_.end()) {
    return InternalError("server named shared region {} without its key", ref.region_id);
  }
  const SharedMapping& region = *it->second;
  if (ref.region_address != region.address() || ref.region_size != region.size()) {
    return InternalError("server's shared region {} changed shape", ref.region_id);
  }
  if (mapping != nullptr) *mapping = it->second;
  return region.Local(ref.address);
}

void MappedPayloads::Probe(const wire::HelloReply& reply, const std::string& server) {
  if (!worker_->options().mapped_payloads || !reply.has_mapped_probe()) return;
  const wire::SharedRegion& probe = reply.mapped_probe();
  MappedRef ref;
  ref.region_id = probe.region_id();
  ref.region_address = probe.address();
  ref.region_size = probe.size();
  ref.address = probe.address();
  ref.length = sizeof(uint64_t);
  if (probe.size() < sizeof(uint64_t)) return;
  server_cookie_ = probe.cookie();
  AddRegion(ref, std::as_bytes(std::span(probe.rkey())), /*probing=*/true);
  auto local = Map(ref);
  uint64_t cookie = 0;
  if (local.ok()) std::memcpy(&cookie, *local, sizeof(cookie));
  const bool mapped = local.ok() && cookie == probe.cookie();
  mapped_.store(mapped);
  KVSTASH_LOG_DEBUG("{}: mapped payloads {}", server, mapped ? "on" : "off");
}

void MappedPayloads::OnPull(const FrameView& frame) {
  const uint64_t id = frame.header.request_id;
  PendingCall* call = calls_.Find(id);
  if (call == nullptr || call->resolved || !call->held) {
    endpoint_.SendControl(FrameKind::kPullDone, id, StatusCode::kCancelled);
    return;
  }
  call->held = false;
  if (frame.ref.length != call->send_payload.size()) {
    endpoint_.SendControl(FrameKind::kPullDone, id, StatusCode::kInvalidArgument);
    calls_.Resolve(call, InternalError("server pulled {} bytes of a {}-byte payload",
                                       frame.ref.length, call->send_payload.size()));
    return;
  }
  if (frame.ref.region_id != 0) {
    std::shared_ptr<SharedMapping> mapping;
    auto local = Map(frame.ref, &mapping);
    if (!local.ok()) {
      endpoint_.SendControl(FrameKind::kPullDone, id, StatusCode::kInternal);
      calls_.Resolve(call, local.status());
      return;
    }
    if (call->copier != nullptr) {
      PostCopy(call, std::move(mapping), *local, call->send_payload.data(),
               call->send_payload.size(), /*pull=*/true);
      return;
    }
    mapping->Populate(*local, call->send_payload.size());
    std::memcpy(*local, call->send_payload.data(), call->send_payload.size());
    counters_.mapped_payloads.fetch_add(1, std::memory_order_relaxed);
    endpoint_.SendControl(FrameKind::kPullDone, id);
    return;
  }
  Status sent = endpoint_.SendPayload(call);
  if (!sent.ok()) calls_.Resolve(call, std::move(sent));
}

void MappedPayloads::OnMappedReply(const FrameView& frame) {
  const uint64_t id = frame.header.request_id;
  // The ack goes after the copy, on every path: once the server has it, the memory may hold
  // another block (an ack sent first let a concurrent store overwrite a block mid-copy).
  bool acked_later = false;
  struct AckWhenDone {
    ClientEndpoint* endpoint;
    uint64_t id;
    const bool* later;
    ~AckWhenDone() {
      if (!*later) endpoint->SendControl(FrameKind::kAck, id);
    }
  } ack{&endpoint_, id, &acked_later};
  PendingCall* call = calls_.Find(id);
  if (call == nullptr || call->resolved) {
    counters_.late_replies.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  if (frame.header.status != 0) {
    calls_.Resolve(call, StatusFromWireError(frame.header.status, frame.message));
    return;
  }
  call->reply.assign(frame.message.begin(), frame.message.end());
  if (frame.ref.length > call->recv_payload.size()) {
    calls_.Resolve(call, OutOfRangeError("reply payload of {} bytes exceeds the receive buffer "
                                         "of {} bytes",
                                         frame.ref.length, call->recv_payload.size()));
    return;
  }
  std::shared_ptr<SharedMapping> mapping;
  auto local = Map(frame.ref, &mapping);
  if (!local.ok()) {
    calls_.Resolve(call, local.status());
    return;
  }
  if (call->copier != nullptr) {
    acked_later = true;  // by OnCopied
    PostCopy(call, std::move(mapping), call->recv_payload.data(), *local, frame.ref.length,
             /*pull=*/false);
    return;
  }
  mapping->Populate(*local, frame.ref.length);
  std::memcpy(call->recv_payload.data(), *local, frame.ref.length);
  counters_.mapped_payloads.fetch_add(1, std::memory_order_relaxed);
  call->payload_bytes = frame.ref.length;
  calls_.Resolve(call, Status::OK());
}

void MappedPayloads::PostCopy(PendingCall* call, std::shared_ptr<SharedMapping> mapping,
                              std::byte* dst, const std::byte* src, size_t n, bool pull) {
  call->copying = true;
  if (!call->skip_copy) call->skip_copy = std::make_shared<std::atomic<bool>>(false);
  ++copies_out_;
  call->copier->Post([this, worker = worker_, mapping = std::move(mapping), id = call->id,
                      skip = call->skip_copy, dst, src, n, pull] {
    const bool copy = !skip->load(std::memory_order_acquire);
    if (copy) {
      mapping->Populate(pull ? dst : src, n);
      std::memcpy(dst, src, n);
    }
    worker->Run([this, id, copy, pull, n] { OnCopied(id, copy, pull, n); });
  });
}

void MappedPayloads::OnCopied(uint64_t id, bool copied, bool pull, size_t n) {
  --copies_out_;
  if (copied) counters_.mapped_payloads.fetch_add(1, std::memory_order_relaxed);
  // The server learns first: its memory is free for another block from here on.
  if (pull) {
    endpoint_.SendControl(FrameKind::kPullDone, id,
                          copied ? StatusCode::kOk : StatusCode::kCancelled);
  } else {
    endpoint_.SendControl(FrameKind::kAck, id);
  }
  PendingCall* call = calls_.Find(id);
  if (call == nullptr) {
    if (PendingCall* gone = calls_.FindAbandoned(id); gone != nullptr) {
      gone->copying = false;
      calls_.ReapAbandoned(gone);
    }
    return;
  }
  call->copying = false;
  if (!pull && !call->resolved) {
    if (copied) {
      call->payload_bytes = n;
      calls_.Resolve(call, Status::OK());
    } else {
      calls_.Resolve(call, CancelledError("call {}: its reply payload was not copied", id));
    }
    return;
  }
  if (pull && !copied && !call->resolved) {
    calls_.Resolve(call, CancelledError("call {}: its payload was not copied", id));
    return;
  }
  calls_.MaybeFinish(call);
}

}  // namespace kvstash::transport::internal
