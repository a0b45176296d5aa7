// RpcClient: calls, deadlines, cancellation, connection and reconnection. Everything below
// Impl's public entry points runs on the progress thread.

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <future>
#include <queue>
#include <unordered_map>

#include "bootstrap.h"
#include "kvstash/common/logging.h"
#include "kvstash/common/mutex.h"
#include "kvstash/proto/wire.pb.h"
#include "kvstash/transport/frame.h"
#include "kvstash/transport/rpc.h"
#include "worker.h"

namespace kvstash::transport {
namespace {

struct PendingCall;
bool InFlight(const PendingCall& call);

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

bool InFlight(const PendingCall& call) {
  return call.send_request != nullptr || call.recv_request != nullptr ||
         call.data_request != nullptr;
}

// A frame with no call behind it (cancel frames, test frames): owns its bytes until sent.
struct LooseSend {
  std::vector<std::byte> header;
  std::vector<std::byte> data;
};

Status StatusFromWireError(uint16_t code, Bytes message) {
  wire::Error error;
  if (!error.ParseFromArray(message.data(), static_cast<int>(message.size()))) {
    return Status(static_cast<StatusCode>(code), "(unparseable error message from the server)");
  }
  return Status(static_cast<StatusCode>(code), error.message());
}

}  // namespace

// The shared part of the clients of one worker: routes each frame to the client whose
// connection it names, and keeps the clients that were destroyed until nothing of theirs can
// still run on the thread. Progress-thread state, except where noted.
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

class RpcClient::Impl : public std::enable_shared_from_this<RpcClient::Impl> {
 public:
  Impl(ClientOptions options, ClientWorker::Impl* hub)
      : options_(std::move(options)),
        hub_(hub),
        worker_(hub->shared_worker()),
        timer_(worker_->io()) {
    options_.worker.reset();  // the RpcClient holds it; a retired Impl must not
  }

  // Fails every call, closes the connection and hands this Impl to the hub, which destroys it
  // once quiet. Returns after the shutdown (so no callback of this client runs after).
  static void Detach(std::unique_ptr<Impl> self) {
    Worker& worker = *self->worker_;
    if (worker.OnThread()) {
      self->Shutdown();
      ClientWorker::Impl* hub = self->hub_;
      hub->Retire(std::move(self));
      return;
    }
    std::promise<void> done;
    auto future = done.get_future();
    Impl* raw = self.release();
    worker.Run([raw, &done] {
      std::unique_ptr<Impl> owned(raw);
      owned->Shutdown();
      ClientWorker::Impl* hub = owned->hub_;
      hub->Retire(std::move(owned));
      done.set_value();
    });
    future.wait();  // the hub's thread runs while any of its clients exists
  }

  // Nothing of this client can still run: no calls, no UCX request, no endpoint.
  bool Quiet() const { return calls_.empty() && abandoned_.empty() && !ep_; }

  std::shared_ptr<Worker> worker() const { return worker_; }
  const ClientOptions& options() const { return options_; }

  uint64_t Call(uint16_t method, Bytes request, const CallOptions& options, ResponseCallback done) {
    auto call = std::make_unique<PendingCall>();
    call->id = next_id_.fetch_add(1);
    call->impl = this;
    call->method = method;
    call->done = std::move(done);
    call->deadline = options.deadline;
    call->send_payload = options.send_payload;
    call->send_region = options.send_region;
    call->recv_payload = options.recv_payload;
    call->recv_region = options.recv_region;
    FrameHeader header;
    header.kind = FrameKind::kRequest;
    header.method = method;
    header.request_id = call->id;
    header.message_bytes = static_cast<uint32_t>(request.size());
    call->message_in_data = kFrameHeaderBytes + request.size() > worker_->max_am_header();
    if (call->message_in_data) {
      header.flags = kMessageInData;
      call->frame.resize(kFrameHeaderBytes + request.size());
      WriteFrame(header, {}, call->frame);
      std::memcpy(call->frame.data() + kFrameHeaderBytes, request.data(), request.size());
      call->message_bytes = Bytes(call->frame).subspan(kFrameHeaderBytes);
    } else {
      call->frame.resize(kFrameHeaderBytes + request.size());
      WriteFrame(header, request, call->frame);
    }
    const uint64_t id = call->id;
    calls_started_.fetch_add(1, std::memory_order_relaxed);
    worker_->Run([this, call = std::move(call)]() mutable { Start(std::move(call)); });
    return id;
  }

  void Cancel(uint64_t id) {
    worker_->Run([this, id] {
      auto it = calls_.find(id);
      if (it == calls_.end() || it->second->resolved) return;
      PendingCall* call = it->second.get();
      if (call->sent) SendCancelFrame(id);
      Resolve(call, CancelledError("call {} cancelled", id));
    });
  }

  Status SendRaw(Bytes header, Bytes data) {
    auto send = std::make_shared<LooseSend>();
    send->header.assign(header.begin(), header.end());
    send->data.assign(data.begin(), data.end());
    std::promise<Status> promise;
    auto future = promise.get_future();
    worker_->Run([this, send, &promise] {
      if (!ep_) {
        promise.set_value(UnavailableError("not connected"));
        return;
      }
      SendLoose(std::move(*send));
      promise.set_value(Status::OK());
    });
    return future.get();
  }

  Status Connect() {
    if (worker_->OnThread()) return FailedPreconditionError("Connect on the progress thread");
    std::promise<Status> promise;
    auto future = promise.get_future();
    worker_->Run([this, &promise] {
      if (state_ == State::kConnected) {
        promise.set_value(Status::OK());
        return;
      }
      connect_waiters_.push_back([&promise](const Status& s) { promise.set_value(s); });
      if (state_ == State::kIdle) StartConnect();
    });
    return future.get();
  }

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

