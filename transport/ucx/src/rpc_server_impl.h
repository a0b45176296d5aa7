#pragma once

// The UCX server's private classes: RpcServer::Impl (accepts connections, validates frames,
// dispatches requests, sends replies), the state of one connection and of one request
// (UcxCall). Private to transport/src/ucx/; the methods are defined in the files named at each
// section below.

#include <ucp/api/ucp.h>

#include <asio.hpp>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "kvstash/common/status.h"
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

// One client's connection: its bootstrap socket, its UCX endpoint and the mapped-payload
// exchanges in flight on it. Shared by the server's table of open connections and by the calls
// that arrived on it (a reply keeps it alive while it is sent). Progress-thread state.
struct ServerConnection {
  uint64_t id = 0;
  uint64_t bind_token = 0;      // the secret its kBind must carry (HelloReply.bind_token)
  uint64_t foreign_frames = 0;  // frames that named it from another endpoint
  std::string key_namespace;
  std::string client_name;
  asio::ip::tcp::socket socket;
  UcpEndpoint ep;  // the endpoint its frames come on, claimed by its kBind (empty until then)
  bool open = true;
  char watch_byte[1];
  // Mapped payloads (progress thread): regions whose rkey the client has, pulls waiting for
  // kPullDone or kPayload, and mapped replies waiting for kAck (their `sent` callbacks).
  std::unordered_set<uint64_t> rkeys_sent;
  std::unordered_map<uint64_t, PendingPull> pulls;
  std::unordered_map<uint64_t, std::function<void(Status)>> acks;
  explicit ServerConnection(asio::ip::tcp::socket s) : socket(std::move(s)) {}
};

// An endpoint a hello made, not claimed yet by a connection's kBind. UCX pairs a client's
// endpoints with the server's by the order each side made them, and a client process that
// connects on several threads may make them in another order than the server answered the
// hellos: the endpoint a client's frames come on is then one made for another of its hellos.
// A spare whose hello's connection closed is kept this long (a client of that process may
// still be paired with it), and at most this many such spares are kept.
inline constexpr auto kSpareGrace = std::chrono::seconds(60);
inline constexpr size_t kMaxOrphanedSpares = 1024;
struct SpareEndpoint {
  UcpEndpoint ep;
  uint64_t hello = 0;               // the connection whose hello made it
  Clock::time_point orphaned_at{};  // when that connection closed (unset while it is open)
};

// One request; shared by its ServerCall handle and the UCX operations it starts. Made and
// dispatched on the progress thread; its fields are progress-thread state but for `replied` and
// `cancel_flag`. As thread-safe as ServerCall says: its replies, ReceivePayload and Drop may
// run on any thread and hand their work to the progress thread. Methods in ucx_call.cc.
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

  // Lets go of the request payload unless it was received or released already. Progress
  // thread.
  void ReleasePayload();

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

namespace internal {

// A reply on its way: owns its header (and a message too large for the header) until UCX has
// sent them, then runs `sent`.
struct ReplySend {
  std::vector<std::byte> header;
  std::vector<std::byte> message_in_data;
  std::function<void(Status)> sent;
  std::shared_ptr<UcxCall> state;  // keeps the connection alive while sending
};

inline wire::Code ToWire(StatusCode code) { return static_cast<wire::Code>(code); }

}  // namespace internal

// RpcServer's implementation: accepts connections (bootstrap socket + UCX endpoint per client),
// validates frames and dispatches requests, and sends the replies. Shared by its RpcServer and
// by every UcxCall, so a call a handler still holds may outlive the RpcServer handle.
//
// Thread-safety: Handle and OnDisconnect before Start; the replies (Reply, ReplyStatus,
// ReceivePayload, Drop) and RunEvery from any thread (they hand their work to the progress
// thread); port after Start, stats and connection_count anywhere. Everything below the public
// entry points runs on the progress thread.
class RpcServer::Impl : public std::enable_shared_from_this<RpcServer::Impl> {
 public:
  Impl(ServerOptions options, std::shared_ptr<Worker> worker);  // rpc_server_connections.cc

  void Handle(uint16_t method, Handler handler) { handlers_[method] = std::move(handler); }
  void OnDisconnect(std::function<void(uint64_t)> fn) { on_disconnect_ = std::move(fn); }

  Status Start();  // rpc_server_connections.cc

  void Stop() { worker_->Stop(); }

