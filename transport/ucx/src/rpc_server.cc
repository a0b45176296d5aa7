// RpcServer: the public class, over its Impl (rpc_server_impl.h), which starts and stops the
// server's parts and runs its periodic tasks (RunEvery).

#include <chrono>
#include <functional>
#include <memory>
#include <utility>

#include "kvstash/transport/rpc.h"
#include "rpc_server_impl.h"
#include "worker.h"

namespace kvstash::transport {

// ---- RpcServer::Impl -------------------------------------------------------------------------

RpcServer::Impl::Impl(ServerOptions options, std::shared_ptr<Worker> worker)
    : worker_(std::move(worker)),
      options_(std::move(options)),
      connections_(*worker_, counters_),
      replies_(*worker_, counters_),
      payloads_(*worker_, counters_),
      frames_(*this, *worker_, connections_, replies_, payloads_, counters_),
      acceptor_(options_, *worker_, connections_, counters_) {}

Status RpcServer::Impl::Start() {
  KVSTASH_RETURN_IF_ERROR(acceptor_.Listen());
  KVSTASH_RETURN_IF_ERROR(worker_->SetFrameHandler(
      &FrameDispatcher::OnFrame, &frames_, UCP_AM_FLAG_WHOLE_MSG | UCP_AM_FLAG_PERSISTENT_DATA));
  worker_->Start([this] { Shutdown(); });
  worker_->Run([this] { acceptor_.Accept(); });
  return Status::OK();
}

void RpcServer::Impl::Shutdown() {
  acceptor_.Stop();
  connections_.CloseAll(CancelledError("server stopping"));
}

void RpcServer::Impl::RunEvery(std::chrono::milliseconds period, std::function<void()> fn) {
  auto timer = std::make_shared<asio::steady_timer>(worker_->io());
  auto task = std::make_shared<std::function<void()>>(std::move(fn));
  worker_->Run([this, timer, period, task] { Tick(timer, period, task); });
}

void RpcServer::Impl::Tick(std::shared_ptr<asio::steady_timer> timer,
                           std::chrono::milliseconds period,
                           std::shared_ptr<std::function<void()>> task) {
  timer->expires_after(period);
  timer->async_wait([this, timer, period, task](const asio::error_code& error) {
    if (error || worker_->stopping()) return;
    (*task)();
    Tick(timer, period, task);
  });
}

// ---- RpcServer -------------------------------------------------------------------------------

Result<std::unique_ptr<RpcServer>> RpcServer::Create(ServerOptions options) {
  KVSTASH_ASSIGN_OR_RETURN(auto worker, Worker::Create(options.transport, "kvstash-server"));
  auto impl = std::make_shared<Impl>(std::move(options), std::move(worker));
  return std::unique_ptr<RpcServer>(new RpcServer(std::move(impl)));
}

RpcServer::RpcServer(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}

RpcServer::~RpcServer() {
  if (impl_) impl_->Stop();
}

void RpcServer::Handle(uint16_t method, Handler handler) {
  impl_->Handle(method, std::move(handler));
}

void RpcServer::OnDisconnect(std::function<void(uint64_t connection_id)> fn) {
  impl_->OnDisconnect(std::move(fn));
}

Status RpcServer::Start() { return impl_->Start(); }
void RpcServer::Stop() { impl_->Stop(); }
uint16_t RpcServer::port() const { return impl_->port(); }

Result<MemoryRegion> RpcServer::RegisterMemory(MutableBytes memory) {
  return impl_->worker()->Register(memory);
}

Result<MemoryRegion> RpcServer::AllocateMemory(size_t bytes) {
  return impl_->worker()->Allocate(bytes);
}

bool RpcServer::OnProgressThread() const { return impl_->worker()->OnThread(); }

void RpcServer::RunOnProgressThread(std::function<void()> fn) {
  impl_->worker()->Run(std::move(fn));
}

void RpcServer::RunEvery(std::chrono::milliseconds period, std::function<void()> fn) {
  impl_->RunEvery(period, std::move(fn));
}

TransportStats RpcServer::stats() const { return impl_->stats(); }
size_t RpcServer::connection_count() const { return impl_->connection_count(); }

}  // namespace kvstash::transport