  std::optional<ServerLimits> server_limits() const {
    MutexLock lock(&limits_mu_);
    return limits_;
  }

  void ConnectAsync(std::function<void(const Status&)> done) {
    worker_->Run([this, done = std::move(done)]() mutable {
      if (state_ == State::kConnected) {
        done(Status::OK());
        return;
      }
      connect_waiters_.push_back(std::move(done));
      if (state_ == State::kIdle) StartConnect();
    });
  }

 private:
  enum class State { kIdle, kConnecting, kConnected };

  // ---- calls -------------------------------------------------------------------------------

  void Start(std::unique_ptr<PendingCall> owned) {
    PendingCall* call = owned.get();
    calls_.emplace(call->id, std::move(owned));
    if (worker_->stopping()) {
      Resolve(call, CancelledError("client is shutting down"));
      return;
    }
    if (call->frame.size() - kFrameHeaderBytes > worker_->options().max_message_bytes) {
      Resolve(call, ResourceExhaustedError("request message of {} bytes exceeds the limit of {}",
                                           call->frame.size() - kFrameHeaderBytes,
                                           worker_->options().max_message_bytes));
      return;
    }
    if (call->send_payload.size() > worker_->options().max_payload_bytes) {
      Resolve(call, ResourceExhaustedError("request payload of {} bytes exceeds the limit of {}",
                                           call->send_payload.size(),
                                           worker_->options().max_payload_bytes));
      return;
    }
    if (call->message_in_data && !call->send_payload.empty()) {
      Resolve(call, InvalidArgumentError(
                        "request message of {} bytes is too large to travel with a payload "
                        "(UCX header limit {})",
                        call->frame.size() - kFrameHeaderBytes, worker_->max_am_header()));
      return;
    }
    if (Clock::now() >= call->deadline) {
      Resolve(call,
              DeadlineExceededError("call of method {} started after its deadline", call->method));
      return;
    }
    ScheduleDeadline(call->deadline, call->id);
    if (state_ == State::kConnected) {
      Send(call);
    } else {
      waiting_.push_back(call->id);
      if (state_ == State::kIdle) StartConnect();
    }
  }

  void Send(PendingCall* call) {
    FrameHeader header;
    std::memcpy(&header, call->frame.data(), kFrameHeaderBytes);
    header.connection_id = connection_id_.load();
    const auto left =
        std::chrono::duration_cast<std::chrono::microseconds>(call->deadline - Clock::now());
    header.timeout_us = static_cast<uint32_t>(
        std::clamp<int64_t>(left.count(), 1, std::numeric_limits<uint32_t>::max()));
    if (mapped_ && !call->message_in_data) {
      if (!call->recv_payload.empty()) header.flags |= kAcceptsMapped;
      // The payload stays here until the server pulls it (kPull).
      call->held = !call->send_payload.empty() &&
                   call->frame.size() + kMappedRefBytes <= worker_->max_am_header();
    }
    if (call->held) {
      MappedRef ref;
      ref.length = call->send_payload.size();
      call->frame =
          WriteFrameWithRef(header, Bytes(call->frame).subspan(kFrameHeaderBytes), ref, {});
    } else {
      std::memcpy(call->frame.data(), &header, kFrameHeaderBytes);
    }

    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                         UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_DATATYPE;
    param.cb.send = &Impl::OnSendDone;
    param.user_data = call;
    param.datatype = ucp_dt_make_contig(1);
    const void* data = call->send_payload.data();
    size_t data_bytes = call->send_payload.size();
    size_t header_bytes = call->frame.size();
    if (call->message_in_data) {
      data = call->message_bytes.data();
      data_bytes = call->message_bytes.size();
      header_bytes = kFrameHeaderBytes;
      param.flags = UCP_AM_SEND_FLAG_EAGER;
    } else if (call->held) {
      data = nullptr;
      data_bytes = 0;
    } else if (call->send_region != nullptr) {
      param.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
      param.memh = static_cast<ucp_mem_h>(call->send_region->handle());
    }
    call->sent = true;
    ucs_status_ptr_t request = ucp_am_send_nbx(ep_.get(), kRpcAmId, call->frame.data(),
                                               header_bytes, data, data_bytes, &param);
    if (request == nullptr) return;  // sent (buffered or done) already
    if (UCS_PTR_IS_ERR(request)) {
      Resolve(call, FromUcs(UCS_PTR_STATUS(request), "sending a request"));
      return;
    }
    call->send_request = request;
  }

  static void OnSendDone(void* request, ucs_status_t status, void* user_data) {
    SendFinished(request, status, static_cast<PendingCall*>(user_data), &PendingCall::send_request,
                 "sending call");
  }

  static void OnDataSent(void* request, ucs_status_t status, void* user_data) {
    SendFinished(request, status, static_cast<PendingCall*>(user_data), &PendingCall::data_request,
                 "sending the payload of call");
  }

  // A send of the call (its request frame, or its payload as a kPayload frame) completed.
  static void SendFinished(void* request, ucs_status_t status, PendingCall* call,
                           void* PendingCall::*slot, std::string_view what) {
    ucp_request_free(request);
    call->*slot = nullptr;
    auto* self = static_cast<Impl*>(call->impl);
    if (call->abandoned) {
      self->ReapAbandoned(call);
      return;
    }
    if (status != UCS_OK && !call->resolved) {
      self->Resolve(call, FromUcs(status, fmt::format("{} {}", what, call->id)));
      return;
    }
    self->MaybeFinish(call);
  }

