#pragma once

// The UCX client's private classes: RpcClient::Impl (one connection to one server, made of the
// parts in rpc_client_calls.h, rpc_client_bootstrap.h and rpc_client_mapped.h) and
// ClientWorker::Impl (the worker its clients share). Private to transport/ucx/src/;
// RpcClient::Impl is defined in rpc_client.cc, ClientWorker::Impl in client_worker.cc.

#include <ucp/api/ucp.h>

#include <asio.hpp>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "kvstash/common/mutex.h"
#include "kvstash/common/status.h"
#include "kvstash/transport/rpc.h"
#include "rpc_client_bootstrap.h"
#include "rpc_client_calls.h"
#include "rpc_client_mapped.h"
#include "worker.h"

namespace kvstash::transport {

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

// RpcClient's implementation: the client end of one connection, made of parts with one job
// each: the calls (CallTable), the UCX endpoint their frames go out on (ClientEndpoint), their
// deadlines (DeadlineQueue), the mapped payloads (MappedPayloads) and the bootstrap connection
// (Bootstrap). It holds the connection's state (idle, connecting, connected), admits
// calls, routes the frames from the server to the part they concern, and ties the parts
// together on connection, loss and shutdown. Owned by its RpcClient, then, from Detach, by its
// ClientWorker::Impl until it is quiet.
//
// Invariants: connected exactly while the endpoint is open and routed under its connection
// id; the calls waiting for a connection (waiting_) and the connect waiters are answered when
// the attempt ends, either way; after a loss every live call is resolved and, once the
// endpoint is closed, finished or abandoned.
//
// Thread-safety: the public entry points above OnFrame (Call, Cancel, Reset, SendRaw, Connect,
// ConnectAsync, stats, connection_id, payloads_mapped, server_limits) may run on any thread:
// they hand their work to the progress thread, and what they read is atomic or under
// limits_mu_. Everything else, OnFrame included (the hub calls it), runs on the progress
// thread.
class RpcClient::Impl {
 public:
  Impl(ClientOptions options, ClientWorker::Impl* hub);

  // Fails every call, closes the connection and hands this Impl to the hub, which destroys it
  // once quiet. Returns after the shutdown (so no callback of this client runs after).
  static void Detach(std::unique_ptr<Impl> self);

  // Nothing of this client can still run: no calls, no UCX request, no copy, no endpoint.
  bool Quiet() const { return calls_.empty() && !endpoint_ && mapped_.quiet(); }

  std::shared_ptr<Worker> worker() const { return worker_; }

  uint64_t Call(uint16_t method, Bytes request, const CallOptions& options, ResponseCallback done);
  void Cancel(uint64_t id);
  // Closes the connection now, failing every call out with `why` (Channel::Reset).
  void Reset(Status why);
  Status SendRaw(Bytes header, Bytes data, std::function<void(Status)> sent);
  Status Connect();
  void ConnectAsync(std::function<void(const Status&)> done);

  TransportStats stats() const { return counters_.Snapshot(); }
  uint64_t connection_id() const { return endpoint_.connection_id(); }
  bool payloads_mapped() const { return mapped_.mapped(); }
  std::optional<ServerLimits> server_limits() const {
    MutexLock lock(&limits_mu_);
    return limits_;
  }

  // A frame the hub routed here (its connection id is this client's).
  ucs_status_t OnFrame(const void* header, size_t header_length, void* data, size_t length,
                       const ucp_am_recv_param_t* param);

 private:
  using PendingCall = internal::PendingCall;
  enum class State { kIdle, kConnecting, kConnected };

  void Start(std::unique_ptr<PendingCall> owned);
  void Send(PendingCall* call);
  void StartConnect();
  void OnConnected(internal::Bootstrap::Hello hello);
  static void OnEndpointError(void* arg, ucp_ep_h ep, ucs_status_t status);
  void FailConnect(Status status);
  // Fails every call and closes the endpoint; the next call reconnects.
  void Disconnect(Status status);
  void Shutdown();

  ClientOptions options_;
  ClientWorker::Impl* hub_;  // outlives this Impl
  std::shared_ptr<Worker> worker_;
  std::string server_;  // host:port, for messages
  std::atomic<uint64_t> next_id_{1};
  internal::ClientCounters counters_;

  // Progress-thread state.
  internal::CallTable calls_;
  internal::ClientEndpoint endpoint_;
  internal::DeadlineQueue deadlines_;
  internal::MappedPayloads mapped_;
  internal::Bootstrap bootstrap_;
  State state_ = State::kIdle;
  std::vector<uint64_t> waiting_;  // calls started while not connected
  std::vector<std::function<void(const Status&)>> connect_waiters_;
  bool in_shutdown_ = false;

  mutable Mutex limits_mu_;
  std::optional<ServerLimits> limits_ GUARDED_BY(limits_mu_);
};

}  // namespace kvstash::transport
