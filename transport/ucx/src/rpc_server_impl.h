#pragma once

// The UCX server's private classes. RpcServer::Impl owns one of each part and wires them:
//   ConnectionTable  the open connections, their ids and the clients' UCX endpoints;
//   HelloAcceptor    the listening socket and each connection's hello on its bootstrap socket;
//   FrameDispatcher  frames from clients: validated, then routed (handlers, cancels, controls);
//   ReplySender      replies, sent with their payload or mapped (then acknowledged, kAck);
//   PayloadReceiver  request payloads: in the frame, by rendezvous, or pulled from the client;
// and UcxCall, one request. The parts live as long as their Impl, which every call keeps alive
// (UcxCall::server), and refer to each other by reference. Private to transport/ucx/src/:
// rpc_server.cc (Impl, RpcServer), rpc_server_connections.cc (ConnectionTable, HelloAcceptor),
// rpc_server_frames.cc (FrameDispatcher), rpc_server_replies.cc (ReplySender, PayloadReceiver,
// UcxCall).

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
// exchanges in flight on it. Shared by the ConnectionTable (while open) and by the calls that
// arrived on it (a reply keeps it alive while it is sent). Progress-thread state.
struct ServerConnection {
  uint64_t id = 0;              // nonzero once its hello was accepted (ConnectionTable::Add)
  uint64_t bind_token = 0;      // the secret its kBind must carry (HelloReply.bind_token)
  uint64_t foreign_frames = 0;  // frames that named it from another endpoint
  std::string tenant;
  std::string client_name;
  asio::ip::tcp::socket socket;
  UcpEndpoint ep;  // the endpoint its frames come on, claimed by its kBind (empty until then)
  bool open = true;
  char watch_byte[1];
  // Mapped payloads: regions whose rkey the client has, pulls waiting for kPullDone or kPayload
  // (PayloadReceiver's), and mapped replies waiting for kAck (ReplySender's `sent` callbacks).
  // Both fail when the connection closes.
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

// The server's counters (TransportStats). Bumped on the progress thread, read from any thread;
// open_connections is the ConnectionTable's size, for connection_count() off the thread.
struct ServerCounters {
  std::atomic<uint64_t> calls{0}, connects{0}, disconnects{0}, malformed{0}, mapped{0}, refusals{0},
      bad_hellos{0}, foreign_frames{0}, accept_pauses{0};
  std::atomic<size_t> open_connections{0};
  // Sockets handed to this worker whose hello is not answered yet: with open_connections, how
  // busy a worker is when the next connection picks one (RpcServer spreads them).
  std::atomic<size_t> pending_hellos{0};

  TransportStats Snapshot() const {
    TransportStats s;
    s.calls = calls.load();
    s.connects = connects.load();
    s.disconnects = disconnects.load();
    s.malformed_frames = malformed.load();
    s.mapped_payloads = mapped.load();
    s.refused = refusals.load();
    s.bad_hellos = bad_hellos.load();
    s.foreign_frames = foreign_frames.load();
    s.accept_pauses = accept_pauses.load();
    return s;
  }
};

// One request; shared by its ServerCall handle and the UCX operations it starts. Made and
// dispatched on the progress thread (FrameDispatcher); its fields are progress-thread state but
// for `replied` and `cancel_flag`. As thread-safe as ServerCall says: its replies,
// ReceivePayload and Drop may run on any thread and hand their work to the progress thread.
// Invariant: once payload_consumed, the request payload is the receiver's or let go, and no one
// touches payload_data again.
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
  const std::string& tenant() const override;
  Bytes request() const override { return request_bytes; }
  size_t payload_bytes() const override { return payload_size; }
  Clock::time_point deadline() const override { return deadline_at; }
  bool cancelled() const override { return cancel_flag.load() || Clock::now() >= deadline_at; }
  void ReceivePayload(MutableBytes dest, const MemoryRegion* region,
                      std::function<void(Status)> done) override;
  void Reply(Bytes message, Bytes payload, const MemoryRegion* region,
             std::function<void(Status)> sent) override;
  void ReplyError(const Status& status) override;
  // The handle was dropped: replies Internal if the handler never did, releases the payload.
  void Drop() override;
};

