// StreamClient (stream.h): the connection attempt and hello, then calls over a FrameStream.

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <future>
#include <optional>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "bootstrap.h"
#include "frame_stream.h"
#include "kvstash/common/mutex.h"
#include "kvstash/proto/wire.pb.h"
#include "kvstash/transport/stream.h"

namespace kvstash::transport {

using stream::FrameStream;
using stream::StreamHeader;
using stream::StreamKind;

namespace {

Status StatusFromWireError(uint16_t code, Bytes message) {
  wire::Error error;
  if (!error.ParseFromArray(message.data(), static_cast<int>(message.size()))) {
    return Status(static_cast<StatusCode>(code), "(unparseable error message from the server)");
  }
  return Status(static_cast<StatusCode>(code), error.message());
}

}  // namespace

// Everything runs on the client's one io thread; Call, Cancel, ConnectAsync and Reset post
// there (or run inline when already there). Held by shared_ptr; handlers hold it weakly, so
// the client goes when its owner lets go.
class StreamClient::Impl : public std::enable_shared_from_this<StreamClient::Impl> {
 public:
  explicit Impl(ClientOptions options) : options_(std::move(options)), guard_(io_.get_executor()) {}

  void StartThread() {
    thread_ = std::thread([this] { io_.run(); });
    thread_id_ = thread_.get_id();
  }

  // Fails every call with Cancelled, closes the connection and ends the thread.
  void Shutdown() {
    std::promise<void> done;
    Run([this, &done] {
      stopping_ = true;
      const Status why = CancelledError("the client is closing");
      FailConnect(why);
      if (stream_) stream_->Close(why);
      FailAll(why);
      done.set_value();
    });
    done.get_future().wait();
    guard_.reset();
    io_.stop();
    thread_.join();
  }

  bool OnThread() const { return std::this_thread::get_id() == thread_id_; }

  void Run(std::function<void()> fn) {
    if (OnThread()) {
      fn();
    } else {
      asio::post(io_, std::move(fn));
    }
  }

  uint64_t Call(uint16_t method, Bytes request, const CallOptions& options, ResponseCallback done) {
    const uint64_t id = next_id_.fetch_add(1, std::memory_order_relaxed);
    counters_.calls.fetch_add(1, std::memory_order_relaxed);
    Pending call;
    call.method = method;
    call.request.assign(reinterpret_cast<const char*>(request.data()), request.size());
    call.send = options.send_payload;
    call.recv = options.recv_payload;
    call.deadline = options.deadline;
    call.done = std::move(done);
    Run([weak = weak_from_this(), id, call = std::move(call)]() mutable {
      if (auto self = weak.lock()) self->Begin(id, std::move(call));
    });
    return id;
  }

  void Cancel(uint64_t id) {
    Run([weak = weak_from_this(), id] {
      if (auto self = weak.lock()) self->Expire(id, CancelledError("call {} cancelled", id));
    });
  }

  void ConnectAsync(std::function<void(const Status&)> done) {
    Run([weak = weak_from_this(), done = std::move(done)]() mutable {
      auto self = weak.lock();
      if (!self) return;
      if (self->stopping_) {
        done(CancelledError("the client is closing"));
      } else if (self->state_ == State::kConnected) {
        done(Status::OK());
      } else {
        self->connect_waiters_.push_back(std::move(done));
        if (self->state_ == State::kIdle) self->Connect();
      }
    });
  }

  void Reset(const Status& why) {
    Run([weak = weak_from_this(), why] {
      auto self = weak.lock();
      if (!self) return;
      const Status reset = UnavailableError("the connection was reset: {}", why.ToString());
      self->FailConnect(reset);
      if (self->stream_) self->stream_->Close(reset);
    });
  }

  std::optional<ServerLimits> server_limits() const {
    MutexLock lock(&mu_);
    return limits_;
  }

  TransportStats stats() const {
    TransportStats s;
    s.calls = counters_.calls.load();
    s.failed = counters_.failed.load();
    s.connects = counters_.connects.load();
    s.disconnects = counters_.disconnects.load();
    s.malformed_frames = counters_.malformed.load();
    s.late_replies = counters_.late.load();
    return s;
  }

 private:
  enum class State { kIdle, kConnecting, kConnected };
  struct Pending {
    uint16_t method = 0;
    std::string request;  // until sent
    Bytes send;
    MutableBytes recv;
    Clock::time_point deadline;
    ResponseCallback done;
    std::shared_ptr<asio::steady_timer> timer;
    uint64_t send_token = 0;  // 0: not sent
    bool reading = false;     // its reply payload is coming into `recv`
    std::string reply;        // the reply message while the payload comes
  };
  struct Counters {
    std::atomic<uint64_t> calls{0}, failed{0}, connects{0}, disconnects{0}, malformed{0}, late{0};
  };

