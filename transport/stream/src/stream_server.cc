// StreamServer (stream.h): its threads, the listening socket and the hello; the connections
// after it are stream_server_calls.cc's.

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <future>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "bootstrap.h"
#include "kvstash/common/logging.h"
#include "kvstash/proto/wire.pb.h"
#include "kvstash/transport/admission.h"
#include "kvstash/transport/stream.h"
#include "stream_server_impl.h"

namespace kvstash::transport {

using stream::ServerShared;
using stream::StreamConnection;

// Owns the io_contexts and their threads, the acceptor and the timers. Held by shared_ptr: the
// accept and hello handlers hold it.
class StreamServer::Impl : public std::enable_shared_from_this<StreamServer::Impl> {
 public:
  explicit Impl(ServerOptions options) : shared_(std::make_shared<ServerShared>()) {
    shared_->options = std::move(options);
    size_t threads = shared_->options.transport.progress_threads;
    if (threads == 0) threads = std::clamp<size_t>(std::thread::hardware_concurrency(), 1, 4);
    threads = std::min(threads, kMaxProgressThreads);
    for (size_t i = 0; i < threads; ++i) ios_.push_back(std::make_unique<asio::io_context>(1));
    acceptor_.emplace(*ios_[0]);
    accept_pause_.emplace(*ios_[0]);
  }

  ~Impl() { Stop(); }

  Status Start() {
    const ServerOptions& options = shared_->options;
    asio::error_code error;
    const auto address = asio::ip::make_address(options.bind_address, error);
    if (error) {
      return InvalidArgumentError("bind address '{}' is not an IP address: {}",
                                  options.bind_address, error.message());
    }
    const asio::ip::tcp::endpoint endpoint(address, options.port);
    acceptor_->open(endpoint.protocol(), error);
    if (!error) acceptor_->set_option(asio::ip::tcp::acceptor::reuse_address(true), error);
    if (!error) acceptor_->bind(endpoint, error);
    if (!error) acceptor_->listen(asio::socket_base::max_listen_connections, error);
    if (error) {
      return UnavailableError("listening on {}:{}: {}", options.bind_address, options.port,
                              error.message());
    }
    port_ = acceptor_->local_endpoint().port();
    for (auto& io : ios_) {
      guards_.emplace_back(asio::make_work_guard(*io));
      threads_.emplace_back([io = io.get()] {
        stream::CurrentServerIo() = io;
        io->run();
        stream::CurrentServerIo() = nullptr;
      });
    }
    asio::post(*ios_[0], [weak = weak_from_this()] {
      if (auto self = weak.lock()) self->Accept();
    });
    for (auto& [period, fn] : every_) Arm(period, std::move(fn));
    every_.clear();
    started_ = true;
    return Status::OK();
  }

  // Not on a thread of this server.
  void Stop() {
    if (stopping_.exchange(true)) return;
    if (started_) {
      // Every connection closes on its own thread (its OnDisconnect runs there), then the
      // threads end; what a handler posts after that runs on its own thread (Run).
      std::vector<std::shared_ptr<StreamConnection>> open;
      {
        MutexLock lock(&shared_->mu);
        for (auto& [id, connection] : shared_->connections) open.push_back(connection);
      }
      std::vector<std::future<void>> closed;
      for (auto& connection : open) {
        auto done = std::make_shared<std::promise<void>>();
        closed.push_back(done->get_future());
        connection->Run([connection, done] {
          connection->Close(UnavailableError("the server is stopping"));
          done->set_value();
        });
      }
      std::promise<void> acceptor_closed;
      asio::post(*ios_[0], [this, &acceptor_closed] {
        asio::error_code ignored;
        acceptor_->close(ignored);
        accept_pause_->cancel();
        for (auto& timer : timers_) timer->cancel();
        acceptor_closed.set_value();
      });
      acceptor_closed.get_future().wait();
      for (auto& f : closed) f.wait();
      guards_.clear();
      for (auto& io : ios_) io->stop();
      for (auto& thread : threads_) thread.join();
    }
    {
      MutexLock lock(&shared_->mu);
      shared_->stopped = true;
      shared_->connections.clear();
    }
    // What was posted and not run (a reply racing the stop) runs here, finding its connection
    // closed: every callback still runs once.
    for (auto& io : ios_) {
      io->restart();
      io->poll();
    }
  }

  void Handle(uint16_t method, Handler handler) { shared_->handlers[method] = std::move(handler); }
  void OnDisconnect(std::function<void(uint64_t)> fn) { shared_->on_disconnect = std::move(fn); }
  uint16_t port() const { return port_; }

  void RunOnProgressThread(std::function<void()> fn) {
    if (stopping_) return;
    asio::post(*ios_[0], std::move(fn));
  }

  void RunEvery(std::chrono::milliseconds period, std::function<void()> fn) {
    if (!started_) {
      every_.emplace_back(period, std::move(fn));
      return;
    }
    asio::post(*ios_[0], [weak = weak_from_this(), period, fn = std::move(fn)]() mutable {
      if (auto self = weak.lock()) self->Arm(period, std::move(fn));
    });
  }

