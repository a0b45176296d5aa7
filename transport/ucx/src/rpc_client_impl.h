#pragma once

// The UCX client's private classes: RpcClient::Impl (one connection: calls, deadlines,
// cancellation, connection and reconnection, mapped payloads), ClientWorker::Impl (the worker
// its clients share) and the state of one call. Private to transport/src/ucx/; the methods are
// defined in the files named at each section below.

#include <ucp/api/ucp.h>

#include <asio.hpp>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <queue>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "kvstash/common/memory_warmer.h"
#include "kvstash/common/mutex.h"
#include "kvstash/common/status.h"
#include "kvstash/proto/wire.pb.h"
#include "kvstash/transport/frame.h"
#include "kvstash/transport/rpc.h"
#include "rpc_client_bootstrap.h"
#include "worker.h"

namespace kvstash::transport {
namespace internal {

// One call of an RpcClient, from Call until its callback has run and UCX has let go of its
// buffers. Owned by its RpcClient::Impl (in calls_, then in abandoned_ while UCX still holds
// one of its requests). Built by Call on the caller's thread; progress-thread state after.
struct PendingCall {
  uint64_t id = 0;
  uint16_t method = 0;
  ResponseCallback done;
  Clock::time_point deadline;
  std::vector<std::byte> frame;           // header + message; UCX reads it until the send completes
  std::vector<std::byte> payload_header;  // of a kPayload frame
  bool message_in_data = false;
  Bytes message_bytes;  // the message inside frame (for kMessageInData)
  Bytes send_payload;
  const MemoryRegion* send_region = nullptr;
  MutableBytes recv_payload;
  const MemoryRegion* recv_region = nullptr;
  CopyExecutor* copier = nullptr;  // runs the call's mapped copy (null: the progress thread)
  // A mapped copy posted to the copier and not yet reported back (OnCopied): the server's
  // memory is lent to this call until then. `skip`, set when the call fails, makes a copy that
  // has not started skip its bytes.
  bool copying = false;
  std::shared_ptr<std::atomic<bool>> skip_copy;
  void* send_request = nullptr;  // in flight: UCX reads send_payload
  void* recv_request = nullptr;  // in flight: UCX writes recv_payload
  void* data_request = nullptr;  // in flight: a kPayload frame (UCX reads send_payload)
  bool held = false;             // the server pulls send_payload (mapped payloads)
  bool sent = false;             // handed to UCX on the current connection
  bool resolved = false;         // outcome known; done runs once no request is in flight
  bool resolving = false;        // inside Resolve: completions must not finish the call
  bool abandoned = false;        // done ran while UCX still held a request (see Abandon)
  Status status;
  std::vector<std::byte> reply;
  size_t payload_bytes = 0;
  void* impl = nullptr;  // the RpcClient::Impl that owns it
};

// True while UCX holds one of the call's requests (and so reads or writes its buffers).
inline bool InFlight(const PendingCall& call) {
  return call.send_request != nullptr || call.recv_request != nullptr ||
         call.data_request != nullptr || call.copying;
}

// A frame with no call behind it (cancel frames, test frames): owns its bytes until sent.
struct LooseSend {
  std::vector<std::byte> header;
  std::vector<std::byte> data;
  std::function<void(Status)> sent;  // when UCX has finished the send; may be empty
};

// The status a server's error reply carries: `code`, with the message of the wire::Error in
// `message` (or a note that it did not parse).
Status StatusFromWireError(uint16_t code, Bytes message);

}  // namespace internal

// The shared part of the clients of one worker: routes each frame to the client whose
// connection it names, and keeps the clients that were destroyed until nothing of theirs can
// still run on the thread. Owned by its ClientWorker, which every client of it holds, so it
// outlives them. Progress-thread state, except where noted. Defined in client_worker.cc.
class ClientWorker::Impl {
 public:
  explicit Impl(std::shared_ptr<Worker> worker)
      : worker_(std::move(worker)), sweep_(worker_->io()) {}
  ~Impl();

  Status Start();
  Worker& worker() { return *worker_; }
  const std::shared_ptr<Worker>& shared_worker() const { return worker_; }
  uint64_t unrouted() const { return unrouted_.load(); }

  // Routes frames naming `connection` to `client`; false when another client of this worker
  // has that id (two servers chose the same one).
  bool Route(uint64_t connection, RpcClient::Impl* client);
  void Unroute(uint64_t connection, const RpcClient::Impl* client);
  // Takes a client that was shut down; destroys it once it is quiet (no call or UCX request
  // left, a grace period for cancelled socket and timer handlers to run).
  void Retire(std::unique_ptr<RpcClient::Impl> client);

 private:
  static ucs_status_t OnFrame(void* arg, const void* header, size_t header_length, void* data,
                              size_t length, const ucp_am_recv_param_t* param);
  void Sweep();

