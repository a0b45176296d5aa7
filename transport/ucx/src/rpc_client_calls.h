#pragma once

// The calls of an RpcClient and what carries them: the state of one call (PendingCall), the
// table that owns the calls until UCX lets go of them (CallTable), the UCX endpoint their
// frames go out on (ClientEndpoint) and their deadlines (DeadlineQueue). Private to
// transport/ucx/src/; defined in rpc_client_calls.cc.

#include <ucp/api/ucp.h>

#include <asio.hpp>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <queue>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "kvstash/common/status.h"
#include "kvstash/transport/frame.h"
#include "kvstash/transport/rpc.h"
#include "worker.h"

namespace kvstash::transport::internal {

class CallTable;

// One call of an RpcClient, from Call until its callback has run and UCX has let go of its
// buffers. Owned by its CallTable (live, then abandoned while UCX still holds one of its
// requests). Built by Call on the caller's thread; progress-thread state after.
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
  CallTable* table = nullptr;  // the table that owns it (set by CallTable::Add)
};

// True while UCX holds one of the call's requests (and so reads or writes its buffers).
inline bool InFlight(const PendingCall& call) {
  return call.send_request != nullptr || call.recv_request != nullptr ||
         call.data_request != nullptr || call.copying;
}

// A call of `method` carrying `request` (copied into its frame: in the AM header, or as data
// when header and message exceed `max_am_header`), with the buffers and deadline of `options`.
std::unique_ptr<PendingCall> NewCall(uint64_t id, uint16_t method, Bytes request,
                                     const CallOptions& options, size_t max_am_header);
// Why the call cannot go out (a message or payload beyond the worker's limits, a message too
// large to travel with a payload, a deadline already passed); OK when it can.
Status CheckCall(const PendingCall& call, const Worker& worker);

// A frame with no call behind it (cancel frames, test frames): owns its bytes until sent.
struct LooseSend {
  std::vector<std::byte> header;
  std::vector<std::byte> data;
  std::function<void(Status)> sent;  // when UCX has finished the send; may be empty
};

// The status a server's error reply carries: `code`, with the message of the wire::Error in
// `message` (or a note that it did not parse).
Status StatusFromWireError(uint16_t code, Bytes message);

// A client's counters (RpcClient::stats). Each part of the client adds to its own; read from
// any thread.
struct ClientCounters {
  std::atomic<uint64_t> calls_started{0}, calls_failed{0}, connects{0}, disconnects{0},
      malformed{0}, late_replies{0}, mapped_payloads{0};

  TransportStats Snapshot() const;
};

// The calls of one client, from Start until their callback has run and UCX has let go of their
// buffers, and the UCX requests that carry them (completions, cancellation, the receive of a
// reply payload). Owns every PendingCall: live until its callback runs, then abandoned (only
// when the callback had to run while UCX still held a request) until UCX lets go.
//
// Invariants: a call is live or abandoned, never both. Its callback runs exactly once: after
// its outcome is decided (Resolve, once) and, but for Abandon, once nothing is in flight; a
// failed call's requests are cancelled as it resolves. A call's memory (its frame and the
// buffers UCX was given) is freed only once no request or copy holds it.
//
// Thread-safety: progress thread only (UCX runs the completions there).
class CallTable {
 public:
  CallTable(Worker& worker, ClientCounters& counters) : worker_(worker), counters_(counters) {}

  // Takes a call that is starting; it is live from here on.
  PendingCall* Add(std::unique_ptr<PendingCall> owned);
  // The live call `id` (its callback has not run), or null.
  PendingCall* Find(uint64_t id);
  // The abandoned call `id` (its callback ran, UCX still holds it), or null.
  PendingCall* FindAbandoned(uint64_t id);
  size_t live() const { return calls_.size(); }
  // No call left, live or abandoned.
  bool empty() const { return calls_.empty() && abandoned_.empty(); }
  // (deadline, id) of every live call but `except`.
  std::vector<std::pair<Clock::time_point, uint64_t>> Deadlines(uint64_t except) const;

  // Decides the call's outcome (once; later outcomes are ignored). Errors cancel whatever UCX
  // still does with the caller's buffers; done runs once nothing is in flight.
  void Resolve(PendingCall* call, Status status);
  // Runs done and drops the call if it is resolved and nothing is in flight.
  void MaybeFinish(PendingCall* call);
  // Frees an abandoned call once UCX has let go of it.
  void ReapAbandoned(PendingCall* call);
  // Receives a reply payload sent by rendezvous (`data`: UCX's descriptor) into the call's
  // buffer; the call resolves when it is there, or with why it failed.
  void ReceivePayload(PendingCall* call, void* data, size_t bytes);

  // The connection is gone: resolves every live call not yet resolved with `failure`, and
  // cancels the UCX requests of all. Returns whether any had one in flight before.
  bool FailAll(const Status& failure);
  // Sets every live call's outcome to `status`, resolved or not (nothing of theirs is on a
  // connection any more), then finishes them as FinishResolved does.
  void ResolveAll(const Status& status);
  // After a connection is gone: finishes resolved calls, abandoning those UCX still holds.
  void FinishResolved();

