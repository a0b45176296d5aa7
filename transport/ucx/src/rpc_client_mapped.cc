// RpcClient::Impl: mapped payloads (progress thread): a client on the server's host copies
// request and reply payloads through the server's shared memory instead of sending them.

#include <fmt/format.h>

#include <cstring>
#include <span>

#include "kvstash/common/logging.h"
#include "kvstash/proto/wire.pb.h"
#include "kvstash/transport/frame.h"
#include "rpc_client_impl.h"
#include "worker.h"

namespace kvstash::transport {

// ---- mapped payloads -------------------------------------------------------------------------

void RpcClient::Impl::AddSharedRegion(const MappedRef& ref, Bytes rkey) {
  if (!ep_) return;
  ucp_rkey_h handle = nullptr;
  const ucs_status_t status = ucp_ep_rkey_unpack(ep_.get(), rkey.data(), &handle);
  if (status != UCS_OK) {
    KVSTASH_LOG_WARN("cannot unpack the key of the server's shared region {}: {}", ref.region_id,
                     ucs_status_string(status));
    return;
  }
  auto [it, added] = shared_regions_.try_emplace(ref.region_id);
  if (!added) RetireSharedRegion(std::exchange(it->second, {}));
  SharedRegion& region = it->second;
  region.rkey = handle;
  region.address = ref.region_address;
  region.size = ref.region_size;
  void* local = nullptr;
  if (ref.region_size > 0 && ucp_rkey_ptr(handle, ref.region_address, &local) == UCS_OK &&
      local != nullptr) {
    region.warmer = std::make_unique<MemoryWarmer>(
        std::span(static_cast<std::byte*>(local), ref.region_size), /*threads=*/1);
  }
}

void RpcClient::Impl::RetireSharedRegion(SharedRegion region) {
  if (copies_out_ == 0) {
    ReleaseSharedRegion(region);
  } else {
    retired_regions_.push_back(std::move(region));
  }
}

void RpcClient::Impl::ReleaseSharedRegion(SharedRegion& region) {
  region.warmer.reset();
  if (region.rkey != nullptr) ucp_rkey_destroy(region.rkey);
  region.rkey = nullptr;
}

Result<std::byte*> RpcClient::Impl::Map(const MappedRef& ref) {
  auto it = shared_regions_.find(ref.region_id);
  if (it == shared_regions_.end()) {
    return InternalError("server named shared region {} without its key", ref.region_id);
  }
  const SharedRegion& region = it->second;
  if (ref.region_address != region.address || ref.region_size != region.size) {
    return InternalError("server's shared region {} changed shape", ref.region_id);
  }
  void* local = nullptr;
  KVSTASH_RETURN_IF_ERROR(FromUcs(ucp_rkey_ptr(region.rkey, ref.address, &local),
                                  fmt::format("mapping shared region {}", ref.region_id)));
  return static_cast<std::byte*>(local);
}

void RpcClient::Impl::ProbeMapping(const wire::HelloReply& reply) {
  if (!worker_->options().mapped_payloads || !reply.has_mapped_probe()) return;
  const wire::SharedRegion& probe = reply.mapped_probe();
  MappedRef ref;
  ref.region_id = probe.region_id();
  ref.region_address = probe.address();
  ref.region_size = probe.size();
  ref.address = probe.address();
  ref.length = sizeof(uint64_t);
  if (probe.size() < sizeof(uint64_t)) return;
  AddSharedRegion(ref, std::as_bytes(std::span(probe.rkey())));
  auto local = Map(ref);
  uint64_t cookie = 0;
  if (local.ok()) std::memcpy(&cookie, *local, sizeof(cookie));
  const bool mapped = local.ok() && cookie == probe.cookie();
  mapped_.store(mapped);
  KVSTASH_LOG_DEBUG("{}:{}: mapped payloads {}", options_.host, options_.port,
                    mapped ? "on" : "off");
}

void RpcClient::Impl::SendControl(FrameKind kind, uint64_t id, StatusCode code) {
  LooseSend send;
  FrameHeader header;
  header.kind = kind;
  header.request_id = id;
  header.connection_id = connection_id_.load();
  header.status = static_cast<uint16_t>(code);
  send.header.resize(kFrameHeaderBytes);
  WriteFrame(header, {}, send.header);
  SendLoose(std::move(send));
}

void RpcClient::Impl::OnPull(const FrameView& frame) {
  const uint64_t id = frame.header.request_id;
  auto it = calls_.find(id);
  PendingCall* call = it == calls_.end() ? nullptr : it->second.get();
  if (call == nullptr || call->resolved || !call->held) {
    SendControl(FrameKind::kPullDone, id, StatusCode::kCancelled);
    return;
  }
  call->held = false;
  if (frame.ref.length != call->send_payload.size()) {
    SendControl(FrameKind::kPullDone, id, StatusCode::kInvalidArgument);
    Resolve(call, InternalError("server pulled {} bytes of a {}-byte payload", frame.ref.length,
                                call->send_payload.size()));
    return;
  }
  if (frame.ref.region_id != 0) {
    auto local = Map(frame.ref);
    if (!local.ok()) {
      SendControl(FrameKind::kPullDone, id, StatusCode::kInternal);
      Resolve(call, local.status());
      return;
    }
    if (call->copier != nullptr) {
      PostCopy(call, *local, call->send_payload.data(), call->send_payload.size(), /*pull=*/true);
      return;
    }
    std::memcpy(*local, call->send_payload.data(), call->send_payload.size());
    mapped_payloads_.fetch_add(1, std::memory_order_relaxed);
    SendControl(FrameKind::kPullDone, id);
    return;
  }
  FrameHeader header;
  header.kind = FrameKind::kPayload;
  header.request_id = id;
  header.connection_id = connection_id_.load();
  call->payload_header.resize(kFrameHeaderBytes);
  WriteFrame(header, {}, call->payload_header);
  ucp_request_param_t param = ContigParam(call, call->send_region);
  param.cb.send = &Impl::OnDataSent;
  FromThisEndpoint(&param);
  ucs_status_ptr_t request =
      ucp_am_send_nbx(ep_.get(), kRpcAmId, call->payload_header.data(), call->payload_header.size(),
                      call->send_payload.data(), call->send_payload.size(), &param);
  if (UCS_PTR_IS_ERR(request)) {
    Resolve(call, FromUcs(UCS_PTR_STATUS(request), "sending a payload"));
  } else if (request != nullptr) {
    call->data_request = request;
  }
}

void RpcClient::Impl::OnMappedReply(const FrameView& frame) {
  const uint64_t id = frame.header.request_id;
  // The ack goes after the copy, on every path: once the server has it, the memory may hold
  // another block (an ack sent first let a concurrent store overwrite a block mid-copy).
  bool acked_later = false;
  struct AckWhenDone {
    Impl* self;
    uint64_t id;
    const bool* later;
    ~AckWhenDone() {
      if (!*later) self->SendControl(FrameKind::kAck, id);
    }
  } ack{this, id, &acked_later};
  auto it = calls_.find(id);
  if (it == calls_.end() || it->second->resolved) {
    late_replies_.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  PendingCall* call = it->second.get();
  if (frame.header.status != 0) {
    Resolve(call, internal::StatusFromWireError(frame.header.status, frame.message));
    return;
  }
  call->reply.assign(frame.message.begin(), frame.message.end());
  if (frame.ref.length > call->recv_payload.size()) {
    Resolve(call, OutOfRangeError("reply payload of {} bytes exceeds the receive buffer of {} "
                                  "bytes",
                                  frame.ref.length, call->recv_payload.size()));
    return;
  }
  auto local = Map(frame.ref);
  if (!local.ok()) {
    Resolve(call, local.status());
    return;
  }
  if (call->copier != nullptr) {
    acked_later = true;  // by OnCopied
    PostCopy(call, call->recv_payload.data(), *local, frame.ref.length, /*pull=*/false);
    return;
  }
  std::memcpy(call->recv_payload.data(), *local, frame.ref.length);
  mapped_payloads_.fetch_add(1, std::memory_order_relaxed);
  call->payload_bytes = frame.ref.length;
  Resolve(call, Status::OK());
}

void RpcClient::Impl::PostCopy(PendingCall* call, std::byte* dst, const std::byte* src, size_t n,
                               bool pull) {
  call->copying = true;
  if (!call->skip_copy) call->skip_copy = std::make_shared<std::atomic<bool>>(false);
  ++copies_out_;
  call->copier->Post(
      [this, worker = worker_, id = call->id, skip = call->skip_copy, dst, src, n, pull] {
        const bool copy = !skip->load(std::memory_order_acquire);
        if (copy) std::memcpy(dst, src, n);
        worker->Run([this, id, copy, pull, n] { OnCopied(id, copy, pull, n); });
      });
}

void RpcClient::Impl::OnCopied(uint64_t id, bool copied, bool pull, size_t n) {
  if (--copies_out_ == 0) {
    for (SharedRegion& region : std::exchange(retired_regions_, {})) ReleaseSharedRegion(region);
  }
  if (copied) mapped_payloads_.fetch_add(1, std::memory_order_relaxed);
  // The server learns first: its memory is free for another block from here on.
  if (pull) {
    SendControl(FrameKind::kPullDone, id, copied ? StatusCode::kOk : StatusCode::kCancelled);
  } else {
    SendControl(FrameKind::kAck, id);
  }
  PendingCall* call = nullptr;
  if (auto it = calls_.find(id); it != calls_.end()) {
    call = it->second.get();
  } else if (auto gone = abandoned_.find(id); gone != abandoned_.end()) {
    gone->second->copying = false;
    ReapAbandoned(gone->second.get());
    return;
  }
  if (call == nullptr) return;
  call->copying = false;
  if (!pull && !call->resolved) {
    if (copied) {
      call->payload_bytes = n;
      Resolve(call, Status::OK());
    } else {
      Resolve(call, CancelledError("call {}: its reply payload was not copied", id));
    }
    return;
  }
  if (pull && !copied && !call->resolved) {
    Resolve(call, CancelledError("call {}: its payload was not copied", id));
    return;
  }
  MaybeFinish(call);
}

}  // namespace kvstash::transport
