// StreamConnection and StreamCall (stream_server_impl.h): a server connection's frames and
// the calls they carry.

#include <bit>
#include <utility>

#include "kvstash/common/logging.h"
#include "kvstash/proto/wire.pb.h"
#include "stream_server_impl.h"

namespace kvstash::transport::stream {

asio::io_context*& CurrentServerIo() {
  thread_local asio::io_context* io = nullptr;
  return io;
}

// ---- StreamCall -------------------------------------------------------------------------------

StreamCall::StreamCall(std::shared_ptr<StreamConnection> connection, const StreamHeader& header,
                       Bytes message)
    : connection_(std::move(connection)),
      method_(header.method),
      request_id_(header.request_id),
      payload_bytes_(header.payload_bytes),
      deadline_(header.timeout_us != 0 ? Clock::now() + std::chrono::microseconds(header.timeout_us)
                                       : Clock::time_point::max()),
      message_(reinterpret_cast<const char*>(message.data()), message.size()),
      payload_(header.payload_bytes != 0 ? Payload::kWaiting : Payload::kNone) {}

uint64_t StreamCall::connection_id() const { return connection_->id(); }
const std::string& StreamCall::tenant() const { return connection_->tenant(); }

void StreamCall::ReceivePayload(MutableBytes dest, const MemoryRegion*,
                                std::function<void(Status)> done) {
  connection_->Run([self = shared_from_this(), dest, done = std::move(done)]() mutable {
    if (self->payload_ != Payload::kWaiting) {
      done(FailedPreconditionError(
          "{}",
          self->payload_ == Payload::kNone
              ? "the request carries no payload"
              : "the request's payload was received already, or the call answered without it"));
      return;
    }
    self->payload_ = Payload::kReading;
    self->connection_->stream().ReadPayload(dest, [self, done = std::move(done)](Status status) {
      self->payload_ = Payload::kDone;
      done(std::move(status));
    });
  });
}

void StreamCall::Reply(Bytes message, Bytes payload, const MemoryRegion*,
                       std::function<void(Status)> sent) {
  std::string bytes(reinterpret_cast<const char*>(message.data()), message.size());
  connection_->Run([self = shared_from_this(), bytes = std::move(bytes), payload,
                    sent = std::move(sent)]() mutable {
    self->Answer(Status::OK(), std::move(bytes), payload, std::move(sent));
  });
}

void StreamCall::ReplyError(const Status& status) {
  wire::Error error;
  error.set_code(static_cast<wire::Code>(status.code()));
  error.set_message(std::string(status.message()));
  const Status code = status.ok() ? InternalError("an error reply with status OK") : status;
  connection_->Run([self = shared_from_this(), code, bytes = error.SerializeAsString()]() mutable {
    self->Answer(code, std::move(bytes), {}, nullptr);
  });
}

void StreamCall::Drop() {
  connection_->Run([self = shared_from_this()] {
    if (self->answered_) return;
    wire::Error error;
    error.set_code(wire::INTERNAL);
    error.set_message("the server's handler let the call go unanswered");
    self->Answer(InternalError("unanswered"), error.SerializeAsString(), {}, nullptr);
  });
}

void StreamCall::Answer(const Status& status, std::string message, Bytes payload,
                        std::function<void(Status)> sent) {
  if (answered_) {
    if (sent) sent(FailedPreconditionError("the call was answered already"));
    return;
  }
  answered_ = true;
  if (payload_ == Payload::kWaiting) {
    payload_ = Payload::kDone;
    connection_->stream().SkipPayload();  // the request's payload is read and dropped
  }
  connection_->Answered(request_id_);
  if (cancelled_.load(std::memory_order_relaxed)) {
    // The client cancelled it (or went): it would drop the reply.
    if (sent) sent(CancelledError("the client cancelled the call"));
    return;
  }
  StreamHeader header;
  header.kind = StreamKind::kResponse;
  header.method = method_;
  header.request_id = request_id_;
  header.status = static_cast<uint16_t>(status.code());
  connection_->stream().Send(header, std::move(message), status.ok() ? payload : Bytes{},
                             std::move(sent));
}

// ---- StreamConnection -------------------------------------------------------------------------

StreamConnection::StreamConnection(uint64_t id, std::string tenant, std::string client_name,
                                   asio::io_context& io, std::shared_ptr<ServerShared> shared)
    : id_(id),
      tenant_(std::move(tenant)),
      client_name_(std::move(client_name)),
      io_(io),
      shared_(std::move(shared)) {}

void StreamConnection::Start(asio::ip::tcp::socket socket) {
  const TransportOptions& transport = shared_->options.transport;
  FrameStream::Events events;
  // The stream is the connection's, and its handlers hold the stream: they hold the connection
  // weakly, so a closed connection goes once its calls do.
  events.frame = [weak = weak_from_this()](const StreamHeader& header, Bytes message) {
    if (auto self = weak.lock()) self->OnFrame(header, message);
  };
  events.closed = [weak = weak_from_this()](const Status& why) {
    if (auto self = weak.lock()) self->OnClosed(why, self->stream_->malformed());
  };
  stream_ =
      std::make_shared<FrameStream>(std::move(socket),
                                    StreamLimits{.server = true,
                                                 .max_message_bytes = transport.max_message_bytes,
                                                 .max_payload_bytes = transport.max_payload_bytes},
                                    transport.stall_timeout, std::move(events));
  stream_->Start();
}

void StreamConnection::Close(const Status& why) {
  if (stream_) stream_->Close(why);
}

void StreamConnection::Run(std::function<void()> fn) {
  if (CurrentServerIo() == &io_) {
    fn();
    return;
  }
  {
    MutexLock lock(&shared_->mu);
    if (!shared_->stopped) {
      asio::post(io_, std::move(fn));
      return;
    }
  }
  MutexLock lock(&inline_mu_);
  fn();
}

void StreamConnection::OnFrame(const StreamHeader& header, Bytes message) {
  if (header.kind == StreamKind::kCancel) {
    const auto it = calls_.find(header.request_id);
    if (it == calls_.end()) return;
    if (auto call = it->second.lock()) call->MarkCancelled();
    return;
  }
  shared_->counters.calls.fetch_add(1, std::memory_order_relaxed);
  auto call = std::make_shared<StreamCall>(shared_from_this(), header, message);
  calls_[header.request_id] = call;
  if (calls_.size() >= kMaxCallsInFlight) stream_->Pause();
  const auto handler = shared_->handlers.find(header.method);
  if (handler == shared_->handlers.end()) {
    call->ReplyError(UnimplementedError("no handler for method {}", header.method));
    return;
  }
  handler->second(ServerCall(std::move(call)));
}

void StreamConnection::Answered(uint64_t request_id) {
  calls_.erase(request_id);
  if (calls_.size() <= kMaxCallsInFlight / 2 && stream_) stream_->Resume();
}

void StreamConnection::OnClosed(const Status& why, bool malformed) {
  for (auto& [id, weak] : calls_) {
    if (auto call = weak.lock()) call->MarkCancelled();
  }
  calls_.clear();
  ServerCounters& counters = shared_->counters;
  counters.disconnects.fetch_add(1, std::memory_order_relaxed);
  if (malformed) {
    // Said for the 1st, 2nd, 4th, 8th ...: a peer sending garbage must not fill the disk.
    if (std::has_single_bit(counters.malformed_frames.fetch_add(1) + 1)) {
      KVSTASH_LOG_WARN("closed connection {} of client {:?}: {}", id_, client_name_,
                       why.ToString());
    }
  } else {
    KVSTASH_LOG_DEBUG("connection {} of client {:?} ended: {}", id_, client_name_, why.ToString());
  }
  {
    MutexLock lock(&shared_->mu);
    shared_->connections.erase(id_);
  }
  if (shared_->on_disconnect) shared_->on_disconnect(id_);
}

}  // namespace kvstash::transport::stream