  static void OnRecvDone(void* request, ucs_status_t status, size_t length, void* user_data) {
    auto* call = static_cast<PendingCall*>(user_data);
    ucp_request_free(request);
    call->recv_request = nullptr;
    auto* self = static_cast<Impl*>(call->impl);
    if (call->abandoned) {
      self->ReapAbandoned(call);
      return;
    }
    if (call->resolved) {
      self->MaybeFinish(call);
      return;
    }
    if (status != UCS_OK) {
      self->Resolve(
          call, FromUcs(status, fmt::format("receiving the reply payload of call {}", call->id)));
      return;
    }
    call->payload_bytes = length;
    self->Resolve(call, Status::OK());
  }

  // Decides the call's outcome. Errors cancel whatever UCX still does with the caller's
  // buffers; done runs once nothing is in flight.
  void Resolve(PendingCall* call, Status status) {
    if (call->resolved) return;
    call->resolved = true;
    call->status = std::move(status);
    if (!call->status.ok()) {
      call->resolving = true;
      CancelRequests(call);
      call->resolving = false;
    }
    MaybeFinish(call);
  }

  void CancelRequests(PendingCall* call) {
    for (void* request : {call->send_request, call->recv_request, call->data_request}) {
      if (request != nullptr) ucp_request_cancel(worker_->ucp(), request);
    }
  }

  void MaybeFinish(PendingCall* call) {
    if (!call->resolved || call->resolving || InFlight(*call)) return;
    auto it = calls_.find(call->id);
    if (it == calls_.end()) return;
    std::unique_ptr<PendingCall> owned = std::move(it->second);
    calls_.erase(it);
    if (!owned->status.ok()) calls_failed_.fetch_add(1, std::memory_order_relaxed);
    Response response{std::move(owned->status), owned->reply, owned->payload_bytes};
    if (owned->done) owned->done(response);
  }

  // Runs done now although UCX still holds one of the call's requests: UCX 1.13 cancels
  // neither a rendezvous send whose peer stopped answering nor one on a force-closed
  // endpoint. Only after the connection is reset (so the peer can no longer pull or push
  // the buffers) or the peer died. The call's own memory is kept until UCX lets go.
  void Abandon(PendingCall* call) {
    auto it = calls_.find(call->id);
    if (it == calls_.end()) return;
    std::unique_ptr<PendingCall> owned = std::move(it->second);
    calls_.erase(it);
    owned->abandoned = true;
    calls_failed_.fetch_add(1, std::memory_order_relaxed);
    Response response{owned->status, {}, 0};
    ResponseCallback done = std::move(owned->done);
    abandoned_.emplace(owned->id, std::move(owned));
    if (done) done(response);
  }

  void ReapAbandoned(PendingCall* call) {
    if (!InFlight(*call)) abandoned_.erase(call->id);
  }

  // ---- deadlines ---------------------------------------------------------------------------

  void ScheduleDeadline(Clock::time_point deadline, uint64_t id) {
    // Entries of finished calls stay until their deadline passes; at a high call rate with
    // long deadlines they would pile up, so the heap is rebuilt from the calls still here when
    // it holds more than twice as many.
    if (deadlines_.size() >= 1024 && deadlines_.size() > 2 * calls_.size()) {
      std::vector<Deadline> live;
      live.reserve(calls_.size());
      for (const auto& [call_id, call] : calls_) {
        // Resolved calls still here wait for a transfer: their deadline resets a stalled peer.
        if (call_id != id) live.emplace_back(call->deadline, call_id);
      }
      deadlines_ = decltype(deadlines_)(std::greater<>(), std::move(live));
    }
    deadlines_.emplace(deadline, id);
    if (!timer_armed_ || deadline < timer_at_) ArmTimer(deadline);
  }

  void ArmTimer(Clock::time_point at) {
    timer_armed_ = true;
    timer_at_ = at;
    timer_.expires_at(at);
    timer_.async_wait([this](const asio::error_code& error) {
      if (error == asio::error::operation_aborted) return;
      timer_armed_ = false;
      OnDeadlines();
    });
  }

  void OnDeadlines() {
    const auto now = Clock::now();
    size_t stuck = 0;
    while (!deadlines_.empty() && deadlines_.top().first <= now) {
      const uint64_t id = deadlines_.top().second;
      deadlines_.pop();
      auto it = calls_.find(id);
      if (it == calls_.end()) continue;
      PendingCall* call = it->second.get();
      if (!call->resolved) {
        if (call->sent && ep_) SendCancelFrame(id);
        Resolve(call,
                DeadlineExceededError("call {} (method {}) passed its deadline", id, call->method));
      }
      // Still here: a transfer the peer does not finish.
      if (calls_.count(id) != 0) ++stuck;
    }
    if (stuck != 0) {
      Disconnect(UnavailableError("{}:{} stalled with {} transfer(s) in flight; connection reset",
                                  options_.host, options_.port, stuck));
    }
    if (!deadlines_.empty()) ArmTimer(deadlines_.top().first);
  }

  // ---- frames from the server --------------------------------------------------------------

