// RpcClient and its Impl (rpc_client_impl.h): one connection to one server, its state, and
// the frames from the server routed to the part of the client they concern.

#include <fmt/format.h>

#include <cstring>
#include <future>
#include <utility>

#include "kvstash/common/logging.h"
#include "kvstash/common/mutex.h"
#include "kvstash/proto/wire.pb.h"
#include "kvstash/transport/frame.h"
#include "kvstash/transport/rpc.h"
#include "rpc_client_impl.h"
#include "worker.h"

namespace kvstash::transport {

// ---- RpcClient -------------------------------------------------------------------------------

Result<std::unique_ptr<RpcClient>> RpcClient::Create(ClientOptions options) {
  if (options.port == 0) return InvalidArgumentError("client needs the server's port");
  std::shared_ptr<ClientWorker> worker = options.worker;
  if (!worker) {
    KVSTASH_ASSIGN_OR_RETURN(worker, ClientWorker::Create(options.transport));
  }
  auto impl = std::make_unique<Impl>(std::move(options), &worker->impl());
  return std::unique_ptr<RpcClient>(new RpcClient(std::move(worker), std::move(impl)));
}

RpcClient::RpcClient(std::shared_ptr<ClientWorker> worker, std::unique_ptr<Impl> impl)
    : worker_(std::move(worker)), impl_(std::move(impl)) {}

RpcClient::~RpcClient() {
  if (impl_) Impl::Detach(std::move(impl_));
}

Status RpcClient::Connect() { return impl_->Connect(); }

uint64_t RpcClient::Call(uint16_t method, Bytes request, const CallOptions& options,
                         ResponseCallback done) {
  return impl_->Call(method, request, options, std::move(done));
}

void RpcClient::Cancel(uint64_t id) { impl_->Cancel(id); }

Status RpcClient::CallSync(uint16_t method, Bytes request, const CallOptions& options,
                           std::vector<std::byte>* reply, size_t* payload_bytes) {
  if (impl_->worker()->OnThread()) {
    return FailedPreconditionError("CallSync on the progress thread would deadlock");
  }
  std::promise<Status> promise;
  auto future = promise.get_future();
  impl_->Call(method, request, options, [&](const Response& response) {
    if (reply != nullptr) reply->assign(response.message.begin(), response.message.end());
    if (payload_bytes != nullptr) *payload_bytes = response.payload_bytes;
    promise.set_value(response.status);
  });
  return future.get();
}

Result<MemoryRegion> RpcClient::RegisterMemory(MutableBytes memory) {
  return impl_->worker()->Register(memory);
}

Result<MemoryRegion> RpcClient::AllocateMemory(size_t bytes) {
  return impl_->worker()->Allocate(bytes);
}

bool RpcClient::OnProgressThread() const { return impl_->worker()->OnThread(); }

void RpcClient::RunOnProgressThread(std::function<void()> fn) {
  impl_->worker()->Run(std::move(fn));
}

TransportStats RpcClient::stats() const { return impl_->stats(); }

uint64_t RpcClient::connection_id() const { return impl_->connection_id(); }

std::optional<ServerLimits> RpcClient::server_limits() const { return impl_->server_limits(); }
bool RpcClient::payloads_mapped() const { return impl_->payloads_mapped(); }

void RpcClient::ConnectAsync(std::function<void(const Status&)> done) {
  impl_->ConnectAsync(std::move(done));
}

void RpcClient::Reset(const Status& why) { impl_->Reset(why); }

Status RpcClient::SendRawForTesting(Bytes header, Bytes data, std::function<void(Status)> sent) {
  KVSTASH_RETURN_IF_ERROR(impl_->Connect());
  return impl_->SendRaw(header, data, std::move(sent));
}

// ---- RpcClient::Impl: calls -----------------------------------------------------------------

RpcClient::Impl::Impl(ClientOptions options, ClientWorker::Impl* hub)
    : options_(std::move(options)),
      hub_(hub),
      worker_(hub->shared_worker()),
      server_(fmt::format("{}:{}", options_.host, options_.port)),
      calls_(*worker_, counters_),
      endpoint_(*worker_),
      deadlines_(
          worker_->io(), calls_, endpoint_,
          [this](size_t stuck) {
            Disconnect(UnavailableError(
                "{} stalled with {} transfer(s) in flight; connection reset", server_, stuck));
          }),
      mapped_(worker_, calls_, endpoint_, counters_),
      bootstrap_(*worker_, options_, ucp_err_handler_t{&Impl::OnEndpointError, this}) {
  options_.worker.reset();  // the RpcClient holds it; a retired Impl must not
}

uint64_t RpcClient::Impl::Call(uint16_t method, Bytes request, const CallOptions& options,
                               ResponseCallback done) {
  auto call =
      internal::NewCall(next_id_.fetch_add(1), method, request, options, worker_->max_am_header());
  call->done = std::move(done);
  const uint64_t id = call->id;
  counters_.calls_started.fetch_add(1, std::memory_order_relaxed);
  worker_->Run([this, call = std::move(call)]() mutable { Start(std::move(call)); });
  return id;
}

void RpcClient::Impl::Cancel(uint64_t id) {
  worker_->Run([this, id] {
    PendingCall* call = calls_.Find(id);
    if (call == nullptr || call->resolved) return;
    if (call->sent) endpoint_.SendControl(FrameKind::kCancel, id);
    calls_.Resolve(call, CancelledError("call {} cancelled", id));
  });
}

void RpcClient::Impl::Reset(Status why) {
  worker_->Run([this, why = std::move(why)] {
    Disconnect(Status(StatusCode::kUnavailable, std::string(why.message())));
  });
}

Status RpcClient::Impl::SendRaw(Bytes header, Bytes data, std::function<void(Status)> sent) {
  auto send = std::make_shared<internal::LooseSend>();
  send->header.assign(header.begin(), header.end());
  send->data.assign(data.begin(), data.end());
  send->sent = std::move(sent);
  std::promise<Status> promise;
  auto future = promise.get_future();
  worker_->Run([this, send, &promise] {
    if (!endpoint_) {
      promise.set_value(UnavailableError("not connected"));
      return;
    }
    endpoint_.SendLoose(std::move(*send));
    promise.set_value(Status::OK());
  });
  return future.get();
}

void RpcClient::Impl::Start(std::unique_ptr<PendingCall> owned) {
  PendingCall* call = calls_.Add(std::move(owned));
  if (worker_->stopping()) {
    calls_.Resolve(call, CancelledError("client is shutting down"));
    return;
  }
  if (Status admitted = internal::CheckCall(*call, *worker_); !admitted.ok()) {
    calls_.Resolve(call, std::move(admitted));
    return;
  }
  deadlines_.Add(call->deadline, call->id);
  if (state_ == State::kConnected) {
    Send(call);
  } else {
    waiting_.push_back(call->id);
    if (state_ == State::kIdle) StartConnect();
  }
}

void RpcClient::Impl::Send(PendingCall* call) {
  Status sent = endpoint_.SendRequest(call, mapped_.mapped());
  if (!sent.ok()) calls_.Resolve(call, std::move(sent));
}

// ---- RpcClient::Impl: frames from the server -------------------------------------------------

ucs_status_t RpcClient::Impl::OnFrame(const void* header, size_t header_length, void* data,
                                      size_t length, const ucp_am_recv_param_t* param) {
  const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
  auto release = [&] {
    if (rndv && !worker_->DiscardRendezvous(data, length)) {
      Disconnect(UnavailableError("server sent a payload of {} bytes, beyond the limit of {}",
                                  length, worker_->options().max_payload_bytes));
    }
  };
  const Bytes data_bytes = rndv ? Bytes{} : Bytes(static_cast<const std::byte*>(data), length);
  auto frame = ParseFrame(Bytes(static_cast<const std::byte*>(header), header_length), data_bytes,
                          length, !rndv, worker_->options().max_message_bytes);
  const bool known = frame.ok() && (frame->header.kind == FrameKind::kResponse ||
                                    frame->header.kind == FrameKind::kPull);
  if (!known) {
    counters_.malformed.fetch_add(1, std::memory_order_relaxed);
    KVSTASH_LOG_WARN("dropped a malformed frame from the server: {}",
                     frame.ok() ? "not a response" : frame.status().ToString());
    release();
    return UCS_OK;
  }
  // The server sends each shared region's key once per connection, with its first use.
  if (frame->has_ref && !frame->rkey.empty()) mapped_.AddRegion(frame->ref, frame->rkey);
  if (frame->header.kind == FrameKind::kPull) {
    mapped_.OnPull(*frame);
    return UCS_OK;
  }
  if (frame->has_ref) {
    mapped_.OnMappedReply(*frame);
    return UCS_OK;
  }
  PendingCall* call = calls_.Find(frame->header.request_id);
  if (call == nullptr || call->resolved) {
    counters_.late_replies.fetch_add(1, std::memory_order_relaxed);
    release();
    return UCS_OK;
  }
  if (frame->header.status != 0) {
    release();
    calls_.Resolve(call, internal::StatusFromWireError(frame->header.status, frame->message));
    return UCS_OK;
  }
  call->reply.assign(frame->message.begin(), frame->message.end());
  const size_t payload = frame->payload_bytes;
  if (payload == 0) {
    calls_.Resolve(call, Status::OK());
    return UCS_OK;
  }
  if (payload > call->recv_payload.size()) {
    release();
    calls_.Resolve(call, OutOfRangeError("reply payload of {} bytes exceeds the receive buffer "
                                         "of {} bytes",
                                         payload, call->recv_payload.size()));
    return UCS_OK;
  }
  if (!rndv) {
    std::memcpy(call->recv_payload.data(), data, payload);
    call->payload_bytes = payload;
    calls_.Resolve(call, Status::OK());
    return UCS_OK;
  }
  calls_.ReceivePayload(call, data, payload);
  return UCS_OK;
}

// ---- RpcClient::Impl: the connection ---------------------------------------------------------

void RpcClient::Impl::Detach(std::unique_ptr<Impl> self) {
  Worker& worker = *self->worker_;
  if (worker.OnThread()) {
    self->Shutdown();
    ClientWorker::Impl* hub = self->hub_;
    hub->Retire(std::move(self));
    return;
  }
  std::promise<void> done;
  auto future = done.get_future();
  Impl* raw = self.release();
  worker.Run([raw, &done] {
    std::unique_ptr<Impl> owned(raw);
    owned->Shutdown();
    ClientWorker::Impl* hub = owned->hub_;
    hub->Retire(std::move(owned));
    done.set_value();
  });
  future.wait();  // the hub's thread runs while any of its clients exists
}

Status RpcClient::Impl::Connect() {
  if (worker_->OnThread()) return FailedPreconditionError("Connect on the progress thread");
  std::promise<Status> promise;
  auto future = promise.get_future();
  worker_->Run([this, &promise] {
    if (state_ == State::kConnected) {
      promise.set_value(Status::OK());
      return;
    }
    connect_waiters_.push_back([&promise](const Status& s) { promise.set_value(s); });
    if (state_ == State::kIdle) StartConnect();
  });
  return future.get();
}

void RpcClient::Impl::ConnectAsync(std::function<void(const Status&)> done) {
  worker_->Run([this, done = std::move(done)]() mutable {
    if (state_ == State::kConnected) {
      done(Status::OK());
      return;
    }
    connect_waiters_.push_back(std::move(done));
    if (state_ == State::kIdle) StartConnect();
  });
}

void RpcClient::Impl::StartConnect() {
  state_ = State::kConnecting;
  bootstrap_.Connect([this](Result<internal::Bootstrap::Hello> hello) {
    if (!hello.ok()) {
      FailConnect(hello.status());
      return;
    }
    OnConnected(std::move(*hello));
  });
}

void RpcClient::Impl::OnConnected(internal::Bootstrap::Hello hello) {
  const wire::HelloReply& reply = hello.reply;
  if (!hub_->Route(reply.connection_id(), this)) {
    // Another server of this worker's clients chose the same id: try again (a new id).
    hello.endpoint = UcpEndpoint();
    FailConnect(
        UnavailableError("{} gave connection id {:#x}, which another connection of this worker "
                         "has; reconnect",
                         server_, reply.connection_id()));
    return;
  }
  endpoint_.Open(std::move(hello.endpoint), reply.connection_id());
  // The endpoint's first frame binds it to the connection (frames after it arrive after it).
  endpoint_.SendControl(FrameKind::kBind, reply.bind_token());
  {
    MutexLock lock(&limits_mu_);
    limits_ = hello.limits;
  }
  mapped_.Probe(reply, server_);
  state_ = State::kConnected;
  counters_.connects.fetch_add(1, std::memory_order_relaxed);
  bootstrap_.Watch([this](Status lost) { Disconnect(std::move(lost)); });
  for (auto& waiter : std::exchange(connect_waiters_, {})) waiter(Status::OK());
  for (uint64_t id : std::exchange(waiting_, {})) {
    PendingCall* call = calls_.Find(id);
    if (call != nullptr && !call->resolved) Send(call);
  }
}

void RpcClient::Impl::OnEndpointError(void* arg, ucp_ep_h ep, ucs_status_t status) {
  auto* self = static_cast<Impl*>(arg);
  if (self->endpoint_.get() != ep) return;
  self->Disconnect(FromUcs(status, fmt::format("UCX endpoint to {} failed", self->server_)));
}

void RpcClient::Impl::FailConnect(Status status) {
  state_ = State::kIdle;
  if (status.code() != StatusCode::kUnauthenticated &&
      status.code() != StatusCode::kFailedPrecondition &&
      status.code() != StatusCode::kPermissionDenied) {
    status = Status(StatusCode::kUnavailable, std::string(status.message()));
  }
  bootstrap_.Close();
  for (auto& waiter : std::exchange(connect_waiters_, {})) waiter(status);
  for (uint64_t id : std::exchange(waiting_, {})) {
    if (PendingCall* call = calls_.Find(id); call != nullptr) calls_.Resolve(call, status);
  }
}

void RpcClient::Impl::Disconnect(Status status) {
  if (state_ == State::kIdle) return;
  // An orderly close with nothing outstanding is not worth a warning.
  if (status.code() != StatusCode::kCancelled || calls_.live() != 0) {
    KVSTASH_LOG_WARN("{}", status.ToString());
  }
  const bool was_connected = state_ == State::kConnected;
  if (was_connected) hub_->Unroute(endpoint_.connection_id(), this);
  state_ = State::kIdle;
  if (was_connected) counters_.disconnects.fetch_add(1, std::memory_order_relaxed);
  bootstrap_.Close();
  Status failure(
      status.code() == StatusCode::kCancelled ? StatusCode::kCancelled : StatusCode::kUnavailable,
      std::string(status.message()));
  const bool in_flight = calls_.FailAll(failure);
  // An orderly close (this client going away) with nothing on the wire flushes: UCX 1.13
  // asserts when a worker is destroyed after a force close of a TCP endpoint whose wireup
  // was still pending (a client that connected and went away without a call).
  const bool force = status.code() != StatusCode::kCancelled || in_flight;
  waiting_.clear();
  mapped_.Reset();
  for (auto& waiter : std::exchange(connect_waiters_, {})) waiter(failure);
  if (endpoint_) {
    endpoint_.Close(force, /*now=*/in_shutdown_, [this] { calls_.FinishResolved(); });
  } else {
    calls_.FinishResolved();
  }
}

void RpcClient::Impl::Shutdown() {
  in_shutdown_ = true;
  deadlines_.Stop();
  if (state_ == State::kIdle) {
    calls_.ResolveAll(CancelledError("client destroyed"));
  } else {
    Disconnect(CancelledError("client destroyed"));
  }
  bootstrap_.Close();
}

}  // namespace kvstash::transport
