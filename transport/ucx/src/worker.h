#pragma once

// One UCX context + worker and the progress thread that drives them (with an Asio io_context
// for sockets and timers). Private to transport/.

#include <ucp/api/ucp.h>

#include <asio.hpp>
#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "kvstash/common/status.h"
#include "kvstash/transport/rpc.h"

namespace kvstash::transport {

// Translates a UCX status; the one place UCX codes become kvstash codes.
Status FromUcs(ucs_status_t status, std::string_view what);

// Parameters of a UCX operation on a contiguous buffer that completes with a callback (the
// caller sets cb.send or cb.recv_am): `user_data`, and the memory handle of `region` when the
// buffer is registered there.
inline ucp_request_param_t ContigParam(void* user_data, const MemoryRegion* region) {
  ucp_request_param_t param{};
  param.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_DATATYPE;
  param.user_data = user_data;
  param.datatype = ucp_dt_make_contig(1);
  if (region != nullptr) {
    param.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
    param.memh = static_cast<ucp_mem_h>(region->handle());
  }
  return param;
}

// Marks a send to a server as coming from its endpoint: the server reads the endpoint a frame
// came on (UCX's reply endpoint) and takes a connection's frames from its bound endpoint only.
inline void FromThisEndpoint(ucp_request_param_t* param) {
  param->op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
  param->flags |= UCP_AM_SEND_FLAG_REPLY;
}

// Owns a ucp_context_h. Move-only.
class UcpContext {
 public:
  UcpContext() = default;
  explicit UcpContext(ucp_context_h handle) : handle_(handle) {}
  UcpContext(UcpContext&& other) noexcept : handle_(std::exchange(other.handle_, nullptr)) {}
  UcpContext& operator=(UcpContext&& other) noexcept {
    std::swap(handle_, other.handle_);
    return *this;
  }
  ~UcpContext() {
    if (handle_ != nullptr) ucp_cleanup(handle_);
  }
  ucp_context_h get() const { return handle_; }

 private:
  ucp_context_h handle_ = nullptr;
};

// Owns a ucp_worker_h. Move-only. Every endpoint of the worker must be closed first.
class UcpWorker {
 public:
  UcpWorker() = default;
  explicit UcpWorker(ucp_worker_h handle) : handle_(handle) {}
  UcpWorker(UcpWorker&& other) noexcept : handle_(std::exchange(other.handle_, nullptr)) {}
  UcpWorker& operator=(UcpWorker&& other) noexcept {
    std::swap(handle_, other.handle_);
    return *this;
  }
  ~UcpWorker() {
    if (handle_ != nullptr) ucp_worker_destroy(handle_);
  }
  ucp_worker_h get() const { return handle_; }

 private:
  ucp_worker_h handle_ = nullptr;
};

// Owns a worker address (ucp_worker_get_address). Move-only.
class UcpWorkerAddress {
 public:
  UcpWorkerAddress() = default;
  UcpWorkerAddress(ucp_worker_h worker, ucp_address_t* address, size_t length)
      : worker_(worker), address_(address), length_(length) {}
  UcpWorkerAddress(UcpWorkerAddress&& other) noexcept
      : worker_(other.worker_),
        address_(std::exchange(other.address_, nullptr)),
        length_(other.length_) {}
  UcpWorkerAddress& operator=(UcpWorkerAddress&& other) noexcept {
    std::swap(worker_, other.worker_);
    std::swap(address_, other.address_);
    std::swap(length_, other.length_);
    return *this;
  }
  ~UcpWorkerAddress() {
    if (address_ != nullptr) ucp_worker_release_address(worker_, address_);
  }
  std::string_view bytes() const { return {reinterpret_cast<const char*>(address_), length_}; }

 private:
  ucp_worker_h worker_ = nullptr;
  ucp_address_t* address_ = nullptr;
  size_t length_ = 0;
};

// Owns a ucp_ep_h; Close() starts a close (force: without flushing) and the destructor forces
// one. Must be closed on the worker's progress thread, before the worker is destroyed.
class UcpEndpoint {
 public:
  UcpEndpoint() = default;
  explicit UcpEndpoint(ucp_ep_h handle) : handle_(handle) {}
  UcpEndpoint(UcpEndpoint&& other) noexcept : handle_(std::exchange(other.handle_, nullptr)) {}
  UcpEndpoint& operator=(UcpEndpoint&& other) noexcept {
    std::swap(handle_, other.handle_);
    return *this;
  }
  ~UcpEndpoint() { Close(/*force=*/true); }
  ucp_ep_h get() const { return handle_; }
  explicit operator bool() const { return handle_ != nullptr; }
  // Returns the close request (to progress until done) or nullptr when already closed.
  void* Close(bool force);