namespace internal {

inline wire::Code ToWire(StatusCode code) { return static_cast<wire::Code>(code); }

}  // namespace internal

// The open connections and the UCX endpoints of their clients. Each accepted hello makes an
// endpoint, a spare until a kBind claims the spare its frames came on (SpareEndpoint), which is
// from then on that connection's own: replies go back on it and frames are taken from it only.
// Owns the table of open connections, the endpoints (bound and spare), and the random source of
// ids and bind tokens.
// Invariants: connections_ holds each connection from its accepted hello (Add) until it closes
// (open turns false), by its nonzero, unique random id (counters.open_connections is its size);
// bound_ maps each claimed endpoint to its connection, which holds it in `ep`; an endpoint is
// in at most one of bound_ and spare_; a connection leaves the table once, in Close, which
// fails its pulls and acks and runs OnDisconnect.
// Thread-safety: OnDisconnect before the worker starts; everything else on the progress thread
// (UCX's endpoint-error callback included).
class ConnectionTable {
 public:
  ConnectionTable(Worker& worker, ServerCounters& counters);

  void OnDisconnect(std::function<void(uint64_t)> fn) { on_disconnect_ = std::move(fn); }

  // Opens a UCX endpoint to the client at `worker_address` (checked already: UCX aborts on an
  // address it does not expect) and adds the connection, under a new id and bind token. The
  // endpoint is a spare until the connection's kBind. Returns the UCX error, adding nothing.
  Status Add(const std::shared_ptr<ServerConnection>& connection,
             const std::string& worker_address);
  size_t size() const { return connections_.size(); }

  // The open connection bound to `from`, or null.
  std::shared_ptr<ServerConnection> BoundConnection(ucp_ep_h from) const;
  // The open connection whose frames come on `from` and which `h` names; null (and counted)
  // when the frame names a connection that is not `from`'s.
  std::shared_ptr<ServerConnection> ConnectionOf(const FrameHeader& h, ucp_ep_h from);
  // A kBind frame: binds the connection it names to `from` when it carries the connection's
  // token.
  void Bind(const FrameHeader& h, ucp_ep_h from);

  // Ends a connection (once): its socket and endpoint close, its pulls and mapped replies fail,
  // OnDisconnect runs.
  void Close(std::shared_ptr<ServerConnection> connection, const Status& why);
  // The server stops: every connection closes with `why`, and every spare endpoint.
  void CloseAll(const Status& why);

 private:
  // A connection id no open connection has; random.
  uint64_t RandomId();
  static void OnEndpointError(void* arg, ucp_ep_h ep, ucs_status_t status);
  // Closes `ep` (force) on the progress thread, now when the worker is stopping.
  void CloseEndpoint(UcpEndpoint ep);
  // Closes spare endpoints whose hello's connection closed over kSpareGrace ago, and the
  // oldest such ones past kMaxOrphanedSpares.
  void SweepSpares(Clock::time_point now);

  Worker& worker_;
  ServerCounters& counters_;
  std::function<void(uint64_t)> on_disconnect_;
  std::mt19937_64 random_;  // connection ids and bind tokens (seeded from random_device)
  std::unordered_map<uint64_t, std::shared_ptr<ServerConnection>> connections_;
  std::unordered_map<ucp_ep_h, uint64_t> bound_;  // a claimed endpoint -> its connection
  std::unordered_map<ucp_ep_h, SpareEndpoint> spare_;
};

// The probe region a client on this host maps to learn it may use mapped payloads: 4 KiB of
// shared memory holding a random cookie. One per server, shared by its workers' acceptors.
struct MappedProbe {
  MemoryRegion region;
  uint64_t cookie = 0;
};

