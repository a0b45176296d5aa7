// ClientWorker and its Impl: the worker and progress thread many RpcClients share, routing each
// frame to the client whose connection it names.

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <thread>

#include "kvstash/common/logging.h"
#include "kvstash/transport/frame.h"
#include "kvstash/transport/rpc.h"
#include "rpc_client_impl.h"
#include "worker.h"

namespace kvstash::transport {

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
std::string ClientWorker::AddressForTesting() const {
  return std::string(impl_->worker().address());
}

// ---- ClientWorkerPool ------------------------------------------------------------------------

ClientWorkerPool::ClientWorkerPool(const TransportOptions& options, size_t size)
    : options_(options),
      size_(size != 0 ? size : std::clamp<size_t>(std::thread::hardware_concurrency(), 1, 4)) {}

std::shared_ptr<ClientWorkerPool> ClientWorkerPool::Create(const TransportOptions& options,
                                                           size_t size) {
  return std::shared_ptr<ClientWorkerPool>(new ClientWorkerPool(options, size));
}

std::shared_ptr<ClientWorkerPool> ClientWorkerPool::ForProcess(const TransportOptions& options) {
  // Pools by every setting a worker is made with: a channel runs on a worker of its own
  // settings only.
  const std::string key = fmt::format(
      "{}\n{}\n{}\n{}\n{}\n{}\n{}\n{}", options.tls, options.max_message_bytes,
      options.max_payload_bytes, options.spin_before_sleep.count(), options.yield_while_spinning,
      options.mapped_payloads, options.shm_dir, options.progress_threads);
  static std::mutex mu;
  static std::map<std::string, std::weak_ptr<ClientWorkerPool>> pools;
  std::lock_guard lock(mu);
  std::weak_ptr<ClientWorkerPool>& slot = pools[key];
  std::shared_ptr<ClientWorkerPool> pool = slot.lock();
  if (!pool) {
    pool = Create(options);
    slot = pool;
  }
  return pool;
}

Result<std::shared_ptr<ClientWorker>> ClientWorkerPool::Next() {
  std::lock_guard lock(mu_);
  // A worker's channels each hold it: the fewest holders, the fewest channels.
  std::shared_ptr<ClientWorker>* least = nullptr;
  for (auto& worker : workers_) {
    if (least == nullptr || worker.use_count() < least->use_count()) least = &worker;
  }
  if (least != nullptr && (least->use_count() == 1 || workers_.size() == size_)) return *least;
  KVSTASH_ASSIGN_OR_RETURN(std::shared_ptr<ClientWorker> worker, ClientWorker::Create(options_));
  workers_.push_back(worker);
  return worker;
}

size_t ClientWorkerPool::workers() const {
  std::lock_guard lock(mu_);
  return workers_.size();
}

}  // namespace kvstash::transport
