// RpcClient::Impl: the connection (progress thread, but for Connect and ConnectAsync): the
// bootstrap socket and its hello, the UCX endpoint, the loss of either and the shutdown.

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <future>
#include <utility>

#include "bootstrap.h"
#include "kvstash/common/logging.h"
#include "kvstash/common/mutex.h"
#include "kvstash/proto/wire.pb.h"
#include "rpc_client_impl.h"
#include "worker.h"

namespace kvstash::transport {

// ---- connection ------------------------------------------------------------------------------

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
  const uint64_t attempt = ++attempt_;
  socket_.emplace(worker_->io());
  connect_timer_.emplace(worker_->io());
  connect_timer_->expires_after(options_.connect_timeout);
  connect_timer_->async_wait([this, attempt](const asio::error_code& error) {
    if (error || attempt != attempt_ || state_ != State::kConnecting) return;
    FailConnect(UnavailableError("connecting to {}:{} timed out after {} ms", options_.host,
                                 options_.port, options_.connect_timeout.count()));
  });
  asio::error_code error;
  const auto address = asio::ip::make_address(options_.host, error);
  if (error) {
    resolver_.emplace(worker_->io());
    resolver_->async_resolve(
        options_.host, std::to_string(options_.port),
        [this, attempt](const asio::error_code& e, asio::ip::tcp::resolver::results_type r) {
          if (attempt != attempt_ || state_ != State::kConnecting) return;
          if (e) {
            FailConnect(UnavailableError("resolving {}: {}", options_.host, e.message()));
            return;
          }
          asio::async_connect(
              *socket_, r,
              [this, attempt](const asio::error_code& ce, const asio::ip::tcp::endpoint&) {
                OnSocketConnected(attempt, ce);
              });
        });
    return;
  }
  socket_->async_connect(
      asio::ip::tcp::endpoint(address, options_.port),
      [this, attempt](const asio::error_code& e) { OnSocketConnected(attempt, e); });
}

void RpcClient::Impl::OnSocketConnected(uint64_t attempt, const asio::error_code& error) {
  if (attempt != attempt_ || state_ != State::kConnecting) return;
  if (error) {
    FailConnect(
        UnavailableError("connecting to {}:{}: {}", options_.host, options_.port, error.message()));
    return;
  }
  asio::error_code ignored;
  socket_->set_option(asio::ip::tcp::no_delay(true), ignored);
  wire::Hello hello;
  hello.set_protocol_version(wire::PROTOCOL_VERSION_CURRENT);
  hello.set_namespace_(options_.tenant);
  hello.set_auth_token(options_.auth_token);
  hello.set_worker_address(std::string(worker_->address()));
  hello.set_client_name(options_.client_name.empty() ? fmt::format("pid {}", ::getpid())
                                                     : options_.client_name);
  AsyncWriteMessage(*socket_, hello, [this, attempt](Status status) {
    if (attempt != attempt_ || state_ != State::kConnecting) return;
    if (!status.ok()) {
      FailConnect(std::move(status));
      return;
    }
    AsyncReadMessage(*socket_, [this, attempt](Status s, std::string body) {
      OnHelloReply(attempt, std::move(s), body);
    });
  });
}

