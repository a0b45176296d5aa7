// RpcServer: the public class, over its Impls (rpc_server_impl.h), one per worker, each of
// which starts and stops its parts; the first listens and runs the periodic tasks (RunEvery).

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "kvstash/transport/rpc.h"
#include "rpc_server_impl.h"
#include "worker.h"

namespace kvstash::transport {

// ---- RpcServer::Impl -------------------------------------------------------------------------

RpcServer::Impl::Impl(ServerOptions options, std::shared_ptr<Worker> worker, bool listens)
    : worker_(std::move(worker)),
      options_(std::move(options)),
      listens_(listens),
      connections_(*worker_, counters_),
      replies_(*worker_, counters_),
      payloads_(*worker_, counters_),
      frames_(*this, *worker_, connections_, replies_, payloads_, counters_),
      acceptor_(options_, *worker_, connections_, counters_) {}

Status RpcServer::Impl::Listen() { return acceptor_.Listen(); }

Status RpcServer::Impl::Start() {
  KVSTASH_RETURN_IF_ERROR(worker_->SetFrameHandler(
      &FrameDispatcher::OnFrame, &frames_, UCP_AM_FLAG_WHOLE_MSG | UCP_AM_FLAG_PERSISTENT_DATA));
  worker_->Start([this] { Shutdown(); });
  if (listens_) worker_->Run([this] { acceptor_.Accept(); });
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

namespace {

// Workers a server runs: the setting, else one per core, at most 4.
size_t ServingThreads(const TransportOptions& options) {
  if (options.progress_threads != 0) return options.progress_threads;
  return std::clamp<size_t>(std::thread::hardware_concurrency(), 1, 4);
}

// A socket the listening worker accepted goes to the worker with the fewest connections (open
// or saying hello); ties go round from `turn`. On the listening worker's thread.
void HandOff(const std::vector<RpcServer::Impl*>& impls, size_t turn,
             asio::ip::tcp::socket socket) {
  const size_t n = impls.size();
  size_t best = turn % n;
  size_t best_load = SIZE_MAX;
  for (size_t k = 0; k < n; ++k) {
    const size_t i = (turn + k) % n;
    const ServerCounters& c = impls[i]->counters();
    const size_t load = c.open_connections.load(std::memory_order_relaxed) +
                        c.pending_hellos.load(std::memory_order_relaxed);
    if (load < best_load) {
      best = i;
      best_load = load;
    }
  }
  RpcServer::Impl& target = *impls[best];
  target.counters().pending_hellos.fetch_add(1, std::memory_order_relaxed);
  // The socket moves to the target worker's io_context as its bare descriptor, which closes
  // if that worker has stopped and drops the hand-over unrun.
  asio::error_code error;
  const auto protocol = socket.local_endpoint(error).protocol();
  std::shared_ptr<int> fd(new int(socket.release(error)), [](int* p) {
    if (*p >= 0) ::close(*p);
    delete p;
  });
  if (error || *fd < 0) {
    target.counters().pending_hellos.fetch_sub(1, std::memory_order_relaxed);
    return;
  }
  target.worker()->Run([&target, fd, protocol] {
    asio::error_code adopt_error;
    asio::ip::tcp::socket adopted(target.worker()->io());
    adopted.assign(protocol, *fd, adopt_error);
    if (adopt_error) {
      target.counters().pending_hellos.fetch_sub(1, std::memory_order_relaxed);
      return;
    }
    *fd = -1;  // the socket owns it now
    target.acceptor().Adopt(std::move(adopted));
  });
}

}  // namespace

// ---- RpcServer -------------------------------------------------------------------------------

Result<std::unique_ptr<RpcServer>> RpcServer::Create(ServerOptions options) {
  const size_t threads = ServingThreads(options.transport);
  if (threads > kMaxProgressThreads) {
    return InvalidArgumentError("{} progress threads: at most {}", threads, kMaxProgressThreads);
  }
  std::vector<std::shared_ptr<Impl>> impls;
  for (size_t i = 0; i < threads; ++i) {
    KVSTASH_ASSIGN_OR_RETURN(
        auto worker, Worker::Create(options.transport, "kvstash-server",
                                    impls.empty() ? nullptr : impls.front()->worker().get()));
    impls.push_back(std::make_shared<Impl>(options, std::move(worker), /*listens=*/i == 0));
  }
  return std::unique_ptr<RpcServer>(new RpcServer(std::move(impls)));
}

RpcServer::RpcServer(std::vector<std::shared_ptr<Impl>> impls) : impls_(std::move(impls)) {}

RpcServer::~RpcServer() { Stop(); }

void RpcServer::Handle(uint16_t method, Handler handler) {
  for (auto& impl : impls_) impl->Handle(method, handler);
}

void RpcServer::OnDisconnect(std::function<void(uint64_t connection_id)> fn) {
  for (auto& impl : impls_) impl->OnDisconnect(fn);
}

Status RpcServer::Start() {
  Impl& first = *impls_.front();
  KVSTASH_RETURN_IF_ERROR(first.Listen());
  if (impls_.size() > 1) {
    for (auto& impl : impls_) impl->acceptor().ShareProbe(first.acceptor().probe());
    // Raw pointers: the listening worker (which runs this) stops before any Impl can go.
    std::vector<Impl*> impls;
    for (auto& impl : impls_) impls.push_back(impl.get());
    first.acceptor().SetHandoff([impls, turn = size_t{0}](asio::ip::tcp::socket socket) mutable {
      HandOff(impls, turn++, std::move(socket));
    });
  }
  // The serving workers first: the listening one hands them sockets as soon as it runs.
  for (size_t i = impls_.size(); i-- > 0;) KVSTASH_RETURN_IF_ERROR(impls_[i]->Start());
  return Status::OK();
}

void RpcServer::Stop() {
  // The listening worker first: no connection is handed to a worker that has stopped.
  for (auto& impl : impls_) impl->Stop();
}

uint16_t RpcServer::port() const { return impls_.front()->port(); }

Result<MemoryRegion> RpcServer::RegisterMemory(MutableBytes memory) {
  return impls_.front()->worker()->Register(memory);
}

Result<MemoryRegion> RpcServer::AllocateMemory(size_t bytes) {
  return impls_.front()->worker()->Allocate(bytes);
}

bool RpcServer::OnProgressThread() const {
  return std::any_of(impls_.begin(), impls_.end(),
                     [](const auto& impl) { return impl->worker()->OnThread(); });
}

void RpcServer::RunOnProgressThread(std::function<void()> fn) {
  impls_.front()->worker()->Run(std::move(fn));
}

void RpcServer::RunEvery(std::chrono::milliseconds period, std::function<void()> fn) {
  impls_.front()->RunEvery(period, std::move(fn));
}

TransportStats RpcServer::stats() const {
  TransportStats sum;
  for (const auto& impl : impls_) {
    const TransportStats s = impl->stats();
    sum.calls += s.calls;
    sum.connects += s.connects;
    sum.disconnects += s.disconnects;
    sum.malformed_frames += s.malformed_frames;
    sum.mapped_payloads += s.mapped_payloads;
    sum.refused += s.refused;
    sum.bad_hellos += s.bad_hellos;
    sum.foreign_frames += s.foreign_frames;
    sum.accept_pauses += s.accept_pauses;
  }
  return sum;
}

size_t RpcServer::connection_count() const {
  size_t sum = 0;
  for (const auto& impl : impls_) sum += impl->connection_count();
  return sum;
}

size_t RpcServer::progress_threads() const { return impls_.size(); }

}  // namespace kvstash::transport