  std::shared_ptr<Worker> worker_;
  std::unordered_map<uint64_t, RpcClient::Impl*> routes_;
  std::vector<std::pair<Clock::time_point, std::unique_ptr<RpcClient::Impl>>> retired_;
  asio::steady_timer sweep_;
  bool sweeping_ = false;
  std::atomic<uint64_t> unrouted_{0};
};

// RpcClient's implementation: the client end of one connection, with its calls, deadlines,
// cancellation, connection and reconnection, and mapped payloads. Owned by its RpcClient, then,
// from Detach, by its ClientWorker::Impl until it is quiet.
//
// Thread-safety: the public entry points above OnFrame (Call, Cancel, SendRaw, Connect,
// ConnectAsync, stats, connection_id, server_limits) may run on any thread: they hand their
// work to the progress thread, and what they read is atomic or under limits_mu_. Everything
// else, OnFrame included (the hub calls it), runs on the progress thread.
class RpcClient::Impl : public std::enable_shared_from_this<RpcClient::Impl> {
 public:
  Impl(ClientOptions options, ClientWorker::Impl* hub)
      : options_(std::move(options)),
        hub_(hub),
        worker_(hub->shared_worker()),
        bootstrap_(*worker_, options_, ucp_err_handler_t{&Impl::OnEndpointError, this}),
        timer_(worker_->io()) {
    options_.worker.reset();  // the RpcClient holds it; a retired Impl must not
  }

  // Fails every call, closes the connection and hands this Impl to the hub, which destroys it
  // once quiet. Returns after the shutdown (so no callback of this client runs after).
  static void Detach(std::unique_ptr<Impl> self);  // rpc_client_connection.cc

  // Nothing of this client can still run: no calls, no UCX request, no copy, no endpoint.
  bool Quiet() const { return calls_.empty() && abandoned_.empty() && !ep_ && copies_out_ == 0; }

  std::shared_ptr<Worker> worker() const { return worker_; }
  const ClientOptions& options() const { return options_; }

  // rpc_client_calls.cc
  uint64_t Call(uint16_t method, Bytes request, const CallOptions& options, ResponseCallback done);
  void Cancel(uint64_t id);
  // Closes the connection now, failing every call out with `why` (Channel::Reset).
  void Reset(Status why);

  // rpc_client_loose_frames.cc
  Status SendRaw(Bytes header, Bytes data, std::function<void(Status)> sent);

  // rpc_client_connection.cc
  Status Connect();
  void ConnectAsync(std::function<void(const Status&)> done);

  TransportStats stats() const {
    TransportStats s;
    s.calls = calls_started_.load();
    s.failed = calls_failed_.load();
    s.connects = connects_.load();
    s.disconnects = disconnects_.load();
    s.malformed_frames = malformed_.load();
    s.late_replies = late_replies_.load();
    s.mapped_payloads = mapped_payloads_.load();
    return s;
  }
  uint64_t connection_id() const { return connection_id_.load(); }
  bool payloads_mapped() const { return mapped_.load(std::memory_order_relaxed); }

  std::optional<ServerLimits> server_limits() const {
    MutexLock lock(&limits_mu_);
    return limits_;
  }

  // ---- frames from the server: rpc_client_frames.cc ----------------------------------------

  // A frame the hub routed here (its connection id is this client's).
  ucs_status_t OnFrame(const void* header, size_t header_length, void* data, size_t length,
                       const ucp_am_recv_param_t* param);

 private:
  using PendingCall = internal::PendingCall;
  using LooseSend = internal::LooseSend;
  enum class State { kIdle, kConnecting, kConnected };
  using Deadline = std::pair<Clock::time_point, uint64_t>;

  // ---- calls: rpc_client_calls.cc ----------------------------------------------------------

  void Start(std::unique_ptr<PendingCall> owned);
  void Send(PendingCall* call);
  static void OnSendDone(void* request, ucs_status_t status, void* user_data);
  static void OnDataSent(void* request, ucs_status_t status, void* user_data);
  // A send of the call (its request frame, or its payload as a kPayload frame) completed.
  static void SendFinished(void* request, ucs_status_t status, PendingCall* call,
                           void* PendingCall::*slot, std::string_view what);
  static void OnRecvDone(void* request, ucs_status_t status, size_t length, void* user_data);
  // Decides the call's outcome. Errors cancel whatever UCX still does with the caller's
  // buffers; done runs once nothing is in flight.
  void Resolve(PendingCall* call, Status status);
  void CancelRequests(PendingCall* call);
  void MaybeFinish(PendingCall* call);
  // Runs done now although UCX still holds one of the call's requests: UCX 1.13 cancels
  // neither a rendezvous send whose peer stopped answering nor one on a force-closed
  // endpoint. Only after the connection is reset (so the peer can no longer pull or push
  // the buffers) or the peer died. The call's own memory is kept until UCX lets go.
  void Abandon(PendingCall* call);
  void ReapAbandoned(PendingCall* call);

