// The UCX server's connections (progress thread): ConnectionTable (the open connections, their
// endpoints, their end) and HelloAcceptor (listening, the hello on the bootstrap socket and its
// refusals).

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <random>
#include <string_view>
#include <utility>

#include "bootstrap.h"
#include "kvstash/common/logging.h"
#include "kvstash/proto/wire.pb.h"
#include "kvstash/transport/admission.h"
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

// ---- ConnectionTable -------------------------------------------------------------------------

ConnectionTable::ConnectionTable(Worker& worker, ServerCounters& counters)
    : worker_(worker), counters_(counters) {
  std::random_device seed;
  random_.seed((uint64_t{seed()} << 32) | seed());
}

uint64_t ConnectionTable::RandomId() {
  for (;;) {
    const uint64_t id = random_();
    if (id != 0 && !connections_.contains(id)) return id;
  }
}

Status ConnectionTable::Add(const std::shared_ptr<ServerConnection>& connection,
                            const std::string& worker_address) {
  ucp_ep_h ep = nullptr;
  ucp_ep_params_t params{};
  params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER;
  params.address = reinterpret_cast<const ucp_address_t*>(worker_address.data());
  params.err_handler.cb = &ConnectionTable::OnEndpointError;
  params.err_handler.arg = this;
  KVSTASH_RETURN_IF_ERROR(
      worker_.CreateEndpoint(&params, &ep, "opening a UCX endpoint to the client"));
  // The endpoint is a spare until a kBind claims it: the one this connection's frames come on
  // may be another hello's (see SpareEndpoint).
  // Ids are random, not a counter: one client's id says nothing of another's. Frames are taken
  // from the endpoint the connection bound (kBind), never from the id alone.
  connection->id = RandomId();
  connection->bind_token = random_();
  connections_[connection->id] = connection;
  spare_[ep] = SpareEndpoint{UcpEndpoint(ep), connection->id, {}};
  counters_.connects.fetch_add(1, std::memory_order_relaxed);
  counters_.open_connections.fetch_add(1, std::memory_order_relaxed);
  return Status::OK();
}

std::shared_ptr<ServerConnection> ConnectionTable::BoundConnection(ucp_ep_h from) const {
  auto bound = from != nullptr ? bound_.find(from) : bound_.end();
  if (bound == bound_.end()) return nullptr;
  auto it = connections_.find(bound->second);
  return it != connections_.end() ? it->second : nullptr;
}

std::shared_ptr<ServerConnection> ConnectionTable::ConnectionOf(const FrameHeader& h,
                                                                ucp_ep_h from) {
  std::shared_ptr<ServerConnection> own = BoundConnection(from);
  if (own != nullptr && own->id == h.connection_id) return own;
  // A frame naming a connection that is not its endpoint's (another tenant's, or one not bound
  // yet): refused, and said once per connection it named or came from.
  counters_.foreign_frames.fetch_add(1, std::memory_order_relaxed);
  auto named = connections_.find(h.connection_id);
  ServerConnection* said = named != connections_.end() ? named->second.get() : own.get();
  if (said != nullptr && said->foreign_frames++ == 0) {
    KVSTASH_LOG_WARN(
        "refused a frame naming connection {:#x} from {}: a connection's frames come "
        "on the endpoint it bound",
        h.connection_id,
        own != nullptr ? fmt::format("connection {} ({})", own->id, own->client_name)
                       : std::string("an endpoint of no connection"));
  }
  return nullptr;
}

void ConnectionTable::Bind(const FrameHeader& h, ucp_ep_h from) {
  auto it = connections_.find(h.connection_id);
  const bool owner = from != nullptr && it != connections_.end() && !it->second->ep &&
                     it->second->bind_token == h.request_id;
  auto spare = owner ? spare_.find(from) : spare_.end();
  if (spare == spare_.end()) {
    // Said 1st, 2nd, 4th ... time: a peer may send any number.
    if (std::has_single_bit(counters_.foreign_frames.fetch_add(1, std::memory_order_relaxed) + 1)) {
      KVSTASH_LOG_WARN("refused a bind to connection {:#x}: {}", h.connection_id,
                       from == nullptr                          ? "no reply endpoint"
                       : it == connections_.end()               ? "no such connection"
                       : it->second->ep                         ? "bound already"
                       : it->second->bind_token != h.request_id ? "a wrong token"
                       : bound_.contains(from)                  ? "its endpoint is bound to another"
                                               : "its endpoint is none a hello made");
    }
    // The owner (it knew the token) on an endpoint it cannot have: closed, so that it connects
    // again at once rather than wait for its calls' deadlines.
    if (owner) {
      Close(it->second, UnavailableError("its kBind came on an endpoint it cannot bind"));
    }
    return;
  }
  // The spare its frames come on, whichever hello made it, becomes its endpoint: replies go
  // back on it, and closing it resets this client's endpoint and no other.
  it->second->ep = std::move(spare->second.ep);
  spare_.erase(spare);
  bound_[from] = h.connection_id;
}

