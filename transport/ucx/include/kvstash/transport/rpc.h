#pragma once

// Request/response RPC over UCX active messages, with block payloads moved zero-copy.
//
// Every call carries a small message (protobuf bytes, see proto/wire.proto) and at most one
// payload each way: a request payload (a put: the server receives it straight into memory it
// chooses) and a reply payload (a get: the client receives it straight into the buffer it
// gave). Large payloads go by UCX rendezvous, so the bytes are copied once, by the transport
// (shared memory: a single CMA/posix copy; TCP: the socket), from registered memory to
// registered memory.
//
// Connections: the server listens on a TCP port. A client connects there, sends wire.Hello
// with its UCX worker address and receives wire.HelloReply with the server's; both then open
// UCX endpoints to each other's worker. The TCP socket stays open as a liveness channel: when
// either process dies, the other side sees it close at once, whatever the UCX transport.
// (A UCX sockaddr listener cannot carry shared-memory transports in UCX 1.13: measured
// "Destination is unreachable" with UCX_TLS=shm.)
//
// Threads: each RpcServer owns TransportOptions::progress_threads UCX workers (one context),
// each with its progress thread, which also runs an Asio io_context (sockets, deadline timers).
// The first listens and hands each accepted connection to the worker with the fewest; a
// connection is served by that worker's thread alone, its handlers included, so handlers of
// different connections run at once. Each RpcClient owns one worker too, unless it is given a
// ClientWorker: then the connections of every client on that ClientWorker share its worker
// and thread (one per process is the intent: a client per node, many engine threads, one
// thread driving UCX). The progress thread spins while there is traffic and sleeps on the
// worker's event fd when idle. Every callback runs on that thread and must not block.

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "kvstash/common/status.h"
#include "kvstash/transport/channel.h"

namespace kvstash::transport {

// The client end of one connection to one server. Connects on the first call (or Connect)
// and again on the next call after the connection is lost. Thread-safe: calls may start on
// any thread; callbacks run on the client's progress thread (its own, or its ClientWorker's).
class RpcClient : public Channel {
 public:
  static Result<std::unique_ptr<RpcClient>> Create(ClientOptions options);
  // Fails every call still outstanding with Cancelled, then closes the connection.
  ~RpcClient() override;

  // Connects now (normally the first call does); blocks. Not on the progress thread.
  Status Connect();

  // Starts a call of `method` with `request` bytes (copied). `done` runs exactly once, on the
  // progress thread: with the reply, or with DeadlineExceeded, Cancelled, Unavailable (the
  // connection failed or was lost) or the server's error. Returns the call's id, for Cancel.
  uint64_t Call(uint16_t method, Bytes request, const CallOptions& options,
                ResponseCallback done) override;

  // Completes call `id` with Cancelled (and tells the server) unless it already completed.
  // Buffers it used are no longer touched when its callback runs.
  void Cancel(uint64_t id) override;

  // Call and wait. Not on the progress thread. The reply message is copied into *reply.
  Status CallSync(uint16_t method, Bytes request, const CallOptions& options,
                  std::vector<std::byte>* reply, size_t* payload_bytes = nullptr);

  // Registers caller memory, or allocates memory UCX can share (shared-memory transports map
  // it directly). Thread-safe.
  Result<MemoryRegion> RegisterMemory(MutableBytes memory);
  Result<MemoryRegion> AllocateMemory(size_t bytes);

  // True on this client's progress thread.
  bool OnProgressThread() const;
  // Runs fn on the progress thread (inline when already there).
  void RunOnProgressThread(std::function<void()> fn);
  TransportStats stats() const;
  uint64_t connection_id() const;
  // The limits the server stated at the latest hello, tightened by this client's own
  // (TransportOptions); nullopt before the first connection. A server restarted with other
  // limits is seen at the reconnection. Thread-safe.
  std::optional<ServerLimits> server_limits() const override;
  bool payloads_mapped() const override;
  // Starts connecting unless connected or connecting; `done` runs once on the progress thread
  // with the outcome (OK at once when connected). For connecting to many servers in parallel.
  void ConnectAsync(std::function<void(const Status&)> done) override;
  void Reset(const Status& why) override;

  // Sends raw frame bytes (AM header, AM data) on the connection, for fuzz tests. Connects
  // first. No reply is matched to it. `sent`, when given, runs on the client's thread once UCX
  // has finished the send: for a rendezvous payload, once the server took or let go of it.
  Status SendRawForTesting(Bytes header, Bytes data, std::function<void(Status)> sent = nullptr);