  // ---- deadlines: rpc_client_deadlines.cc --------------------------------------------------

  void ScheduleDeadline(Clock::time_point deadline, uint64_t id);
  void ArmTimer(Clock::time_point at);
  void OnDeadlines();

  // ---- mapped payloads: rpc_client_mapped.cc -----------------------------------------------

  struct SharedRegion {
    ucp_rkey_h rkey = nullptr;
    uint64_t address = 0;
    uint64_t size = 0;
    // Faults this process's mapping of the region in, behind the copies: a mapping is this
    // process's page tables, so the server's warm memory still faults here page by page.
    std::unique_ptr<MemoryWarmer> warmer;
  };

  void AddSharedRegion(const MappedRef& ref, Bytes rkey);
  // Stops the region's warmer, then unmaps it.
  static void ReleaseSharedRegion(SharedRegion& region);
  // Where `ref` is in this process (the server's shared memory, mapped).
  Result<std::byte*> Map(const MappedRef& ref);
  // Tries the probe region of the hello reply: mapped payloads when its cookie reads back.
  void ProbeMapping(const wire::HelloReply& reply);
  void SendControl(FrameKind kind, uint64_t id, StatusCode code = StatusCode::kOk);
  // The server wants a held payload: copied into its shared memory, or sent as data.
  void OnPull(const FrameView& frame);
  // A reply whose payload is in the server's shared memory: copied out, then acknowledged
  // (always, so the server may reuse the memory).
  void OnMappedReply(const FrameView& frame);
  // Hands a mapped copy of `call` (dst <- src, n bytes) to its copier; OnCopied follows.
  void PostCopy(PendingCall* call, std::byte* dst, const std::byte* src, size_t n, bool pull);
  // The copier made (or skipped) the copy of call `id`: tells the server (kPullDone or kAck)
  // and completes a mapped reply.
  void OnCopied(uint64_t id, bool copied, bool pull, size_t n);
  // Unmaps a region now, or once no copy can still use it.
  void RetireSharedRegion(SharedRegion region);

  // ---- loose frames (cancel, tests): rpc_client_loose_frames.cc ----------------------------

  void SendCancelFrame(uint64_t id);
  void SendLoose(LooseSend send);

  // ---- connection: rpc_client_connection.cc (the socket and hello: Bootstrap)
  // ---------------------------------------------

  void StartConnect();
  // The hello succeeded: routes the connection, binds the endpoint, sends the waiting calls.
  void OnConnected(internal::Bootstrap::Hello hello);
  static void OnEndpointError(void* arg, ucp_ep_h ep, ucs_status_t status);
  void FailConnect(Status status);
  // Fails every call and closes the endpoint; the next call reconnects.
  void Disconnect(Status status);
  // After a connection is gone: finishes resolved calls, abandoning those UCX still holds.
  void FinishResolved();
  void Shutdown();

  ClientOptions options_;
  ClientWorker::Impl* hub_;  // outlives this Impl
  std::shared_ptr<Worker> worker_;
  std::atomic<uint64_t> next_id_{1};

  // Progress-thread state.
  internal::Bootstrap bootstrap_;
  State state_ = State::kIdle;
  UcpEndpoint ep_;
  // This connection copies payloads from and into the server's memory (set and cleared on the
  // progress thread; read anywhere).
  std::atomic<bool> mapped_{false};
  std::unordered_map<uint64_t, SharedRegion> shared_regions_;
  size_t copies_out_ = 0;                      // posted to copiers, not yet reported back
  std::vector<SharedRegion> retired_regions_;  // unmapped once copies_out_ is 0
  std::unordered_map<uint64_t, std::unique_ptr<PendingCall>> calls_;
  std::unordered_map<uint64_t, std::unique_ptr<PendingCall>> abandoned_;
  std::vector<uint64_t> waiting_;
  std::vector<std::function<void(const Status&)>> connect_waiters_;
  std::priority_queue<Deadline, std::vector<Deadline>, std::greater<>> deadlines_;
  asio::steady_timer timer_;
  bool timer_armed_ = false;
  Clock::time_point timer_at_;
  bool in_shutdown_ = false;

  std::atomic<uint64_t> connection_id_{0};
  mutable Mutex limits_mu_;
  std::optional<ServerLimits> limits_ GUARDED_BY(limits_mu_);
  std::atomic<uint64_t> calls_started_{0}, calls_failed_{0}, connects_{0}, disconnects_{0},
      malformed_{0}, late_replies_{0}, mapped_payloads_{0};
};

}  // namespace kvstash::transport