// Lets clients in: listens, reads each connection's hello on its bootstrap socket and checks it
// (protocol version, token, namespace, the client's UCX worker address), answers it (refused:
// the error, then the socket closes; accepted: the connection's id and bind token, the server's
// limits, UCX address and mapped probe), then watches the socket for the client going away.
// A server with several workers listens on one of them, whose acceptor hands each accepted
// socket to the worker that serves it (Handoff); that worker's acceptor reads the hello (Adopt),
// so the connection's endpoint, frames and replies are that worker's from the start.
// Owns the acceptor and its pause after a failed accept, the count of refused hellos (for the
// log), and a share of the mapped probe.
// Invariants: a connection enters the ConnectionTable only with a hello that passed every check
// and an endpoint; a refused one never does. Every socket Adopt takes decrements
// pending_hellos once, when its hello is answered or fails.
// Thread-safety: Listen, SetHandoff and ShareProbe before the worker starts, port() anywhere
// after it; everything else on the progress thread.
class HelloAcceptor {
 public:
  // Where an accepted socket goes: another worker's acceptor (Adopt, on that worker's thread).
  using Handoff = std::function<void(asio::ip::tcp::socket)>;

  HelloAcceptor(const ServerOptions& options, Worker& worker, ConnectionTable& connections,
                ServerCounters& counters);

  // Binds and listens (the port is known when it returns), and allocates the mapped probe.
  Status Listen();
  void SetHandoff(Handoff handoff) { handoff_ = std::move(handoff); }
  // The probe clients of this acceptor's connections are shown (the listening acceptor's).
  std::shared_ptr<const MappedProbe> probe() const { return probe_; }
  void ShareProbe(std::shared_ptr<const MappedProbe> probe) { probe_ = std::move(probe); }
  uint16_t port() const { return port_; }
  void Accept();
  // Serves an accepted socket, whose pending_hellos the caller counted: reads its hello, with
  // the server's hello timeout.
  void Adopt(asio::ip::tcp::socket socket);
  // Stops accepting; the connections stay (ConnectionTable::CloseAll ends them).
  void Stop();

 private:
  // Accept failed (no file descriptors, no memory): tries again after a pause, saying so once
  // per episode.
  void PauseAccepting(const asio::error_code& error);
  void OnHello(const std::shared_ptr<ServerConnection>& connection, Status status,
               const std::string& body);
  // The checks of a parsed hello but the UCX endpoint's: OK or why it is refused.
  Status Check(const wire::Hello& hello);
  void Refuse(const std::shared_ptr<ServerConnection>& connection, const wire::Hello& hello,
              wire::HelloReply& reply, const Status& refused);
  void Watch(const std::shared_ptr<ServerConnection>& connection);

  const ServerOptions& options_;
  Worker& worker_;
  ConnectionTable& connections_;
  ServerCounters& counters_;
  asio::ip::tcp::acceptor acceptor_;
  asio::steady_timer accept_pause_;
  Handoff handoff_;               // empty: this acceptor serves what it accepts
  unsigned accept_failures_ = 0;  // in a row, since the last accept that worked
  uint64_t hellos_refused_ = 0;   // for the log, which says the 1st, 2nd, 4th, ...
  uint16_t port_ = 0;
  std::shared_ptr<const MappedProbe> probe_;  // null when the worker cannot share memory
};

// A reply on its way: owns its header (and a message too large for the header) until UCX has
// sent them, then runs `sent`.
struct ReplySend {
  std::vector<std::byte> header;
  std::vector<std::byte> message_in_data;
  std::function<void(Status)> sent;
  std::shared_ptr<UcxCall> state;  // keeps the connection alive while sending
};

// Sends replies: the header (with the message, or the message as data when too large) and the
// payload as one active message on the connection's endpoint; or, to a client that accepts it,
// a payload in the server's shared memory named by a MappedRef, which the client copies out and
// acknowledges with kAck. Owns no state of its own: a mapped reply's `sent` waits in its
// connection's `acks` (failed there when the connection closes).
// Invariant: each reply's `sent` runs once, on the progress thread (sent, failed, or the kAck),
// unless the worker stopped first (Worker::Run then drops the send unrun).
// Thread-safety: Reply and ReplyStatus from any thread (they hand the send to the progress
// thread); OnAck on the progress thread.
class ReplySender {
 public:
  ReplySender(Worker& worker, ServerCounters& counters) : worker_(worker), counters_(counters) {}

  void Reply(const std::shared_ptr<UcxCall>& state, StatusCode code, Bytes message, Bytes payload,
             const MemoryRegion* region, std::function<void(Status)> sent);
  // Replies `status` (its message as a wire.Error).
  void ReplyStatus(const std::shared_ptr<UcxCall>& state, const Status& status);
  // A kAck: the client copied the mapped reply of call `request_id` out.
  void OnAck(ServerConnection& connection, uint64_t request_id);