  TransportStats stats() const {
    const stream::ServerCounters& c = shared_->counters;
    TransportStats s;
    s.calls = c.calls.load();
    s.connects = c.connects.load();
    s.disconnects = c.disconnects.load();
    s.malformed_frames = c.malformed_frames.load();
    s.refused = c.refused.load();
    s.bad_hellos = c.bad_hellos.load();
    s.accept_pauses = c.accept_pauses.load();
    return s;
  }

  size_t connection_count() const {
    MutexLock lock(&shared_->mu);
    return shared_->connections.size();
  }

 private:
  // Runs `fn` every `period` on the first thread until Stop.
  void Arm(std::chrono::milliseconds period, std::function<void()> fn) {
    auto timer = std::make_shared<asio::steady_timer>(*ios_[0]);
    timers_.push_back(timer);
    auto tick = std::make_shared<std::function<void()>>();
    *tick = [timer, period, fn = std::move(fn), weak = std::weak_ptr(tick)] {
      timer->expires_after(period);
      timer->async_wait([timer, fn, weak](const asio::error_code& error) {
        auto again = weak.lock();
        if (error || !again) return;
        fn();
        (*again)();
      });
    };
    ticks_.push_back(tick);
    (*tick)();
  }

  void Accept() {
    asio::io_context& io = *ios_[next_io_++ % ios_.size()];
    // Handlers hold the server weakly: one the io_context drops at the end must not keep it.
    acceptor_->async_accept(io, [weak = weak_from_this(), &io](const asio::error_code& error,
                                                               asio::ip::tcp::socket socket) {
      auto self = weak.lock();
      if (!self) return;
      if (error) {
        if (error != asio::error::operation_aborted) self->PauseAccepting();
        return;
      }
      if (self->accept_failures_ != 0) {
        KVSTASH_LOG_WARN("accepting connections again, after {} failed accept(s)",
                         self->accept_failures_);
        self->accept_failures_ = 0;
      }
      auto pending = std::make_shared<asio::ip::tcp::socket>(std::move(socket));
      asio::post(io, [weak, pending, &io] {
        if (auto again = weak.lock()) again->ReadHello(io, pending);
      });
      self->Accept();
    });
  }

  void PauseAccepting() {
    // Out of descriptors (EMFILE) accept fails at once for as long as it lasts: retrying at
    // once would spin a core. Connections open are served meanwhile. Nothing is logged here
    // (a logger may need a descriptor): the count is in the stats, the recovery is logged.
    shared_->counters.accept_pauses.fetch_add(1, std::memory_order_relaxed);
    const auto pause =
        std::chrono::milliseconds(std::min(50u << std::min(accept_failures_, 4u), 1000u));
    ++accept_failures_;
    accept_pause_->expires_after(pause);
    accept_pause_->async_wait([weak = weak_from_this()](const asio::error_code& e) {
      auto self = weak.lock();
      if (!e && self) self->Accept();
    });
  }

  void ReadHello(asio::io_context& io, const std::shared_ptr<asio::ip::tcp::socket>& socket) {
    auto timer = std::make_shared<asio::steady_timer>(io, shared_->options.hello_timeout);
    timer->async_wait([socket](const asio::error_code& e) {
      asio::error_code ignored;
      if (!e) socket->close(ignored);
    });
    AsyncReadMessage(
        *socket, [weak = weak_from_this(), socket, timer, &io](Status status, std::string body) {
          timer->cancel();
          auto self = weak.lock();
          if (!self) return;
          if (!status.ok()) {
            KVSTASH_LOG_DEBUG("dropped a connection before its hello: {}", status.ToString());
            return;
          }
          self->OnHello(io, socket, body);
        });
  }

  Status Check(const wire::Hello& hello) {
    if (hello.protocol_version() != wire::PROTOCOL_VERSION_CURRENT) {
      return FailedPreconditionError("protocol version {} is not the server's {}",
                                     hello.protocol_version(),
                                     static_cast<int>(wire::PROTOCOL_VERSION_CURRENT));
    }
    if (!hello.worker_address().empty()) {
      shared_->counters.bad_hellos.fetch_add(1, std::memory_order_relaxed);
      return FailedPreconditionError(
          "this server speaks the stream transport, and the hello carries a UCX worker address "
          "(a UCX client: connect with the stream transport)");
    }
    if (Status refused = CheckHelloToken(shared_->options, hello.namespace_(), hello.auth_token());
        !refused.ok()) {
      shared_->counters.refused.fetch_add(1, std::memory_order_relaxed);
      return refused;
    }
    if (shared_->options.admit_tenant) {
      KVSTASH_RETURN_IF_ERROR(shared_->options.admit_tenant(hello.namespace_()));
    }
    return Status::OK();
  }