  class Impl;

 private:
  RpcClient(std::shared_ptr<ClientWorker> worker, std::unique_ptr<Impl> impl);
  std::shared_ptr<ClientWorker> worker_;  // declared first: outlives impl_
  std::unique_ptr<Impl> impl_;
};

// A UCX worker and progress thread that many RpcClients share: every connection of every
// client created with it (ClientOptions::worker) is driven by this one thread, and replies
// are routed to their client by connection id. On a machine with few cores, one spinning
// progress thread per process instead of one per connection leaves the cores to the work.
// Callbacks of all its clients run on its thread, one at a time. Lives while any of its
// clients does.
class ClientWorker {
 public:
  static Result<std::shared_ptr<ClientWorker>> Create(const TransportOptions& options);
  ~ClientWorker();
  ClientWorker(const ClientWorker&) = delete;
  ClientWorker& operator=(const ClientWorker&) = delete;

  const TransportOptions& options() const;
  // Frames that named no connection of this worker's clients (dropped).
  uint64_t unrouted_frames() const;
  // The UCX worker address its clients' hellos carry (for tests that speak the hello).
  std::string AddressForTesting() const;

  class Impl;
  Impl& impl() { return *impl_; }

 private:
  explicit ClientWorker(std::shared_ptr<Impl> impl);
  std::shared_ptr<Impl> impl_;
};

// The ClientWorkers a process's channels spread over, as engines run them: each new channel
// takes the worker serving the fewest channels, and a worker is made when all serve some and
// fewer than size() exist. A process's connectors share one pool per transport setting
// (ForProcess), so a process runs at most size() client progress threads however many nodes
// and clients it has. Thread-safe.
class ClientWorkerPool {
 public:
  // `size` workers at most; 0: one per core, at most 4.
  static std::shared_ptr<ClientWorkerPool> Create(const TransportOptions& options, size_t size = 0);
  // The process's pool for these options (one per distinct TransportOptions), made at first
  // use and kept while any client holds it.
  static std::shared_ptr<ClientWorkerPool> ForProcess(const TransportOptions& options);

  // The worker the next channel should run on.
  Result<std::shared_ptr<ClientWorker>> Next();
  size_t size() const { return size_; }
  // Workers made so far.
  size_t workers() const;

 private:
  ClientWorkerPool(const TransportOptions& options, size_t size);

  const TransportOptions options_;
  const size_t size_;
  mutable std::mutex mu_;
  std::vector<std::shared_ptr<ClientWorker>> workers_;  // guarded by mu_
};

// The server end: accepts connections and dispatches requests to handlers by method.
// Handlers run on the progress thread and must not block (hand slow work to another thread and
// reply from there). Register handlers before Start. Thread-safe after Start.
class RpcServer : public Listener {
 public:
  static Result<std::unique_ptr<RpcServer>> Create(ServerOptions options);
  ~RpcServer() override;

  void Handle(uint16_t method, Handler handler) override;
  // Runs on the progress thread when a connection ends (the client closed or died, or the
  // server is stopping), after its outstanding payload transfers failed. Register before Start.
  void OnDisconnect(std::function<void(uint64_t connection_id)> fn) override;
  // Binds and starts accepting; port() is known after it returns.
  Status Start() override;
  // Stops accepting, closes every connection (OnDisconnect runs for each) and joins the
  // progress thread; after it no handler runs. Idempotent; the destructor calls it.
  void Stop() override;
  uint16_t port() const override;

  Result<MemoryRegion> RegisterMemory(MutableBytes memory);
  Result<MemoryRegion> AllocateMemory(size_t bytes) override;
  bool OnProgressThread() const;
  void RunOnProgressThread(std::function<void()> fn) override;
  void RunEvery(std::chrono::milliseconds period, std::function<void()> fn) override;
  TransportStats stats() const override;
  size_t connection_count() const override;
  // The workers serving connections, each with its progress thread.
  size_t progress_threads() const;

  class Impl;

 private:
  explicit RpcServer(std::vector<std::shared_ptr<Impl>> impls);

  // One per worker; the first listens. Each is shared with calls still held by handlers.
  std::vector<std::shared_ptr<Impl>> impls_;
};

}  // namespace kvstash::transport