void RpcClient::Impl::OnHelloReply(uint64_t attempt, Status status, const std::string& body) {
  if (attempt != attempt_ || state_ != State::kConnecting) return;
  if (!status.ok()) {
    FailConnect(UnavailableError("{}:{} closed the connection during the hello ({})", options_.host,
                                 options_.port, status.message()));
    return;
  }
  wire::HelloReply reply;
  if (!reply.ParseFromString(body)) {
    FailConnect(
        UnavailableError("{}:{} sent an unparseable hello reply", options_.host, options_.port));
    return;
  }
  if (reply.has_error() && reply.error().code() != wire::OK) {
    FailConnect(Status(static_cast<StatusCode>(reply.error().code()),
                       fmt::format("{}:{} refused the connection: {}", options_.host, options_.port,
                                   reply.error().message())));
    return;
  }
  const std::string& address = reply.worker_address();
  ucp_ep_params_t params{};
  params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER;
  params.address = reinterpret_cast<const ucp_address_t*>(address.data());
  params.err_handler.cb = &Impl::OnEndpointError;
  params.err_handler.arg = this;
  ucp_ep_h ep = nullptr;
  // The node's way of handling a dead peer, whatever this client's own default: a TCP-only
  // client of a node that also has shared memory takes peer-failure mode, and the reverse.
  std::optional<bool> peer_failure;
  if (reply.error_handling() != wire::UCX_ERROR_HANDLING_UNSPECIFIED) {
    peer_failure = reply.error_handling() == wire::UCX_ERROR_HANDLING_PEER;
  }
  const Status created = worker_->CreateEndpoint(
      &params, &ep, fmt::format("opening a UCX endpoint to {}:{}", options_.host, options_.port),
      peer_failure);
  if (!created.ok()) {
    // UCX's shared-memory transports refuse a process of another user (shmat: permission
    // denied): such a client reaches a node on its host over TCP only.
    if (created.message().find("Shared memory error") != std::string_view::npos) {
      FailConnect(Status(created.code(),
                         fmt::format("{} (the node's shared memory belongs to another user: run "
                                     "this client as the node's user, or over TCP: --tls tcp, "
                                     "UCX_TLS=tcp)",
                                     created.message())));
      return;
    }
    FailConnect(created);
    return;
  }
  ep_ = UcpEndpoint(ep);
  if (!hub_->Route(reply.connection_id(), this)) {
    // Another server of this worker's clients chose the same id: try again (a new id).
    ep_ = UcpEndpoint();
    FailConnect(
        UnavailableError("{}:{} gave connection id {:#x}, which another connection of "
                         "this worker has; reconnect",
                         options_.host, options_.port, reply.connection_id()));
    return;
  }
  connection_id_ = reply.connection_id();
  // The endpoint's first frame binds it to the connection (frames after it arrive after it).
  SendControl(FrameKind::kBind, reply.bind_token());
  {
    // The server's limits, within this client's own (a larger message or payload would be
    // refused here before it is sent).
    const TransportOptions& own = worker_->options();
    ServerLimits limits;
    limits.service_limits = reply.service_limits();
    limits.max_message_bytes =
        reply.max_message_bytes() == 0
            ? own.max_message_bytes
            : std::min<uint64_t>(reply.max_message_bytes(), own.max_message_bytes);
    limits.max_payload_bytes =
        reply.max_payload_bytes() == 0
            ? own.max_payload_bytes
            : std::min<uint64_t>(reply.max_payload_bytes(), own.max_payload_bytes);
    MutexLock lock(&limits_mu_);
    limits_ = limits;
  }
  ProbeMapping(reply);
  state_ = State::kConnected;
  connect_timer_->cancel();
  connects_.fetch_add(1, std::memory_order_relaxed);
  WatchSocket(attempt);
  for (auto& waiter : std::exchange(connect_waiters_, {})) waiter(Status::OK());
  for (uint64_t id : std::exchange(waiting_, {})) {
    auto it = calls_.find(id);
    if (it != calls_.end() && !it->second->resolved) Send(it->second.get());
  }
}

void RpcClient::Impl::WatchSocket(uint64_t attempt) {
  socket_->async_read_some(
      asio::buffer(watch_byte_, 1), [this, attempt](const asio::error_code& error, size_t) {
        if (attempt != attempt_ || state_ != State::kConnected) return;
        Disconnect(UnavailableError("connection to {}:{} lost ({})", options_.host, options_.port,
                                    error ? error.message() : "unexpected bytes"));
      });
}