 public:
  // A frame the hub routed here (its connection id is this client's).
  ucs_status_t OnFrame(const void* header, size_t header_length, void* data, size_t length,
                       const ucp_am_recv_param_t* param) {
    Impl* self = this;
    const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
    auto release = [&] {
      if (rndv && !self->worker_->DiscardRendezvous(data, length)) {
        self->Disconnect(
            UnavailableError("server sent a payload of {} bytes, beyond the limit "
                             "of {}",
                             length, self->worker_->options().max_payload_bytes));
      }
    };
    const Bytes data_bytes = rndv ? Bytes{} : Bytes(static_cast<const std::byte*>(data), length);
    auto frame = ParseFrame(Bytes(static_cast<const std::byte*>(header), header_length), data_bytes,
                            length, !rndv, self->worker_->options().max_message_bytes);
    const bool known = frame.ok() && (frame->header.kind == FrameKind::kResponse ||
                                      frame->header.kind == FrameKind::kPull);
    if (!known) {
      self->malformed_.fetch_add(1, std::memory_order_relaxed);
      KVSTASH_LOG_WARN("dropped a malformed frame from the server: {}",
                       frame.ok() ? "not a response" : frame.status().ToString());
      release();
      return UCS_OK;
    }
    // The server sends each shared region's key once per connection, with its first use.
    if (frame->has_ref && !frame->rkey.empty()) self->AddSharedRegion(frame->ref, frame->rkey);
    if (frame->header.kind == FrameKind::kPull) {
      self->OnPull(*frame);
      return UCS_OK;
    }
    if (frame->has_ref) {
      self->OnMappedReply(*frame);
      return UCS_OK;
    }
    auto it = self->calls_.find(frame->header.request_id);
    if (it == self->calls_.end() || it->second->resolved) {
      self->late_replies_.fetch_add(1, std::memory_order_relaxed);
      release();
      return UCS_OK;
    }
    PendingCall* call = it->second.get();
    if (frame->header.status != 0) {
      release();
      self->Resolve(call, StatusFromWireError(frame->header.status, frame->message));
      return UCS_OK;
    }
    call->reply.assign(frame->message.begin(), frame->message.end());
    const size_t payload = frame->payload_bytes;
    if (payload == 0) {
      self->Resolve(call, Status::OK());
      return UCS_OK;
    }
    if (payload > call->recv_payload.size()) {
      release();
      self->Resolve(call, OutOfRangeError("reply payload of {} bytes exceeds the receive buffer "
                                          "of {} bytes",
                                          payload, call->recv_payload.size()));
      return UCS_OK;
    }
    if (!rndv) {
      std::memcpy(call->recv_payload.data(), data, payload);
      call->payload_bytes = payload;
      self->Resolve(call, Status::OK());
      return UCS_OK;
    }
    ucp_request_param_t recv = ContigParam(call, call->recv_region);
    recv.cb.recv_am = &Impl::OnRecvDone;
    ucs_status_ptr_t request =
        ucp_am_recv_data_nbx(self->worker_->ucp(), data, call->recv_payload.data(), payload, &recv);
    if (request == nullptr) {
      call->payload_bytes = payload;
      self->Resolve(call, Status::OK());
    } else if (UCS_PTR_IS_ERR(request)) {
      self->Resolve(call, FromUcs(UCS_PTR_STATUS(request), "receiving a reply payload"));
    } else {
      call->recv_request = request;
    }
    return UCS_OK;
  }

 private:
  // ---- mapped payloads ---------------------------------------------------------------------

  struct SharedRegion {
    ucp_rkey_h rkey = nullptr;
    uint64_t address = 0;
    uint64_t size = 0;
  };

  void AddSharedRegion(const MappedRef& ref, Bytes rkey) {
    if (!ep_) return;
    ucp_rkey_h handle = nullptr;
    const ucs_status_t status = ucp_ep_rkey_unpack(ep_.get(), rkey.data(), &handle);
    if (status != UCS_OK) {
      KVSTASH_LOG_WARN("cannot unpack the key of the server's shared region {}: {}", ref.region_id,
                       ucs_status_string(status));
      return;
    }
    auto [it, added] = shared_regions_.try_emplace(ref.region_id);
    if (!added) ucp_rkey_destroy(it->second.rkey);
    it->second = SharedRegion{handle, ref.region_address, ref.region_size};
  }

  // Where `ref` is in this process (the server's shared memory, mapped).
  Result<std::byte*> Map(const MappedRef& ref) {
    auto it = shared_regions_.find(ref.region_id);
    if (it == shared_regions_.end()) {
      return InternalError("server named shared region {} without its key", ref.region_id);
    }
    const SharedRegion& region = it->second;
    if (ref.region_address != region.address || ref.region_size != region.size) {
      return InternalError("server's shared region {} changed shape", ref.region_id);
    }
    void* local = nullptr;
    KVSTASH_RETURN_IF_ERROR(FromUcs(ucp_rkey_ptr(region.rkey, ref.address, &local),
                                    fmt::format("mapping shared region {}", ref.region_id)));
    return static_cast<std::byte*>(local);
  }

  // Tries the probe region of the hello reply: mapped payloads when its cookie reads back.
  void ProbeMapping(const wire::HelloReply& reply) {
    if (!worker_->options().mapped_payloads || !reply.has_mapped_probe()) return;
    const wire::SharedRegion& probe = reply.mapped_probe();
    MappedRef ref;
    ref.region_id = probe.region_id();
    ref.region_address = probe.address();
    ref.region_size = probe.size();
    ref.address = probe.address();
    ref.length = sizeof(uint64_t);
    if (probe.size() < sizeof(uint64_t)) return;
    AddSharedRegion(ref, std::as_bytes(std::span(probe.rkey())));
    auto local = Map(ref);
    uint64_t cookie = 0;
    if (local.ok()) std::memcpy(&cookie, *local, sizeof(cookie));
    mapped_ = local.ok() && cookie == probe.cookie();
    KVSTASH_LOG_DEBUG("{}:{}: mapped payloads {}", options_.host, options_.port,
                      mapped_ ? "on" : "off");
  }

  void SendControl(FrameKind kind, uint64_t id, StatusCode code = StatusCode::kOk) {
    LooseSend send;
    FrameHeader header;
    header.kind = kind;
    header.request_id = id;
    header.connection_id = connection_id_.load();
    header.status = static_cast<uint16_t>(code);
    send.header.resize(kFrameHeaderBytes);
    WriteFrame(header, {}, send.header);
    SendLoose(std::move(send));
  }