 private:
  void SendReply(std::unique_ptr<ReplySend> send, Bytes payload, const MemoryRegion* region);
  // The payload stays in the server's shared memory; the client copies it out and sends kAck,
  // which runs `sent` (until then the payload must not change).
  void SendMappedReply(std::unique_ptr<ReplySend> send, Bytes payload, const MemoryRegion& region);

  Worker& worker_;
  ServerCounters& counters_;
};

// Delivers request payloads into a handler's buffer: copied from the frame (eager), received by
// rendezvous, or, when the client holds the payload (mapped payloads), pulled: kPull asks the
// client to copy it straight into the buffer when the buffer is in memory the client maps, else
// to send it as a kPayload frame. Owns no state of its own: a pull waits in its connection's
// `pulls` (failed there when the connection closes).
// Invariant: each ReceivePayload's `done` runs once, on the progress thread, unless the worker
// stopped first; a payload is received at most once (UcxCall::payload_consumed).
// Thread-safety: ReceivePayload from any thread (it hands its work to the progress thread);
// OnPullAnswer on the progress thread.
class PayloadReceiver {
 public:
  PayloadReceiver(Worker& worker, ServerCounters& counters)
      : worker_(worker), counters_(counters) {}

  void ReceivePayload(const std::shared_ptr<UcxCall>& state, MutableBytes dest,
                      const MemoryRegion* region, std::function<void(Status)> done);
  // A kPullDone or kPayload frame from the client, answering a pull.
  void OnPullAnswer(const std::shared_ptr<ServerConnection>& connection, const FrameView& frame,
                    void* data, size_t length, bool rndv);

 private:
  // Receives rendezvous payload bytes (of a request or a kPayload frame) into dest.
  void ReceiveData(const std::shared_ptr<UcxCall>& state, void* descriptor, MutableBytes dest,
                   const MemoryRegion* region, std::function<void(Status)> done);
  // Asks the client for a held payload. `done` runs on kPullDone / the data, or when the
  // connection closes.
  void Pull(const std::shared_ptr<UcxCall>& state, MutableBytes dest, const MemoryRegion* region,
            std::function<void(Status)> done);

  Worker& worker_;
  ServerCounters& counters_;
};

// Takes every frame from clients (UCX's active-message callback): validates it, takes it only
// from the endpoint its connection bound, and routes it: a kBind to the ConnectionTable, a
// request to its method's handler as a new UcxCall, a kCancel to its call, a kAck to the
// ReplySender and a pull's answer to the PayloadReceiver. A malformed frame is counted, its
// rendezvous payload drained, and answered when it names its own connection and a request.
// Owns the handlers and the table of calls in flight (for kCancel).
// Invariants: active_ names each call from its dispatch until it is dropped (Forget); an
// entry's call may be gone already (weak). Every rendezvous payload a frame brings is received,
// drained, or its connection closed.
// Thread-safety: Handle before the worker starts; everything else on the progress thread.
class FrameDispatcher {
 public:
  FrameDispatcher(RpcServer::Impl& server, Worker& worker, ConnectionTable& connections,
                  ReplySender& replies, PayloadReceiver& payloads, ServerCounters& counters)
      : server_(server),
        worker_(worker),
        connections_(connections),
        replies_(replies),
        payloads_(payloads),
        counters_(counters) {}

  void Handle(uint16_t method, Handler handler) { handlers_[method] = std::move(handler); }
  // UCX's callback for kRpcAmId frames; `arg` is the FrameDispatcher.
  static ucs_status_t OnFrame(void* arg, const void* header, size_t header_length, void* data,
                              size_t length, const ucp_am_recv_param_t* param);
  // The call was dropped: a kCancel no longer finds it.
  void Forget(const UcxCall& state);

