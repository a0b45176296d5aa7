// Bootstrap (rpc_client_bootstrap.h): the TCP socket to the server and its hello, and the UCX
// endpoint opened from the reply.

#include "rpc_client_bootstrap.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <string>
#include <utility>

#include "bootstrap.h"
#include "kvstash/proto/wire.pb.h"
#include "worker.h"

namespace kvstash::transport::internal {

void Bootstrap::Connect(std::function<void(Result<Hello>)> done) {
  const uint64_t attempt = ++attempt_;
  phase_ = Phase::kConnecting;
  done_ = std::move(done);
  socket_.emplace(worker_.io());
  connect_timer_.emplace(worker_.io());
  connect_timer_->expires_after(options_.connect_timeout);
  connect_timer_->async_wait([this, attempt](const asio::error_code& error) {
    if (error || !Current(attempt, Phase::kConnecting)) return;
    Fail(UnavailableError("connecting to {}:{} timed out after {} ms", options_.host, options_.port,
                          options_.connect_timeout.count()));
  });
  asio::error_code error;
  const auto address = asio::ip::make_address(options_.host, error);
  if (error) {
    resolver_.emplace(worker_.io());
    resolver_->async_resolve(
        options_.host, std::to_string(options_.port),
        [this, attempt](const asio::error_code& e, asio::ip::tcp::resolver::results_type r) {
          if (!Current(attempt, Phase::kConnecting)) return;
          if (e) {
            Fail(UnavailableError("resolving {}: {}", options_.host, e.message()));
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

void Bootstrap::OnSocketConnected(uint64_t attempt, const asio::error_code& error) {
  if (!Current(attempt, Phase::kConnecting)) return;
  if (error) {
    Fail(
        UnavailableError("connecting to {}:{}: {}", options_.host, options_.port, error.message()));
    return;
  }
  asio::error_code ignored;
  socket_->set_option(asio::ip::tcp::no_delay(true), ignored);
  wire::Hello hello;
  hello.set_protocol_version(wire::PROTOCOL_VERSION_CURRENT);
  hello.set_namespace_(options_.tenant);
  hello.set_auth_token(options_.auth_token);
  hello.set_worker_address(std::string(worker_.address()));
  hello.set_client_name(options_.client_name.empty() ? fmt::format("pid {}", ::getpid())
                                                     : options_.client_name);
  AsyncWriteMessage(*socket_, hello, [this, attempt](Status status) {
    if (!Current(attempt, Phase::kConnecting)) return;
    if (!status.ok()) {
      Fail(std::move(status));
      return;
    }
    AsyncReadMessage(*socket_, [this, attempt](Status s, std::string body) {
      OnHelloReply(attempt, std::move(s), body);
    });
  });
}

void Bootstrap::OnHelloReply(uint64_t attempt, Status status, const std::string& body) {
  if (!Current(attempt, Phase::kConnecting)) return;
  if (!status.ok()) {
    Fail(UnavailableError("{}:{} closed the connection during the hello ({})", options_.host,
                          options_.port, status.message()));
    return;
  }
  wire::HelloReply reply;
  if (!reply.ParseFromString(body)) {
    Fail(UnavailableError("{}:{} sent an unparseable hello reply", options_.host, options_.port));
    return;
  }
  if (reply.has_error() && reply.error().code() != wire::OK) {
    Fail(Status(static_cast<StatusCode>(reply.error().code()),
                fmt::format("{}:{} refused the connection: {}", options_.host, options_.port,
                            reply.error().message())));
    return;
  }
  const std::string& address = reply.worker_address();
  ucp_ep_params_t params{};
  params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER;
  params.address = reinterpret_cast<const ucp_address_t*>(address.data());
  params.err_handler = on_endpoint_error_;
  ucp_ep_h ep = nullptr;
  // The node's way of handling a dead peer, whatever this client's own default: a TCP-only
  // client of a node that also has shared memory takes peer-failure mode, and the reverse.
  std::optional<bool> peer_failure;
  if (reply.error_handling() != wire::UCX_ERROR_HANDLING_UNSPECIFIED) {
    peer_failure = reply.error_handling() == wire::UCX_ERROR_HANDLING_PEER;
  }
  const Status created = worker_.CreateEndpoint(
      &params, &ep, fmt::format("opening a UCX endpoint to {}:{}", options_.host, options_.port),
      peer_failure);
  if (!created.ok()) {
    // UCX's shared-memory transports refuse a process of another user (shmat: permission
    // denied): such a client reaches a node on its host over TCP only.
    if (created.message().find("Shared memory error") != std::string_view::npos) {
      Fail(Status(created.code(),
                  fmt::format("{} (the node's shared memory belongs to another user: run "
                              "this client as the node's user, or over TCP: --tls tcp, "
                              "UCX_TLS=tcp)",
                              created.message())));
      return;
    }
    Fail(created);
    return;
  }
  const TransportOptions& own = worker_.options();
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
  phase_ = Phase::kEstablished;
  connect_timer_->cancel();
  auto done = std::move(done_);
  done(Hello{UcpEndpoint(ep), std::move(reply), limits});
}

void Bootstrap::Watch(std::function<void(Status)> lost) {
  socket_->async_read_some(
      asio::buffer(watch_byte_, 1),
      [this, attempt = attempt_, lost = std::move(lost)](const asio::error_code& error, size_t) {
        if (!Current(attempt, Phase::kEstablished)) return;
        lost(UnavailableError("connection to {}:{} lost ({})", options_.host, options_.port,
                              error ? error.message() : "unexpected bytes"));
      });
}

void Bootstrap::Fail(Status status) {
  auto done = std::move(done_);
  Close();
  if (done) done(std::move(status));
}

void Bootstrap::Close() {
  ++attempt_;
  phase_ = Phase::kIdle;
  done_ = nullptr;
  asio::error_code ignored;
  if (socket_) socket_->close(ignored);
  if (connect_timer_) connect_timer_->cancel();
  if (resolver_) resolver_->cancel();
}

}  // namespace kvstash::transport::internal