void ConnectionTable::OnEndpointError(void* arg, ucp_ep_h ep, ucs_status_t status) {
  auto* self = static_cast<ConnectionTable*>(arg);
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

void ConnectionTable::CloseEndpoint(UcpEndpoint endpoint) {
  auto ep = std::make_shared<UcpEndpoint>(std::move(endpoint));
  Worker* worker = &worker_;
  auto close = [worker, ep] { worker->WaitRequest(ep->Close(/*force=*/true)); };
  if (worker_.stopping()) {
    close();
  } else {
    asio::post(worker_.io(), close);
  }
}

void ConnectionTable::SweepSpares(Clock::time_point now) {
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

void ConnectionTable::Close(std::shared_ptr<ServerConnection> connection, const Status& why) {
  if (!connection->open) return;
  connection->open = false;
  KVSTASH_LOG_INFO("closing connection {}: {}", connection->id, why.ToString());
  counters_.open_connections.fetch_sub(1, std::memory_order_relaxed);
  counters_.disconnects.fetch_add(1, std::memory_order_relaxed);
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
  if (!worker_.stopping()) SweepSpares(now);
}

void ConnectionTable::CloseAll(const Status& why) {
  auto all = connections_;
  for (auto& [id, connection] : all) Close(connection, why);
  auto spares = std::move(spare_);
  spare_.clear();
  for (auto& [ep, spare] : spares) CloseEndpoint(std::move(spare.ep));
}

// ---- HelloAcceptor ---------------------------------------------------------------------------

HelloAcceptor::HelloAcceptor(const ServerOptions& options, Worker& worker,
                             ConnectionTable& connections, ServerCounters& counters)
    : options_(options),
      worker_(worker),
      connections_(connections),
      counters_(counters),
      acceptor_(worker.io()),
      accept_pause_(worker.io()) {}

Status HelloAcceptor::Listen() {
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
  if (worker_.options().mapped_payloads) {
    // Clients on this host that can map this (and read the cookie) use mapped payloads.
    auto region = worker_.Allocate(4096);
    if (region.ok() && !region->packed_rkey().empty()) {
      auto probe = std::make_shared<MappedProbe>();
      probe->region = std::move(*region);
      std::random_device random;
      probe->cookie = (uint64_t{random()} << 32) | random();
      std::memcpy(probe->region.data(), &probe->cookie, sizeof(probe->cookie));
      probe_ = std::move(probe);
    }
  }
  return Status::OK();
}

void HelloAcceptor::Stop() {
  asio::error_code ignored;
  accept_pause_.cancel();
  acceptor_.close(ignored);
}

void HelloAcceptor::Accept() {
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
    if (handoff_) {
      handoff_(std::move(socket));
    } else {
      counters_.pending_hellos.fetch_add(1, std::memory_order_relaxed);
      Adopt(std::move(socket));
    }
    Accept();
  });
}

void HelloAcceptor::Adopt(asio::ip::tcp::socket socket) {
  auto connection = std::make_shared<ServerConnection>(std::move(socket));
  auto timer = std::make_shared<asio::steady_timer>(worker_.io());
  timer->expires_after(options_.hello_timeout);
  timer->async_wait([connection](const asio::error_code& e) {
    if (!e && connection->id == 0) {
      asio::error_code ignored;
      connection->socket.close(ignored);
    }
  });
  AsyncReadMessage(connection->socket, [this, connection, timer](Status s, std::string body) {
    timer->cancel();
    counters_.pending_hellos.fetch_sub(1, std::memory_order_relaxed);
    OnHello(connection, std::move(s), body);
  });
}

void HelloAcceptor::PauseAccepting(const asio::error_code& error) {
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
  counters_.accept_pauses.fetch_add(1, std::memory_order_relaxed);
  accept_pause_.expires_after(pause);
  accept_pause_.async_wait([this](const asio::error_code& e) {
    if (!e) Accept();
  });
}