  // UCX completions (user_data: the PendingCall) of a call's request frame, of its kPayload
  // frame and of the receive of its reply payload.
  static void OnSendDone(void* request, ucs_status_t status, void* user_data);
  static void OnDataSent(void* request, ucs_status_t status, void* user_data);
  static void OnRecvDone(void* request, ucs_status_t status, size_t length, void* user_data);

 private:
  // A send of the call (its request frame, or its payload as a kPayload frame) completed.
  void SendFinished(void* request, ucs_status_t status, PendingCall* call, void* PendingCall::*slot,
                    std::string_view what);
  void CancelRequests(PendingCall* call);
  // Runs done now although UCX still holds one of the call's requests: UCX 1.13 cancels
  // neither a rendezvous send whose peer stopped answering nor one on a force-closed
  // endpoint. Only after the connection is reset (so the peer can no longer pull or push
  // the buffers) or the peer died. The call's own memory is kept until UCX lets go.
  void Abandon(PendingCall* call);

  Worker& worker_;
  ClientCounters& counters_;
  std::unordered_map<uint64_t, std::unique_ptr<PendingCall>> calls_;      // live
  std::unordered_map<uint64_t, std::unique_ptr<PendingCall>> abandoned_;  // done ran
};

// The UCX endpoint of one connection to the server and the frames the client sends on it:
// call requests, request payloads the server asked for (kPayload), control frames and loose
// frames. Owns the endpoint; the bytes of a send belong to its call (which the CallTable keeps
// until UCX lets go) or, for a loose frame, to a LooseSend freed by its completion.
//
// Invariants: every frame carries the id of the connection the endpoint was opened for; loose
// and control frames without an endpoint are dropped (the connection is gone, so is their
// purpose). Thread-safety: progress thread, but connection_id (atomic) anywhere.
class ClientEndpoint {
 public:
  explicit ClientEndpoint(Worker& worker) : worker_(worker) {}

  // The connection `connection_id` is up, over `ep`.
  void Open(UcpEndpoint ep, uint64_t connection_id);
  // Closes the endpoint (force: without flushing), now or from the event loop, then runs
  // `closed`; the connection id stays for the log and stats. Loose frames after it are dropped.
  void Close(bool force, bool now, std::function<void()> closed);
  explicit operator bool() const { return static_cast<bool>(ep_); }
  ucp_ep_h get() const { return ep_.get(); }
  // The latest connection's id (0 before the first); any thread.
  uint64_t connection_id() const { return connection_id_.load(); }

  // Sends the call's request frame, with its payload unless it is held for the server to pull
  // (`mapped`: the connection maps payloads). Connected only. An error means nothing is in
  // flight.
  Status SendRequest(PendingCall* call, bool mapped);
  // Sends the call's request payload as a kPayload frame (the server pulled it, unmapped).
  Status SendPayload(PendingCall* call);
  void SendControl(FrameKind kind, uint64_t id, StatusCode code = StatusCode::kOk);
  void SendLoose(LooseSend send);

 private:
  Worker& worker_;
  UcpEndpoint ep_;
  std::atomic<uint64_t> connection_id_{0};
};

// The deadlines of a client's calls, on one timer: a call whose deadline passes fails with
// DeadlineExceeded (and the server is told, when the call went out); a call still live after
// that holds a transfer the peer does not finish, and `on_stalled` runs with how many, for the
// owner to reset the connection. An entry outlives its call (dropped when it comes due); at a
// high call rate with long deadlines they would pile up, so Add rebuilds the heap from the
// calls still live when it holds more than twice as many.
//
// Invariant: while an entry is queued (and but for Stop), the timer is armed at or before the
// earliest one. Thread-safety: progress thread only.
class DeadlineQueue {
 public:
  DeadlineQueue(asio::io_context& io, CallTable& calls, ClientEndpoint& endpoint,
                std::function<void(size_t stuck)> on_stalled)
      : calls_(calls), endpoint_(endpoint), timer_(io), on_stalled_(std::move(on_stalled)) {}

  void Add(Clock::time_point deadline, uint64_t id);
  // Cancels the timer (the client is shutting down); a later Add arms it again.
  void Stop() { timer_.cancel(); }

 private:
  using Deadline = std::pair<Clock::time_point, uint64_t>;
  void Arm(Clock::time_point at);
  // Fails the calls whose deadline passed.
  void Expire();

  CallTable& calls_;
  ClientEndpoint& endpoint_;
  std::priority_queue<Deadline, std::vector<Deadline>, std::greater<>> deadlines_;
  asio::steady_timer timer_;
  bool armed_ = false;
  Clock::time_point armed_at_;
  std::function<void(size_t stuck)> on_stalled_;
};

}  // namespace kvstash::transport::internal
