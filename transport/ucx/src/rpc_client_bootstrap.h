#pragma once

// The bootstrap connection of an RpcClient: the TCP socket to the server, the hello over it and
// the UCX endpoint opened from the reply. Private to transport/ucx/src/; defined in
// rpc_client_bootstrap.cc.

#include <ucp/api/ucp.h>

#include <asio.hpp>
#include <cstdint>
#include <functional>
#include <optional>

#include "kvstash/common/status.h"
#include "kvstash/proto/wire.pb.h"
#include "kvstash/transport/rpc.h"
#include "worker.h"

namespace kvstash::transport::internal {

// The bootstrap connection to one server: the TCP socket, the hello that trades UCX worker
// addresses (wire.Hello, wire.HelloReply) and the UCX endpoint opened to the server's worker
// from the reply; after that the socket carries nothing and only watches for the server going
// away. One attempt at a time: Connect starts one, Close ends it (and the next Connect starts
// the next: reconnection is a new attempt). Owned by its RpcClient::Impl.
//
// Invariants: no handler of an attempt that was closed or superseded reaches the owner; an
// attempt's `done` runs at most once, and after a failure the attempt is closed already; the
// watch reports a loss only for the attempt whose hello succeeded.
//
// Thread-safety: progress thread only. Its socket and timer handlers hold `this`: the owner
// keeps it for a grace period after Close (ClientWorker::Impl::Retire).
class Bootstrap {
 public:
  // What a hello yields: the endpoint to the server's worker, the server's reply, and the
  // limits it states, within this client's own (a larger message or payload would be refused
  // here before it is sent).
  struct Hello {
    UcpEndpoint endpoint;
    wire::HelloReply reply;
    ServerLimits limits;
  };

  // `on_endpoint_error` is the error handler of the endpoints it opens.
  Bootstrap(Worker& worker, const ClientOptions& options, ucp_err_handler_t on_endpoint_error)
      : worker_(worker), options_(options), on_endpoint_error_(on_endpoint_error) {}

  // Starts an attempt: resolve, connect, hello, endpoint, within options.connect_timeout.
  // `done` runs once on the progress thread with the endpoint and the reply, or with why it
  // failed (a refusal carries the server's code), unless Close comes first.
  void Connect(std::function<void(Result<Hello>)> done);
  // The connection is up: from now on, any read completion of the socket (the server went away
  // or broke protocol) runs `lost` with why.
  void Watch(std::function<void(Status)> lost);
  // Ends the attempt: closes the socket and cancels its timer and resolve; none of its handlers
  // reaches the owner after. Idempotent.
  void Close();

 private:
  enum class Phase { kIdle, kConnecting, kEstablished };

  void OnSocketConnected(uint64_t attempt, const asio::error_code& error);
  void OnHelloReply(uint64_t attempt, Status status, const std::string& body);
  // True when a handler of `attempt` in `phase` may go on.
  bool Current(uint64_t attempt, Phase phase) const {
    return attempt == attempt_ && phase_ == phase;
  }
  // Closes the attempt, then tells the owner why it failed.
  void Fail(Status status);

  Worker& worker_;
  const ClientOptions& options_;  // the owner's
  ucp_err_handler_t on_endpoint_error_;
  uint64_t attempt_ = 0;
  Phase phase_ = Phase::kIdle;
  std::function<void(Result<Hello>)> done_;
  std::optional<asio::ip::tcp::socket> socket_;
  std::optional<asio::ip::tcp::resolver> resolver_;
  std::optional<asio::steady_timer> connect_timer_;
  char watch_byte_[1];
};

}  // namespace kvstash::transport::internal