void RpcClient::Impl::OnEndpointError(void* arg, ucp_ep_h ep, ucs_status_t status) {
  auto* self = static_cast<Impl*>(arg);
  if (self->ep_.get() != ep) return;
  self->Disconnect(FromUcs(status, fmt::format("UCX endpoint to {}:{} failed", self->options_.host,
                                               self->options_.port)));
}

void RpcClient::Impl::FailConnect(Status status) {
  state_ = State::kIdle;
  ++attempt_;
  if (status.code() != StatusCode::kUnauthenticated &&
      status.code() != StatusCode::kFailedPrecondition &&
      status.code() != StatusCode::kPermissionDenied) {
    status = Status(StatusCode::kUnavailable, std::string(status.message()));
  }
  CloseSocket();
  for (auto& waiter : std::exchange(connect_waiters_, {})) waiter(status);
  for (uint64_t id : std::exchange(waiting_, {})) {
    auto it = calls_.find(id);
    if (it != calls_.end()) Resolve(it->second.get(), status);
  }
}

void RpcClient::Impl::CloseSocket() {
  asio::error_code ignored;
  if (socket_) socket_->close(ignored);
  if (connect_timer_) connect_timer_->cancel();
}

void RpcClient::Impl::Disconnect(Status status) {
  if (state_ == State::kIdle) return;
  // An orderly close with nothing outstanding is not worth a warning.
  if (status.code() != StatusCode::kCancelled || !calls_.empty()) {
    KVSTASH_LOG_WARN("{}", status.ToString());
  }
  const bool was_connected = state_ == State::kConnected;
  if (was_connected) hub_->Unroute(connection_id_.load(), this);
  state_ = State::kIdle;
  ++attempt_;
  if (was_connected) disconnects_.fetch_add(1, std::memory_order_relaxed);
  CloseSocket();
  Status failure(
      status.code() == StatusCode::kCancelled ? StatusCode::kCancelled : StatusCode::kUnavailable,
      std::string(status.message()));
  // Outstanding requests on the endpoint complete (cancelled) when it is force-closed; the
  // calls resolve first so those completions only finish them.
  std::vector<PendingCall*> all;
  all.reserve(calls_.size());
  bool in_flight = false;
  for (auto& [id, call] : calls_) {
    all.push_back(call.get());
    in_flight = in_flight || InFlight(*call);
  }
  // An orderly close (this client going away) with nothing on the wire flushes: UCX 1.13
  // asserts when a worker is destroyed after a force close of a TCP endpoint whose wireup
  // was still pending (a client that connected and went away without a call).
  const bool force = status.code() != StatusCode::kCancelled || in_flight;
  for (PendingCall* call : all) {
    if (!call->resolved) {
      call->resolved = true;
      call->status = failure;
    }
    call->resolving = true;
    CancelRequests(call);
    call->resolving = false;
  }
  waiting_.clear();
  mapped_.store(false);
  for (auto& [id, region] : std::exchange(shared_regions_, {})) {
    RetireSharedRegion(std::move(region));
  }
  for (auto& waiter : std::exchange(connect_waiters_, {})) waiter(failure);
  if (ep_) {
    auto ep = std::make_shared<UcpEndpoint>(std::move(ep_));
    auto close = [this, ep, force] {
      worker_->WaitRequest(ep->Close(force));
      FinishResolved();
    };
    if (in_shutdown_) {
      close();
    } else {
      asio::post(worker_->io(), close);
    }
  } else {
    FinishResolved();
  }
}

void RpcClient::Impl::FinishResolved() {
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

void RpcClient::Impl::Shutdown() {
  in_shutdown_ = true;
  timer_.cancel();
  if (state_ == State::kIdle) {
    for (auto& [id, call] : calls_) {
      call->resolved = true;
      call->status = CancelledError("client destroyed");
    }
    FinishResolved();
  } else {
    Disconnect(CancelledError("client destroyed"));
  }
  if (resolver_) resolver_->cancel();
}

}  // namespace kvstash::transport