 private:
  ucp_ep_h handle_ = nullptr;
};

// A worker, its progress thread and the context it belongs to. Created by RpcClient/RpcServer;
// shared with their asynchronous handlers through shared_ptr. All UCX worker calls happen on
// the thread. A server's workers share one context (Create's `sibling`), so that memory one
// registers is the others' too: a block moves from the node's tier on whichever worker serves
// the connection.
class Worker : public std::enable_shared_from_this<Worker> {
 public:
  // A worker in a context of its own, or, given `sibling`, in the sibling's context (with its
  // options; `options` is then ignored).
  static Result<std::shared_ptr<Worker>> Create(const TransportOptions& options,
                                                const std::string& name,
                                                const Worker* sibling = nullptr);
  ~Worker();

  // Starts the progress thread. `on_stop` runs on it when Stop is called, before it exits: the
  // owner closes its endpoints there.
  void Start(std::function<void()> on_stop);
  // Runs on_stop on the thread, progresses outstanding closes, joins. Idempotent.
  void Stop();

  asio::io_context& io() { return io_; }
  ucp_worker_h ucp() const { return worker_.get(); }
  const TransportOptions& options() const { return options_; }
  // Largest AM header this worker can send (frame header + message above it go as data).
  size_t max_am_header() const { return max_am_header_; }
  std::string_view address() const { return address_.bytes(); }

  bool OnThread() const { return std::this_thread::get_id() == thread_id_.load(); }
  bool stopping() const { return stopping_.load(); }
  // Runs fn on the progress thread: inline when already there, else posted.
  // After the thread has exited, fn is dropped unrun.
  template <typename F>
  void Run(F&& fn) {
    if (OnThread()) {
      fn();
    } else if (!exited_.load()) {
      asio::post(io_, std::forward<F>(fn));
    }
  }

  // Hands `request` (an endpoint close) back to UCX; while stopping, first progresses the
  // worker until it completes or 200 ms pass. Never blocks otherwise: the request is kept and
  // finished (as while stopping) when the worker stops. On the thread.
  void WaitRequest(void* request);

  // ucp_ep_create with UCX peer-failure mode (errors, not aborts, when a peer dies), over every
  // transport (see Create), unless `peer_failure` says otherwise: a server states its mode at
  // hello (HelloReply.error_handling) and its clients open their endpoints the same way (UCX
  // fails an endpoint whose two ends differ), and nodes of before 2026-11-26 said none over TCP.
  Status CreateEndpoint(ucp_ep_params_t* params, ucp_ep_h* ep, std::string_view what,
                        std::optional<bool> peer_failure = std::nullopt);

  // Drops a rendezvous payload the receiver does not want. UCX 1.13's ucp_am_data_release of a
  // rendezvous descriptor trips an assertion in the sender over shared memory, so the bytes are
  // received into a scratch buffer and thrown away. False (nothing done) when the payload is
  // beyond max_payload_bytes: the caller then closes the endpoint, which releases it.
  bool DiscardRendezvous(void* descriptor, size_t length);

  // Sets the handler of every RPC frame (active-message id kRpcAmId) on this worker.
  Status SetFrameHandler(ucp_am_recv_callback_t cb, void* arg, uint32_t flags);

  Result<MemoryRegion> Register(MutableBytes memory);
  Result<MemoryRegion> Allocate(size_t bytes);

 private:
  std::function<void()> Unmapper(void* memh) const;
  Worker(const TransportOptions& options) : options_(options) {}
  void Loop();

  TransportOptions options_;
  std::shared_ptr<UcpContext> context_;  // shared with sibling workers; outlives worker_
  UcpWorker worker_;
  UcpWorkerAddress address_;
  size_t max_am_header_ = 0;
  int event_fd_ = -1;
  bool tcp_only_ = false;  // UCX_TLS is "tcp": no shared-memory transport to configure

  asio::io_context io_{1};
  std::thread thread_;
  std::atomic<std::thread::id> thread_id_{};
  std::atomic<bool> stopping_{false};
  std::atomic<bool> exit_{false};
  std::atomic<bool> exited_{false};
  std::function<void()> on_stop_;
  std::vector<void*> closing_;  // endpoint closes still in flight (progress thread only)

  void FinishClosing();
};

}  // namespace kvstash::transport
