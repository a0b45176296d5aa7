// RpcClient::Impl: the connection (progress thread, but for Connect and ConnectAsync): its
// attempts (the socket and the hello are Bootstrap's), the UCX endpoint, the loss of either and
// the shutdown.

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <future>
#include <utility>

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
  ep_ = std::move(hello.endpoint);
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
    MutexLock lock(&limits_mu_);
    limits_ = hello.limits;
  }
  ProbeMapping(reply);
  state_ = State::kConnected;
  connects_.fetch_add(1, std::memory_order_relaxed);
  bootstrap_.Watch([this](Status lost) { Disconnect(std::move(lost)); });
  for (auto& waiter : std::exchange(connect_waiters_, {})) waiter(Status::OK());
  for (uint64_t id : std::exchange(waiting_, {})) {
    auto it = calls_.find(id);
    if (it != calls_.end() && !it->second->resolved) Send(it->second.get());
  }
}

void RpcClient::Impl::OnEndpointError(void* arg, ucp_ep_h ep, ucs_status_t status) {
  auto* self = static_cast<Impl*>(arg);
  if (self->ep_.get() != ep) return;
  self->Disconnect(FromUcs(status, fmt::format("UCX endpoint to {}:{} failed", self->options_.host,
                                               self->options_.port)));
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
    auto it = calls_.find(id);
    if (it != calls_.end()) Resolve(it->second.get(), status);
  }
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
  if (was_connected) disconnects_.fetch_add(1, std::memory_order_relaxed);
  bootstrap_.Close();
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
  bootstrap_.Close();
}

}  // namespace kvstash::transport
