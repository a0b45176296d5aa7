// RpcServer: accepts connections (bootstrap socket + UCX endpoint per client), validates
// frames and dispatches requests. Everything below the public entry points runs on the
// progress thread.

#include <fmt/format.h>

#include <cstring>
#include <random>
#include <unordered_map>
#include <unordered_set>

#include "bootstrap.h"
#include "hello.h"
#include "kvstash/common/logging.h"
#include "kvstash/proto/wire.pb.h"
#include "kvstash/transport/frame.h"
#include "kvstash/transport/rpc.h"
#include "worker.h"

namespace kvstash::transport {

class UcxCall;

// A held request payload the server asked the client for (kPull).
struct PendingPull {
  std::shared_ptr<UcxCall> state;
  MutableBytes dest;
  const MemoryRegion* region = nullptr;
  bool as_data = false;  // asked for a kPayload frame rather than a copy into shared memory
  std::function<void(Status)> done;
};

struct ServerConnection {
  uint64_t id = 0;
  std::string key_namespace;
  std::string client_name;
  asio::ip::tcp::socket socket;
  UcpEndpoint ep;
  bool open = true;
  char watch_byte[1];
  // Mapped payloads (progress thread): regions whose rkey the client has, pulls waiting for
  // kPullDone or kPayload, and mapped replies waiting for kAck (their `sent` callbacks).
  std::unordered_set<uint64_t> rkeys_sent;
  std::unordered_map<uint64_t, PendingPull> pulls;
  std::unordered_map<uint64_t, std::function<void(Status)>> acks;
  explicit ServerConnection(asio::ip::tcp::socket s) : socket(std::move(s)) {}
};

// One request; shared by its ServerCall handle and the UCX operations it starts.
class UcxCall : public ServerCallState, public std::enable_shared_from_this<UcxCall> {
 public:
  std::shared_ptr<RpcServer::Impl> server;  // calls may outlive the RpcServer handle
  std::shared_ptr<Worker> worker;
  std::shared_ptr<ServerConnection> connection;
  uint16_t method_id = 0;
  uint64_t request_id = 0;
  Clock::time_point deadline_at;
  std::vector<std::byte> request_bytes;
  size_t payload_size = 0;
  void* payload_data = nullptr;  // eager bytes or the rendezvous descriptor
  bool payload_rndv = false;
  bool payload_persistent = false;  // eager bytes kept past the AM callback
  bool payload_held = false;        // the client holds it until pulled (mapped payloads)
  bool accepts_mapped = false;      // the client copies a mapped reply payload itself
  bool payload_consumed = false;
  bool in_am_callback = false;
  std::atomic<bool> replied{false};
  std::atomic<bool> cancel_flag{false};

  void ReleasePayload() {
    if (payload_consumed || payload_size == 0) return;
    payload_consumed = true;
    if (payload_held) return;  // the client lets go of it when the call completes
    if (payload_rndv) {
      worker->DiscardRendezvous(payload_data, payload_size);  // within limits: checked
    } else if (payload_persistent) {
      ucp_am_data_release(worker->ucp(), payload_data);
    }
  }

  // ServerCallState.
  uint16_t method() const override { return method_id; }
  uint64_t connection_id() const override;
  const std::string& key_namespace() const override;
  Bytes request() const override { return request_bytes; }
  size_t payload_bytes() const override { return payload_size; }
  Clock::time_point deadline() const override { return deadline_at; }
  bool cancelled() const override { return cancel_flag.load() || Clock::now() >= deadline_at; }
  void ReceivePayload(MutableBytes dest, const MemoryRegion* region,
                      std::function<void(Status)> done) override;
  void Reply(Bytes message, Bytes payload, const MemoryRegion* region,
             std::function<void(Status)> sent) override;
  void ReplyError(const Status& status) override;
  void Drop() override;
};

namespace {

struct ReplySend {
  std::vector<std::byte> header;
  std::vector<std::byte> message_in_data;
  std::function<void(Status)> sent;
  std::shared_ptr<UcxCall> state;  // keeps the connection alive while sending
};

struct PayloadRecv {
  std::shared_ptr<UcxCall> state;
  std::function<void(Status)> done;
};

// A control frame (kPull) with no call callback behind it: owns its bytes until sent.
struct ControlSend {
  std::vector<std::byte> header;
  std::shared_ptr<ServerConnection> connection;
};

wire::Code ToWire(StatusCode code) { return static_cast<wire::Code>(code); }

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

class RpcServer::Impl : public std::enable_shared_from_this<RpcServer::Impl> {
 public:
  Impl(ServerOptions options, std::shared_ptr<Worker> worker)
      : options_(std::move(options)), worker_(std::move(worker)), acceptor_(worker_->io()) {
    std::random_device random;
    epoch_ = (uint64_t{random()} << 32);
  }