 private:
  // `from`: the endpoint the frame came on (UCX's reply endpoint; the client sends every frame
  // with UCP_AM_SEND_FLAG_REPLY), null when UCX gave none.
  ucs_status_t Dispatch(Bytes header, void* data, size_t length, bool rndv, ucp_ep_h from);
  // A frame ParseFrame refused: counted, said (sparingly), and answered when it names a request
  // of its own endpoint's connection.
  void OnMalformed(Bytes header, const Status& error, ucp_ep_h from);
  // A request: to its method's handler as a new call, or answered with why not. Returns
  // UCS_INPROGRESS when the call keeps its payload past the callback.
  ucs_status_t DispatchRequest(const std::shared_ptr<ServerConnection>& connection,
                               const FrameView& frame, void* data, size_t length, bool rndv,
                               ucp_ep_h from);
  // An unwanted rendezvous payload is drained; one beyond the payload limit closes the
  // connection it came on (which releases it), never one it merely names.
  void Release(void* data, size_t length, bool rndv, ucp_ep_h from);
  std::shared_ptr<UcxCall> NewState(const std::shared_ptr<ServerConnection>& connection,
                                    const FrameHeader& h);

  struct PairHash {
    size_t operator()(const std::pair<uint64_t, uint64_t>& p) const {
      return std::hash<uint64_t>()(p.first * 0x9e3779b97f4a7c15ULL ^ p.second);
    }
  };

  RpcServer::Impl& server_;  // its owner, which each call keeps alive
  Worker& worker_;
  ConnectionTable& connections_;
  ReplySender& replies_;
  PayloadReceiver& payloads_;
  ServerCounters& counters_;
  std::unordered_map<uint16_t, Handler> handlers_;
  // (connection id, request id) -> the call.
  std::unordered_map<std::pair<uint64_t, uint64_t>, std::weak_ptr<UcxCall>, PairHash> active_;
};

// RpcServer's implementation: owns the worker and the parts above, starts and stops them, and
// runs the periodic tasks. Shared by its RpcServer and by every UcxCall, so a call a handler
// still holds may outlive the RpcServer handle (its replies then go nowhere).
// Invariant: the parts are made with the Impl and die with it, after the worker stopped (its
// progress thread calls them until then); worker_ is declared first so it outlives them.
// Thread-safety: Handle and OnDisconnect before Start; RunEvery from any thread; port after
// Start, stats and connection_count anywhere. Shutdown runs on the progress thread.
class RpcServer::Impl : public std::enable_shared_from_this<RpcServer::Impl> {
 public:
  // `listens`: this worker's acceptor listens (the server's first worker); the others serve
  // the connections handed to them.
  Impl(ServerOptions options, std::shared_ptr<Worker> worker, bool listens);

  void Handle(uint16_t method, Handler handler) { frames_.Handle(method, std::move(handler)); }
  void OnDisconnect(std::function<void(uint64_t)> fn) { connections_.OnDisconnect(std::move(fn)); }
  // Binds and listens (the listening Impl only, before Start).
  Status Listen();
  Status Start();
  void Stop() { worker_->Stop(); }
  void RunEvery(std::chrono::milliseconds period, std::function<void()> fn);

  uint16_t port() const { return acceptor_.port(); }
  const std::shared_ptr<Worker>& worker() const { return worker_; }
  // The listening worker's acceptor (handoffs, the probe), or another worker's (Adopt).
  HelloAcceptor& acceptor() { return acceptor_; }
  const ServerCounters& counters() const { return counters_; }
  ServerCounters& counters() { return counters_; }
  TransportStats stats() const { return counters_.Snapshot(); }
  size_t connection_count() const { return counters_.open_connections.load(); }

  // The parts a call uses (UcxCall).
  ReplySender& replies() { return replies_; }
  PayloadReceiver& payloads() { return payloads_; }
  FrameDispatcher& frames() { return frames_; }

 private:
  // One period of RunEvery: runs the task when the timer fires, then sets it again, until the
  // worker stops (its io_context then drops the pending wait).
  void Tick(std::shared_ptr<asio::steady_timer> timer, std::chrono::milliseconds period,
            std::shared_ptr<std::function<void()>> task);
  // The worker stops: no more accepts, every connection closes.
  void Shutdown();

  std::shared_ptr<Worker> worker_;
  ServerOptions options_;
  bool listens_ = true;
  ServerCounters counters_;
  ConnectionTable connections_;
  ReplySender replies_;
  PayloadReceiver payloads_;
  FrameDispatcher frames_;
  HelloAcceptor acceptor_;
};

}  // namespace kvstash::transport
