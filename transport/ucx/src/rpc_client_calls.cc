// The calls of an RpcClient (rpc_client_calls.h): their frames, the table that owns them until
// UCX lets go, the endpoint their frames go out on and their deadlines.

#include "rpc_client_calls.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <limits>

#include "kvstash/proto/wire.pb.h"
#include "kvstash/transport/frame.h"
#include "worker.h"

namespace kvstash::transport::internal {

// ---- a call and its frame --------------------------------------------------------------------

std::unique_ptr<PendingCall> NewCall(uint64_t id, uint16_t method, Bytes request,
                                     const CallOptions& options, size_t max_am_header) {
  auto call = std::make_unique<PendingCall>();
  call->id = id;
  call->method = method;
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
  call->message_in_data = kFrameHeaderBytes + request.size() > max_am_header;
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
  return call;
}

Status CheckCall(const PendingCall& call, const Worker& worker) {
  const TransportOptions& limits = worker.options();
  if (call.frame.size() - kFrameHeaderBytes > limits.max_message_bytes) {
    return ResourceExhaustedError("request message of {} bytes exceeds the limit of {}",
                                  call.frame.size() - kFrameHeaderBytes, limits.max_message_bytes);
  }
  if (call.send_payload.size() > limits.max_payload_bytes) {
    return ResourceExhaustedError("request payload of {} bytes exceeds the limit of {}",
                                  call.send_payload.size(), limits.max_payload_bytes);
  }
  if (call.message_in_data && !call.send_payload.empty()) {
    return InvalidArgumentError(
        "request message of {} bytes is too large to travel with a payload "
        "(UCX header limit {})",
        call.frame.size() - kFrameHeaderBytes, worker.max_am_header());
  }
  if (Clock::now() >= call.deadline) {
    return DeadlineExceededError("call of method {} started after its deadline", call.method);
  }
  return Status::OK();
}

Status StatusFromWireError(uint16_t code, Bytes message) {
  wire::Error error;
  if (!error.ParseFromArray(message.data(), static_cast<int>(message.size()))) {
    return Status(static_cast<StatusCode>(code), "(unparseable error message from the server)");
  }
  return Status(static_cast<StatusCode>(code), error.message());
}

TransportStats ClientCounters::Snapshot() const {
  TransportStats s;
  s.calls = calls_started.load();
  s.failed = calls_failed.load();
  s.connects = connects.load();
  s.disconnects = disconnects.load();
  s.malformed_frames = malformed.load();
  s.late_replies = late_replies.load();
  s.mapped_payloads = mapped_payloads.load();
  return s;
}

// ---- CallTable -------------------------------------------------------------------------------

PendingCall* CallTable::Add(std::unique_ptr<PendingCall> owned) {
  PendingCall* call = owned.get();
  call->table = this;
  calls_.emplace(call->id, std::move(owned));
  return call;
}

PendingCall* CallTable::Find(uint64_t id) {
  auto it = calls_.find(id);
  return it == calls_.end() ? nullptr : it->second.get();
}

PendingCall* CallTable::FindAbandoned(uint64_t id) {
  auto it = abandoned_.find(id);
  return it == abandoned_.end() ? nullptr : it->second.get();
}

std::vector<std::pair<Clock::time_point, uint64_t>> CallTable::Deadlines(uint64_t except) const {
  std::vector<std::pair<Clock::time_point, uint64_t>> live;
  live.reserve(calls_.size());
  for (const auto& [id, call] : calls_) {
    if (id != except) live.emplace_back(call->deadline, id);
  }
  return live;
}

void CallTable::OnSendDone(void* request, ucs_status_t status, void* user_data) {
  auto* call = static_cast<PendingCall*>(user_data);
  call->table->SendFinished(request, status, call, &PendingCall::send_request, "sending call");
}

void CallTable::OnDataSent(void* request, ucs_status_t status, void* user_data) {
  auto* call = static_cast<PendingCall*>(user_data);
  call->table->SendFinished(request, status, call, &PendingCall::data_request,
                            "sending the payload of call");
}

void CallTable::SendFinished(void* request, ucs_status_t status, PendingCall* call,
                             void* PendingCall::*slot, std::string_view what) {
  ucp_request_free(request);
  call->*slot = nullptr;
  if (call->abandoned) {
    ReapAbandoned(call);
    return;
  }
  if (status != UCS_OK && !call->resolved) {
    Resolve(call, FromUcs(status, fmt::format("{} {}", what, call->id)));
    return;
  }
  MaybeFinish(call);
}

void CallTable::OnRecvDone(void* request, ucs_status_t status, size_t length, void* user_data) {
  auto* call = static_cast<PendingCall*>(user_data);
  ucp_request_free(request);
  call->recv_request = nullptr;
  CallTable* self = call->table;
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

void CallTable::ReceivePayload(PendingCall* call, void* data, size_t bytes) {
  ucp_request_param_t recv = ContigParam(call, call->recv_region);
  recv.cb.recv_am = &CallTable::OnRecvDone;
  ucs_status_ptr_t request =
      ucp_am_recv_data_nbx(worker_.ucp(), data, call->recv_payload.data(), bytes, &recv);
  if (request == nullptr) {
    call->payload_bytes = bytes;
    Resolve(call, Status::OK());
  } else if (UCS_PTR_IS_ERR(request)) {
    Resolve(call, FromUcs(UCS_PTR_STATUS(request), "receiving a reply payload"));
  } else {
    call->recv_request = request;
  }
}

void CallTable::Resolve(PendingCall* call, Status status) {
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

void CallTable::CancelRequests(PendingCall* call) {
  if (call->skip_copy) call->skip_copy->store(true, std::memory_order_release);
  for (void* request : {call->send_request, call->recv_request, call->data_request}) {
    if (request != nullptr) ucp_request_cancel(worker_.ucp(), request);
  }
}

void CallTable::MaybeFinish(PendingCall* call) {
  if (!call->resolved || call->resolving || InFlight(*call)) return;
  auto it = calls_.find(call->id);
  if (it == calls_.end()) return;
  std::unique_ptr<PendingCall> owned = std::move(it->second);
  calls_.erase(it);
  if (!owned->status.ok()) counters_.calls_failed.fetch_add(1, std::memory_order_relaxed);
  Response response{std::move(owned->status), owned->reply, owned->payload_bytes};
  if (owned->done) owned->done(response);
}

void CallTable::Abandon(PendingCall* call) {
  auto it = calls_.find(call->id);
  if (it == calls_.end()) return;
  std::unique_ptr<PendingCall> owned = std::move(it->second);
  calls_.erase(it);
  owned->abandoned = true;
  counters_.calls_failed.fetch_add(1, std::memory_order_relaxed);
  Response response{owned->status, {}, 0};
  ResponseCallback done = std::move(owned->done);
  abandoned_.emplace(owned->id, std::move(owned));
  if (done) done(response);
}

void CallTable::ReapAbandoned(PendingCall* call) {
  if (!InFlight(*call)) abandoned_.erase(call->id);
}

bool CallTable::FailAll(const Status& failure) {
  // Outstanding requests on the endpoint complete (cancelled) when it is force-closed; the
  // calls resolve first so those completions only finish them.
  std::vector<PendingCall*> all;
  all.reserve(calls_.size());
  bool in_flight = false;
  for (auto& [id, call] : calls_) {
    all.push_back(call.get());
    in_flight = in_flight || InFlight(*call);
  }
  for (PendingCall* call : all) {
    if (!call->resolved) {
      call->resolved = true;
      call->status = failure;
    }
    call->resolving = true;
    CancelRequests(call);
    call->resolving = false;
  }
  return in_flight;
}

void CallTable::ResolveAll(const Status& status) {
  for (auto& [id, call] : calls_) {
    call->resolved = true;
    call->status = status;
  }
  FinishResolved();
}

void CallTable::FinishResolved() {
  std::vector<PendingCall*> done;
  for (auto& [id, call] : calls_) {
    if (call->resolved) done.push_back(call.get());
  }
  for (PendingCall* call : done) {
    if (InFlight(*call)) {
      Abandon(call);
    } else {
      MaybeFinish(call);
    }
  }
}

// ---- ClientEndpoint --------------------------------------------------------------------------

void ClientEndpoint::Open(UcpEndpoint ep, uint64_t connection_id) {
  ep_ = std::move(ep);
  connection_id_ = connection_id;
}

void ClientEndpoint::Close(bool force, bool now, std::function<void()> closed) {
  auto ep = std::make_shared<UcpEndpoint>(std::move(ep_));
  auto close = [worker = &worker_, ep, force, closed = std::move(closed)] {
    worker->WaitRequest(ep->Close(force));
    closed();
  };
  if (now) {
    close();
  } else {
    asio::post(worker_.io(), std::move(close));
  }
}

Status ClientEndpoint::SendRequest(PendingCall* call, bool mapped) {
  FrameHeader header;
  std::memcpy(&header, call->frame.data(), kFrameHeaderBytes);
  header.connection_id = connection_id_.load();
  const auto left =
      std::chrono::duration_cast<std::chrono::microseconds>(call->deadline - Clock::now());
  header.timeout_us = static_cast<uint32_t>(
      std::clamp<int64_t>(left.count(), 1, std::numeric_limits<uint32_t>::max()));
  if (mapped && !call->message_in_data) {
    if (!call->recv_payload.empty()) header.flags |= kAcceptsMapped;
    // The payload stays here until the server pulls it (kPull).
    call->held = !call->send_payload.empty() &&
                 call->frame.size() + kMappedRefBytes <= worker_.max_am_header();
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
  param.cb.send = &CallTable::OnSendDone;
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
  if (request == nullptr) return Status::OK();  // sent (buffered or done) already
  if (UCS_PTR_IS_ERR(request)) return FromUcs(UCS_PTR_STATUS(request), "sending a request");
  call->send_request = request;
  return Status::OK();
}

Status ClientEndpoint::SendPayload(PendingCall* call) {
  FrameHeader header;
  header.kind = FrameKind::kPayload;
  header.request_id = call->id;
  header.connection_id = connection_id_.load();
  call->payload_header.resize(kFrameHeaderBytes);
  WriteFrame(header, {}, call->payload_header);
  ucp_request_param_t param = ContigParam(call, call->send_region);
  param.cb.send = &CallTable::OnDataSent;
  FromThisEndpoint(&param);
  ucs_status_ptr_t request =
      ucp_am_send_nbx(ep_.get(), kRpcAmId, call->payload_header.data(), call->payload_header.size(),
                      call->send_payload.data(), call->send_payload.size(), &param);
  if (UCS_PTR_IS_ERR(request)) return FromUcs(UCS_PTR_STATUS(request), "sending a payload");
  if (request != nullptr) call->data_request = request;
  return Status::OK();
}

void ClientEndpoint::SendControl(FrameKind kind, uint64_t id, StatusCode code) {
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

void ClientEndpoint::SendLoose(LooseSend send) {
  if (!ep_) return;
  auto* owned = new LooseSend(std::move(send));
  ucp_request_param_t param{};
  param.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_DATATYPE;
  param.cb.send = [](void* request, ucs_status_t status, void* user_data) {
    ucp_request_free(request);
    std::unique_ptr<LooseSend> done(static_cast<LooseSend*>(user_data));
    if (done->sent) done->sent(FromUcs(status, "sending a raw frame"));
  };
  param.user_data = owned;
  param.datatype = ucp_dt_make_contig(1);
  FromThisEndpoint(&param);
  ucs_status_ptr_t request =
      ucp_am_send_nbx(ep_.get(), kRpcAmId, owned->header.data(), owned->header.size(),
                      owned->data.data(), owned->data.size(), &param);
  if (request == nullptr || UCS_PTR_IS_ERR(request)) {
    std::unique_ptr<LooseSend> done(owned);
    if (done->sent) {
      done->sent(request == nullptr ? Status::OK()
                                    : FromUcs(UCS_PTR_STATUS(request), "sending a raw frame"));
    }
  }
}

// ---- DeadlineQueue ---------------------------------------------------------------------------

void DeadlineQueue::Add(Clock::time_point deadline, uint64_t id) {
  if (deadlines_.size() >= 1024 && deadlines_.size() > 2 * calls_.live()) {
    // Resolved calls still live wait for a transfer: their deadline resets a stalled peer.
    deadlines_ = decltype(deadlines_)(std::greater<>(), calls_.Deadlines(id));
  }
  deadlines_.emplace(deadline, id);
  if (!armed_ || deadline < armed_at_) Arm(deadline);
}

void DeadlineQueue::Expire() {
  const auto now = Clock::now();
  size_t stuck = 0;
  while (!deadlines_.empty() && deadlines_.top().first <= now) {
    const uint64_t id = deadlines_.top().second;
    deadlines_.pop();
    PendingCall* call = calls_.Find(id);
    if (call == nullptr) continue;
    if (!call->resolved) {
      if (call->sent && endpoint_) endpoint_.SendControl(FrameKind::kCancel, id);
      calls_.Resolve(
          call, DeadlineExceededError("call {} (method {}) passed its deadline", id, call->method));
    }
    // Still here: a transfer the peer does not finish, or a copy its copier still has (which
    // completes the call when it runs: the copier must run it, and soon).
    if (PendingCall* left = calls_.Find(id); left != nullptr && !left->copying) ++stuck;
  }
  if (stuck != 0) on_stalled_(stuck);
}

void DeadlineQueue::Arm(Clock::time_point at) {
  armed_ = true;
  armed_at_ = at;
  timer_.expires_at(at);
  timer_.async_wait([this](const asio::error_code& error) {
    if (error == asio::error::operation_aborted) return;
    armed_ = false;
    Expire();
    if (!deadlines_.empty()) Arm(deadlines_.top().first);
  });
}

}  // namespace kvstash::transport::internal