  void Handle(uint16_t method, Handler handler) { handlers_[method] = std::move(handler); }
  void OnDisconnect(std::function<void(uint64_t)> fn) { on_disconnect_ = std::move(fn); }

  Status Start() {
    asio::error_code error;
    const auto address = asio::ip::make_address(options_.bind_address, error);
    if (error) {
      return InvalidArgumentError("bind address '{}' is not an IP address: {}",
                                  options_.bind_address, error.message());
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

  void Stop() { worker_->Stop(); }

  void RunEvery(std::chrono::milliseconds period, std::function<void()> fn) {
    auto timer = std::make_shared<asio::steady_timer>(worker_->io());
    auto task = std::make_shared<std::function<void()>>(std::move(fn));
    worker_->Run([this, timer, period, task] { Tick(timer, period, task); });
  }
  uint16_t port() const { return port_; }
  const std::shared_ptr<Worker>& worker() const { return worker_; }

  TransportStats stats() const {
    TransportStats s;
    s.calls = calls_.load();
    s.connects = connects_.load();
    s.disconnects = disconnects_.load();
    s.malformed_frames = malformed_.load();
    s.mapped_payloads = mapped_.load();
    s.refused = refusals_.load();
    return s;
  }
  size_t connection_count() const { return open_connections_.load(); }

  // ---- replies (any thread) ----------------------------------------------------------------

  void Reply(const std::shared_ptr<UcxCall>& state, StatusCode code, Bytes message, Bytes payload,
             const MemoryRegion* region, std::function<void(Status)> sent) {
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
    const bool in_data = kFrameHeaderBytes + message.size() > worker_->max_am_header();
    if (in_data) {
      header.flags = kMessageInData;
      send->header.resize(kFrameHeaderBytes);
      WriteFrame(header, {}, send->header);
      send->message_in_data.assign(message.begin(), message.end());
    } else {
      send->header.resize(kFrameHeaderBytes + message.size());
      WriteFrame(header, message, send->header);
    }
    worker_->Run([this, send = std::move(send), payload, region]() mutable {
      SendReply(std::move(send), payload, region);
    });
  }

  void ReplyStatus(const std::shared_ptr<UcxCall>& state, const Status& status) {
    wire::Error error;
    error.set_code(ToWire(status.code()));
    error.set_message(std::string(status.message()));
    const std::string bytes = error.SerializeAsString();
    Reply(state, status.code(), std::as_bytes(std::span(bytes)), {}, nullptr, {});
  }

  void ReceivePayload(const std::shared_ptr<UcxCall>& state, MutableBytes dest,
                      const MemoryRegion* region, std::function<void(Status)> done) {
    worker_->Run([this, state, dest, region, done = std::move(done)]() mutable {
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

  // Receives rendezvous payload bytes (of a request or a kPayload frame) into dest.
  void ReceiveData(const std::shared_ptr<UcxCall>& state, void* descriptor, MutableBytes dest,
                   const MemoryRegion* region, std::function<void(Status)> done) {
    auto* op = new PayloadRecv{state, std::move(done)};
    ucp_request_param_t param = ContigParam(op, region);
    param.cb.recv_am = [](void* request, ucs_status_t status, size_t, void* user_data) {
      ucp_request_free(request);
      std::unique_ptr<PayloadRecv> owned(static_cast<PayloadRecv*>(user_data));
      owned->done(FromUcs(status, "receiving a request payload"));
    };
    ucs_status_ptr_t request =
        ucp_am_recv_data_nbx(worker_->ucp(), descriptor, dest.data(), dest.size(), &param);
    if (request == nullptr || UCS_PTR_IS_ERR(request)) {
      std::unique_ptr<PayloadRecv> owned(op);
      owned->done(request == nullptr
                      ? Status::OK()
                      : FromUcs(UCS_PTR_STATUS(request), "receiving a request payload"));
    }
  }

  // Asks the client for a held payload: copied by the client straight into dest when dest is in
  // memory it can map, else sent as a kPayload frame. `done` runs on kPullDone / the data, or
  // when the connection closes.
  void Pull(const std::shared_ptr<UcxCall>& state, MutableBytes dest, const MemoryRegion* region,
            std::function<void(Status)> done) {
    state->payload_consumed = true;
    ServerConnection& connection = *state->connection;
    MappedRef ref;
    ref.length = dest.size();
    std::span<const std::byte> rkey;
    const bool shared =
        region != nullptr && !region->packed_rkey().empty() && region->Contains(dest);
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

  // Names `bytes` of a shared region in ref, with the region's rkey the first time this
  // connection hears of it.
  void FillRef(ServerConnection& connection, const MemoryRegion& region, Bytes bytes,
               MappedRef* ref, std::span<const std::byte>* rkey) {
    ref->region_id = region.id();
    ref->region_address = reinterpret_cast<uintptr_t>(region.data());
    ref->region_size = region.size();
    ref->address = reinterpret_cast<uintptr_t>(bytes.data());
    ref->length = bytes.size();
    if (connection.rkeys_sent.insert(region.id()).second) {
      *rkey = std::as_bytes(std::span(region.packed_rkey()));
    }
  }

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

  // One period of RunEvery: runs the task when the timer fires, then sets it again, until the
  // worker stops (its io_context then drops the pending wait).
  void Tick(std::shared_ptr<asio::steady_timer> timer, std::chrono::milliseconds period,
            std::shared_ptr<std::function<void()>> task) {
    timer->expires_after(period);
    timer->async_wait([this, timer, period, task](const asio::error_code& error) {
      if (error || worker_->stopping()) return;
      (*task)();
      Tick(timer, period, task);
    });
  }

  // The handle was dropped: reply Internal if the handler never did, release the payload.
  void Drop(std::shared_ptr<UcxCall> state) {
    worker_->Run([this, state = std::move(state)] {
      if (!state->in_am_callback) {
        state->ReleasePayload();
        Forget(*state);
      }
      if (!state->replied.exchange(true)) {
        ReplyStatus(state, InternalError("handler of method {} dropped the call without a reply",
                                         state->method_id));
      }
    });
  }

 private:
  void SendReply(std::unique_ptr<ReplySend> send, Bytes payload, const MemoryRegion* region) {
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
            worker_->max_am_header()) {
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

  // The payload stays in the server's shared memory; the client copies it out and sends kAck,
  // which runs `sent` (until then the payload must not change).
  void SendMappedReply(std::unique_ptr<ReplySend> send, Bytes payload, const MemoryRegion& region) {
    const std::shared_ptr<ServerConnection>& connection = send->state->connection;
    FrameHeader header;
    std::memcpy(&header, send->header.data(), kFrameHeaderBytes);
    MappedRef ref;
    std::span<const std::byte> rkey;
    FillRef(*connection, region, payload, &ref, &rkey);
    const uint64_t id = send->state->request_id;
    auto sent = std::move(send->sent);
    connection->acks[id] = sent ? std::move(sent) : [](Status) {};
    SendControl(connection, WriteFrameWithRef(
                                header, Bytes(send->header).subspan(kFrameHeaderBytes), ref, rkey));
  }

  // A control frame from the client about a pull or a mapped reply.
  void OnControl(const std::shared_ptr<ServerConnection>& connection, const FrameView& frame,
                 void* data, size_t length, bool rndv) {
    const FrameHeader& h = frame.header;
    if (h.kind == FrameKind::kAck) {
      auto it = connection->acks.find(h.request_id);
      if (it == connection->acks.end()) return;
      auto sent = std::move(it->second);
      connection->acks.erase(it);
      mapped_.fetch_add(1, std::memory_order_relaxed);
      sent(Status::OK());
      return;
    }
    auto it = connection->pulls.find(h.request_id);
    if (it == connection->pulls.end() || (h.kind == FrameKind::kPayload) != it->second.as_data) {
      if (rndv) worker_->DiscardRendezvous(data, length);
      KVSTASH_LOG_WARN("connection {}: unexpected frame kind {} for call {}", connection->id,
                       static_cast<int>(h.kind), h.request_id);
      return;
    }
    PendingPull pull = std::move(it->second);
    connection->pulls.erase(it);
    if (h.kind == FrameKind::kPullDone) {
      if (h.status == 0) mapped_.fetch_add(1, std::memory_order_relaxed);
      pull.done(h.status == 0 ? Status::OK()
                              : Status(static_cast<StatusCode>(h.status),
                                       fmt::format("the client did not deliver the payload of "
                                                   "call {}",
                                                   h.request_id)));
      return;
    }
    if (length != pull.dest.size()) {
      if (rndv) worker_->DiscardRendezvous(data, length);
      pull.done(InvalidArgumentError("client sent {} payload bytes for call {}, announced {}",
                                     length, h.request_id, pull.dest.size()));
      return;
    }
    if (!rndv) {
      std::memcpy(pull.dest.data(), data, length);
      pull.done(Status::OK());
      return;
    }
    ReceiveData(pull.state, data, pull.dest, pull.region, std::move(pull.done));
  }

  // ---- connections -------------------------------------------------------------------------

  void Accept() {
    acceptor_.async_accept([this](const asio::error_code& error, asio::ip::tcp::socket socket) {
      if (error) {
        if (error != asio::error::operation_aborted) {
          KVSTASH_LOG_WARN("accept: {}", error.message());
          Accept();
        }
        return;
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

  // The hello's token against the namespace's own token, else the node's.
  Status CheckToken(const wire::Hello& hello) const {
    return CheckHelloToken(options_, hello.namespace_(), hello.auth_token());
  }

  void OnHello(const std::shared_ptr<ServerConnection>& connection, Status status,
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
      refused = InvalidArgumentError("unparseable hello of {} bytes", body.size());
    } else if (hello.protocol_version() != wire::PROTOCOL_VERSION_CURRENT) {
      refused = FailedPreconditionError("protocol version {} is not the node's {}",
                                        hello.protocol_version(),
                                        static_cast<int>(wire::PROTOCOL_VERSION_CURRENT));
    } else {
      refused = CheckToken(hello);
      if (!refused.ok()) refusals_.fetch_add(1, std::memory_order_relaxed);
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
      // where it connected from. Never the token it sent.
      KVSTASH_LOG_WARN("refused a client: {} (client {:?}, namespace {:?}, from {})",
                       refused.ToString(), Printable(hello.client_name()),
                       Printable(hello.namespace_()), PeerOf(connection->socket));
      reply.mutable_error()->set_code(ToWire(refused.code()));
      reply.mutable_error()->set_message(std::string(refused.message()));
      AsyncWriteMessage(connection->socket, reply, [connection](Status) {
        asio::error_code ignored;
        connection->socket.close(ignored);
      });
      return;
    }
    connection->ep = UcpEndpoint(ep);
    connection->id = epoch_ | ++next_connection_;
    connection->key_namespace = hello.namespace_();
    connection->client_name = hello.client_name();
    connections_[connection->id] = connection;
    endpoints_[ep] = connection->id;
    connects_.fetch_add(1, std::memory_order_relaxed);
    open_connections_.fetch_add(1, std::memory_order_relaxed);
    reply.set_connection_id(connection->id);
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

  void Watch(const std::shared_ptr<ServerConnection>& connection) {
    connection->socket.async_read_some(
        asio::buffer(connection->watch_byte, 1),
        [this, connection](const asio::error_code& error, size_t) {
          Close(connection, UnavailableError("client {} ({}) went away: {}", connection->id,
                                             connection->client_name,
                                             error ? error.message() : "unexpected bytes"));
        });
  }

  static void OnEndpointError(void* arg, ucp_ep_h ep, ucs_status_t status) {
    auto* self = static_cast<Impl*>(arg);
    auto it = self->endpoints_.find(ep);
    if (it == self->endpoints_.end()) return;
    auto connection = self->connections_.find(it->second);
    if (connection == self->connections_.end()) return;
    self->Close(connection->second, FromUcs(status, "UCX endpoint to a client failed"));
  }

  void Close(std::shared_ptr<ServerConnection> connection, const Status& why) {
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
    if (connection->ep) {
      endpoints_.erase(connection->ep.get());
      auto ep = std::make_shared<UcpEndpoint>(std::move(connection->ep));
      auto close = [this, ep] { worker_->WaitRequest(ep->Close(/*force=*/true)); };
      if (worker_->stopping()) {
        close();
      } else {
        asio::post(worker_->io(), close);
      }
    }
  }

  void Shutdown() {
    asio::error_code ignored;
    acceptor_.close(ignored);
    auto all = connections_;
    for (auto& [id, connection] : all) Close(connection, CancelledError("server stopping"));
  }

  // ---- frames ------------------------------------------------------------------------------

  static ucs_status_t OnFrame(void* arg, const void* header, size_t header_length, void* data,
                              size_t length, const ucp_am_recv_param_t* param) {
    return static_cast<Impl*>(arg)->Dispatch(
        Bytes(static_cast<const std::byte*>(header), header_length), data, length,
        (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0);
  }

  ucs_status_t Dispatch(Bytes header, void* data, size_t length, bool rndv) {
    // An unwanted rendezvous payload is drained; one beyond the payload limit closes the
    // connection it came on (which releases it).
    auto release = [&] {
      if (!rndv || worker_->DiscardRendezvous(data, length)) return;
      if (header.size() < kFrameHeaderBytes) return;
      FrameHeader h;
      std::memcpy(&h, header.data(), kFrameHeaderBytes);
      auto it = connections_.find(h.connection_id);
      if (it != connections_.end()) {
        Close(it->second, ResourceExhaustedError("payload of {} bytes beyond the limit of {}",
                                                 length, worker_->options().max_payload_bytes));
      }
    };
    const Bytes eager = rndv ? Bytes{} : Bytes(static_cast<const std::byte*>(data), length);
    auto frame = ParseFrame(header, eager, length, !rndv, worker_->options().max_message_bytes);
    if (!frame.ok()) {
      malformed_.fetch_add(1, std::memory_order_relaxed);
      release();
      // The error goes back when the frame names a live connection and a request.
      if (header.size() >= kFrameHeaderBytes) {
        FrameHeader h;
        std::memcpy(&h, header.data(), kFrameHeaderBytes);
        auto it = connections_.find(h.connection_id);
        if (h.magic == kFrameMagic && h.kind == FrameKind::kRequest && it != connections_.end()) {
          auto state = NewState(it->second, h);
          state->replied = true;
          ReplyStatus(state, frame.status());
        }
      }
      KVSTASH_LOG_WARN("malformed frame: {}", frame.status().ToString());
      return UCS_OK;
    }
    const FrameHeader& h = frame->header;
    auto it = connections_.find(h.connection_id);
    if (it == connections_.end()) {
      malformed_.fetch_add(1, std::memory_order_relaxed);
      release();
      KVSTASH_LOG_WARN("frame for unknown connection {:#x}", h.connection_id);
      return UCS_OK;
    }
    const std::shared_ptr<ServerConnection>& connection = it->second;
    if (h.kind == FrameKind::kCancel) {
      auto call = active_.find({h.connection_id, h.request_id});
      if (call != active_.end()) {
        if (auto state = call->second.lock()) state->cancel_flag = true;
      }
      return UCS_OK;
    }
    if (h.kind == FrameKind::kAck || h.kind == FrameKind::kPullDone ||
        h.kind == FrameKind::kPayload) {
      OnControl(connection, *frame, data, length, rndv);
      return UCS_OK;
    }
    if (h.kind != FrameKind::kRequest) {
      malformed_.fetch_add(1, std::memory_order_relaxed);
      release();
      return UCS_OK;
    }
    auto state = NewState(connection, h);
    if (frame->payload_bytes > worker_->options().max_payload_bytes) {
      release();
      state->replied = true;
      ReplyStatus(state, ResourceExhaustedError("payload of {} bytes exceeds the limit of {}",
                                                frame->payload_bytes,
                                                worker_->options().max_payload_bytes));
      return UCS_OK;
    }
    auto handler = handlers_.find(h.method);
    if (handler == handlers_.end()) {
      release();
      state->replied = true;
      ReplyStatus(state, UnimplementedError("no handler for method {}", h.method));
      return UCS_OK;
    }
    calls_.fetch_add(1, std::memory_order_relaxed);
    state->request_bytes.assign(frame->message.begin(), frame->message.end());
    state->payload_size = frame->payload_bytes;
    state->payload_data = data;
    state->payload_rndv = rndv;
    state->payload_held = frame->has_ref;
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
    if (!rndv && !state->payload_held) {
      state->payload_persistent = true;
      return UCS_INPROGRESS;
    }
    return UCS_OK;
  }

  std::shared_ptr<UcxCall> NewState(const std::shared_ptr<ServerConnection>& connection,
                                    const FrameHeader& h) {
    auto state = std::make_shared<UcxCall>();
    state->server = shared_from_this();
    state->worker = worker_;
    state->connection = connection;
    state->method_id = h.method;
    state->request_id = h.request_id;
    state->accepts_mapped = (h.flags & kAcceptsMapped) != 0;
    state->deadline_at = h.timeout_us == 0 ? Clock::time_point::max()
                                           : Clock::now() + std::chrono::microseconds(h.timeout_us);
    return state;
  }

 public:
  void Forget(const UcxCall& state) { active_.erase({state.connection->id, state.request_id}); }

 private:
  struct PairHash {
    size_t operator()(const std::pair<uint64_t, uint64_t>& p) const {
      return std::hash<uint64_t>()(p.first * 0x9e3779b97f4a7c15ULL ^ p.second);
    }
  };

  ServerOptions options_;
  std::shared_ptr<Worker> worker_;
  asio::ip::tcp::acceptor acceptor_;
  uint16_t port_ = 0;
  uint64_t epoch_ = 0;
  uint64_t next_connection_ = 0;
  MemoryRegion probe_;
  uint64_t cookie_ = 0;
  std::unordered_map<uint16_t, Handler> handlers_;
  std::function<void(uint64_t)> on_disconnect_;
  std::unordered_map<uint64_t, std::shared_ptr<ServerConnection>> connections_;
  std::unordered_map<ucp_ep_h, uint64_t> endpoints_;
  std::unordered_map<std::pair<uint64_t, uint64_t>, std::weak_ptr<UcxCall>, PairHash> active_;
  std::atomic<uint64_t> calls_{0}, connects_{0}, disconnects_{0}, malformed_{0}, mapped_{0},
      refusals_{0};
  std::atomic<size_t> open_connections_{0};
};

// ---- UcxCall ---------------------------------------------------------------------------------

uint64_t UcxCall::connection_id() const { return connection->id; }
const std::string& UcxCall::key_namespace() const { return connection->key_namespace; }

void UcxCall::ReceivePayload(MutableBytes dest, const MemoryRegion* region,
                             std::function<void(Status)> done) {
  server->ReceivePayload(shared_from_this(), dest, region, std::move(done));
}

void UcxCall::Reply(Bytes message, Bytes payload, const MemoryRegion* region,
                    std::function<void(Status)> sent) {
  if (replied.exchange(true)) {
    if (sent) sent(FailedPreconditionError("call {} already replied", request_id));
    return;
  }
  server->Reply(shared_from_this(), StatusCode::kOk, message, payload, region, std::move(sent));
}

void UcxCall::ReplyError(const Status& status) {
  if (replied.exchange(true)) return;
  server->ReplyStatus(shared_from_this(),
                      status.ok() ? InternalError("ReplyError with OK") : status);
}

void UcxCall::Drop() { server->Drop(shared_from_this()); }

// ---- RpcServer -------------------------------------------------------------------------------

Result<std::unique_ptr<RpcServer>> RpcServer::Create(ServerOptions options) {
  KVSTASH_ASSIGN_OR_RETURN(auto worker, Worker::Create(options.transport, "kvstash-server"));
  auto impl = std::make_shared<Impl>(std::move(options), std::move(worker));
  return std::unique_ptr<RpcServer>(new RpcServer(std::move(impl)));
}

RpcServer::RpcServer(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}

RpcServer::~RpcServer() {
  if (impl_) impl_->Stop();
}

void RpcServer::Handle(uint16_t method, Handler handler) {
  impl_->Handle(method, std::move(handler));
}

void RpcServer::OnDisconnect(std::function<void(uint64_t connection_id)> fn) {
  impl_->OnDisconnect(std::move(fn));
}

Status RpcServer::Start() { return impl_->Start(); }
void RpcServer::Stop() { impl_->Stop(); }
uint16_t RpcServer::port() const { return impl_->port(); }

Result<MemoryRegion> RpcServer::RegisterMemory(MutableBytes memory) {
  return impl_->worker()->Register(memory);
}

Result<MemoryRegion> RpcServer::AllocateMemory(size_t bytes) {
  return impl_->worker()->Allocate(bytes);
}

bool RpcServer::OnProgressThread() const { return impl_->worker()->OnThread(); }

void RpcServer::RunOnProgressThread(std::function<void()> fn) {
  impl_->worker()->Run(std::move(fn));
}

void RpcServer::RunEvery(std::chrono::milliseconds period, std::function<void()> fn) {
  impl_->RunEvery(period, std::move(fn));
}

TransportStats RpcServer::stats() const { return impl_->stats(); }
size_t RpcServer::connection_count() const { return impl_->connection_count(); }

}  // namespace kvstash::transport
