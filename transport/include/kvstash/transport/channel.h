#pragma once

// The call interface a service and its clients are written against, whatever carries the calls:
// a client's Channel, a server's Listener and the ServerCall a handler answers. UCX implements
// it (rpc.h, kvstash::transport_ucx), so does the in-process loopback (loopback.h,
// kvstash::transport_testing); every implementation passes the contract suite
// (tests/transport/contract_test.cc, ctest label `contract`), which is what this interface
// promises.
//
// Every call carries a small message (bytes; a service puts its protobuf there) and at most one
// payload each way: a request payload (the server receives it straight into memory it chooses)
// and a reply payload (the client receives it straight into the buffer it gave). Every callback
// runs on the transport's progress thread and must not block.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvstash/common/status.h"

namespace kvstash::transport {

using Bytes = std::span<const std::byte>;
using MutableBytes = std::span<std::byte>;
using Clock = std::chrono::steady_clock;

// The most progress threads a server runs (TransportOptions::progress_threads).
inline constexpr size_t kMaxProgressThreads = 64;

struct TransportOptions {
  // UCX transports for this endpoint's context, as UCX_TLS would name them ("shm", "tcp",
  // "shm,tcp"...). Empty: the UCX_TLS environment variable, else UCX's default.
  std::string tls;
  // Largest RPC message (the protobuf part of a frame) accepted or sent.
  size_t max_message_bytes = size_t{4} << 20;
  // Largest payload accepted in one call (a request payload on the server).
  size_t max_payload_bytes = size_t{64} << 20;
  // A server's progress threads, each with its UCX worker, serving its connections (each
  // connection one thread's); 0: one per core, at most 4. Clients ignore it.
  size_t progress_threads = 0;
  // The stream transport (stream.h) cuts off a peer that stops mid-frame (a header, message or
  // payload begun and not finished, or a reply it does not read) for this long, freeing what
  // the frame held (a tier slot, a call). UCX ignores it.
  std::chrono::milliseconds stall_timeout{10000};
  // How long the progress thread spins without events before it sleeps on the event fd.
  std::chrono::microseconds spin_before_sleep{200};
  // While spinning, yield the core to any other runnable thread (sched_yield) between polls.
  bool yield_while_spinning = true;
  // Copy payloads straight from and into the server's shared memory when both ends are on
  // one host (see above). Off: payloads always go by UCX rendezvous.
  bool mapped_payloads = true;
  // Where this context's UCX posix allocator creates its shared-memory files (UCX_POSIX_DIR,
  // for this context only: other contexts in the process keep theirs). A file lives there
  // while UCX fills it, until it is unlinked, so a process killed meanwhile leaves it behind:
  // the node gives a directory of its own that a later node cleans (kvstashd). Empty: UCX's
  // setting (by default /dev/shm through shm_open).
  std::string shm_dir;
};

// Memory a transport knows, so payloads move from and into it without a registration per call
// (UCX: registered with its context, or allocated where a client on the same host can map it).
// Move-only; the transport's release (unregister, free) runs on destruction. Must not outlive
// the client or server that made it.
class MemoryRegion {
 public:
  MemoryRegion() = default;
  // For implementations: `handle` is theirs (UCX: the ucp_mem_h), `id` unique in the process,
  // `packed_rkey` what a process on the same host maps it with (empty where none can), and
  // `release` runs once when the region goes.
  MemoryRegion(MutableBytes bytes, void* handle, uint64_t id, std::string packed_rkey,
               std::function<void()> release);
  MemoryRegion(MemoryRegion&& other) noexcept;
  MemoryRegion& operator=(MemoryRegion&& other) noexcept;
  MemoryRegion(const MemoryRegion&) = delete;
  MemoryRegion& operator=(const MemoryRegion&) = delete;
  ~MemoryRegion();

  std::byte* data() const { return data_; }
  size_t size() const { return size_; }
  MutableBytes bytes() const { return {data_, size_}; }
  bool Contains(Bytes span) const {
    return span.data() >= data_ && span.data() + span.size() <= data_ + size_;
  }
  // For the transport's own use (see the constructor).
  void* handle() const { return handle_; }
  uint64_t id() const { return id_; }
  const std::string& packed_rkey() const { return rkey_; }

 private:
  void Reset();

