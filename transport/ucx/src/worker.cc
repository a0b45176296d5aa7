#include "worker.h"

#include <fmt/format.h>
#include <sched.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <string_view>
#include <thread>
#include <utility>

#include "kvstash/common/logging.h"
#include "kvstash/transport/frame.h"

namespace kvstash::transport {

Status FromUcs(ucs_status_t status, std::string_view what) {
  if (status == UCS_OK) return Status::OK();
  const std::string message = fmt::format("{}: {}", what, ucs_status_string(status));
  switch (status) {
    case UCS_ERR_CANCELED:
      return Status(StatusCode::kCancelled, message);
    case UCS_ERR_TIMED_OUT:
      return Status(StatusCode::kDeadlineExceeded, message);
    case UCS_ERR_NO_MEMORY:
    case UCS_ERR_NO_RESOURCE:
    case UCS_ERR_EXCEEDS_LIMIT:
    case UCS_ERR_OUT_OF_RANGE:
      return Status(StatusCode::kResourceExhausted, message);
    case UCS_ERR_INVALID_PARAM:
    case UCS_ERR_MESSAGE_TRUNCATED:
      return Status(StatusCode::kInvalidArgument, message);
    case UCS_ERR_UNSUPPORTED:
    case UCS_ERR_NOT_IMPLEMENTED:
      return Status(StatusCode::kUnimplemented, message);
    case UCS_ERR_UNREACHABLE:
    case UCS_ERR_ENDPOINT_TIMEOUT:  // the peer stopped answering: it is gone, not our deadline
    case UCS_ERR_CONNECTION_RESET:
    case UCS_ERR_NOT_CONNECTED:
    case UCS_ERR_REJECTED:
    case UCS_ERR_IO_ERROR:
    case UCS_ERR_NO_DEVICE:
      return Status(StatusCode::kUnavailable, message);
    default:
      return Status(StatusCode::kInternal, message);
  }
}

Status Worker::CreateEndpoint(ucp_ep_params_t* params, ucp_ep_h* ep, std::string_view what,
                              std::optional<bool> peer_failure) {
  params->field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
  params->err_mode =
      peer_failure.value_or(true) ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
  return FromUcs(ucp_ep_create(worker_.get(), params, ep), what);
}

void* UcpEndpoint::Close(bool force) {
  if (handle_ == nullptr) return nullptr;
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  ucs_status_ptr_t request = ucp_ep_close_nbx(std::exchange(handle_, nullptr), &param);
  if (request == nullptr || UCS_PTR_IS_ERR(request)) return nullptr;
  return request;
}

namespace {
std::atomic<uint64_t> next_region_id{1};
}  // namespace

namespace {

// Whether a worker whose UCX_TLS is `tls` ("" for UCX's default, every transport) may carry
// traffic over TCP. UCX's default picks TCP between hosts only where there is no RDMA device,
// so the default counts as TCP on a host without one (no /sys/class/infiniband entries).
bool MayUseTcp(std::string_view tls) {
  const bool every = tls.empty() || tls == "all";
  const bool excluding = !tls.empty() && tls.front() == '^';
  std::string_view names = excluding ? tls.substr(1) : tls;
  bool names_tcp = false;
  while (!names.empty()) {
    const size_t comma = names.find(',');
    if (names.substr(0, comma) == "tcp") names_tcp = true;
    names = comma == std::string_view::npos ? std::string_view() : names.substr(comma + 1);
  }
  if (names_tcp) return !excluding;
  if (!every && !excluding) return false;
  std::error_code error;
  std::filesystem::directory_iterator rdma("/sys/class/infiniband", error);
  return error || rdma == std::filesystem::directory_iterator();
}

// The context of a new worker: UCX's configuration read, with `options` applied over it.
// `tcp_only`: the transports are TCP alone.
Result<UcpContext> CreateContext(const TransportOptions& options, const std::string& name,
                                 bool tcp_only) {
  // UCX 1.13's posix and sysv shared-memory transports can detect a dead peer but only
  // advertise it when asked. Without it, peer-failure mode refuses shared memory; and without
  // peer-failure mode, a transfer from a killed peer aborts the process (cma). The option is
  // read from the environment only (ucp_config_modify rejects it), so it is set there, over
  // whatever the environment said: both ends must agree on it, or the node's UCX aborts when the
  // client's endpoint reaches it with other lanes than the node chose ("endpoint
  // reconfiguration not supported yet"), which `UCX_POSIX_ERROR_HANDLING=n kvstash put` did.
  if (!tcp_only) {
    for (const char* variable : {"UCX_POSIX_ERROR_HANDLING", "UCX_SYSV_ERROR_HANDLING"}) {
      const char* set = std::getenv(variable);
      if (set != nullptr && std::string_view(set) != "y") {
        KVSTASH_LOG_WARN("{}={} in the environment is overridden: kvstash runs UCX with it 'y'",
                         variable, set);
      }
      ::setenv(variable, "y", /*overwrite=*/1);
    }
  }
  ucp_config_t* config = nullptr;
  KVSTASH_RETURN_IF_ERROR(FromUcs(ucp_config_read(nullptr, nullptr, &config), "ucp_config_read"));
  Status status;
  if (status.ok() && !options.tls.empty()) {
    status = FromUcs(ucp_config_modify(config, "TLS", options.tls.c_str()),
                     fmt::format("UCX_TLS={}", options.tls));
  }
  // UCX 1.13 hands keys it does not know to its transports' settings, and there the posix
  // allocator's UCX_POSIX_DIR is "DIR" (no other transport has one); "POSIX_DIR" would be kept
  // and never applied. A directory other than /dev/shm makes UCX use open(2), not shm_open.
  if (status.ok() && !options.shm_dir.empty()) {
    status = FromUcs(ucp_config_modify(config, "DIR", options.shm_dir.c_str()),
                     fmt::format("UCX_POSIX_DIR={}", options.shm_dir));
  }
  // UCX 1.13's TCP transport completes a zero-copy send twice when the socket fails under it
  // (uct_tcp_ep_sendv: once in the endpoint's purge, once after it); the second completion
  // asserts (uct_iface.h, `comp->count > 0`) and aborts the process, so a peer killed while a
  // zero-copy fragment was on its socket took the survivor down with it: a node killed mid-put
  // aborted the engine, a client killed mid-get the node (RpcFaultTest, about 1 run in 14
  // beside a CPU hog). Copied sends have no completion to repeat. With 64 KiB send segments
  // instead of 8 KiB they move 256 KiB to 2 MiB payloads within the run-to-run noise of zero copy
  // (`kvstash bench transport --tls tcp`); an explicit UCX_ZCOPY_THRESH or UCX_TCP_TX_SEG_SIZE in
  // the environment is kept.
  const char* env_tls = std::getenv("UCX_TLS");
  if (status.ok() && MayUseTcp(!options.tls.empty() ? options.tls
                               : env_tls != nullptr ? env_tls
                                                    : "")) {
    if (std::getenv("UCX_ZCOPY_THRESH") == nullptr) {
      status = FromUcs(ucp_config_modify(config, "ZCOPY_THRESH", "inf"), "UCX_ZCOPY_THRESH=inf");
    }
    // Kept for the TCP transport (its send segment; no other transport has one).
    if (status.ok() && std::getenv("UCX_TCP_TX_SEG_SIZE") == nullptr) {
      status = FromUcs(ucp_config_modify(config, "TX_SEG_SIZE", "64k"), "UCX_TCP_TX_SEG_SIZE=64k");
    }
  }
  ucp_context_h context = nullptr;
  if (status.ok()) {
    ucp_params_t params{};
    params.field_mask =
        UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED | UCP_PARAM_FIELD_NAME;
    params.features = UCP_FEATURE_AM | UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP;
    // Memory is registered from any thread, and a server's workers share the context: the
    // context's lock makes that safe.
    params.mt_workers_shared = 1;
    params.name = name.c_str();
    status = FromUcs(ucp_init(&params, config, &context), "ucp_init");
  }
  ucp_config_release(config);
  KVSTASH_RETURN_IF_ERROR(status);
  return UcpContext(context);
}

}  // namespace

Result<std::shared_ptr<Worker>> Worker::Create(const TransportOptions& options,
                                               const std::string& name, const Worker* sibling) {
  std::shared_ptr<Worker> self(new Worker(sibling != nullptr ? sibling->options_ : options));
  // Every endpoint takes UCX peer-failure mode, TCP alone too. Without it, UCX 1.13 sends the
  // wireup request an endpoint needs for its first reply-flagged frame straight on the TCP
  // endpoint; when the peer is stopped (SIGSTOP, a stall) that request waits there, and when the
  // connection then fails, is closed by force, or the worker is destroyed, UCX asserts on it
  // ("got REQ message", ucp_request.c:684) and aborts the process: the engine, for a node that
  // only stalled. UCX documents a forced close without peer-failure mode on both ends as
  // undefined too. The mode costs TCP its put-zcopy rendezvous lanes (a received fragment is
  // copied once more).
  const char* env_tls = std::getenv("UCX_TLS");
  const std::string& tls = self->options_.tls;
  self->tcp_only_ = (!tls.empty() ? tls : (env_tls != nullptr ? env_tls : "")) == "tcp";
  ucp_worker_params_t worker_params{};
  worker_params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  worker_params.thread_mode = UCS_THREAD_MODE_SINGLE;  // only the progress thread touches it
  ucp_worker_h worker = nullptr;
  // A network interface that goes away between the context listing the devices and the worker
  // opening them (a container's veth, a VPN) fails the worker with "No such device": a new
  // context lists them again (a sibling's context is kept: its devices opened before).
  for (int attempt = 1;; ++attempt) {
    if (sibling != nullptr) {
      self->context_ = sibling->context_;
    } else {
      KVSTASH_ASSIGN_OR_RETURN(UcpContext context,
                               CreateContext(self->options_, name, self->tcp_only_));
      self->context_ = std::make_shared<UcpContext>(std::move(context));
    }
    const ucs_status_t created = ucp_worker_create(self->context_->get(), &worker_params, &worker);
    if (created == UCS_OK) break;
    if (created != UCS_ERR_NO_DEVICE || attempt == 5 || sibling != nullptr) {
      return FromUcs(created, "ucp_worker_create");
    }
    KVSTASH_LOG_WARN("ucp_worker_create: {} (a network device went away?); trying again",
                     ucs_status_string(created));
    std::this_thread::sleep_for(std::chrono::milliseconds(50 * attempt));
  }
  self->worker_ = UcpWorker(worker);

  ucp_worker_attr_t attr{};
  attr.field_mask = UCP_WORKER_ATTR_FIELD_MAX_AM_HEADER;
  KVSTASH_RETURN_IF_ERROR(FromUcs(ucp_worker_query(worker, &attr), "ucp_worker_query"));
  self->max_am_header_ = attr.max_am_header;

  ucp_address_t* address = nullptr;
  size_t address_length = 0;
  KVSTASH_RETURN_IF_ERROR(
      FromUcs(ucp_worker_get_address(worker, &address, &address_length), "ucp_worker_get_address"));
  self->address_ = UcpWorkerAddress(worker, address, address_length);
  KVSTASH_RETURN_IF_ERROR(
      FromUcs(ucp_worker_get_efd(worker, &self->event_fd_), "ucp_worker_get_efd"));
  return self;
}

Worker::~Worker() { Stop(); }

void Worker::Start(std::function<void()> on_stop) {
  on_stop_ = std::move(on_stop);
  thread_ = std::thread([this] { Loop(); });
  while (thread_id_.load() == std::thread::id()) std::this_thread::yield();
}

void Worker::Stop() {
  if (!thread_.joinable()) return;
  if (thread_.get_id() == std::this_thread::get_id()) {
    KVSTASH_LOG_ERROR("transport worker stopped from its own progress thread; detaching");
    thread_.detach();
    return;
  }
  asio::post(io_, [this] {
    stopping_ = true;
    if (on_stop_) on_stop_();
    FinishClosing();
    exit_ = true;
  });
  thread_.join();
}

void Worker::WaitRequest(void* request) {
  if (request == nullptr || UCS_PTR_IS_ERR(request)) return;
  if (!stopping_) {
    // Finishes in the background; the worker keeps it so that it is progressed (and done, or
    // given up on) before the worker is destroyed: UCX 1.13 asserts when a worker is destroyed
    // with a TCP endpoint still closing mid-wireup.
    std::erase_if(closing_, [](void* r) {
      if (ucp_request_check_status(r) == UCS_INPROGRESS) return false;
      ucp_request_free(r);
      return true;
    });
    closing_.push_back(request);
    return;
  }
  // Bounded: a force close whose transfers the dead peer never finishes must not hold the
  // progress thread. ucp_request_free of an unfinished request releases it when it finishes.
  const auto give_up = Clock::now() + std::chrono::milliseconds(200);
  while (ucp_request_check_status(request) == UCS_INPROGRESS && Clock::now() < give_up) {
    ucp_worker_progress(worker_.get());
  }
  ucp_request_free(request);
}

void Worker::FinishClosing() {
  for (void* request : std::exchange(closing_, {})) WaitRequest(request);
}

void Worker::Loop() {
  thread_id_ = std::this_thread::get_id();
  // The event fd belongs to UCX; Asio watches a duplicate so closing it closes nothing of UCX's.
  asio::posix::stream_descriptor event_fd(io_, ::dup(event_fd_));
  bool wait_pending = false;
  auto guard = asio::make_work_guard(io_);
  const auto spin = options_.spin_before_sleep;
  Clock::time_point idle_since = Clock::now();
  bool idle = false;
  while (!exit_.load(std::memory_order_relaxed)) {
    unsigned events = ucp_worker_progress(worker_.get());
    if (events == 0) events += io_.poll();
    if (events != 0) {
      idle = false;
      continue;
    }
    const auto now = Clock::now();
    if (!idle) {
      idle = true;
      idle_since = now;
      continue;
    }
    if (now - idle_since < spin) {
      // Spinning with nothing to do: let a thread that has work (an engine thread, a client
      // on a small box) have this core first; with none runnable this returns at once.
      if (options_.yield_while_spinning) sched_yield();
      continue;
    }
    // Idle long enough: arm the event fd and sleep in Asio until UCX, a socket, a timer or a
    // posted handler has something.
    if (!wait_pending) {
      wait_pending = true;
      event_fd.async_wait(asio::posix::descriptor_base::wait_read,
                          [&wait_pending](const asio::error_code&) { wait_pending = false; });
    }
    const ucs_status_t armed = ucp_worker_arm(worker_.get());
    if (armed == UCS_ERR_BUSY) {
      idle = false;
      continue;
    }
    if (armed != UCS_OK) {
      KVSTASH_LOG_ERROR("ucp_worker_arm: {}; polling instead", ucs_status_string(armed));
      continue;
    }
    io_.run_one();
    idle = false;
  }
  asio::error_code ignored;
  event_fd.cancel(ignored);
  event_fd.close(ignored);
  guard.reset();
  io_.poll();
  exited_ = true;
}

Status Worker::SetFrameHandler(ucp_am_recv_callback_t cb, void* arg, uint32_t flags) {
  ucp_am_handler_param_t param{};
  param.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                     UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
  param.id = kRpcAmId;
  param.cb = cb;
  param.arg = arg;
  param.flags = flags;
  return FromUcs(ucp_worker_set_am_recv_handler(worker_.get(), &param),
                 "ucp_worker_set_am_recv_handler");
}

bool Worker::DiscardRendezvous(void* descriptor, size_t length) {
  if (length > options_.max_payload_bytes) return false;
  auto* scratch = new std::byte[std::max<size_t>(length, 1)];
  ucp_request_param_t param{};
  param.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_DATATYPE;
  param.cb.recv_am = [](void* request, ucs_status_t, size_t, void* user_data) {
    ucp_request_free(request);
    delete[] static_cast<std::byte*>(user_data);
  };
  param.user_data = scratch;
  param.datatype = ucp_dt_make_contig(1);
  ucs_status_ptr_t request =
      ucp_am_recv_data_nbx(worker_.get(), descriptor, scratch, length, &param);
  if (request == nullptr || UCS_PTR_IS_ERR(request)) delete[] scratch;
  return true;
}

// The release of a region this worker's context mapped: unmapped while the context lives (a
// region must not outlive its client or server, which own the context).
std::function<void()> Worker::Unmapper(void* memh) const {
  ucp_context_h context = context_->get();
  return [context, memh] { ucp_mem_unmap(context, static_cast<ucp_mem_h>(memh)); };
}

Result<MemoryRegion> Worker::Register(MutableBytes memory) {
  if (memory.empty()) return InvalidArgumentError("cannot register 0 bytes");
  ucp_mem_map_params_t params{};
  params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
  params.address = memory.data();
  params.length = memory.size();
  ucp_mem_h memh = nullptr;
  KVSTASH_RETURN_IF_ERROR(FromUcs(ucp_mem_map(context_->get(), &params, &memh),
                                  fmt::format("registering {} bytes", memory.size())));
  return MemoryRegion(memory, memh, next_region_id.fetch_add(1), {}, Unmapper(memh));
}

Result<MemoryRegion> Worker::Allocate(size_t bytes) {
  if (bytes == 0) return InvalidArgumentError("cannot allocate 0 bytes");
  ucp_mem_map_params_t params{};
  params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                      UCP_MEM_MAP_PARAM_FIELD_FLAGS;
  params.address = nullptr;
  params.length = bytes;
  params.flags = UCP_MEM_MAP_ALLOCATE;
  ucp_mem_h memh = nullptr;
  KVSTASH_RETURN_IF_ERROR(FromUcs(ucp_mem_map(context_->get(), &params, &memh),
                                  fmt::format("allocating {} registered bytes", bytes)));
  ucp_mem_attr_t attr{};
  attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
  const Status queried = FromUcs(ucp_mem_query(memh, &attr), "ucp_mem_query");
  if (!queried.ok()) {
    ucp_mem_unmap(context_->get(), memh);
    return queried;
  }
  // The packed key lets a process on this host map the memory (mapped payloads).
  std::string packed;
  void* rkey = nullptr;
  size_t rkey_size = 0;
  if (ucp_rkey_pack(context_->get(), memh, &rkey, &rkey_size) == UCS_OK) {
    packed.assign(static_cast<const char*>(rkey), rkey_size);
    ucp_rkey_buffer_release(rkey);
  }
  return MemoryRegion({static_cast<std::byte*>(attr.address), bytes}, memh,
                      next_region_id.fetch_add(1), std::move(packed), Unmapper(memh));
}

}  // namespace kvstash::transport