  void OnHello(asio::io_context& io, const std::shared_ptr<asio::ip::tcp::socket>& socket,
               const std::string& body) {
    const TransportOptions& transport = shared_->options.transport;
    wire::Hello hello;
    wire::HelloReply reply;
    reply.set_protocol_version(wire::PROTOCOL_VERSION_CURRENT);
    reply.set_service_limits(shared_->options.service_limits);
    reply.set_max_message_bytes(transport.max_message_bytes);
    reply.set_max_payload_bytes(transport.max_payload_bytes);
    Status refused;
    if (!hello.ParseFromString(body)) {
      shared_->counters.bad_hellos.fetch_add(1, std::memory_order_relaxed);
      refused = InvalidArgumentError("unparseable hello of {} bytes", body.size());
    } else if (stopping_) {
      refused = UnavailableError("the server is stopping");
    } else {
      refused = Check(hello);
    }
    if (!refused.ok()) {
      if (std::has_single_bit(++hellos_refused_)) {
        asio::error_code ignored;
        KVSTASH_LOG_WARN(
            "refused a client: {} (client {:?}, namespace {:?}, from {}; {} so far)",
            refused.ToString(), hello.client_name().substr(0, 64), hello.namespace_().substr(0, 64),
            socket->remote_endpoint(ignored).address().to_string(), hellos_refused_.load());
      }
      reply.mutable_error()->set_code(static_cast<wire::Code>(refused.code()));
      reply.mutable_error()->set_message(std::string(refused.message()));
      AsyncWriteMessage(*socket, reply, [socket](Status) {
        asio::error_code ignored;
        socket->close(ignored);
      });
      return;
    }
    const uint64_t id = next_connection_id_.fetch_add(1);
    reply.set_connection_id(id);
    auto connection = std::make_shared<StreamConnection>(id, hello.namespace_(),
                                                         hello.client_name(), io, shared_);
    AsyncWriteMessage(*socket, reply, [weak = weak_from_this(), socket, connection](Status s) {
      auto self = weak.lock();
      if (!s.ok() || !self || self->stopping_) return;
      {
        MutexLock lock(&self->shared_->mu);
        if (self->shared_->stopped) return;
        self->shared_->connections.emplace(connection->id(), connection);
      }
      self->shared_->counters.connects.fetch_add(1, std::memory_order_relaxed);
      connection->Start(std::move(*socket));
    });
  }

  std::shared_ptr<ServerShared> shared_;
  std::vector<std::unique_ptr<asio::io_context>> ios_;
  std::vector<asio::executor_work_guard<asio::io_context::executor_type>> guards_;
  std::vector<std::thread> threads_;
  std::optional<asio::ip::tcp::acceptor> acceptor_;
  std::optional<asio::steady_timer> accept_pause_;
  std::vector<std::shared_ptr<asio::steady_timer>> timers_;    // the first thread's
  std::vector<std::shared_ptr<std::function<void()>>> ticks_;  // the first thread's
  std::vector<std::pair<std::chrono::milliseconds, std::function<void()>>> every_;  // before Start
  std::atomic<uint64_t> next_connection_id_{1};
  std::atomic<uint64_t> hellos_refused_{0};
  size_t next_io_ = 0;            // the first thread's
  unsigned accept_failures_ = 0;  // the first thread's
  uint16_t port_ = 0;
  bool started_ = false;
  std::atomic<bool> stopping_{false};
};

Result<std::unique_ptr<StreamServer>> StreamServer::Create(ServerOptions options) {
  asio::error_code error;
  asio::ip::make_address(options.bind_address, error);
  if (error) {
    return InvalidArgumentError("bind address '{}' is not an IP address: {}", options.bind_address,
                                error.message());
  }
  return std::unique_ptr<StreamServer>(
      new StreamServer(std::make_shared<Impl>(std::move(options))));
}

StreamServer::StreamServer(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
StreamServer::~StreamServer() { impl_->Stop(); }

void StreamServer::Handle(uint16_t method, Handler handler) {
  impl_->Handle(method, std::move(handler));
}
void StreamServer::OnDisconnect(std::function<void(uint64_t)> fn) {
  impl_->OnDisconnect(std::move(fn));
}
Status StreamServer::Start() { return impl_->Start(); }
void StreamServer::Stop() { impl_->Stop(); }
uint16_t StreamServer::port() const { return impl_->port(); }
Result<MemoryRegion> StreamServer::AllocateMemory(size_t bytes) {
  return UnimplementedError("the stream transport shares no memory (asked for {} bytes)", bytes);
}
void StreamServer::RunOnProgressThread(std::function<void()> fn) {
  impl_->RunOnProgressThread(std::move(fn));
}
void StreamServer::RunEvery(std::chrono::milliseconds period, std::function<void()> fn) {
  impl_->RunEvery(period, std::move(fn));
}
TransportStats StreamServer::stats() const { return impl_->stats(); }
size_t StreamServer::connection_count() const { return impl_->connection_count(); }

}  // namespace kvstash::transport
