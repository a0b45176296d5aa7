// RpcClient::Impl: frames from the server (progress thread): replies, with their payloads in
// the frame or received by rendezvous; pulls and mapped replies go on to rpc_client_mapped.cc.

#include <cstring>

#include "kvstash/common/logging.h"
#include "kvstash/proto/wire.pb.h"
#include "kvstash/transport/frame.h"
#include "rpc_client_impl.h"
#include "worker.h"

namespace kvstash::transport {

// ---- frames from the server ------------------------------------------------------------------

namespace internal {

Status StatusFromWireError(uint16_t code, Bytes message) {
  wire::Error error;
  if (!error.ParseFromArray(message.data(), static_cast<int>(message.size()))) {
    return Status(static_cast<StatusCode>(code), "(unparseable error message from the server)");
  }
  return Status(static_cast<StatusCode>(code), error.message());
}

}  // namespace internal

ucs_status_t RpcClient::Impl::OnFrame(const void* header, size_t header_length, void* data,
                                      size_t length, const ucp_am_recv_param_t* param) {
  Impl* self = this;
  const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
  auto release = [&] {
    if (rndv && !self->worker_->DiscardRendezvous(data, length)) {
      self->Disconnect(
          UnavailableError("server sent a payload of {} bytes, beyond the limit "
                           "of {}",
                           length, self->worker_->options().max_payload_bytes));
    }
  };
  const Bytes data_bytes = rndv ? Bytes{} : Bytes(static_cast<const std::byte*>(data), length);
  auto frame = ParseFrame(Bytes(static_cast<const std::byte*>(header), header_length), data_bytes,
                          length, !rndv, self->worker_->options().max_message_bytes);
  const bool known = frame.ok() && (frame->header.kind == FrameKind::kResponse ||
                                    frame->header.kind == FrameKind::kPull);
  if (!known) {
    self->malformed_.fetch_add(1, std::memory_order_relaxed);
    KVSTASH_LOG_WARN("dropped a malformed frame from the server: {}",
                     frame.ok() ? "not a response" : frame.status().ToString());
    release();
    return UCS_OK;
  }
  // The server sends each shared region's key once per connection, with its first use.
  if (frame->has_ref && !frame->rkey.empty()) self->AddSharedRegion(frame->ref, frame->rkey);
  if (frame->header.kind == FrameKind::kPull) {
    self->OnPull(*frame);
    return UCS_OK;
  }
  if (frame->has_ref) {
    self->OnMappedReply(*frame);
    return UCS_OK;
  }
  auto it = self->calls_.find(frame->header.request_id);
  if (it == self->calls_.end() || it->second->resolved) {
    self->late_replies_.fetch_add(1, std::memory_order_relaxed);
    release();
    return UCS_OK;
  }
  PendingCall* call = it->second.get();
  if (frame->header.status != 0) {
    release();
    self->Resolve(call, internal::StatusFromWireError(frame->header.status, frame->message));
    return UCS_OK;
  }
  call->reply.assign(frame->message.begin(), frame->message.end());
  const size_t payload = frame->payload_bytes;
  if (payload == 0) {
    self->Resolve(call, Status::OK());
    return UCS_OK;
  }
  if (payload > call->recv_payload.size()) {
    release();
    self->Resolve(call, OutOfRangeError("reply payload of {} bytes exceeds the receive buffer "
                                        "of {} bytes",
                                        payload, call->recv_payload.size()));
    return UCS_OK;
  }
  if (!rndv) {
    std::memcpy(call->recv_payload.data(), data, payload);
    call->payload_bytes = payload;
    self->Resolve(call, Status::OK());
    return UCS_OK;
  }
  ucp_request_param_t recv = ContigParam(call, call->recv_region);
  recv.cb.recv_am = &Impl::OnRecvDone;
  ucs_status_ptr_t request =
      ucp_am_recv_data_nbx(self->worker_->ucp(), data, call->recv_payload.data(), payload, &recv);
  if (request == nullptr) {
    call->payload_bytes = payload;
    self->Resolve(call, Status::OK());
  } else if (UCS_PTR_IS_ERR(request)) {
    self->Resolve(call, FromUcs(UCS_PTR_STATUS(request), "receiving a reply payload"));
  } else {
    call->recv_request = request;
  }
  return UCS_OK;
}

}  // namespace kvstash::transport
