#pragma once

// Request/response RPC over one plain TCP socket per connection, kvstash's own framing: the
// transport between hosts where UCX's TCP transport is not trusted (UCX 1.13 aborts a client
// process on some peer failures over TCP; docs/architecture.md, "Transports").
//
// A client connects to the server's port and sends wire.Hello with no UCX worker address; the
// server answers wire.HelloReply (its limits, or why it refuses) on the same socket, which then
// carries frames both ways: a 32-byte little-endian header (stream_frame.h), the message bytes,
// then the payload bytes. Payloads move straight between the socket and the caller's memory: a
// request payload into the buffer the server's handler names (ReceivePayload), a reply payload
// into the client's CallOptions::recv_payload. Nothing is shared between processes
// (AllocateMemory is Unimplemented): a node maps its own tier.
//
// Every input is the peer's: a frame with a bad magic, kind, size or field closes the
// connection (TransportStats::malformed_frames), never reaches an assert; a peer that stops
// mid-frame for TransportOptions::stall_timeout is cut off, freeing what its frame held.
//
// Threads: a StreamServer runs TransportOptions::progress_threads threads, each serving its
// share of the connections (a connection is one thread's: its handlers run there); the first
// also accepts and runs the timers. A StreamClient runs one thread of its own.

#include <cstdint>
#include <functional>
#include <memory>

#include "kvstash/common/status.h"
#include "kvstash/transport/channel.h"

namespace kvstash::transport {

// The server end. Thread-safe after Start (register handlers before).
class StreamServer : public Listener {
 public:
  // Fails with InvalidArgument for options it cannot serve (a bind address that is not an IP).
  static Result<std::unique_ptr<StreamServer>> Create(ServerOptions options);
  ~StreamServer() override;

  void Handle(uint16_t method, Handler handler) override;
  void OnDisconnect(std::function<void(uint64_t connection_id)> fn) override;
  // Listens (Unavailable when the port is taken) and starts the threads.
  Status Start() override;
  void Stop() override;
  uint16_t port() const override;
  // Unimplemented: no memory is shared between processes.
  Result<MemoryRegion> AllocateMemory(size_t bytes) override;
  void RunOnProgressThread(std::function<void()> fn) override;
  void RunEvery(std::chrono::milliseconds period, std::function<void()> fn) override;
  TransportStats stats() const override;
  size_t connection_count() const override;

  class Impl;

 private:
  explicit StreamServer(std::shared_ptr<Impl> impl);
  std::shared_ptr<Impl> impl_;
};

// The client end of one connection to one server: connects on the first call (or Connect) and
// again on the next call after the connection is lost. Thread-safe: calls may start on any
// thread; callbacks run on the client's thread.
class StreamClient : public Channel {
 public:
  static Result<std::unique_ptr<StreamClient>> Create(ClientOptions options);
  // Fails every call still outstanding with Cancelled, then closes the connection. Not on the
  // client's thread (from a callback).
  ~StreamClient() override;

  // Connects now unless connected (normally the first call does); blocks. Not on the client's
  // thread.
  Status Connect();

  uint64_t Call(uint16_t method, Bytes request, const CallOptions& options,
                ResponseCallback done) override;
  void Cancel(uint64_t id) override;
  void ConnectAsync(std::function<void(const Status&)> done) override;
  void Reset(const Status& why) override;
  std::optional<ServerLimits> server_limits() const override;
  TransportStats stats() const;

  class Impl;

 private:
  explicit StreamClient(std::shared_ptr<Impl> impl);
  std::shared_ptr<Impl> impl_;
};

}  // namespace kvstash::transport