  void Begin(uint64_t id, Pending call) {
    if (stopping_) {
      call.done(Response{CancelledError("the client is closing"), {}, 0});
      return;
    }
    call.timer = std::make_shared<asio::steady_timer>(io_, call.deadline);
    call.timer->async_wait([weak = weak_from_this(), id](const asio::error_code& error) {
      auto self = weak.lock();
      if (error || !self) return;
      self->Expire(id, DeadlineExceededError("call {} passed its deadline", id));
    });
    Pending& stored = calls_.emplace(id, std::move(call)).first->second;
    if (state_ == State::kConnected) {
      Send(id, stored);
      return;
    }
    waiting_.push_back(id);
    if (state_ == State::kIdle) Connect();
  }

  void Send(uint64_t id, Pending& call) {
    Status refused;
    if (call.request.size() > limits_now_.max_message_bytes) {
      refused = ResourceExhaustedError("request message of {} bytes exceeds the limit of {}",
                                       call.request.size(), limits_now_.max_message_bytes);
    } else if (call.send.size() > limits_now_.max_payload_bytes) {
      refused = ResourceExhaustedError("request payload of {} bytes exceeds the limit of {}",
                                       call.send.size(), limits_now_.max_payload_bytes);
    }
    if (!refused.ok()) {
      Complete(id, refused, {}, 0);
      return;
    }
    StreamHeader header;
    header.kind = StreamKind::kRequest;
    header.method = call.method;
    header.request_id = id;
    const auto left =
        std::chrono::duration_cast<std::chrono::microseconds>(call.deadline - Clock::now());
    header.timeout_us = static_cast<uint32_t>(std::clamp<int64_t>(left.count(), 1, UINT32_MAX));
    call.send_token = stream_->Send(header, std::move(call.request), call.send, nullptr);
  }

  // Ends call `id` with `status`: the stream lets go of its memory first, then its callback
  // runs. No-op for a call already ended.
  void Complete(uint64_t id, const Status& status, Bytes message, size_t payload_bytes) {
    auto it = calls_.find(id);
    if (it == calls_.end()) return;
    Pending call = std::move(it->second);
    calls_.erase(it);
    call.timer->cancel();
    if (stream_ && call.send_token != 0) stream_->Detach(call.send_token);
    if (stream_ && call.reading) stream_->DetachPayload();
    if (!status.ok()) counters_.failed.fetch_add(1, std::memory_order_relaxed);
    call.done(Response{status, message, payload_bytes});
  }

  // A call ends before its reply: deadline or cancel. The server hears of it.
  void Expire(uint64_t id, const Status& why) {
    const auto it = calls_.find(id);
    if (it == calls_.end()) return;
    if (stream_ && stream_->open() && it->second.send_token != 0) {
      StreamHeader cancel;
      cancel.kind = StreamKind::kCancel;
      cancel.request_id = id;
      stream_->Send(cancel, {}, {}, nullptr);
    }
    Complete(id, why, {}, 0);
  }

  void OnFrame(const StreamHeader& header, Bytes message) {
    const auto it = calls_.find(header.request_id);
    if (it == calls_.end()) {
      counters_.late.fetch_add(1, std::memory_order_relaxed);
      stream_->SkipPayload();
      return;
    }
    Pending& call = it->second;
    if (header.status != 0) {
      Complete(header.request_id, StatusFromWireError(header.status, message), {}, 0);
      return;
    }
    const size_t n = header.payload_bytes;
    if (n == 0) {
      Complete(header.request_id, Status::OK(), message, 0);
      return;
    }
    if (n > call.recv.size()) {
      stream_->SkipPayload();
      Complete(header.request_id,
               OutOfRangeError("reply payload of {} bytes exceeds the receive buffer of {}", n,
                               call.recv.size()),
               {}, 0);
      return;
    }
    call.reading = true;
    call.reply.assign(reinterpret_cast<const char*>(message.data()), message.size());
    stream_->ReadPayload(call.recv.first(n), [this, id = header.request_id, n](Status status) {
      const auto found = calls_.find(id);
      if (found == calls_.end()) return;  // ended meanwhile (its deadline): detached
      found->second.reading = false;
      const std::string reply = std::move(found->second.reply);
      Complete(id, status, std::as_bytes(std::span(reply)), status.ok() ? n : 0);
    });
  }

