// The loopback transport: see loopback.h. Everything below the public entry points runs on the
// network's one thread (the executor), so the state it touches needs no lock; what other
// threads read (limits, counters, the current connection) is atomic or under a Mutex.

#include "kvstash/transport/loopback.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <future>
#include <map>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "executor.h"
#include "kvstash/common/mutex.h"
#include "kvstash/transport/admission.h"

namespace kvstash::transport {

class LoopbackCall;

namespace {

struct ServerState {
  ServerOptions options;
  std::unordered_map<uint16_t, Handler> handlers;  // set before Start
  std::function<void(uint64_t)> on_disconnect;
  // Executor thread only.
  uint16_t port = 0;
  bool serving = false;
  std::unordered_set<uint64_t> connections;
  // Read anywhere.
  std::atomic<uint64_t> calls{0}, connects{0}, disconnects{0};
  std::atomic<size_t> open{0};
};

struct ClientState;

struct Connection {
  uint64_t id = 0;
  std::shared_ptr<ServerState> server;
  std::weak_ptr<ClientState> client;
  std::string tenant;
  bool open = true;
};

struct PendingCall {
  std::shared_ptr<Connection> connection;
  ResponseCallback done;
  MutableBytes recv;
  std::shared_ptr<LoopbackCall> state;
};

struct ClientState {
  ClientOptions options;
  // Executor thread only.
  std::shared_ptr<Connection> connection;
  std::unordered_map<uint64_t, PendingCall> pending;
  // Read anywhere.
  std::atomic<uint64_t> next_id{1};
  std::atomic<uint64_t> connection_id{0};
  std::atomic<bool> cut_after_next{false};  // CutAfterNextRequest
  Mutex limits_mu;
  std::optional<ServerLimits> limits GUARDED_BY(limits_mu);
};

}  // namespace

class LoopbackNetwork::Impl {
 public:
  Executor& executor() { return executor_; }

  // ---- servers (executor thread) ----------------------------------------------------------

  Status StartServer(const std::shared_ptr<ServerState>& server) {
    if (server->serving) return FailedPreconditionError("loopback server already started");
    uint16_t port = server->options.port;
    if (port == 0 || servers_.count(port) != 0) {
      while (servers_.count(next_port_) != 0) ++next_port_;
      port = next_port_++;
    }
    server->port = port;
    server->serving = true;
    servers_[port] = server;
    return Status::OK();
  }

  void StopServer(const std::shared_ptr<ServerState>& server) {
    if (!server->serving) return;
    server->serving = false;
    servers_.erase(server->port);
    const std::vector<uint64_t> ids(server->connections.begin(), server->connections.end());
    for (uint64_t id : ids) Disconnect(id, UnavailableError("the server stopped"));
  }

  // ---- connections (executor thread) ------------------------------------------------------

  Status EnsureConnected(const std::shared_ptr<ClientState>& client) {
    if (client->connection && client->connection->open) return Status::OK();
    const uint16_t port = client->options.port;
    auto it = servers_.find(port);
    if (it == servers_.end()) {
      return UnavailableError("connecting to loopback port {}: no server listens there", port);
    }
    const std::shared_ptr<ServerState>& server = it->second;
    const Status hello =
        CheckHello(server->options, client->options.tenant, client->options.auth_token);
    if (!hello.ok()) {
      return Status(hello.code(), fmt::format("loopback port {} refused the connection: {}", port,
                                              hello.message()));
    }
    auto connection = std::make_shared<Connection>();
    connection->id = next_connection_++;
    connection->server = server;
    connection->client = client;
    connection->tenant = client->options.tenant;
    connections_[connection->id] = connection;
    server->connections.insert(connection->id);
    server->connects.fetch_add(1, std::memory_order_relaxed);
    server->open.fetch_add(1, std::memory_order_relaxed);
    client->connection = connection;
    client->connection_id = connection->id;
    const TransportOptions& own = client->options.transport;
    const TransportOptions& theirs = server->options.transport;
    ServerLimits limits;
    limits.service_limits = server->options.service_limits;
    limits.max_message_bytes = std::min(own.max_message_bytes, theirs.max_message_bytes);
    limits.max_payload_bytes = std::min(own.max_payload_bytes, theirs.max_payload_bytes);
    MutexLock lock(&client->limits_mu);
    client->limits = limits;
    return Status::OK();
  }