  // The server wants a held payload: copied into its shared memory, or sent as data.
  void OnPull(const FrameView& frame) {
    const uint64_t id = frame.header.request_id;
    auto it = calls_.find(id);
    PendingCall* call = it == calls_.end() ? nullptr : it->second.get();
    if (call == nullptr || call->resolved || !call->held) {
      SendControl(FrameKind::kPullDone, id, StatusCode::kCancelled);
      return;
    }
    call->held = false;
    if (frame.ref.length != call->send_payload.size()) {
      SendControl(FrameKind::kPullDone, id, StatusCode::kInvalidArgument);
      Resolve(call, InternalError("server pulled {} bytes of a {}-byte payload", frame.ref.length,
                                  call->send_payload.size()));
      return;
    }
    if (frame.ref.region_id != 0) {
      auto local = Map(frame.ref);
      if (!local.ok()) {
        SendControl(FrameKind::kPullDone, id, StatusCode::kInternal);
        Resolve(call, local.status());
        return;
      }
      std::memcpy(*local, call->send_payload.data(), call->send_payload.size());
      mapped_payloads_.fetch_add(1, std::memory_order_relaxed);
      SendControl(FrameKind::kPullDone, id);
      return;
    }
    FrameHeader header;
    header.kind = FrameKind::kPayload;
    header.request_id = id;
    header.connection_id = connection_id_.load();
    call->payload_header.resize(kFrameHeaderBytes);
    WriteFrame(header, {}, call->payload_header);
    ucp_request_param_t param = ContigParam(call, call->send_region);
    param.cb.send = &Impl::OnDataSent;
    ucs_status_ptr_t request = ucp_am_send_nbx(
        ep_.get(), kRpcAmId, call->payload_header.data(), call->payload_header.size(),
        call->send_payload.data(), call->send_payload.size(), &param);
    if (UCS_PTR_IS_ERR(request)) {
      Resolve(call, FromUcs(UCS_PTR_STATUS(request), "sending a payload"));
    } else if (request != nullptr) {
      call->data_request = request;
    }
  }