  void OnClosed(const Status& why, bool malformed) {
    stream_.reset();
    state_ = State::kIdle;
    counters_.disconnects.fetch_add(1, std::memory_order_relaxed);
    if (malformed) counters_.malformed.fetch_add(1, std::memory_order_relaxed);
    FailAll(why.code() == StatusCode::kCancelled
                ? why
                : UnavailableError("connection to {}:{} lost: {}", options_.host, options_.port,
                                   why.ToString()));
  }

  void FailAll(const Status& why) {
    std::vector<uint64_t> ids;
    ids.reserve(calls_.size());
    for (const auto& [id, call] : calls_) ids.push_back(id);
    std::sort(ids.begin(), ids.end());
    for (const uint64_t id : ids) Complete(id, why, {}, 0);
    waiting_.clear();
  }

  // ---- The connection attempt.

  void Connect() {
    state_ = State::kConnecting;
    const uint64_t attempt = ++attempt_;
    socket_.emplace(io_);
    connect_timer_.emplace(io_, options_.connect_timeout);
    connect_timer_->async_wait([weak = weak_from_this(), attempt](const asio::error_code& e) {
      auto self = weak.lock();
      if (e || !self || self->attempt_ != attempt || self->state_ != State::kConnecting) return;
      self->FailConnect(UnavailableError("connecting to {}:{} timed out after {} ms",
                                         self->options_.host, self->options_.port,
                                         self->options_.connect_timeout.count()));
    });
    auto connected = [weak = weak_from_this(), attempt](const asio::error_code& e) {
      auto self = weak.lock();
      if (!self || self->attempt_ != attempt || self->state_ != State::kConnecting) return;
      if (e) {
        self->FailConnect(UnavailableError("connecting to {}:{}: {}", self->options_.host,
                                           self->options_.port, e.message()));
        return;
      }
      self->SayHello(attempt);
    };
    asio::error_code error;
    const auto address = asio::ip::make_address(options_.host, error);
    if (!error) {
      socket_->async_connect(asio::ip::tcp::endpoint(address, options_.port), connected);
      return;
    }
    resolver_.emplace(io_);
    resolver_->async_resolve(
        options_.host, std::to_string(options_.port),
        [weak = weak_from_this(), attempt, connected](
            const asio::error_code& e, asio::ip::tcp::resolver::results_type results) {
          auto self = weak.lock();
          if (!self || self->attempt_ != attempt || self->state_ != State::kConnecting) return;
          if (e) {
            self->FailConnect(
                UnavailableError("resolving {}: {}", self->options_.host, e.message()));
            return;
          }
          asio::async_connect(*self->socket_, results,
                              [connected](const asio::error_code& ce,
                                          const asio::ip::tcp::endpoint&) { connected(ce); });
        });
  }

  void SayHello(uint64_t attempt) {
    wire::Hello hello;
    hello.set_protocol_version(wire::PROTOCOL_VERSION_CURRENT);
    hello.set_namespace_(options_.tenant);
    hello.set_auth_token(options_.auth_token);
    hello.set_client_name(options_.client_name.empty() ? fmt::format("pid {}", ::getpid())
                                                       : options_.client_name);
    AsyncWriteMessage(*socket_, hello, [weak = weak_from_this(), attempt](Status status) {
      auto self = weak.lock();
      if (!self || self->attempt_ != attempt || self->state_ != State::kConnecting) return;
      if (!status.ok()) {
        self->FailConnect(status);
        return;
      }
      AsyncReadMessage(*self->socket_, [weak, attempt](Status s, std::string body) {
        auto again = weak.lock();
        if (!again || again->attempt_ != attempt || again->state_ != State::kConnecting) return;
        again->OnHelloReply(std::move(s), body);
      });
    });
  }

