// RpcClient: the public class, over its Impl (rpc_client_impl.h).

#include <future>

#include "kvstash/transport/rpc.h"
#include "rpc_client_impl.h"
#include "worker.h"

namespace kvstash::transport {

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
bool RpcClient::payloads_mapped() const { return impl_->payloads_mapped(); }

void RpcClient::ConnectAsync(std::function<void(const Status&)> done) {
  impl_->ConnectAsync(std::move(done));
}

void RpcClient::Reset(const Status& why) { impl_->Reset(why); }

Status RpcClient::SendRawForTesting(Bytes header, Bytes data, std::function<void(Status)> sent) {
  KVSTASH_RETURN_IF_ERROR(impl_->Connect());
  return impl_->SendRaw(header, data, std::move(sent));
}

}  // namespace kvstash::transport