Status HelloAcceptor::Check(const wire::Hello& hello) {
  if (hello.protocol_version() != wire::PROTOCOL_VERSION_CURRENT) {
    return FailedPreconditionError("protocol version {} is not the node's {}",
                                   hello.protocol_version(),
                                   static_cast<int>(wire::PROTOCOL_VERSION_CURRENT));
  }
  if (Status refused = CheckHelloToken(options_, hello.namespace_(), hello.auth_token());
      !refused.ok()) {
    counters_.refusals.fetch_add(1, std::memory_order_relaxed);
    return refused;
  }
  if (options_.admit_tenant) {
    KVSTASH_RETURN_IF_ERROR(options_.admit_tenant(hello.namespace_()));
  }
  // The client's address goes to UCX only once checked: UCX 1.13 reads it unchecked and aborts
  // on bytes it does not expect (worker_address.h).
  const std::string_view own = worker_.address();
  const Status address = CheckPeerWorkerAddress(std::as_bytes(std::span(hello.worker_address())),
                                                std::as_bytes(std::span(own.data(), own.size())));
  if (!address.ok()) {
    counters_.bad_hellos.fetch_add(1, std::memory_order_relaxed);
    return Status(address.code(),
                  fmt::format("the client's UCX worker address: {}", address.message()));
  }
  return Status::OK();
}

void HelloAcceptor::OnHello(const std::shared_ptr<ServerConnection>& connection, Status status,
                            const std::string& body) {
  if (!status.ok()) {
    KVSTASH_LOG_WARN("dropped a connection before its hello: {}", status.ToString());
    return;
  }
  wire::Hello hello;
  wire::HelloReply reply;
  reply.set_protocol_version(wire::PROTOCOL_VERSION_CURRENT);
  reply.set_service_limits(options_.service_limits);
  reply.set_max_message_bytes(worker_.options().max_message_bytes);
  reply.set_max_payload_bytes(worker_.options().max_payload_bytes);
  Status refused;
  if (!hello.ParseFromString(body)) {
    counters_.bad_hellos.fetch_add(1, std::memory_order_relaxed);
    refused = InvalidArgumentError("unparseable hello of {} bytes", body.size());
  } else {
    refused = Check(hello);
  }
  if (refused.ok()) refused = connections_.Add(connection, hello.worker_address());
  if (!refused.ok()) {
    Refuse(connection, hello, reply, refused);
    return;
  }
  connection->tenant = hello.namespace_();
  connection->client_name = hello.client_name();
  reply.set_connection_id(connection->id);
  reply.set_bind_token(connection->bind_token);
  reply.set_error_handling(wire::UCX_ERROR_HANDLING_PEER);  // as CreateEndpoint made ours
  reply.set_worker_address(std::string(worker_.address()));
  if (probe_ && worker_.options().mapped_payloads) {
    const MemoryRegion& region = probe_->region;
    wire::SharedRegion* probe = reply.mutable_mapped_probe();
    probe->set_region_id(region.id());
    probe->set_address(reinterpret_cast<uintptr_t>(region.data()));
    probe->set_size(region.size());
    probe->set_rkey(region.packed_rkey());
    probe->set_cookie(probe_->cookie);
    connection->rkeys_sent.insert(region.id());
  }
  AsyncWriteMessage(connection->socket, reply, [this, connection](Status s) {
    if (!s.ok()) {
      connections_.Close(connection, s);
      return;
    }
    Watch(connection);
  });
}

void HelloAcceptor::Refuse(const std::shared_ptr<ServerConnection>& connection,
                           const wire::Hello& hello, wire::HelloReply& reply,
                           const Status& refused) {
  // Who was refused, so an operator can find the misconfigured engine: the name and namespace
  // the client gave (escaped and cut short: they are the client's bytes) and where it connected
  // from. Never the token it sent. A flood of bad hellos must not fill the disk: the 1st, 2nd,
  // 4th, 8th ... are said.
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
}

void HelloAcceptor::Watch(const std::shared_ptr<ServerConnection>& connection) {
  connection->socket.async_read_some(
      asio::buffer(connection->watch_byte, 1),
      [this, connection](const asio::error_code& error, size_t) {
        connections_.Close(connection,
                           UnavailableError("client {} ({}) went away: {}", connection->id,
                                            connection->client_name,
                                            error ? error.message() : "unexpected bytes"));
      });
}

}  // namespace kvstash::transport
