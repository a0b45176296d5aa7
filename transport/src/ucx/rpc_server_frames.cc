// RpcServer::Impl: frames from clients (progress thread): validated, then a request dispatched
// to its handler, a cancel flagged on its call, or a control frame passed to the replies.

#include <cstring>

#include "kvstash/common/logging.h"
#include "kvstash/transport/frame.h"
#include "rpc_server_impl.h"
#include "worker.h"

namespace kvstash::transport {

// ---- frames ----------------------------------------------------------------------------------

ucs_status_t RpcServer::Impl::OnFrame(void* arg, const void* header, size_t header_length,
                                      void* data, size_t length, const ucp_am_recv_param_t* param) {
  return static_cast<Impl*>(arg)->Dispatch(
      Bytes(static_cast<const std::byte*>(header), header_length), data, length,
      (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0);
}

ucs_status_t RpcServer::Impl::Dispatch(Bytes header, void* data, size_t length, bool rndv) {
  // An unwanted rendezvous payload is drained; one beyond the payload limit closes the
  // connection it came on (which releases it).
  auto release = [&] {
    if (!rndv || worker_->DiscardRendezvous(data, length)) return;
    if (header.size() < kFrameHeaderBytes) return;
    FrameHeader h;
    std::memcpy(&h, header.data(), kFrameHeaderBytes);
    auto it = connections_.find(h.connection_id);
    if (it != connections_.end()) {
      Close(it->second, ResourceExhaustedError("payload of {} bytes beyond the limit of {}", length,
                                               worker_->options().max_payload_bytes));
    }
  };
  const Bytes eager = rndv ? Bytes{} : Bytes(static_cast<const std::byte*>(data), length);
  auto frame = ParseFrame(header, eager, length, !rndv, worker_->options().max_message_bytes);
  if (!frame.ok()) {
    malformed_.fetch_add(1, std::memory_order_relaxed);
    release();
    // The error goes back when the frame names a live connection and a request.
    if (header.size() >= kFrameHeaderBytes) {
      FrameHeader h;
      std::memcpy(&h, header.data(), kFrameHeaderBytes);
      auto it = connections_.find(h.connection_id);
      if (h.magic == kFrameMagic && h.kind == FrameKind::kRequest && it != connections_.end()) {
        auto state = NewState(it->second, h);
        state->replied = true;
        ReplyStatus(state, frame.status());
      }
    }
    KVSTASH_LOG_WARN("malformed frame: {}", frame.status().ToString());
    return UCS_OK;
  }
  const FrameHeader& h = frame->header;
  auto it = connections_.find(h.connection_id);
  if (it == connections_.end()) {
    malformed_.fetch_add(1, std::memory_order_relaxed);
    release();
    KVSTASH_LOG_WARN("frame for unknown connection {:#x}", h.connection_id);
    return UCS_OK;
  }
  const std::shared_ptr<ServerConnection>& connection = it->second;
  if (h.kind == FrameKind::kCancel) {
    auto call = active_.find({h.connection_id, h.request_id});
    if (call != active_.end()) {
      if (auto state = call->second.lock()) state->cancel_flag = true;
    }
    return UCS_OK;
  }
  if (h.kind == FrameKind::kAck || h.kind == FrameKind::kPullDone ||
      h.kind == FrameKind::kPayload) {
    OnControl(connection, *frame, data, length, rndv);
    return UCS_OK;
  }
  if (h.kind != FrameKind::kRequest) {
    malformed_.fetch_add(1, std::memory_order_relaxed);
    release();
    return UCS_OK;
  }
  auto state = NewState(connection, h);
  if (frame->payload_bytes > worker_->options().max_payload_bytes) {
    release();
    state->replied = true;
    ReplyStatus(state,
                ResourceExhaustedError("payload of {} bytes exceeds the limit of {}",
                                       frame->payload_bytes, worker_->options().max_payload_bytes));
    return UCS_OK;
  }
  auto handler = handlers_.find(h.method);
  if (handler == handlers_.end()) {
    release();
    state->replied = true;
    ReplyStatus(state, UnimplementedError("no handler for method {}", h.method));
    return UCS_OK;
  }
  calls_.fetch_add(1, std::memory_order_relaxed);
  state->request_bytes.assign(frame->message.begin(), frame->message.end());
  state->payload_size = frame->payload_bytes;
  state->payload_data = data;
  state->payload_rndv = rndv;
  state->payload_held = frame->has_ref;
  state->in_am_callback = true;
  active_[{h.connection_id, h.request_id}] = state;
  handler->second(ServerCall(state));
  state->in_am_callback = false;
  const bool keep = !state->payload_consumed && state->payload_size > 0 && state.use_count() > 1;
  if (!keep) {
    // Dropped during the handler (Drop ran inline and skipped the release) or consumed.
    if (!state->payload_consumed && state->payload_size > 0) {
      state->ReleasePayload();
    }
    active_.erase({h.connection_id, h.request_id});
    return UCS_OK;
  }
  if (!state->payload_held) {
    // Kept past the callback (a handler that takes the bytes later, e.g. once its slot is
    // free): UCX keeps an eager payload's data, or a rendezvous descriptor, only when told so.
    state->payload_persistent = !rndv;
    return UCS_INPROGRESS;
  }
  return UCS_OK;
}

std::shared_ptr<UcxCall> RpcServer::Impl::NewState(
    const std::shared_ptr<ServerConnection>& connection, const FrameHeader& h) {
  auto state = std::make_shared<UcxCall>();
  state->server = shared_from_this();
  state->worker = worker_;
  state->connection = connection;
  state->method_id = h.method;
  state->request_id = h.request_id;
  state->accepts_mapped = (h.flags & kAcceptsMapped) != 0;
  state->deadline_at = h.timeout_us == 0 ? Clock::time_point::max()
                                         : Clock::now() + std::chrono::microseconds(h.timeout_us);
  return state;
}

void RpcServer::Impl::Forget(const UcxCall& state) {
  active_.erase({state.connection->id, state.request_id});
}

}  // namespace kvstash::transport
