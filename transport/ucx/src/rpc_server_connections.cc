// RpcServer::Impl: connections (progress thread): listening, the hello on the bootstrap socket
// and its refusals, the UCX endpoint, and the end of a connection.

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <random>
#include <string_view>
#include <utility>

#include "bootstrap.h"
#include "kvstash/transport/admission.h"
#include "kvstash/common/logging.h"
#include "kvstash/proto/wire.pb.h"
#include "rpc_server_impl.h"
#include "worker.h"
#include "worker_address.h"

namespace kvstash::transport {

namespace {

// At most 64 bytes of a string a client sent, for a log line (formatted with {:?}, escaped).
std::string_view Printable(std::string_view s) { return s.substr(0, 64); }

// "ADDRESS:PORT" of the socket's peer, for logs.
std::string PeerOf(const asio::ip::tcp::socket& socket) {
  asio::error_code error;
  const asio::ip::tcp::endpoint peer = socket.remote_endpoint(error);
  if (error) return fmt::format("an unknown address ({})", error.message());
  if (peer.address().is_v6()) {
    return fmt::format("[{}]:{}", peer.address().to_string(), peer.port());
  }
  return fmt::format("{}:{}", peer.address().to_string(), peer.port());
}

}  // namespace

// ---- connections -----------------------------------------------------------------------------

RpcServer::Impl::Impl(ServerOptions options, std::shared_ptr<Worker> worker)
    : options_(std::move(options)),
      worker_(std::move(worker)),
      acceptor_(worker_->io()),
      accept_pause_(worker_->io()) {
  std::random_device seed;
  random_.seed((uint64_t{seed()} << 32) | seed());
}

uint64_t RpcServer::Impl::RandomId() {
  for (;;) {
    const uint64_t id = random_();
    if (id != 0 && !connections_.contains(id)) return id;
  }
}

Status RpcServer::Impl::Start() {
  asio::error_code error;
  const auto address = asio::ip::make_address(options_.bind_address, error);
  if (error) {
    return InvalidArgumentError("bind address '{}' is not an IP address: {}", options_.bind_address,
                                error.message());
  }
  const asio::ip::tcp::endpoint endpoint(address, options_.port);
  acceptor_.open(endpoint.protocol(), error);
  if (!error) acceptor_.set_option(asio::ip::tcp::acceptor::reuse_address(true), error);
  if (!error) acceptor_.bind(endpoint, error);
  if (!error) acceptor_.listen(asio::socket_base::max_listen_connections, error);
  if (error) {
    return UnavailableError("listening on {}:{}: {}", options_.bind_address, options_.port,
                            error.message());
  }
  port_ = acceptor_.local_endpoint().port();
  if (worker_->options().mapped_payloads) {
    // Clients on this host that can map this (and read the cookie) use mapped payloads.
    auto probe = worker_->Allocate(4096);
    if (probe.ok() && !probe->packed_rkey().empty()) {
      probe_ = std::move(*probe);
      std::random_device random;
      cookie_ = (uint64_t{random()} << 32) | random();
      std::memcpy(probe_.data(), &cookie_, sizeof(cookie_));
    }
  }
  KVSTASH_RETURN_IF_ERROR(worker_->SetFrameHandler(
      &Impl::OnFrame, this, UCP_AM_FLAG_WHOLE_MSG | UCP_AM_FLAG_PERSISTENT_DATA));
  worker_->Start([this] { Shutdown(); });
  worker_->Run([this] { Accept(); });
  return Status::OK();
}

void RpcServer::Impl::Accept() {
  acceptor_.async_accept([this](const asio::error_code& error, asio::ip::tcp::socket socket) {
    if (error) {
      if (error != asio::error::operation_aborted) PauseAccepting(error);
      return;
    }
    if (accept_failures_ != 0) {
      KVSTASH_LOG_WARN("accepting connections again, after {} failed accept(s)", accept_failures_);
      accept_failures_ = 0;
    }
    asio::error_code ignored;
    socket.set_option(asio::ip::tcp::no_delay(true), ignored);
    auto connection = std::make_shared<ServerConnection>(std::move(socket));
    auto timer = std::make_shared<asio::steady_timer>(worker_->io());
    timer->expires_after(options_.hello_timeout);
    timer->async_wait([connection](const asio::error_code& e) {
      if (!e && connection->id == 0) {
        asio::error_code ignored2;
        connection->socket.close(ignored2);
      }
    });
    AsyncReadMessage(connection->socket, [this, connection, timer](Status s, std::string body) {
      timer->cancel();
      OnHello(connection, std::move(s), body);
    });
    Accept();
  });
}

void RpcServer::Impl::PauseAccepting(const asio::error_code& error) {
  // Out of file descriptors (EMFILE, ENFILE) or memory, accept fails at once for as long as it
  // lasts: retrying at once spins a core and floods the log (2.3 million lines in 12 s were
  // seen). The connections open are served meanwhile; the pending ones wait in the backlog.
  const auto pause =
      std::chrono::milliseconds(std::min(50u << std::min(accept_failures_, 4u), 1000u));
  if (accept_failures_++ == 0) {
    KVSTASH_LOG_WARN(
        "accept: {}; serving the {} open connection(s) and trying again every {} ms at most "
        "until it works",
        error.message(), connections_.size(), 1000);
  }
  accept_pauses_.fetch_add(1, std::memory_order_relaxed);
  accept_pause_.expires_after(pause);
  accept_pause_.async_wait([this](const asio::error_code& e) {
    if (!e) Accept();
  });
}

void RpcServer::Impl::OnHello(const std::shared_ptr<ServerConnection>& connection, Status status,
                              const std::string& body) {
  if (!status.ok()) {
    KVSTASH_LOG_WARN("dropped a connection before its hello: {}", status.ToString());
    return;
  }
  wire::Hello hello;
  wire::HelloReply reply;
  reply.set_protocol_version(wire::PROTOCOL_VERSION_CURRENT);
  reply.set_block_bytes(options_.block_bytes);
  reply.set_max_keys_per_request(options_.max_keys_per_request);
  reply.set_max_message_bytes(worker_->options().max_message_bytes);
  reply.set_max_payload_bytes(worker_->options().max_payload_bytes);
  Status refused;
  if (!hello.ParseFromString(body)) {
    bad_hellos_.fetch_add(1, std::memory_order_relaxed);
    refused = InvalidArgumentError("unparseable hello of {} bytes", body.size());
  } else if (hello.protocol_version() != wire::PROTOCOL_VERSION_CURRENT) {
    refused = FailedPreconditionError("protocol version {} is not the node's {}",
                                      hello.protocol_version(),
                                      static_cast<int>(wire::PROTOCOL_VERSION_CURRENT));
  } else if (refused = CheckHelloToken(options_, hello.namespace_(), hello.auth_token());
             !refused.ok()) {
    refusals_.fetch_add(1, std::memory_order_relaxed);
  } else if (options_.admit_namespace) {
    refused = options_.admit_namespace(hello.namespace_());
  }
  // The client's address goes to UCX only once checked: UCX 1.13 reads it unchecked and aborts
  // on bytes it does not expect (worker_address.h).
  if (refused.ok()) {
    const std::string_view own = worker_->address();
    refused = CheckPeerWorkerAddress(std::as_bytes(std::span(hello.worker_address())),
                                     std::as_bytes(std::span(own.data(), own.size())));
    if (!refused.ok()) {
      bad_hellos_.fetch_add(1, std::memory_order_relaxed);
      refused = Status(refused.code(),
                       fmt::format("the client's UCX worker address: {}", refused.message()));
    }
  }
  ucp_ep_h ep = nullptr;
  if (refused.ok()) {
    ucp_ep_params_t params{};
    params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                        UCP_EP_PARAM_FIELD_ERR_HANDLER;
    params.address = reinterpret_cast<const ucp_address_t*>(hello.worker_address().data());
    params.err_handler.cb = &Impl::OnEndpointError;
    params.err_handler.arg = this;
    refused = worker_->CreateEndpoint(&params, &ep, "opening a UCX endpoint to the client");
  }
  if (!refused.ok()) {
    // Who was refused, so an operator can find the misconfigured engine: the name and
    // namespace the client gave (escaped and cut short: they are the client's bytes) and
    // where it connected from. Never the token it sent. A flood of bad hellos must not fill
    // the disk: the 1st, 2nd, 4th, 8th ... are said.
    if (std::has_single_bit(++hellos_refused_)) {
      KVSTASH_LOG_WARN(
          "refused a client: {} (client {:?}, namespace {:?}, from {}; {} refused so far)",
          refused.ToString(), Printable(hello.client_name()), Printable(hello.namespace_()),
          PeerOf(connection->socket), hellos_refused_);
    }
    reply.mutable_error()->set_code(internal::ToWire(refused.code()));
    reply.mutable_error()->set_message(std::string(refused.message()));
    AsyncWriteMessage(connection->socket, reply, [connection](Status) {
      asio::error_code ignored;
      connection->socket.close(ignored);
    });
    return;
  }
  // The endpoint is a spare until a kBind claims it: the one this connection's frames come on
  // may be another hello's (see SpareEndpoint).
  // Ids are random, not a counter: one client's id says nothing of another's. Frames are taken
  // from the endpoint the connection bound (kBind), never from the id alone.
  connection->id = RandomId();
  connection->bind_token = random_();
  connection->key_namespace = hello.namespace_();
  connection->client_name = hello.client_name();
  connections_[connection->id] = connection;
  spare_[ep] = SpareEndpoint{UcpEndpoint(ep), connection->id, {}};
  connects_.fetch_add(1, std::memory_order_relaxed);
  open_connections_.fetch_add(1, std::memory_order_relaxed);
  reply.set_connection_id(connection->id);
  reply.set_bind_token(connection->bind_token);
  reply.set_error_handling(worker_->peer_failure_mode() ? wire::UCX_ERROR_HANDLING_PEER
                                                        : wire::UCX_ERROR_HANDLING_NONE);
  reply.set_worker_address(std::string(worker_->address()));
  if (probe_.size() != 0 && worker_->options().mapped_payloads) {
    wire::SharedRegion* probe = reply.mutable_mapped_probe();
    probe->set_region_id(probe_.id());
    probe->set_address(reinterpret_cast<uintptr_t>(probe_.data()));
    probe->set_size(probe_.size());
    probe->set_rkey(probe_.packed_rkey());
    probe->set_cookie(cookie_);
    connection->rkeys_sent.insert(probe_.id());
  }
  AsyncWriteMessage(connection->socket, reply, [this, connection](Status s) {
    if (!s.ok()) {
      Close(connection, s);
      return;
    }
    Watch(connection);
  });
}

void RpcServer::Impl::Watch(const std::shared_ptr<ServerConnection>& connection) {
  connection->socket.async_read_some(
      asio::buffer(connection->watch_byte, 1),
      [this, connection](const asio::error_code& error, size_t) {
        Close(connection, UnavailableError("client {} ({}) went away: {}", connection->id,
                                           connection->client_name,
                                           error ? error.message() : "unexpected bytes"));
      });
}

void RpcServer::Impl::OnEndpointError(void* arg, ucp_ep_h ep, ucs_status_t status) {
  auto* self = static_cast<Impl*>(arg);
  if (auto spare = self->spare_.find(ep); spare != self->spare_.end()) {
    UcpEndpoint failed = std::move(spare->second.ep);
    self->spare_.erase(spare);
    self->CloseEndpoint(std::move(failed));
    return;
  }
  auto it = self->bound_.find(ep);
  if (it == self->bound_.end()) return;
  auto connection = self->connections_.find(it->second);
  if (connection == self->connections_.end()) return;
  self->Close(connection->second, FromUcs(status, "UCX endpoint to a client failed"));
}

void RpcServer::Impl::CloseEndpoint(UcpEndpoint endpoint) {
  auto ep = std::make_shared<UcpEndpoint>(std::move(endpoint));
  auto close = [this, ep] { worker_->WaitRequest(ep->Close(/*force=*/true)); };
  if (worker_->stopping()) {
    close();
  } else {
    asio::post(worker_->io(), close);
  }
}

void RpcServer::Impl::SweepSpares(Clock::time_point now) {
  std::vector<std::pair<Clock::time_point, ucp_ep_h>> orphans;
  for (const auto& [ep, spare] : spare_) {
    if (spare.orphaned_at != Clock::time_point{}) orphans.emplace_back(spare.orphaned_at, ep);
  }
  std::sort(orphans.begin(), orphans.end());
  size_t left = orphans.size();
  for (const auto& [at, ep] : orphans) {
    if (now - at < kSpareGrace && left <= kMaxOrphanedSpares) break;
    auto it = spare_.find(ep);
    UcpEndpoint old = std::move(it->second.ep);
    spare_.erase(it);
    CloseEndpoint(std::move(old));
    --left;
  }
}

void RpcServer::Impl::Close(std::shared_ptr<ServerConnection> connection, const Status& why) {
  if (!connection->open) return;
  connection->open = false;
  KVSTASH_LOG_INFO("closing connection {}: {}", connection->id, why.ToString());
  open_connections_.fetch_sub(1, std::memory_order_relaxed);
  disconnects_.fetch_add(1, std::memory_order_relaxed);
  connections_.erase(connection->id);
  asio::error_code ignored;
  connection->socket.close(ignored);
  const Status gone = UnavailableError("connection {} closed", connection->id);
  for (auto& [id, pull] : std::exchange(connection->pulls, {})) pull.done(gone);
  for (auto& [id, sent] : std::exchange(connection->acks, {})) sent(gone);
  if (on_disconnect_) on_disconnect_(connection->id);
  // Its own endpoint (the one it claimed) goes; the spare its hello made stays a while for the
  // client endpoint UCX paired it with, which may belong to another connection of that client
  // (closing it would break that one).
  if (connection->ep) {
    bound_.erase(connection->ep.get());
    CloseEndpoint(std::move(connection->ep));
  }
  const Clock::time_point now = Clock::now();
  for (auto& [ep, spare] : spare_) {
    if (spare.hello == connection->id) spare.orphaned_at = now;
  }
  if (!worker_->stopping()) SweepSpares(now);
}

void RpcServer::Impl::Shutdown() {
  asio::error_code ignored;
  accept_pause_.cancel();
  acceptor_.close(ignored);
  auto all = connections_;
  for (auto& [id, connection] : all) Close(connection, CancelledError("server stopping"));
  auto spares = std::move(spare_);
  spare_.clear();
  for (auto& [ep, spare] : spares) CloseEndpoint(std::move(spare.ep));
}

}  // namespace kvstash::transport