  void* handle_ = nullptr;
  std::byte* data_ = nullptr;
  size_t size_ = 0;
  uint64_t id_ = 0;
  std::string rkey_;
  std::function<void()> release_;
};

// The outcome of one call, passed to its callback.
struct Response {
  Status status;
  Bytes message;             // the reply's protobuf bytes; valid during the callback only
  size_t payload_bytes = 0;  // bytes written into CallOptions::recv_payload
};
using ResponseCallback = std::function<void(const Response&)>;

// Runs the same-host payload copies of calls (CallOptions::copier) on a thread of the caller's
// choosing, normally the one waiting for those calls: then N callers copy in parallel, where
// the progress thread would copy for all of them one after another. CallGroup is the usual one.
class CopyExecutor {
 public:
  virtual ~CopyExecutor() = default;
  // Called on the transport's progress thread. `copy` must run exactly once, soon, and not on
  // that thread: its call does not complete, and the server's memory stays lent to it, until
  // it has run.
  virtual void Post(std::function<void()> copy) = 0;
};

struct CallOptions {
  // The call fails with DeadlineExceeded at this time (and the server is told to cancel it).
  Clock::time_point deadline = Clock::now() + std::chrono::seconds(10);
  // Request payload; must stay valid and unchanged until the callback runs. Registered memory
  // (send_region) moves without a registration per call.
  Bytes send_payload;
  const MemoryRegion* send_region = nullptr;
  // Where a reply payload lands; must stay valid until the callback runs. A reply payload
  // larger than this fails the call with OutOfRange.
  MutableBytes recv_payload;
  const MemoryRegion* recv_region = nullptr;
  // Where the call's payload copies run when they go through the server's shared memory (a
  // client on its host); must outlive the call. Null: on the transport's progress thread.
  CopyExecutor* copier = nullptr;
};

class ClientWorker;

// What a server states at hello: the limits every call to it must keep (a client splits its
// batches to fit them instead of having them refused), and its service's own statement.
struct ServerLimits {
  uint64_t max_message_bytes = 0;  // bytes of one request message
  uint64_t max_payload_bytes = 0;  // bytes of one request payload
  // ServerOptions::service_limits as the server gave them, carried as they are: what they mean
  // is the service's (a node's: its block size and key limit, wire.NodeLimits).
  std::string service_limits;
};

struct ClientOptions {
  std::string host = "127.0.0.1";
  uint16_t port = 0;
  // Who the client is to the server, named at hello with its token (a node: the namespace;
  // docs/semantics.md §18).
  std::string tenant = "default";
  std::string auth_token;
  std::string client_name;
  TransportOptions transport;  // ignored with `worker`: the worker's options apply
  std::chrono::milliseconds connect_timeout{5000};
  // Run this client's connection on a shared worker and progress thread (see ClientWorker).
  // Empty: the client makes its own.
  std::shared_ptr<ClientWorker> worker;
};

struct TransportStats {
  uint64_t calls = 0;             // client: calls started; server: requests dispatched
  uint64_t failed = 0;            // client: calls completed with an error
  uint64_t connects = 0;          // client: connections made; server: accepted
  uint64_t disconnects = 0;       // connections lost or closed
  uint64_t malformed_frames = 0;  // frames dropped or answered with an error for bad framing
  uint64_t late_replies = 0;      // replies for calls already completed (deadline, cancel)
  uint64_t mapped_payloads = 0;   // payloads copied through the server's shared memory
  uint64_t refused = 0;           // server: hellos refused for a wrong auth token
  uint64_t bad_hellos = 0;        // server: hellos refused as malformed (bytes, UCX address)
  uint64_t foreign_frames = 0;    // server: frames naming a connection not of their endpoint
  uint64_t accept_pauses = 0;     // server: accepts that failed (no descriptors) and paused
};

// The client end of a connection as a client of a service uses it: calls with deadlines and
// payloads, the connection made ahead when wanted, and the limits the server stated. RpcClient
// (UCX) and the loopback transport (loopback.h) implement it; FaultChannel (fault_channel.h)
// wraps one. Thread-safe.
class Channel {
 public:
  virtual ~Channel() = default;
  // As RpcClient::Call: `done` runs exactly once, on the transport's thread.
  virtual uint64_t Call(uint16_t method, Bytes request, const CallOptions& options,
                        ResponseCallback done) = 0;
  virtual void Cancel(uint64_t id) = 0;
  // Connects unless connected; `done` runs once with the outcome.
  virtual void ConnectAsync(std::function<void(const Status&)> done) = 0;
  // Closes the connection now (a peer that answers nothing, not even a probe): every call out
  // fails with Unavailable naming `why`, transfers under way included (their buffers are free
  // once their callbacks ran); the next call connects again.
  virtual void Reset(const Status& why) = 0;
  // What the server stated at the latest hello; nullopt before the first connection.
  virtual std::optional<ServerLimits> server_limits() const = 0;
  // Whether payloads now move through the server's shared memory (a client on its host copies
  // them into and out of its memory itself): no network carries them, so a checksum of them
  // guards nothing. False until connected.
  virtual bool payloads_mapped() const { return false; }
};

// One request on a server, as the transport that carries it implements it (UCX, loopback).
// Used through ServerCall. Thread-safe where ServerCall's methods say so.
class ServerCallState {
 public:
  virtual ~ServerCallState() = default;
  virtual uint16_t method() const = 0;
  virtual uint64_t connection_id() const = 0;
  virtual const std::string& tenant() const = 0;
  virtual Bytes request() const = 0;
  virtual size_t payload_bytes() const = 0;
  virtual Clock::time_point deadline() const = 0;
  virtual bool cancelled() const = 0;
  virtual void ReceivePayload(MutableBytes dest, const MemoryRegion* region,
                              std::function<void(Status)> done) = 0;
  // The first Reply or ReplyError answers; later ones do nothing (a later Reply's `sent` runs
  // with FailedPrecondition).
  virtual void Reply(Bytes message, Bytes payload, const MemoryRegion* region,
                     std::function<void(Status)> sent) = 0;
  virtual void ReplyError(const Status& status) = 0;
  // The handle went away: the call answers Internal unless it was answered, and lets go of its
  // payload.
  virtual void Drop() = 0;
};

// One request on the server, handed to the method's handler. Move-only. The handler replies
// now or later, from any thread; a call destroyed without a reply answers Internal. A call may
// outlive its RpcServer: once the server stopped, replies go nowhere.
class ServerCall {
 public:
  ServerCall() = default;
  explicit ServerCall(std::shared_ptr<ServerCallState> state);
  ServerCall(ServerCall&&) noexcept = default;
  ServerCall& operator=(ServerCall&&) noexcept;
  ServerCall(const ServerCall&) = delete;
  ServerCall& operator=(const ServerCall&) = delete;
  ~ServerCall();