  void Disconnect(uint64_t id, const Status& why) {
    auto it = connections_.find(id);
    if (it == connections_.end()) return;
    std::shared_ptr<Connection> connection = it->second.lock();
    connections_.erase(it);
    if (!connection || !connection->open) return;
    connection->open = false;
    ServerState& server = *connection->server;
    server.connections.erase(id);
    server.open.fetch_sub(1, std::memory_order_relaxed);
    server.disconnects.fetch_add(1, std::memory_order_relaxed);
    if (std::shared_ptr<ClientState> client = connection->client.lock()) {
      std::vector<uint64_t> lost;
      for (const auto& [call, pending] : client->pending) {
        if (pending.connection == connection) lost.push_back(call);
      }
      for (uint64_t call : lost) {
        Complete(*client, call,
                 Status(why.code(), fmt::format("connection {} lost: {}", id, why.message())));
      }
      if (client->connection == connection) {
        client->connection.reset();
        client->connection_id = 0;
      }
    }
    if (server.on_disconnect) server.on_disconnect(id);
  }

  // ---- calls (executor thread) ------------------------------------------------------------

  // `self` is this Impl's own handle, for the calls it creates.
  void Dispatch(const std::weak_ptr<Impl>& self, const std::shared_ptr<ClientState>& client,
                uint64_t id, uint16_t method, std::vector<std::byte> request,
                const CallOptions& options, ResponseCallback done);

  // Completes call `id` of `client` once: the reply's payload copied into the call's buffer.
  // False when it already completed (a late reply).
  bool Complete(ClientState& client, uint64_t id, Status status, Bytes message = {},
                Bytes payload = {}) {
    auto it = client.pending.find(id);
    if (it == client.pending.end()) return false;
    PendingCall call = std::move(it->second);
    client.pending.erase(it);
    size_t copied = 0;
    if (status.ok() && !payload.empty()) {
      if (payload.size() > call.recv.size()) {
        status = OutOfRangeError("reply payload of {} bytes exceeds the receive buffer of {} bytes",
                                 payload.size(), call.recv.size());
      } else {
        std::memcpy(call.recv.data(), payload.data(), payload.size());
        copied = payload.size();
      }
    }
    Response response;
    response.status = std::move(status);
    if (response.status.ok()) response.message = message;
    response.payload_bytes = copied;
    call.done(response);
    return true;
  }

  bool Pending(const ClientState& client, uint64_t id) const {
    return client.pending.count(id) != 0;
  }

  void CloseClient(const std::shared_ptr<ClientState>& client) {
    std::vector<uint64_t> ids;
    for (const auto& [id, call] : client->pending) ids.push_back(id);
    for (uint64_t id : ids) Complete(*client, id, CancelledError("the client closed"));
    if (client->connection) Disconnect(client->connection->id, CancelledError("the client closed"));
  }

 private:
  std::map<uint16_t, std::shared_ptr<ServerState>> servers_;
  std::unordered_map<uint64_t, std::weak_ptr<Connection>> connections_;
  uint64_t next_connection_ = 1;
  uint16_t next_port_ = 1;
  // Last: destroyed first, running what is queued while the state above still exists. Tasks
  // refer to this Impl by plain pointer: it outlives its executor.
  Executor executor_;
};

namespace {

// Runs `fn` on the executor and waits for it; inline on the executor itself.
void RunAndWait(Executor& executor, const std::function<void()>& fn) {
  if (executor.OnThread()) {
    fn();
    return;
  }
  std::promise<void> done;
  executor.Run([&] {
    fn();
    done.set_value();
  });
  done.get_future().wait();
}

}  // namespace

// One call on a loopback server, as its handler sees it.
class LoopbackCall : public ServerCallState, public std::enable_shared_from_this<LoopbackCall> {
 public:
  LoopbackCall(std::weak_ptr<LoopbackNetwork::Impl> network, std::shared_ptr<ClientState> client,
               std::shared_ptr<Connection> connection, uint64_t id, uint16_t method,
               std::vector<std::byte> request, Bytes payload, Clock::time_point deadline)
      : network_(std::move(network)),
        client_(std::move(client)),
        connection_(std::move(connection)),
        id_(id),
        method_(method),
        request_(std::move(request)),
        payload_(payload),
        deadline_(deadline) {}

