// ReplySender: replies (any thread, sent on the progress thread). PayloadReceiver: the request
// payloads a handler receives, in the frame, by rendezvous, or pulled from a client that holds
// them. UcxCall: one request, as its ServerCall handle sees it.

#include <fmt/format.h>

#include <cstring>
#include <memory>
#include <span>
#include <utility>

#include "kvstash/common/logging.h"
#include "kvstash/proto/wire.pb.h"
#include "kvstash/transport/frame.h"
#include "rpc_server_impl.h"
#include "worker.h"

namespace kvstash::transport {

namespace {

struct PayloadRecv {
  std::shared_ptr<UcxCall> state;
  std::function<void(Status)> done;
};

// A control frame (kPull, a mapped reply) with no call callback behind it: owns its bytes until
// sent.
struct ControlSend {
  std::vector<std::byte> header;
  std::shared_ptr<ServerConnection> connection;
};

// Names `bytes` of a shared region in ref, with the region's rkey the first time this
// connection hears of it.
void FillRef(ServerConnection& connection, const MemoryRegion& region, Bytes bytes, MappedRef* ref,
             std::span<const std::byte>* rkey) {
  ref->region_id = region.id();
  ref->region_address = reinterpret_cast<uintptr_t>(region.data());
  ref->region_size = region.size();
  ref->address = reinterpret_cast<uintptr_t>(bytes.data());
  ref->length = bytes.size();
  if (connection.rkeys_sent.insert(region.id()).second) {
    *rkey = std::as_bytes(std::span(region.packed_rkey()));
  }
}

// Sends `frame` on the connection's endpoint, keeping the connection until it is sent; nothing
// once the connection closed or before it bound its endpoint. Progress thread.
void SendControl(std::shared_ptr<ServerConnection> connection, std::vector<std::byte> frame) {
  if (!connection->open || !connection->ep) return;
  auto* owned = new ControlSend{std::move(frame), std::move(connection)};
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.cb.send = [](void* request, ucs_status_t, void* user_data) {
    ucp_request_free(request);
    delete static_cast<ControlSend*>(user_data);
  };
  param.user_data = owned;
  ucs_status_ptr_t request =
      ucp_am_send_nbx(owned->connection->ep.get(), kRpcAmId, owned->header.data(),
                      owned->header.size(), nullptr, 0, &param);
  if (request == nullptr || UCS_PTR_IS_ERR(request)) delete owned;
}

}  // namespace

// ---- ReplySender -----------------------------------------------------------------------------

void ReplySender::Reply(const std::shared_ptr<UcxCall>& state, StatusCode code, Bytes message,
                        Bytes payload, const MemoryRegion* region,
                        std::function<void(Status)> sent) {
  auto send = std::make_unique<ReplySend>();
  send->sent = std::move(sent);
  send->state = state;
  FrameHeader header;
  header.kind = FrameKind::kResponse;
  header.method = state->method_id;
  header.request_id = state->request_id;
  header.connection_id = state->connection->id;
  header.status = static_cast<uint16_t>(code);
  header.message_bytes = static_cast<uint32_t>(message.size());
  const bool in_data = kFrameHeaderBytes + message.size() > worker_.max_am_header();
  if (in_data) {
    header.flags = kMessageInData;
    send->header.resize(kFrameHeaderBytes);
    WriteFrame(header, {}, send->header);
    send->message_in_data.assign(message.begin(), message.end());
  } else {
    send->header.resize(kFrameHeaderBytes + message.size());
    WriteFrame(header, message, send->header);
  }
  worker_.Run([this, send = std::move(send), payload, region]() mutable {
    // A call answered without taking its request payload lets it go now: a payload kept past
    // its frame would otherwise stay with UCX, and a rendezvous sender would never finish.
    send->state->ReleasePayload();
    SendReply(std::move(send), payload, region);
  });
}

void ReplySender::ReplyStatus(const std::shared_ptr<UcxCall>& state, const Status& status) {
  wire::Error error;
  error.set_code(internal::ToWire(status.code()));
  error.set_message(std::string(status.message()));
  const std::string bytes = error.SerializeAsString();
  Reply(state, status.code(), std::as_bytes(std::span(bytes)), {}, nullptr, {});
}

void ReplySender::SendReply(std::unique_ptr<ReplySend> send, Bytes payload,
                            const MemoryRegion* region) {
  ServerConnection& connection = *send->state->connection;
  if (!connection.open || !connection.ep) {
    if (send->sent) send->sent(UnavailableError("connection {} is closed", connection.id));
    return;
  }
  if (send->state->cancel_flag.load()) {
    if (send->sent) {
      send->sent(CancelledError("call {} was cancelled by the client", send->state->request_id));
    }
    return;
  }
  if (!send->message_in_data.empty() && !payload.empty()) {
    if (send->sent) {
      send->sent(
          InvalidArgumentError("reply message of {} bytes is too large to travel with "
                               "a payload",
                               send->message_in_data.size()));
    }
    return;
  }
  if (send->state->accepts_mapped && send->message_in_data.empty() && !payload.empty() &&
      region != nullptr && !region->packed_rkey().empty() && region->Contains(payload) &&
      send->header.size() + kMappedRefBytes + region->packed_rkey().size() <=
          worker_.max_am_header()) {
    SendMappedReply(std::move(send), payload, *region);
    return;
  }
  ucp_request_param_t param{};
  param.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_DATATYPE;
  param.cb.send = [](void* request, ucs_status_t status, void* user_data) {
    ucp_request_free(request);
    std::unique_ptr<ReplySend> owned(static_cast<ReplySend*>(user_data));
    if (owned->sent) owned->sent(FromUcs(status, "sending a reply"));
  };
  param.datatype = ucp_dt_make_contig(1);
  const void* data = payload.data();
  size_t data_bytes = payload.size();
  if (!send->message_in_data.empty()) {
    data = send->message_in_data.data();
    data_bytes = send->message_in_data.size();
    param.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = UCP_AM_SEND_FLAG_EAGER;
  } else if (region != nullptr) {
    param.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
    param.memh = static_cast<ucp_mem_h>(region->handle());
  }
  ReplySend* raw = send.release();
  param.user_data = raw;
  ucs_status_ptr_t request = ucp_am_send_nbx(connection.ep.get(), kRpcAmId, raw->header.data(),
                                             raw->header.size(), data, data_bytes, &param);
  if (request == nullptr || UCS_PTR_IS_ERR(request)) {
    std::unique_ptr<ReplySend> owned(raw);
    if (owned->sent) {
      owned->sent(request == nullptr ? Status::OK()
                                     : FromUcs(UCS_PTR_STATUS(request), "sending a reply"));
    }
  }
}

void ReplySender::SendMappedReply(std::unique_ptr<ReplySend> send, Bytes payload,
                                  const MemoryRegion& region) {
  const std::shared_ptr<ServerConnection>& connection = send->state->connection;
  FrameHeader header;
  std::memcpy(&header, send->header.data(), kFrameHeaderBytes);
  MappedRef ref;
  std::span<const std::byte> rkey;
  FillRef(*connection, region, payload, &ref, &rkey);
  const uint64_t id = send->state->request_id;
  auto sent = std::move(send->sent);
  connection->acks[id] = sent ? std::move(sent) : [](Status) {};
  SendControl(connection,
              WriteFrameWithRef(header, Bytes(send->header).subspan(kFrameHeaderBytes), ref, rkey));
}

void ReplySender::OnAck(ServerConnection& connection, uint64_t request_id) {
  auto it = connection.acks.find(request_id);
  if (it == connection.acks.end()) return;
  auto sent = std::move(it->second);
  connection.acks.erase(it);
  counters_.mapped.fetch_add(1, std::memory_order_relaxed);
  sent(Status::OK());
}

// ---- PayloadReceiver -------------------------------------------------------------------------

void PayloadReceiver::ReceivePayload(const std::shared_ptr<UcxCall>& state, MutableBytes dest,
                                     const MemoryRegion* region, std::function<void(Status)> done) {
  worker_.Run([this, state, dest, region, done = std::move(done)]() mutable {
    if (state->payload_consumed) {
      done(FailedPreconditionError("payload of call {} already received or released",
                                   state->request_id));
      return;
    }
    if (state->payload_size == 0) {
      done(Status::OK());
      return;
    }
    if (dest.size() < state->payload_size) {
      const size_t n = state->payload_size;
      state->ReleasePayload();
      done(InvalidArgumentError("payload of {} bytes does not fit a {}-byte buffer", n,
                                dest.size()));
      return;
    }
    if (!state->connection->open) {
      state->ReleasePayload();
      done(UnavailableError("connection {} closed before its payload arrived",
                            state->connection->id));
      return;
    }
    if (state->payload_held) {
      Pull(state, dest.first(state->payload_size), region, std::move(done));
      return;
    }
    if (!state->payload_rndv) {
      std::memcpy(dest.data(), state->payload_data, state->payload_size);
      state->ReleasePayload();
      done(Status::OK());
      return;
    }
    state->payload_consumed = true;
    ReceiveData(state, state->payload_data, dest, region, std::move(done));
  });
}

void PayloadReceiver::ReceiveData(const std::shared_ptr<UcxCall>& state, void* descriptor,
                                  MutableBytes dest, const MemoryRegion* region,
                                  std::function<void(Status)> done) {
  auto* op = new PayloadRecv{state, std::move(done)};
  ucp_request_param_t param = ContigParam(op, region);
  param.cb.recv_am = [](void* request, ucs_status_t status, size_t, void* user_data) {
    ucp_request_free(request);
    std::unique_ptr<PayloadRecv> owned(static_cast<PayloadRecv*>(user_data));
    owned->done(FromUcs(status, "receiving a request payload"));
  };
  ucs_status_ptr_t request =
      ucp_am_recv_data_nbx(worker_.ucp(), descriptor, dest.data(), dest.size(), &param);
  if (request == nullptr || UCS_PTR_IS_ERR(request)) {
    std::unique_ptr<PayloadRecv> owned(op);
    owned->done(request == nullptr
                    ? Status::OK()
                    : FromUcs(UCS_PTR_STATUS(request), "receiving a request payload"));
  }
}

void PayloadReceiver::Pull(const std::shared_ptr<UcxCall>& state, MutableBytes dest,
                           const MemoryRegion* region, std::function<void(Status)> done) {
  state->payload_consumed = true;
  ServerConnection& connection = *state->connection;
  MappedRef ref;
  ref.length = dest.size();
  std::span<const std::byte> rkey;
  const bool shared = region != nullptr && !region->packed_rkey().empty() && region->Contains(dest);
  if (shared) {
    FillRef(connection, *region, dest, &ref, &rkey);
  }
  FrameHeader header;
  header.kind = FrameKind::kPull;
  header.request_id = state->request_id;
  header.connection_id = connection.id;
  connection.pulls[state->request_id] =
      PendingPull{state, dest, region, /*as_data=*/!shared, std::move(done)};
  SendControl(state->connection, WriteFrameWithRef(header, {}, ref, rkey));
}

void PayloadReceiver::OnPullAnswer(const std::shared_ptr<ServerConnection>& connection,
                                   const FrameView& frame, void* data, size_t length, bool rndv) {
  const FrameHeader& h = frame.header;
  auto it = connection->pulls.find(h.request_id);
  if (it == connection->pulls.end() || (h.kind == FrameKind::kPayload) != it->second.as_data) {
    if (rndv) worker_.DiscardRendezvous(data, length);
    KVSTASH_LOG_WARN("connection {}: unexpected frame kind {} for call {}", connection->id,
                     static_cast<int>(h.kind), h.request_id);
    return;
  }
  PendingPull pull = std::move(it->second);
  connection->pulls.erase(it);
  if (h.kind == FrameKind::kPullDone) {
    if (h.status == 0) counters_.mapped.fetch_add(1, std::memory_order_relaxed);
    pull.done(h.status == 0 ? Status::OK()
                            : Status(static_cast<StatusCode>(h.status),
                                     fmt::format("the client did not deliver the payload of "
                                                 "call {}",
                                                 h.request_id)));
    return;
  }
  if (length != pull.dest.size()) {
    if (rndv) worker_.DiscardRendezvous(data, length);
    pull.done(InvalidArgumentError("client sent {} payload bytes for call {}, announced {}", length,
                                   h.request_id, pull.dest.size()));
    return;
  }
  if (!rndv) {
    std::memcpy(pull.dest.data(), data, length);
    pull.done(Status::OK());
    return;
  }
  ReceiveData(pull.state, data, pull.dest, pull.region, std::move(pull.done));
}

// ---- UcxCall ---------------------------------------------------------------------------------

void UcxCall::ReleasePayload() {
  if (payload_consumed || payload_size == 0) return;
  payload_consumed = true;
  if (payload_held) return;  // the client lets go of it when the call completes
  if (payload_rndv) {
    worker->DiscardRendezvous(payload_data, payload_size);  // within limits: checked
  } else if (payload_persistent) {
    ucp_am_data_release(worker->ucp(), payload_data);
  }
}

uint64_t UcxCall::connection_id() const { return connection->id; }
const std::string& UcxCall::tenant() const { return connection->tenant; }

void UcxCall::ReceivePayload(MutableBytes dest, const MemoryRegion* region,
                             std::function<void(Status)> done) {
  server->payloads().ReceivePayload(shared_from_this(), dest, region, std::move(done));
}

void UcxCall::Reply(Bytes message, Bytes payload, const MemoryRegion* region,
                    std::function<void(Status)> sent) {
  if (replied.exchange(true)) {
    if (sent) sent(FailedPreconditionError("call {} already replied", request_id));
    return;
  }
  server->replies().Reply(shared_from_this(), StatusCode::kOk, message, payload, region,
                          std::move(sent));
}

void UcxCall::ReplyError(const Status& status) {
  if (replied.exchange(true)) return;
  server->replies().ReplyStatus(shared_from_this(),
                                status.ok() ? InternalError("ReplyError with OK") : status);
}

void UcxCall::Drop() {
  worker->Run([self = shared_from_this()] {
    if (!self->in_am_callback) {
      self->ReleasePayload();
      self->server->frames().Forget(*self);
    }
    if (!self->replied.exchange(true)) {
      self->server->replies().ReplyStatus(
          self,
          InternalError("handler of method {} dropped the call without a reply", self->method_id));
    }
  });
}

}  // namespace kvstash::transport
