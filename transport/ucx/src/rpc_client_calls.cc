// RpcClient::Impl: calls, from Call (any thread) to the callback (progress thread), with the
// UCX sends and receives of their frames and payloads.

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <limits>

#include "kvstash/transport/frame.h"
#include "rpc_client_impl.h"
#include "worker.h"

namespace kvstash::transport {

// ---- calls -----------------------------------------------------------------------------------

uint64_t RpcClient::Impl::Call(uint16_t method, Bytes request, const CallOptions& options,
                               ResponseCallback done) {
  auto call = std::make_unique<PendingCall>();
  call->id = next_id_.fetch_add(1);
  call->impl = this;
  call->method = method;
  call->done = std::move(done);
  call->deadline = options.deadline;
  call->send_payload = options.send_payload;
  call->send_region = options.send_region;
  call->recv_payload = options.recv_payload;
  call->recv_region = options.recv_region;
  call->copier = options.copier;
  FrameHeader header;
  header.kind = FrameKind::kRequest;
  header.method = method;
  header.request_id = call->id;
  header.message_bytes = static_cast<uint32_t>(request.size());
  call->message_in_data = kFrameHeaderBytes + request.size() > worker_->max_am_header();
  if (call->message_in_data) {
    header.flags = kMessageInData;
    call->frame.resize(kFrameHeaderBytes + request.size());
    WriteFrame(header, {}, call->frame);
    std::memcpy(call->frame.data() + kFrameHeaderBytes, request.data(), request.size());
    call->message_bytes = Bytes(call->frame).subspan(kFrameHeaderBytes);
  } else {
    call->frame.resize(kFrameHeaderBytes + request.size());
    WriteFrame(header, request, call->frame);
  }
  const uint64_t id = call->id;
  calls_started_.fetch_add(1, std::memory_order_relaxed);
  worker_->Run([this, call = std::move(call)]() mutable { Start(std::move(call)); });
  return id;
}

void RpcClient::Impl::Cancel(uint64_t id) {
  worker_->Run([this, id] {
    auto it = calls_.find(id);
    if (it == calls_.end() || it->second->resolved) return;
    PendingCall* call = it->second.get();
    if (call->sent) SendCancelFrame(id);
    Resolve(call, CancelledError("call {} cancelled", id));
  });
}

void RpcClient::Impl::Reset(Status why) {
  worker_->Run([this, why = std::move(why)] {
    Disconnect(Status(StatusCode::kUnavailable, std::string(why.message())));
  });
}

void RpcClient::Impl::Start(std::unique_ptr<PendingCall> owned) {
  PendingCall* call = owned.get();
  calls_.emplace(call->id, std::move(owned));
  if (worker_->stopping()) {
    Resolve(call, CancelledError("client is shutting down"));
    return;
  }
  if (call->frame.size() - kFrameHeaderBytes > worker_->options().max_message_bytes) {
    Resolve(call, ResourceExhaustedError("request message of {} bytes exceeds the limit of {}",
                                         call->frame.size() - kFrameHeaderBytes,
                                         worker_->options().max_message_bytes));
    return;
  }
  if (call->send_payload.size() > worker_->options().max_payload_bytes) {
    Resolve(call, ResourceExhaustedError("request payload of {} bytes exceeds the limit of {}",
                                         call->send_payload.size(),
                                         worker_->options().max_payload_bytes));
    return;
  }
  if (call->message_in_data && !call->send_payload.empty()) {
    Resolve(call, InvalidArgumentError(
                      "request message of {} bytes is too large to travel with a payload "
                      "(UCX header limit {})",
                      call->frame.size() - kFrameHeaderBytes, worker_->max_am_header()));
    return;
  }
  if (Clock::now() >= call->deadline) {
    Resolve(call,
            DeadlineExceededError("call of method {} started after its deadline", call->method));
    return;
  }
  ScheduleDeadline(call->deadline, call->id);
  if (state_ == State::kConnected) {
    Send(call);
  } else {
    waiting_.push_back(call->id);
    if (state_ == State::kIdle) StartConnect();
  }
}

void RpcClient::Impl::Send(PendingCall* call) {
  FrameHeader header;
  std::memcpy(&header, call->frame.data(), kFrameHeaderBytes);
  header.connection_id = connection_id_.load();
  const auto left =
      std::chrono::duration_cast<std::chrono::microseconds>(call->deadline - Clock::now());
  header.timeout_us = static_cast<uint32_t>(
      std::clamp<int64_t>(left.count(), 1, std::numeric_limits<uint32_t>::max()));
  if (mapped_.load(std::memory_order_relaxed) && !call->message_in_data) {
    if (!call->recv_payload.empty()) header.flags |= kAcceptsMapped;
    // The payload stays here until the server pulls it (kPull).
    call->held = !call->send_payload.empty() &&
                 call->frame.size() + kMappedRefBytes <= worker_->max_am_header();
  }
  if (call->held) {
    MappedRef ref;
    ref.length = call->send_payload.size();
    call->frame = WriteFrameWithRef(header, Bytes(call->frame).subspan(kFrameHeaderBytes), ref, {});
  } else {
    std::memcpy(call->frame.data(), &header, kFrameHeaderBytes);
  }

  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                       UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_DATATYPE;
  param.cb.send = &Impl::OnSendDone;
  param.user_data = call;
  param.datatype = ucp_dt_make_contig(1);
  const void* data = call->send_payload.data();
  size_t data_bytes = call->send_payload.size();
  size_t header_bytes = call->frame.size();
  if (call->message_in_data) {
    data = call->message_bytes.data();
    data_bytes = call->message_bytes.size();
    header_bytes = kFrameHeaderBytes;
    param.flags = UCP_AM_SEND_FLAG_EAGER;
  } else if (call->held) {
    data = nullptr;
    data_bytes = 0;
  } else if (call->send_region != nullptr) {
    param.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
    param.memh = static_cast<ucp_mem_h>(call->send_region->handle());
  }
  FromThisEndpoint(&param);
  call->sent = true;
  ucs_status_ptr_t request = ucp_am_send_nbx(ep_.get(), kRpcAmId, call->frame.data(), header_bytes,
                                             data, data_bytes, &param);
  if (request == nullptr) return;  // sent (buffered or done) already
  if (UCS_PTR_IS_ERR(request)) {
    Resolve(call, FromUcs(UCS_PTR_STATUS(request), "sending a request"));
    return;
  }
  call->send_request = request;
}

void RpcClient::Impl::OnSendDone(void* request, ucs_status_t status, void* user_data) {
  SendFinished(request, status, static_cast<PendingCall*>(user_data), &PendingCall::send_request,
               "sending call");
}

void RpcClient::Impl::OnDataSent(void* request, ucs_status_t status, void* user_data) {
  SendFinished(request, status, static_cast<PendingCall*>(user_data), &PendingCall::data_request,
               "sending the payload of call");
}

void RpcClient::Impl::SendFinished(void* request, ucs_status_t status, PendingCall* call,
                                   void* PendingCall::*slot, std::string_view what) {
  ucp_request_free(request);
  call->*slot = nullptr;
  auto* self = static_cast<Impl*>(call->impl);
  if (call->abandoned) {
    self->ReapAbandoned(call);
    return;
  }
  if (status != UCS_OK && !call->resolved) {
    self->Resolve(call, FromUcs(status, fmt::format("{} {}", what, call->id)));
    return;
  }
  self->MaybeFinish(call);
}

void RpcClient::Impl::OnRecvDone(void* request, ucs_status_t status, size_t length,
                                 void* user_data) {
  auto* call = static_cast<PendingCall*>(user_data);
  ucp_request_free(request);
  call->recv_request = nullptr;
  auto* self = static_cast<Impl*>(call->impl);
  if (call->abandoned) {
    self->ReapAbandoned(call);
    return;
  }
  if (call->resolved) {
    self->MaybeFinish(call);
    return;
  }
  if (status != UCS_OK) {
    self->Resolve(call,
                  FromUcs(status, fmt::format("receiving the reply payload of call {}", call->id)));
    return;
  }
  call->payload_bytes = length;
  self->Resolve(call, Status::OK());
}

void RpcClient::Impl::Resolve(PendingCall* call, Status status) {
  if (call->resolved) return;
  call->resolved = true;
  call->status = std::move(status);
  if (!call->status.ok()) {
    call->resolving = true;
    CancelRequests(call);
    call->resolving = false;
  }
  MaybeFinish(call);
}

void RpcClient::Impl::CancelRequests(PendingCall* call) {
  if (call->skip_copy) call->skip_copy->store(true, std::memory_order_release);
  for (void* request : {call->send_request, call->recv_request, call->data_request}) {
    if (request != nullptr) ucp_request_cancel(worker_->ucp(), request);
  }
}

void RpcClient::Impl::MaybeFinish(PendingCall* call) {
  if (!call->resolved || call->resolving || InFlight(*call)) return;
  auto it = calls_.find(call->id);
  if (it == calls_.end()) return;
  std::unique_ptr<PendingCall> owned = std::move(it->second);
  calls_.erase(it);
  if (!owned->status.ok()) calls_failed_.fetch_add(1, std::memory_order_relaxed);
  Response response{std::move(owned->status), owned->reply, owned->payload_bytes};
  if (owned->done) owned->done(response);
}

void RpcClient::Impl::Abandon(PendingCall* call) {
  auto it = calls_.find(call->id);
  if (it == calls_.end()) return;
  std::unique_ptr<PendingCall> owned = std::move(it->second);
  calls_.erase(it);
  owned->abandoned = true;
  calls_failed_.fetch_add(1, std::memory_order_relaxed);
  Response response{owned->status, {}, 0};
  ResponseCallback done = std::move(owned->done);
  abandoned_.emplace(owned->id, std::move(owned));
  if (done) done(response);
}

void RpcClient::Impl::ReapAbandoned(PendingCall* call) {
  if (!InFlight(*call)) abandoned_.erase(call->id);
}

}  // namespace kvstash::transport