  void OnHelloReply(Status status, const std::string& body) {
    wire::HelloReply reply;
    if (status.ok() && !reply.ParseFromString(body)) {
      status = UnavailableError("unparseable hello reply of {} bytes from {}:{}", body.size(),
                                options_.host, options_.port);
    }
    if (status.ok() && reply.has_error()) {
      const auto code = static_cast<uint32_t>(reply.error().code());
      status = Status(code <= static_cast<uint32_t>(StatusCode::kUnauthenticated) && code != 0
                          ? static_cast<StatusCode>(code)
                          : StatusCode::kUnknown,
                      fmt::format("{}:{} refused the connection: {}", options_.host, options_.port,
                                  reply.error().message()));
    }
    if (status.ok() && reply.protocol_version() != wire::PROTOCOL_VERSION_CURRENT) {
      status = FailedPreconditionError("{}:{} speaks protocol version {}, this client {}",
                                       options_.host, options_.port, reply.protocol_version(),
                                       static_cast<int>(wire::PROTOCOL_VERSION_CURRENT));
    }
    if (!status.ok()) {
      FailConnect(status);
      return;
    }
    const TransportOptions& own = options_.transport;
    limits_now_.max_message_bytes =
        std::min<uint64_t>(own.max_message_bytes, reply.max_message_bytes());
    limits_now_.max_payload_bytes =
        std::min<uint64_t>(own.max_payload_bytes, reply.max_payload_bytes());
    limits_now_.service_limits = reply.service_limits();
    {
      MutexLock lock(&mu_);
      limits_ = limits_now_;
    }
    connect_timer_->cancel();
    FrameStream::Events events;
    events.frame = [this](const StreamHeader& header, Bytes message) { OnFrame(header, message); };
    events.closed = [this](const Status& why) { OnClosed(why, stream_ && stream_->malformed()); };
    stream_ = std::make_shared<FrameStream>(
        std::move(*socket_),
        stream::StreamLimits{.server = false,
                             .max_message_bytes = own.max_message_bytes,
                             .max_payload_bytes = own.max_payload_bytes},
        own.stall_timeout, std::move(events));
    socket_.reset();
    state_ = State::kConnected;
    counters_.connects.fetch_add(1, std::memory_order_relaxed);
    stream_->Start();
    std::vector<uint64_t> waiting = std::move(waiting_);
    waiting_.clear();
    for (const uint64_t id : waiting) {
      const auto it = calls_.find(id);
      if (it != calls_.end() && stream_) Send(id, it->second);
    }
    for (auto& done : std::exchange(connect_waiters_, {})) done(Status::OK());
  }

  // Ends the attempt under way (if any): its waiting calls and ConnectAsync callers get `why`.
  void FailConnect(const Status& why) {
    if (state_ != State::kConnecting) return;
    state_ = State::kIdle;
    ++attempt_;
    asio::error_code ignored;
    if (socket_) socket_->close(ignored);
    if (resolver_) resolver_->cancel();
    if (connect_timer_) connect_timer_->cancel();
    for (const uint64_t id : std::exchange(waiting_, {})) Complete(id, why, {}, 0);
    for (auto& done : std::exchange(connect_waiters_, {})) done(why);
  }

  asio::io_context io_;
  const ClientOptions options_;
  asio::executor_work_guard<asio::io_context::executor_type> guard_;
  std::thread thread_;
  std::thread::id thread_id_;
  std::atomic<uint64_t> next_id_{1};
  Counters counters_;
  mutable Mutex mu_;
  std::optional<ServerLimits> limits_ GUARDED_BY(mu_);

  // The io thread's.
  State state_ = State::kIdle;
  bool stopping_ = false;
  uint64_t attempt_ = 0;
  ServerLimits limits_now_;
  std::optional<asio::ip::tcp::socket> socket_;
  std::optional<asio::ip::tcp::resolver> resolver_;
  std::optional<asio::steady_timer> connect_timer_;
  std::shared_ptr<FrameStream> stream_;
  std::unordered_map<uint64_t, Pending> calls_;
  std::vector<uint64_t> waiting_;  // calls begun while connecting
  std::vector<std::function<void(const Status&)>> connect_waiters_;
};

Result<std::unique_ptr<StreamClient>> StreamClient::Create(ClientOptions options) {
  if (options.port == 0) return InvalidArgumentError("no port to connect to");
  auto impl = std::make_shared<Impl>(std::move(options));
  impl->StartThread();
  return std::unique_ptr<StreamClient>(new StreamClient(std::move(impl)));
}

StreamClient::StreamClient(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
StreamClient::~StreamClient() { impl_->Shutdown(); }

Status StreamClient::Connect() {
  std::promise<Status> outcome;
  impl_->ConnectAsync([&outcome](const Status& status) { outcome.set_value(status); });
  return outcome.get_future().get();
}

uint64_t StreamClient::Call(uint16_t method, Bytes request, const CallOptions& options,
                            ResponseCallback done) {
  return impl_->Call(method, request, options, std::move(done));
}
void StreamClient::Cancel(uint64_t id) { impl_->Cancel(id); }
void StreamClient::ConnectAsync(std::function<void(const Status&)> done) {
  impl_->ConnectAsync(std::move(done));
}
void StreamClient::Reset(const Status& why) { impl_->Reset(why); }
std::optional<ServerLimits> StreamClient::server_limits() const { return impl_->server_limits(); }
TransportStats StreamClient::stats() const { return impl_->stats(); }

}  // namespace kvstash::transport