  void RunEvery(std::chrono::milliseconds period, std::function<void()> fn);  // rpc_server.cc
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
    s.bad_hellos = bad_hellos_.load();
    s.foreign_frames = foreign_frames_.load();
    s.accept_pauses = accept_pauses_.load();
    return s;
  }
  size_t connection_count() const { return open_connections_.load(); }

  // ---- replies (any thread): rpc_server_replies.cc -----------------------------------------

  void Reply(const std::shared_ptr<UcxCall>& state, StatusCode code, Bytes message, Bytes payload,
             const MemoryRegion* region, std::function<void(Status)> sent);
  void ReplyStatus(const std::shared_ptr<UcxCall>& state, const Status& status);
  void ReceivePayload(const std::shared_ptr<UcxCall>& state, MutableBytes dest,
                      const MemoryRegion* region, std::function<void(Status)> done);
  // The handle was dropped: reply Internal if the handler never did, release the payload.
  void Drop(std::shared_ptr<UcxCall> state);

  // rpc_server_frames.cc
  void Forget(const UcxCall& state);

 private:
  using ReplySend = internal::ReplySend;

  // ---- replies, on the progress thread: rpc_server_replies.cc ------------------------------

  // Receives rendezvous payload bytes (of a request or a kPayload frame) into dest.
  void ReceiveData(const std::shared_ptr<UcxCall>& state, void* descriptor, MutableBytes dest,
                   const MemoryRegion* region, std::function<void(Status)> done);
  // Asks the client for a held payload: copied by the client straight into dest when dest is in
  // memory it can map, else sent as a kPayload frame. `done` runs on kPullDone / the data, or
  // when the connection closes.
  void Pull(const std::shared_ptr<UcxCall>& state, MutableBytes dest, const MemoryRegion* region,
            std::function<void(Status)> done);
  // Names `bytes` of a shared region in ref, with the region's rkey the first time this
  // connection hears of it.
  void FillRef(ServerConnection& connection, const MemoryRegion& region, Bytes bytes,
               MappedRef* ref, std::span<const std::byte>* rkey);
  void SendControl(std::shared_ptr<ServerConnection> connection, std::vector<std::byte> frame);
  void SendReply(std::unique_ptr<ReplySend> send, Bytes payload, const MemoryRegion* region);
  // The payload stays in the server's shared memory; the client copies it out and sends kAck,
  // which runs `sent` (until then the payload must not change).
  void SendMappedReply(std::unique_ptr<ReplySend> send, Bytes payload, const MemoryRegion& region);
  // A control frame from the client about a pull or a mapped reply.
  void OnControl(const std::shared_ptr<ServerConnection>& connection, const FrameView& frame,
                 void* data, size_t length, bool rndv);

  // ---- timers: rpc_server.cc ---------------------------------------------------------------

  // One period of RunEvery: runs the task when the timer fires, then sets it again, until the
  // worker stops (its io_context then drops the pending wait).
  void Tick(std::shared_ptr<asio::steady_timer> timer, std::chrono::milliseconds period,
            std::shared_ptr<std::function<void()>> task);

  // ---- connections: rpc_server_connections.cc ----------------------------------------------

  void Accept();
  // Accept failed (no file descriptors, no memory): tries again after a pause, saying so once
  // per episode.
  void PauseAccepting(const asio::error_code& error);
  // A connection id no open connection has; random.
  uint64_t RandomId();
  void OnHello(const std::shared_ptr<ServerConnection>& connection, Status status,
               const std::string& body);
  void Watch(const std::shared_ptr<ServerConnection>& connection);
  static void OnEndpointError(void* arg, ucp_ep_h ep, ucs_status_t status);
  void Close(std::shared_ptr<ServerConnection> connection, const Status& why);
  // Closes `ep` (force) on the progress thread, now when the worker is stopping.
  void CloseEndpoint(UcpEndpoint ep);
  // Closes spare endpoints whose hello's connection closed over kSpareGrace ago, and the
  // oldest such ones past kMaxOrphanedSpares.
  void SweepSpares(Clock::time_point now);
  void Shutdown();

  // ---- frames: rpc_server_frames.cc --------------------------------------------------------

  static ucs_status_t OnFrame(void* arg, const void* header, size_t header_length, void* data,
                              size_t length, const ucp_am_recv_param_t* param);
  // `from`: the endpoint the frame came on (UCX's reply endpoint; the client sends every frame
  // with UCP_AM_SEND_FLAG_REPLY), null when UCX gave none.
  ucs_status_t Dispatch(Bytes header, void* data, size_t length, bool rndv, ucp_ep_h from);
  // The open connection bound to `from`, or null.
  std::shared_ptr<ServerConnection> BoundConnection(ucp_ep_h from) const;
  // The open connection whose frames come on `from` and which `h` names; null (and counted)
  // when the frame names a connection that is not `from`'s.
  std::shared_ptr<ServerConnection> ConnectionOf(const FrameHeader& h, ucp_ep_h from);
  // A kBind frame: binds the connection it names to `from` when it carries the connection's
  // token.
  void Bind(const FrameHeader& h, ucp_ep_h from);
  std::shared_ptr<UcxCall> NewState(const std::shared_ptr<ServerConnection>& connection,
                                    const FrameHeader& h);

  struct PairHash {
    size_t operator()(const std::pair<uint64_t, uint64_t>& p) const {
      return std::hash<uint64_t>()(p.first * 0x9e3779b97f4a7c15ULL ^ p.second);
    }
  };

  ServerOptions options_;
  std::shared_ptr<Worker> worker_;
  asio::ip::tcp::acceptor acceptor_;
  asio::steady_timer accept_pause_;
  unsigned accept_failures_ = 0;  // in a row, since the last accept that worked
  uint64_t hellos_refused_ = 0;   // for the log, which says the 1st, 2nd, 4th, ...
  std::mt19937_64 random_;        // connection ids and bind tokens (seeded from random_device)
  uint16_t port_ = 0;
  MemoryRegion probe_;
  uint64_t cookie_ = 0;
  std::unordered_map<uint16_t, Handler> handlers_;
  std::function<void(uint64_t)> on_disconnect_;
  std::unordered_map<uint64_t, std::shared_ptr<ServerConnection>> connections_;
  // Endpoints: each hello makes one (a spare) and each kBind claims the spare its frames came
  // on, which becomes that connection's endpoint (bound_). See ClaimEndpoint.
  std::unordered_map<ucp_ep_h, uint64_t> bound_;  // a claimed endpoint -> its connection
  std::unordered_map<ucp_ep_h, SpareEndpoint> spare_;
  std::unordered_map<std::pair<uint64_t, uint64_t>, std::weak_ptr<UcxCall>, PairHash> active_;
  std::atomic<uint64_t> calls_{0}, connects_{0}, disconnects_{0}, malformed_{0}, mapped_{0},
      refusals_{0}, bad_hellos_{0}, foreign_frames_{0}, accept_pauses_{0};
  std::atomic<size_t> open_connections_{0};
};

}  // namespace kvstash::transport