  // A reply whose payload is in the server's shared memory: copied out, then acknowledged
  // (always, so the server may reuse the memory).
  void OnMappedReply(const FrameView& frame) {
    const uint64_t id = frame.header.request_id;
    // The ack goes after the copy, on every path: once the server has it, the memory may hold
    // another block (an ack sent first let a concurrent store overwrite a block mid-copy).
    struct AckWhenDone {
      Impl* self;
      uint64_t id;
      ~AckWhenDone() { self->SendControl(FrameKind::kAck, id); }
    } ack{this, id};
    auto it = calls_.find(id);
    if (it == calls_.end() || it->second->resolved) {
      late_replies_.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    PendingCall* call = it->second.get();
    if (frame.header.status != 0) {
      Resolve(call, StatusFromWireError(frame.header.status, frame.message));
      return;
    }
    call->reply.assign(frame.message.begin(), frame.message.end());
    if (frame.ref.length > call->recv_payload.size()) {
      Resolve(call, OutOfRangeError("reply payload of {} bytes exceeds the receive buffer of {} "
                                    "bytes",
                                    frame.ref.length, call->recv_payload.size()));
      return;
    }
    auto local = Map(frame.ref);
    if (!local.ok()) {
      Resolve(call, local.status());
      return;
    }
    std::memcpy(call->recv_payload.data(), *local, frame.ref.length);
    mapped_payloads_.fetch_add(1, std::memory_order_relaxed);
    call->payload_bytes = frame.ref.length;
    Resolve(call, Status::OK());
  }

  // ---- loose frames (cancel, tests) --------------------------------------------------------

  void SendCancelFrame(uint64_t id) { SendControl(FrameKind::kCancel, id); }

  void SendLoose(LooseSend send) {
    if (!ep_) return;
    auto* owned = new LooseSend(std::move(send));
    ucp_request_param_t param{};
    param.op_attr_mask =
        UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_DATATYPE;
    param.cb.send = [](void* request, ucs_status_t, void* user_data) {
      ucp_request_free(request);
      delete static_cast<LooseSend*>(user_data);
    };
    param.user_data = owned;
    param.datatype = ucp_dt_make_contig(1);
    ucs_status_ptr_t request =
        ucp_am_send_nbx(ep_.get(), kRpcAmId, owned->header.data(), owned->header.size(),
                        owned->data.data(), owned->data.size(), &param);
    if (request == nullptr || UCS_PTR_IS_ERR(request)) delete owned;
  }

  // ---- connection --------------------------------------------------------------------------

  void StartConnect() {
    state_ = State::kConnecting;
    const uint64_t attempt = ++attempt_;
    socket_.emplace(worker_->io());
    connect_timer_.emplace(worker_->io());
    connect_timer_->expires_after(options_.connect_timeout);
    connect_timer_->async_wait([this, attempt](const asio::error_code& error) {
      if (error || attempt != attempt_ || state_ != State::kConnecting) return;
      FailConnect(UnavailableError("connecting to {}:{} timed out after {} ms", options_.host,
                                   options_.port, options_.connect_timeout.count()));
    });
    asio::error_code error;
    const auto address = asio::ip::make_address(options_.host, error);
    if (error) {
      resolver_.emplace(worker_->io());
      resolver_->async_resolve(
          options_.host, std::to_string(options_.port),
          [this, attempt](const asio::error_code& e, asio::ip::tcp::resolver::results_type r) {
            if (attempt != attempt_ || state_ != State::kConnecting) return;
            if (e) {
              FailConnect(UnavailableError("resolving {}: {}", options_.host, e.message()));
              return;
            }
            asio::async_connect(
                *socket_, r,
                [this, attempt](const asio::error_code& ce, const asio::ip::tcp::endpoint&) {
                  OnSocketConnected(attempt, ce);
                });
          });
      return;
    }
    socket_->async_connect(
        asio::ip::tcp::endpoint(address, options_.port),
        [this, attempt](const asio::error_code& e) { OnSocketConnected(attempt, e); });
  }

  void OnSocketConnected(uint64_t attempt, const asio::error_code& error) {
    if (attempt != attempt_ || state_ != State::kConnecting) return;
    if (error) {
      FailConnect(UnavailableError("connecting to {}:{}: {}", options_.host, options_.port,
                                   error.message()));
      return;
    }
    asio::error_code ignored;
    socket_->set_option(asio::ip::tcp::no_delay(true), ignored);
    wire::Hello hello;
    hello.set_protocol_version(wire::PROTOCOL_VERSION_CURRENT);
    hello.set_namespace_(options_.key_namespace);
    hello.set_auth_token(options_.auth_token);
    hello.set_worker_address(std::string(worker_->address()));
    hello.set_client_name(options_.client_name.empty() ? fmt::format("pid {}", ::getpid())
                                                       : options_.client_name);
    AsyncWriteMessage(*socket_, hello, [this, attempt](Status status) {
      if (attempt != attempt_ || state_ != State::kConnecting) return;
      if (!status.ok()) {
        FailConnect(std::move(status));
        return;
      }
      AsyncReadMessage(*socket_, [this, attempt](Status s, std::string body) {
        OnHelloReply(attempt, std::move(s), body);
      });
    });
  }

  void OnHelloReply(uint64_t attempt, Status status, const std::string& body) {
    if (attempt != attempt_ || state_ != State::kConnecting) return;
    if (!status.ok()) {
      FailConnect(UnavailableError("{}:{} closed the connection during the hello ({})",
                                   options_.host, options_.port, status.message()));
      return;
    }
    wire::HelloReply reply;
    if (!reply.ParseFromString(body)) {
      FailConnect(
          UnavailableError("{}:{} sent an unparseable hello reply", options_.host, options_.port));
      return;
    }
    if (reply.has_error() && reply.error().code() != wire::OK) {
      FailConnect(Status(static_cast<StatusCode>(reply.error().code()),
                         fmt::format("{}:{} refused the connection: {}", options_.host,
                                     options_.port, reply.error().message())));
      return;
    }
    const std::string& address = reply.worker_address();
    ucp_ep_params_t params{};
    params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                        UCP_EP_PARAM_FIELD_ERR_HANDLER;
    params.address = reinterpret_cast<const ucp_address_t*>(address.data());
    params.err_handler.cb = &Impl::OnEndpointError;
    params.err_handler.arg = this;
    ucp_ep_h ep = nullptr;
    const Status created = worker_->CreateEndpoint(
        &params, &ep, fmt::format("opening a UCX endpoint to {}:{}", options_.host, options_.port));
    if (!created.ok()) {
      FailConnect(created);
      return;
    }
    ep_ = UcpEndpoint(ep);
    if (!hub_->Route(reply.connection_id(), this)) {
      // Another server of this worker's clients chose the same id: try again (a new id).
      ep_ = UcpEndpoint();
      FailConnect(
          UnavailableError("{}:{} gave connection id {:#x}, which another connection of "
                           "this worker has; reconnect",
                           options_.host, options_.port, reply.connection_id()));
      return;
    }
    connection_id_ = reply.connection_id();
    {
      // The server's limits, within this client's own (a larger message or payload would be
      // refused here before it is sent).
      const TransportOptions& own = worker_->options();
      ServerLimits limits;
      limits.block_bytes = reply.block_bytes();
      limits.max_keys_per_request = reply.max_keys_per_request();
      limits.max_message_bytes =
          reply.max_message_bytes() == 0
              ? own.max_message_bytes
              : std::min<uint64_t>(reply.max_message_bytes(), own.max_message_bytes);
      limits.max_payload_bytes =
          reply.max_payload_bytes() == 0
              ? own.max_payload_bytes
              : std::min<uint64_t>(reply.max_payload_bytes(), own.max_payload_bytes);
      MutexLock lock(&limits_mu_);
      limits_ = limits;
    }
    ProbeMapping(reply);
    state_ = State::kConnected;
    connect_timer_->cancel();
    connects_.fetch_add(1, std::memory_order_relaxed);
    WatchSocket(attempt);
    for (auto& waiter : std::exchange(connect_waiters_, {})) waiter(Status::OK());
    for (uint64_t id : std::exchange(waiting_, {})) {
      auto it = calls_.find(id);
      if (it != calls_.end() && !it->second->resolved) Send(it->second.get());
    }
  }

  // The bootstrap socket carries nothing after the hello: any read completion means the
  // server went away (or broke protocol).
  void WatchSocket(uint64_t attempt) {
    socket_->async_read_some(
        asio::buffer(watch_byte_, 1), [this, attempt](const asio::error_code& error, size_t) {
          if (attempt != attempt_ || state_ != State::kConnected) return;
          Disconnect(UnavailableError("connection to {}:{} lost ({})", options_.host, options_.port,
                                      error ? error.message() : "unexpected bytes"));
        });
  }

  static void OnEndpointError(void* arg, ucp_ep_h ep, ucs_status_t status) {
    auto* self = static_cast<Impl*>(arg);
    if (self->ep_.get() != ep) return;
    self->Disconnect(FromUcs(status, fmt::format("UCX endpoint to {}:{} failed",
                                                 self->options_.host, self->options_.port)));
  }

  void FailConnect(Status status) {
    state_ = State::kIdle;
    ++attempt_;
    if (status.code() != StatusCode::kUnauthenticated &&
        status.code() != StatusCode::kFailedPrecondition &&
        status.code() != StatusCode::kPermissionDenied) {
      status = Status(StatusCode::kUnavailable, std::string(status.message()));
    }
    CloseSocket();
    for (auto& waiter : std::exchange(connect_waiters_, {})) waiter(status);
    for (uint64_t id : std::exchange(waiting_, {})) {
      auto it = calls_.find(id);
      if (it != calls_.end()) Resolve(it->second.get(), status);
    }
  }

  void CloseSocket() {
    asio::error_code ignored;
    if (socket_) socket_->close(ignored);
    if (connect_timer_) connect_timer_->cancel();
  }

  // Fails every call and closes the endpoint; the next call reconnects.
  void Disconnect(Status status) {
    if (state_ == State::kIdle) return;
    // An orderly close with nothing outstanding is not worth a warning.
    if (status.code() != StatusCode::kCancelled || !calls_.empty()) {
      KVSTASH_LOG_WARN("{}", status.ToString());
    }
    const bool was_connected = state_ == State::kConnected;
    if (was_connected) hub_->Unroute(connection_id_.load(), this);
    state_ = State::kIdle;
    ++attempt_;
    if (was_connected) disconnects_.fetch_add(1, std::memory_order_relaxed);
    CloseSocket();
    Status failure(
        status.code() == StatusCode::kCancelled ? StatusCode::kCancelled : StatusCode::kUnavailable,
        std::string(status.message()));
    // Outstanding requests on the endpoint complete (cancelled) when it is force-closed; the
    // calls resolve first so those completions only finish them.
    std::vector<PendingCall*> all;
    all.reserve(calls_.size());
    bool in_flight = false;
    for (auto& [id, call] : calls_) {
      all.push_back(call.get());
      in_flight = in_flight || InFlight(*call);
    }
    // An orderly close (this client going away) with nothing on the wire flushes: UCX 1.13
    // asserts when a worker is destroyed after a force close of a TCP endpoint whose wireup
    // was still pending (a client that connected and went away without a call).
    const bool force = status.code() != StatusCode::kCancelled || in_flight;
    for (PendingCall* call : all) {
      if (!call->resolved) {
        call->resolved = true;
        call->status = failure;
      }
      call->resolving = true;
      CancelRequests(call);
      call->resolving = false;
    }
    waiting_.clear();
    mapped_ = false;
    for (auto& [id, region] : std::exchange(shared_regions_, {})) ucp_rkey_destroy(region.rkey);
    for (auto& waiter : std::exchange(connect_waiters_, {})) waiter(failure);
    if (ep_) {
      auto ep = std::make_shared<UcpEndpoint>(std::move(ep_));
      auto close = [this, ep, force] {
        worker_->WaitRequest(ep->Close(force));
        FinishResolved();
      };
      if (in_shutdown_) {
        close();
      } else {
        asio::post(worker_->io(), close);
      }
    } else {
      FinishResolved();
    }
  }

  // After a connection is gone: finishes resolved calls, abandoning those UCX still holds.
  void FinishResolved() {
    std::vector<PendingCall*> done;
    for (auto& [id, call] : calls_) {
      if (call->resolved) done.push_back(call.get());
    }
    for (PendingCall* call : done) {
      if (InFlight(*call)) {
        Abandon(call);
      } else {
        MaybeFinish(call);
      }
    }
  }

  void Shutdown() {
    in_shutdown_ = true;
    timer_.cancel();
    if (state_ == State::kIdle) {
      for (auto& [id, call] : calls_) {
        call->resolved = true;
        call->status = CancelledError("client destroyed");
      }
      FinishResolved();
    } else {
      Disconnect(CancelledError("client destroyed"));
    }
    if (resolver_) resolver_->cancel();
  }

  ClientOptions options_;
  ClientWorker::Impl* hub_;  // outlives this Impl
  std::shared_ptr<Worker> worker_;
  std::atomic<uint64_t> next_id_{1};

  // Progress-thread state.
  State state_ = State::kIdle;
  uint64_t attempt_ = 0;
  std::optional<asio::ip::tcp::socket> socket_;
  std::optional<asio::ip::tcp::resolver> resolver_;
  std::optional<asio::steady_timer> connect_timer_;
  char watch_byte_[1];
  UcpEndpoint ep_;
  bool mapped_ = false;  // this connection copies payloads from and into the server's memory
  std::unordered_map<uint64_t, SharedRegion> shared_regions_;
  std::unordered_map<uint64_t, std::unique_ptr<PendingCall>> calls_;
  std::unordered_map<uint64_t, std::unique_ptr<PendingCall>> abandoned_;
  std::vector<uint64_t> waiting_;
  std::vector<std::function<void(const Status&)>> connect_waiters_;
  using Deadline = std::pair<Clock::time_point, uint64_t>;
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

// ---- ClientWorker ----------------------------------------------------------------------------

Status ClientWorker::Impl::Start() {
  KVSTASH_RETURN_IF_ERROR(worker_->SetFrameHandler(&Impl::OnFrame, this, UCP_AM_FLAG_WHOLE_MSG));
  // Every client detaches (shuts down) before the hub goes, so nothing is left to close.
  worker_->Start([this] { sweep_.cancel(); });
  return Status::OK();
}

ClientWorker::Impl::~Impl() {
  worker_->Stop();  // joins the thread: nothing of the retired clients runs any more
  retired_.clear();
}

bool ClientWorker::Impl::Route(uint64_t connection, RpcClient::Impl* client) {
  auto [it, added] = routes_.try_emplace(connection, client);
  return added || it->second == client;
}

void ClientWorker::Impl::Unroute(uint64_t connection, const RpcClient::Impl* client) {
  auto it = routes_.find(connection);
  if (it != routes_.end() && it->second == client) routes_.erase(it);
}

void ClientWorker::Impl::Retire(std::unique_ptr<RpcClient::Impl> client) {
  retired_.emplace_back(Clock::now(), std::move(client));
  if (!sweeping_) Sweep();
}

void ClientWorker::Impl::Sweep() {
  // Cancelled socket and timer handlers of a shut-down client run within a pass of the event
  // loop; the grace period covers them with a wide margin.
  constexpr auto kGrace = std::chrono::milliseconds(200);
  const auto now = Clock::now();
  std::erase_if(retired_, [&](const auto& entry) {
    return now - entry.first >= kGrace && entry.second->Quiet();
  });
  sweeping_ = !retired_.empty() && !worker_->stopping();
  if (!sweeping_) return;
  sweep_.expires_after(kGrace);
  sweep_.async_wait([this](const asio::error_code& error) {
    if (error) {
      sweeping_ = false;
      return;
    }
    Sweep();
  });
}

ucs_status_t ClientWorker::Impl::OnFrame(void* arg, const void* header, size_t header_length,
                                         void* data, size_t length,
                                         const ucp_am_recv_param_t* param) {
  auto* self = static_cast<Impl*>(arg);
  uint64_t connection = 0;
  if (header_length >= kFrameHeaderBytes) {
    std::memcpy(&connection,
                static_cast<const std::byte*>(header) + offsetof(FrameHeader, connection_id),
                sizeof(connection));
  }
  auto it = self->routes_.find(connection);
  if (it == self->routes_.end()) {
    // A frame of a connection already closed (or garbage): nobody waits for it.
    self->unrouted_.fetch_add(1, std::memory_order_relaxed);
    KVSTASH_LOG_DEBUG("dropped a frame for connection {:#x}, which no client has", connection);
    if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0) {
      (void)self->worker_->DiscardRendezvous(data, length);
    }
    return UCS_OK;
  }
  return it->second->OnFrame(header, header_length, data, length, param);
}

Result<std::shared_ptr<ClientWorker>> ClientWorker::Create(const TransportOptions& options) {
  KVSTASH_ASSIGN_OR_RETURN(auto worker, Worker::Create(options, "kvstash-client"));
  auto impl = std::make_shared<Impl>(std::move(worker));
  KVSTASH_RETURN_IF_ERROR(impl->Start());
  return std::shared_ptr<ClientWorker>(new ClientWorker(std::move(impl)));
}

ClientWorker::ClientWorker(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
ClientWorker::~ClientWorker() = default;
const TransportOptions& ClientWorker::options() const { return impl_->worker().options(); }
uint64_t ClientWorker::unrouted_frames() const { return impl_->unrouted(); }

// ---- RpcClient -------------------------------------------------------------------------------

Result<std::unique_ptr<RpcClient>> RpcClient::Create(ClientOptions options) {
  if (options.port == 0) return InvalidArgumentError("client needs the server's port");
  std::shared_ptr<ClientWorker> worker = options.worker;
  if (!worker) {
    KVSTASH_ASSIGN_OR_RETURN(worker, ClientWorker::Create(options.transport));
  }
  auto impl = std::make_unique<Impl>(std::move(options), &worker->impl());
  return std::unique_ptr<RpcClient>(new RpcClient(std::move(worker), std::move(impl)));
}

RpcClient::RpcClient(std::shared_ptr<ClientWorker> worker, std::unique_ptr<Impl> impl)
    : worker_(std::move(worker)), impl_(std::move(impl)) {}

RpcClient::~RpcClient() {
  if (impl_) Impl::Detach(std::move(impl_));
}

Status RpcClient::Connect() { return impl_->Connect(); }

uint64_t RpcClient::Call(uint16_t method, Bytes request, const CallOptions& options,
                         ResponseCallback done) {
  return impl_->Call(method, request, options, std::move(done));
}

void RpcClient::Cancel(uint64_t id) { impl_->Cancel(id); }

Status RpcClient::CallSync(uint16_t method, Bytes request, const CallOptions& options,
                           std::vector<std::byte>* reply, size_t* payload_bytes) {
  if (impl_->worker()->OnThread()) {
    return FailedPreconditionError("CallSync on the progress thread would deadlock");
  }
  std::promise<Status> promise;
  auto future = promise.get_future();
  impl_->Call(method, request, options, [&](const Response& response) {
    if (reply != nullptr) reply->assign(response.message.begin(), response.message.end());
    if (payload_bytes != nullptr) *payload_bytes = response.payload_bytes;
    promise.set_value(response.status);
  });
  return future.get();
}

Result<MemoryRegion> RpcClient::RegisterMemory(MutableBytes memory) {
  return impl_->worker()->Register(memory);
}

Result<MemoryRegion> RpcClient::AllocateMemory(size_t bytes) {
  return impl_->worker()->Allocate(bytes);
}

bool RpcClient::OnProgressThread() const { return impl_->worker()->OnThread(); }

void RpcClient::RunOnProgressThread(std::function<void()> fn) {
  impl_->worker()->Run(std::move(fn));
}

TransportStats RpcClient::stats() const { return impl_->stats(); }

uint64_t RpcClient::connection_id() const { return impl_->connection_id(); }

std::optional<ServerLimits> RpcClient::server_limits() const { return impl_->server_limits(); }

void RpcClient::ConnectAsync(std::function<void(const Status&)> done) {
  impl_->ConnectAsync(std::move(done));
}

Status RpcClient::SendRawForTesting(Bytes header, Bytes data) {
  KVSTASH_RETURN_IF_ERROR(impl_->Connect());
  return impl_->SendRaw(header, data);
}

}  // namespace kvstash::transport
