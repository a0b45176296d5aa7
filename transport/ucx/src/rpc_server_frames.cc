// FrameDispatcher: frames from clients (progress thread): validated, then a request dispatched
// to its handler, a cancel flagged on its call, a bind passed to the connections, or a control
// frame to the replies (kAck) or the payloads (a pull's answer).

#include <fmt/format.h>

#include <bit>
#include <cstring>

#include "kvstash/common/logging.h"
#include "kvstash/transport/frame.h"
#include "rpc_server_impl.h"
#include "worker.h"

namespace kvstash::transport {

// ---- FrameDispatcher
// ----------------------------------------------------------------------------------

ucs_status_t FrameDispatcher::OnFrame(void* arg, const void* header, size_t header_length,
                                      void* data, size_t length, const ucp_am_recv_param_t* param) {
  ucp_ep_h from =
      (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) != 0 ? param->reply_ep : nullptr;
  return static_cast<FrameDispatcher*>(arg)->Dispatch(
      Bytes(static_cast<const std::byte*>(header), header_length), data, length,
      (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0, from);
}

void FrameDispatcher::Release(void* data, size_t length, bool rndv, ucp_ep_h from) {
  if (!rndv || worker_.DiscardRendezvous(data, length)) return;
  if (std::shared_ptr<ServerConnection> own = connections_.BoundConnection(from)) {
    connections_.Close(own, ResourceExhaustedError("payload of {} bytes beyond the limit of {}",
                                                   length, worker_.options().max_payload_bytes));
  }
}

ucs_status_t FrameDispatcher::Dispatch(Bytes header, void* data, size_t length, bool rndv,
                                       ucp_ep_h from) {
  const Bytes eager = rndv ? Bytes{} : Bytes(static_cast<const std::byte*>(data), length);
  auto frame = ParseFrame(header, eager, length, !rndv, worker_.options().max_message_bytes);
  if (!frame.ok()) {
    // Released first: a payload beyond the limit closes the connection, which then is not
    // answered.
    Release(data, length, rndv, from);
    OnMalformed(header, frame.status(), from);
    return UCS_OK;
  }
  const FrameHeader& h = frame->header;
  if (h.kind == FrameKind::kBind) {
    connections_.Bind(h, from);
    return UCS_OK;
  }
  const std::shared_ptr<ServerConnection> connection = connections_.ConnectionOf(h, from);
  if (connection == nullptr) {
    Release(data, length, rndv, from);
    return UCS_OK;
  }
  switch (h.kind) {
    case FrameKind::kRequest:
      return DispatchRequest(connection, *frame, data, length, rndv, from);
    case FrameKind::kCancel:
      if (auto call = active_.find({h.connection_id, h.request_id}); call != active_.end()) {
        if (auto state = call->second.lock()) state->cancel_flag = true;
      }
      return UCS_OK;
    case FrameKind::kAck:
      replies_.OnAck(*connection, h.request_id);
      return UCS_OK;
    case FrameKind::kPullDone:
    case FrameKind::kPayload:
      payloads_.OnPullAnswer(connection, *frame, data, length, rndv);
      return UCS_OK;
    default:  // a kind only a server sends
      counters_.malformed.fetch_add(1, std::memory_order_relaxed);
      Release(data, length, rndv, from);
      return UCS_OK;
  }
}

void FrameDispatcher::OnMalformed(Bytes header, const Status& error, ucp_ep_h from) {
  const uint64_t malformed = counters_.malformed.fetch_add(1, std::memory_order_relaxed) + 1;
  // The error goes back when the frame names its own endpoint's live connection and a request.
  if (header.size() >= kFrameHeaderBytes) {
    FrameHeader h;
    std::memcpy(&h, header.data(), kFrameHeaderBytes);
    std::shared_ptr<ServerConnection> own = connections_.BoundConnection(from);
    if (h.magic == kFrameMagic && h.kind == FrameKind::kRequest && own != nullptr &&
        own->id == h.connection_id) {
      auto state = NewState(own, h);
      state->replied = true;
      replies_.ReplyStatus(state, error);
    }
  }
  // A peer sending garbage must not flood the log: the 1st, 2nd, 4th, 8th ... are said.
  if (std::has_single_bit(malformed)) {
    KVSTASH_LOG_WARN("malformed frame ({} so far): {}", malformed, error.ToString());
  }
}

ucs_status_t FrameDispatcher::DispatchRequest(const std::shared_ptr<ServerConnection>& connection,
                                              const FrameView& frame, void* data, size_t length,
                                              bool rndv, ucp_ep_h from) {
  const FrameHeader& h = frame.header;
  auto state = NewState(connection, h);
  if (frame.payload_bytes > worker_.options().max_payload_bytes) {
    Release(data, length, rndv, from);
    state->replied = true;
    replies_.ReplyStatus(
        state, ResourceExhaustedError("payload of {} bytes exceeds the limit of {}",
                                      frame.payload_bytes, worker_.options().max_payload_bytes));
    return UCS_OK;
  }
  auto handler = handlers_.find(h.method);
  if (handler == handlers_.end()) {
    Release(data, length, rndv, from);
    state->replied = true;
    replies_.ReplyStatus(state, UnimplementedError("no handler for method {}", h.method));
    return UCS_OK;
  }
  counters_.calls.fetch_add(1, std::memory_order_relaxed);
  state->request_bytes.assign(frame.message.begin(), frame.message.end());
  state->payload_size = frame.payload_bytes;
  state->payload_data = data;
  state->payload_rndv = rndv;
  state->payload_held = frame.has_ref;
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

std::shared_ptr<UcxCall> FrameDispatcher::NewState(
    const std::shared_ptr<ServerConnection>& connection, const FrameHeader& h) {
  auto state = std::make_shared<UcxCall>();
  state->server = server_.shared_from_this();
  state->worker = server_.worker();
  state->connection = connection;
  state->method_id = h.method;
  state->request_id = h.request_id;
  state->accepts_mapped = (h.flags & kAcceptsMapped) != 0;
  state->deadline_at = h.timeout_us == 0 ? Clock::time_point::max()
                                         : Clock::now() + std::chrono::microseconds(h.timeout_us);
  return state;
}

void FrameDispatcher::Forget(const UcxCall& state) {
  active_.erase({state.connection->id, state.request_id});
}

}  // namespace kvstash::transport