  uint16_t method() const override { return method_; }
  uint64_t connection_id() const override { return connection_->id; }
  const std::string& tenant() const override { return connection_->tenant; }
  Bytes request() const override { return request_; }
  size_t payload_bytes() const override { return payload_.size(); }
  Clock::time_point deadline() const override { return deadline_; }
  bool cancelled() const override { return cancelled_.load() || Clock::now() >= deadline_; }
  void Cancel() { cancelled_ = true; }

  void ReceivePayload(MutableBytes dest, const MemoryRegion*,
                      std::function<void(Status)> done) override {
    std::shared_ptr<LoopbackNetwork::Impl> network = network_.lock();
    if (!network) {
      done(UnavailableError("the loopback network is gone"));
      return;
    }
    auto self = shared_from_this();
    LoopbackNetwork::Impl* impl = network.get();
    impl->executor().Run([self, impl, dest, done = std::move(done)] {
      if (self->payload_consumed_) {
        done(FailedPreconditionError("payload of call {} already received", self->id_));
        return;
      }
      self->payload_consumed_ = true;
      if (self->payload_.empty()) {
        done(Status::OK());
        return;
      }
      if (dest.size() < self->payload_.size()) {
        done(InvalidArgumentError("payload of {} bytes does not fit a {}-byte buffer",
                                  self->payload_.size(), dest.size()));
        return;
      }
      // The client's buffer is only valid while the call is pending.
      if (!self->connection_->open || !impl->Pending(*self->client_, self->id_)) {
        done(UnavailableError("connection {} closed before its payload arrived",
                              self->connection_->id));
        return;
      }
      std::memcpy(dest.data(), self->payload_.data(), self->payload_.size());
      done(Status::OK());
    });
  }

  void Reply(Bytes message, Bytes payload, const MemoryRegion*,
             std::function<void(Status)> sent) override {
    if (replied_.exchange(true)) {
      if (sent) sent(FailedPreconditionError("call {} already replied", id_));
      return;
    }
    std::shared_ptr<LoopbackNetwork::Impl> network = network_.lock();
    if (!network) {
      if (sent) sent(UnavailableError("the loopback network is gone"));
      return;
    }
    auto self = shared_from_this();
    LoopbackNetwork::Impl* impl = network.get();
    impl->executor().Run([self, impl,
                          bytes = std::vector<std::byte>(message.begin(), message.end()), payload,
                          sent = std::move(sent)] {
      const bool delivered =
          impl->Complete(*self->client_, self->id_, Status::OK(), bytes, payload);
      if (sent) {
        sent(delivered ? Status::OK()
                       : CancelledError("call {} completed before its reply", self->id_));
      }
    });
  }

  void ReplyError(const Status& status) override {
    if (replied_.exchange(true)) return;
    Finish(status.ok() ? InternalError("ReplyError with OK") : status);
  }

  void Drop() override {
    if (replied_.exchange(true)) return;
    Finish(InternalError("handler of method {} dropped the call without a reply", method_));
  }

 private:
  void Finish(const Status& error) {
    std::shared_ptr<LoopbackNetwork::Impl> network = network_.lock();
    if (!network) return;
    auto self = shared_from_this();
    LoopbackNetwork::Impl* impl = network.get();
    impl->executor().Run([self, impl, error] { impl->Complete(*self->client_, self->id_, error); });
  }