  uint16_t method() const;
  uint64_t connection_id() const;
  // The tenant the client named at hello (ClientOptions::tenant).
  const std::string& tenant() const;
  Bytes request() const;
  size_t payload_bytes() const;
  Clock::time_point deadline() const;
  // True once the client cancelled the call or its deadline passed: a reply would be dropped.
  bool cancelled() const;

  // Receives the request payload into dest (dest.size() >= payload_bytes()); `done` runs once
  // on the progress thread when the bytes are there (or failed). Call at most once.
  void ReceivePayload(MutableBytes dest, const MemoryRegion* region,
                      std::function<void(Status)> done);

  // Replies OK with `message` (copied) and an optional payload that must stay valid until
  // `sent` runs (on the progress thread, once, also when the reply could not be sent).
  void Reply(Bytes message, Bytes payload = {}, const MemoryRegion* region = nullptr,
             std::function<void(Status)> sent = {});
  // Replies with an error (message carried as wire.Error).
  void ReplyError(const Status& status);

 private:
  std::shared_ptr<ServerCallState> state_;
};

using Handler = std::function<void(ServerCall call)>;

struct ServerOptions {
  std::string bind_address = "127.0.0.1";
  uint16_t port = 0;  // 0: an ephemeral port (see RpcServer::port)
  // When not empty, a client's Hello must carry this token (else Unauthenticated).
  std::string auth_token;
  // Tenants with their own token: a client naming one of them must carry its token (else
  // Unauthenticated). When any is set, a tenant not listed here is served only if auth_token
  // is set (and then with it); else it is refused (PermissionDenied).
  std::map<std::string, std::string> tenant_tokens;
  TransportOptions transport;
  // Stated to every client at hello (ServerLimits::service_limits), as they are.
  std::string service_limits;
  std::chrono::milliseconds hello_timeout{5000};
  // Called on the progress thread at each hello whose token passed, with the tenant the client
  // named; a refusal is the hello's answer (a node gives the name its namespace id here, and
  // refuses one it cannot serve). Empty: every tenant.
  std::function<Status(std::string_view tenant)> admit_tenant;
};

// The server end of a transport as a service uses it: handlers by method, the end of each
// connection, the thread everything runs on, timers, and memory clients on the same host can
// map where the transport has it. RpcServer (UCX) and the loopback transport implement it.
// Thread-safe after Start; register handlers before.
class Listener {
 public:
  virtual ~Listener() = default;
  virtual void Handle(uint16_t method, Handler handler) = 0;
  // Runs on the progress thread when a connection ends (closed, lost, or the server stopping).
  virtual void OnDisconnect(std::function<void(uint64_t connection_id)> fn) = 0;
  virtual Status Start() = 0;
  // Stops accepting and ends every connection; after it no handler or timer runs. Idempotent.
  virtual void Stop() = 0;
  virtual uint16_t port() const = 0;
  // Memory clients on the same host copy into and out of directly; Unimplemented where the
  // transport has none.
  virtual Result<MemoryRegion> AllocateMemory(size_t bytes) = 0;
  virtual void RunOnProgressThread(std::function<void()> fn) = 0;
  // Runs `fn` on the progress thread every `period` from Start until Stop.
  virtual void RunEvery(std::chrono::milliseconds period, std::function<void()> fn) = 0;
  virtual TransportStats stats() const = 0;
  virtual size_t connection_count() const = 0;
};

}  // namespace kvstash::transport
