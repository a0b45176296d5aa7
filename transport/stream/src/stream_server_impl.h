#pragma once

// A StreamServer's insides shared by its files: what its connections share with it
// (ServerShared), a connection after its hello (StreamConnection) and one request on it
// (StreamCall). Private to transport/stream/.

#include <asio.hpp>
#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>

#include "frame_stream.h"
#include "kvstash/common/mutex.h"
#include "kvstash/transport/channel.h"

namespace kvstash::transport::stream {

class StreamConnection;

struct ServerCounters {
  std::atomic<uint64_t> calls{0};
  std::atomic<uint64_t> connects{0};
  std::atomic<uint64_t> disconnects{0};
  std::atomic<uint64_t> malformed_frames{0};
  std::atomic<uint64_t> refused{0};
  std::atomic<uint64_t> bad_hellos{0};
  std::atomic<uint64_t> accept_pauses{0};
};

// What the server's connections share with it, and outlives both: a call a handler keeps may
// outlive the server. Handlers and the disconnect hook are set before Start and read-only
// after. Thread-safe where its members say.
struct ServerShared {
  ServerOptions options;
  std::map<uint16_t, Handler> handlers;
  std::function<void(uint64_t connection_id)> on_disconnect;
  ServerCounters counters;

  Mutex mu;
  // True once Stop joined the threads: work for a connection then runs on the caller's thread.
  bool stopped GUARDED_BY(mu) = false;
  std::unordered_map<uint64_t, std::shared_ptr<StreamConnection>> connections GUARDED_BY(mu);
};

// One request on a connection, the ServerCallState a handler's ServerCall holds. Immutable
// fields are read anywhere; the rest is the connection's thread's (every method posts there).
class StreamCall : public ServerCallState, public std::enable_shared_from_this<StreamCall> {
 public:
  StreamCall(std::shared_ptr<StreamConnection> connection, const StreamHeader& header,
             Bytes message);

  uint16_t method() const override { return method_; }
  uint64_t connection_id() const override;
  const std::string& tenant() const override;
  Bytes request() const override { return std::as_bytes(std::span(message_)); }
  size_t payload_bytes() const override { return payload_bytes_; }
  Clock::time_point deadline() const override { return deadline_; }
  bool cancelled() const override {
    return cancelled_.load(std::memory_order_relaxed) || Clock::now() > deadline_;
  }
  void ReceivePayload(MutableBytes dest, const MemoryRegion* region,
                      std::function<void(Status)> done) override;
  void Reply(Bytes message, Bytes payload, const MemoryRegion* region,
             std::function<void(Status)> sent) override;
  void ReplyError(const Status& status) override;
  void Drop() override;

  uint64_t request_id() const { return request_id_; }
  // The client cancelled it, or its connection ended.
  void MarkCancelled() { cancelled_.store(true, std::memory_order_relaxed); }

 private:
  enum class Payload { kNone, kWaiting, kReading, kDone };
  // On the connection's thread.
  void Answer(const Status& status, std::string message, Bytes payload,
              std::function<void(Status)> sent);

  const std::shared_ptr<StreamConnection> connection_;
  const uint16_t method_;
  const uint64_t request_id_;
  const size_t payload_bytes_;
  const Clock::time_point deadline_;
  const std::string message_;
  std::atomic<bool> cancelled_{false};
  Payload payload_;        // the connection's thread's
  bool answered_ = false;  // the connection's thread's
};

// A connection after its hello: its frames (FrameStream), its calls, and the thread it is
// served on. Created and started on that thread; held by the server's table until it closes
// and by its calls. Every method on its thread, except Run.
class StreamConnection : public std::enable_shared_from_this<StreamConnection> {
 public:
  // A server's calls in flight on one connection before it stops reading: it reads on when
  // half of them are answered.
  static constexpr size_t kMaxCallsInFlight = 1024;

  StreamConnection(uint64_t id, std::string tenant, std::string client_name, asio::io_context& io,
                   std::shared_ptr<ServerShared> shared);
  void Start(asio::ip::tcp::socket socket);
  void Close(const Status& why);

  // Runs `fn` on the connection's thread: inline when already there, else posted; once the
  // server stopped, on the caller's thread, one at a time. Thread-safe.
  void Run(std::function<void()> fn);

  uint64_t id() const { return id_; }
  const std::string& tenant() const { return tenant_; }
  FrameStream& stream() { return *stream_; }
  // A call was answered: one less in flight.
  void Answered(uint64_t request_id);

 private:
  void OnFrame(const StreamHeader& header, Bytes message);
  void OnClosed(const Status& why, bool malformed);

  const uint64_t id_;
  const std::string tenant_;
  const std::string client_name_;
  asio::io_context& io_;  // the server's; used only while it runs (ServerShared::stopped)
  const std::shared_ptr<ServerShared> shared_;
  std::shared_ptr<FrameStream> stream_;
  std::unordered_map<uint64_t, std::weak_ptr<StreamCall>> calls_;  // unanswered
  Mutex inline_mu_;  // Run's work after the server stopped, one at a time
};

// The server thread's io_context, for StreamConnection::Run's test of "already there".
asio::io_context*& CurrentServerIo();

}  // namespace kvstash::transport::stream