  // A handler may hold its call past the network: then replies go nowhere.
  const std::weak_ptr<LoopbackNetwork::Impl> network_;
  const std::shared_ptr<ClientState> client_;
  const std::shared_ptr<Connection> connection_;
  const uint64_t id_;
  const uint16_t method_;
  const std::vector<std::byte> request_;
  const Bytes payload_;  // the client's buffer, valid while the call is pending
  const Clock::time_point deadline_;
  std::atomic<bool> replied_{false};
  std::atomic<bool> cancelled_{false};
  bool payload_consumed_ = false;  // executor thread only
};

void LoopbackNetwork::Impl::Dispatch(const std::weak_ptr<Impl>& self,
                                     const std::shared_ptr<ClientState>& client, uint64_t id,
                                     uint16_t method, std::vector<std::byte> request,
                                     const CallOptions& options, ResponseCallback done) {
  auto fail = [&](const Status& status) {
    Response response;
    response.status = status;
    done(response);
  };
  if (Status connected = EnsureConnected(client); !connected.ok()) {
    fail(connected);
    return;
  }
  const std::shared_ptr<Connection> connection = client->connection;
  ServerState& server = *connection->server;
  const TransportOptions& own = client->options.transport;
  if (request.size() > own.max_message_bytes) {
    fail(ResourceExhaustedError("request message of {} bytes exceeds the limit of {}",
                                request.size(), own.max_message_bytes));
    return;
  }
  if (options.send_payload.size() > own.max_payload_bytes) {
    fail(ResourceExhaustedError("request payload of {} bytes exceeds the limit of {}",
                                options.send_payload.size(), own.max_payload_bytes));
    return;
  }
  const TransportOptions& theirs = server.options.transport;
  if (request.size() > theirs.max_message_bytes ||
      options.send_payload.size() > theirs.max_payload_bytes) {
    fail(
        InvalidArgumentError("request of {} message and {} payload bytes exceeds the server's "
                             "limits of {} and {}",
                             request.size(), options.send_payload.size(), theirs.max_message_bytes,
                             theirs.max_payload_bytes));
    return;
  }
  auto state =
      std::make_shared<LoopbackCall>(self, client, connection, id, method, std::move(request),
                                     options.send_payload, options.deadline);
  client->pending.emplace(id,
                          PendingCall{connection, std::move(done), options.recv_payload, state});
  if (options.deadline != Clock::time_point::max()) {
    std::weak_ptr<ClientState> weak = client;
    executor_.RunAt(options.deadline, [this, weak, id, state] {
      std::shared_ptr<ClientState> c = weak.lock();
      if (!c) return;
      if (Complete(*c, id, DeadlineExceededError("call {} passed its deadline", id))) {
        state->Cancel();
      }
    });
  }
  server.calls.fetch_add(1, std::memory_order_relaxed);
  auto handler = server.handlers.find(method);
  if (handler == server.handlers.end()) {
    state->ReplyError(UnimplementedError("no handler for method {}", method));
  } else {
    handler->second(ServerCall(state));
  }
  if (client->cut_after_next.exchange(false)) {
    Disconnect(connection->id, UnavailableError("the connection was cut after a request"));
  }
}

namespace {

class LoopbackListener : public Listener {
 public:
  LoopbackListener(std::shared_ptr<LoopbackNetwork::Impl> network, ServerOptions options)
      : network_(std::move(network)), server_(std::make_shared<ServerState>()) {
    server_->options = std::move(options);
  }
  ~LoopbackListener() override { Stop(); }

  void Handle(uint16_t method, Handler handler) override {
    server_->handlers[method] = std::move(handler);
  }
  void OnDisconnect(std::function<void(uint64_t)> fn) override {
    server_->on_disconnect = std::move(fn);
  }
  Status Start() override {
    Status started;
    RunAndWait(network_->executor(), [&] { started = network_->StartServer(server_); });
    if (started.ok()) {
      port_ = server_->port;
      started_ = true;
    }
    return started;
  }
  void Stop() override {
    if (!started_.exchange(false)) return;
    RunAndWait(network_->executor(), [&] { network_->StopServer(server_); });
  }
  uint16_t port() const override { return port_; }
  Result<MemoryRegion> AllocateMemory(size_t bytes) override {
    return UnimplementedError("the loopback transport shares no memory ({} bytes asked)", bytes);
  }
  void RunOnProgressThread(std::function<void()> fn) override {
    network_->executor().Run(std::move(fn));
  }
  void RunEvery(std::chrono::milliseconds period, std::function<void()> fn) override {
    Schedule(network_.get(), server_, period,
             std::make_shared<std::function<void()>>(std::move(fn)));
  }
  TransportStats stats() const override {
    TransportStats s;
    s.calls = server_->calls.load();
    s.connects = server_->connects.load();
    s.disconnects = server_->disconnects.load();
    return s;
  }
  size_t connection_count() const override { return server_->open.load(); }

 private:
  // One period of RunEvery, until the server stops.
  static void Schedule(LoopbackNetwork::Impl* network, std::weak_ptr<ServerState> weak,
                       std::chrono::milliseconds period,
                       std::shared_ptr<std::function<void()>> task) {
    network->executor().RunAt(Clock::now() + period, [network, weak, period, task] {
      std::shared_ptr<ServerState> server = weak.lock();
      if (!server || !server->serving) return;
      (*task)();
      Schedule(network, weak, period, task);
    });
  }

  std::shared_ptr<LoopbackNetwork::Impl> network_;
  std::shared_ptr<ServerState> server_;
  std::atomic<bool> started_{false};
  uint16_t port_ = 0;
};

class LoopbackChannel : public Channel {
 public:
  LoopbackChannel(std::shared_ptr<LoopbackNetwork::Impl> network, ClientOptions options)
      : network_(std::move(network)), client_(std::make_shared<ClientState>()) {
    client_->options = std::move(options);
  }
  ~LoopbackChannel() override {
    LoopbackNetwork::Impl* network = network_.get();
    RunAndWait(network->executor(), [&] { network->CloseClient(client_); });
  }

  uint64_t Call(uint16_t method, Bytes request, const CallOptions& options,
                ResponseCallback done) override {
    const uint64_t id = client_->next_id.fetch_add(1);
    std::weak_ptr<LoopbackNetwork::Impl> weak = network_;
    LoopbackNetwork::Impl* network = network_.get();
    network->executor().Run([network, weak, client = client_, id, method,
                             bytes = std::vector<std::byte>(request.begin(), request.end()),
                             options, done = std::move(done)]() mutable {
      network->Dispatch(weak, client, id, method, std::move(bytes), options, std::move(done));
    });
    return id;
  }
  void Cancel(uint64_t id) override {
    LoopbackNetwork::Impl* network = network_.get();
    network->executor().Run([network, client = client_, id] {
      network->Complete(*client, id, CancelledError("call {} cancelled", id));
    });
  }
  void ConnectAsync(std::function<void(const Status&)> done) override {
    LoopbackNetwork::Impl* network = network_.get();
    network->executor().Run([network, client = client_, done = std::move(done)] {
      done(network->EnsureConnected(client));
    });
  }
  void Reset(const Status& why) override {
    LoopbackNetwork::Impl* network = network_.get();
    network->executor().Run([network, client = client_, why] {
      const uint64_t id = client->connection_id.load();
      if (id != 0) {
        network->Disconnect(id, Status(StatusCode::kUnavailable, std::string(why.message())));
      }
    });
  }
  std::optional<ServerLimits> server_limits() const override {
    MutexLock lock(&client_->limits_mu);
    return client_->limits;
  }
  uint64_t connection_id() const { return client_->connection_id.load(); }
  void CutAfterNextRequest() { client_->cut_after_next = true; }

 private:
  std::shared_ptr<LoopbackNetwork::Impl> network_;
  std::shared_ptr<ClientState> client_;
};

}  // namespace

// ---- LoopbackNetwork ---------------------------------------------------------------------------

std::shared_ptr<LoopbackNetwork> LoopbackNetwork::Create() {
  return std::shared_ptr<LoopbackNetwork>(new LoopbackNetwork());
}

LoopbackNetwork::LoopbackNetwork() : impl_(std::make_shared<Impl>()) {}
LoopbackNetwork::~LoopbackNetwork() = default;

std::unique_ptr<Listener> LoopbackNetwork::Listen(ServerOptions options) {
  return std::make_unique<LoopbackListener>(impl_, std::move(options));
}

std::unique_ptr<Channel> LoopbackNetwork::Connect(ClientOptions options) {
  return std::make_unique<LoopbackChannel>(impl_, std::move(options));
}

void LoopbackNetwork::Disconnect(uint64_t connection_id) {
  Impl* impl = impl_.get();
  impl->executor().Run([impl, connection_id] {
    impl->Disconnect(connection_id, UnavailableError("the connection was cut"));
  });
}

void LoopbackNetwork::CutAfterNextRequest(Channel& channel) {
  if (auto* loopback = dynamic_cast<LoopbackChannel*>(&channel)) loopback->CutAfterNextRequest();
}

uint64_t LoopbackNetwork::ConnectionOf(const Channel& channel) {
  const auto* loopback = dynamic_cast<const LoopbackChannel*>(&channel);
  return loopback != nullptr ? loopback->connection_id() : 0;
}

void LoopbackNetwork::Run(std::function<void()> fn) { impl_->executor().Run(std::move(fn)); }

void LoopbackNetwork::RunAfter(std::chrono::nanoseconds delay, std::function<void()> fn) {
  impl_->executor().RunAt(Clock::now() + delay, std::move(fn));
}

void LoopbackNetwork::Flush() {
  RunAndWait(impl_->executor(), [] {});
}

bool LoopbackNetwork::OnThread() const { return impl_->executor().OnThread(); }

}  // namespace kvstash::transport
