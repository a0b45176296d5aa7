// `kvstash bench transport`: the RPC transport's put and get throughput (and its call latency)
// between two processes on this machine, next to ucx_perftest's over the same UCX transports, so
// the figure reads as a fraction of what UCX itself moves.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <future>
#include <iostream>
#include <memory>
#include <optional>
#include <ostream>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "commands.h"
#include "fmt/format.h"
#include "fmt/ranges.h"
#include "kvstash/bench/harness.h"
#include "kvstash/common/logging.h"
#include "kvstash/common/status.h"
#include "kvstash/common/subprocess.h"
#include "kvstash/transport/rpc.h"

namespace kvstash::bench {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using transport::Bytes;
using transport::CallOptions;
using transport::MemoryRegion;
using transport::MutableBytes;
using transport::Response;
using transport::RpcClient;
using transport::RpcServer;
using transport::ServerCall;

constexpr uint64_t kMaxSizeBytes = uint64_t{64} << 20;
constexpr uint64_t kDefaultRpcBytes = 32;
// The echo message travels in the RPC message, not as a payload: keep it to a size that is
// still a small call.
constexpr uint64_t kMaxRpcBytes = uint64_t{64} << 10;
// Default --iters for put and get: about this many bytes per round and side.
constexpr uint64_t kBytesPerRound = uint64_t{1} << 30;
constexpr uint64_t kMinDefaultIters = 100;
constexpr uint64_t kMaxDefaultIters = 20000;
constexpr uint64_t kRpcDefaultIters = 20000;
constexpr int64_t kMaxIters = 1'000'000'000;
constexpr int kMaxWindow = 1024;
// Payload memory on each side (window x size with --distinct-buffers).
constexpr uint64_t kMaxWindowBytes = uint64_t{2} << 30;
// Every call fails after this long; a stuck server ends the round instead of hanging it.
constexpr auto kCallTimeout = 30s;
// The transport server child reports its port (or its failure) within this.
constexpr auto kServerStartTimeout = 30s;
// Each ucx_perftest run is killed after this long.
constexpr auto kPerftestTimeout = 120s;
constexpr int kPerftestConnectAttempts = 20;
constexpr auto kPerftestConnectRetry = 100ms;
constexpr char kPerftest[] = "ucx_perftest";

// Methods of the bench server (its own numbering; not the node's protocol).
constexpr uint16_t kPutMethod = 1;   // request payload into the server's ring, empty reply
constexpr uint16_t kGetMethod = 2;   // reply payload of --size bytes from a server buffer
constexpr uint16_t kEchoMethod = 3;  // reply message = request message

enum class Op { kPut, kGet, kRpc };

struct BenchConfig {
  Op op = Op::kPut;
  std::string op_name;
  uint64_t size = 0;  // payload bytes (put, get) or echo message bytes (rpc)
  std::string tls;
  int window = 8;
  // Payload buffers per side: 1, as ucx_perftest (every call in the window moves from and into
  // the same memory), or `window` with --distinct-buffers.
  int slots = 1;
  uint64_t iters = 0;
  uint64_t warmup = 0;
  bool sync = false;  // rpc: CallSync from the main thread instead of the progress thread
  bool perftest = true;
  std::string perftest_path;  // ucx_perftest as found on PATH
  // ucx_perftest's environment: this command's as it started, with UCX_TLS=<tls>. Captured before
  // the transport runs, which sets UCX variables of its own in the process environment.
  std::vector<std::string> perftest_env;
};

std::string PerftestTest(const BenchConfig& config) {
  return config.op == Op::kRpc ? "ucp_am_lat" : "ucp_am_bw";
}

// ---- the transport server, in a child process -----------------------------------------------

// Writes all of `text` to fd, ignoring errors (the reader may be gone).
void WriteAll(int fd, std::string_view text) {
  while (!text.empty()) {
    const ssize_t n = write(fd, text.data(), text.size());
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    text.remove_prefix(static_cast<size_t>(n));
  }
}

[[noreturn]] void ChildFail(int report_fd, const Status& status) {
  WriteAll(report_fd, fmt::format("ERR {}\n", status.ToString()));
  _exit(1);
}

// The child's whole life: serve put/get/echo until `life_fd` reads EOF (the parent closed it or
// died), then exit. Reports "OK <port>" or "ERR <message>" on `report_fd` first.
[[noreturn]] void ServeInChild(const BenchConfig& config, int report_fd, int life_fd) {
  transport::ServerOptions options;
  options.bind_address = "127.0.0.1";
  options.port = 0;
  options.transport.tls = config.tls;
  Result<std::unique_ptr<RpcServer>> created = RpcServer::Create(options);
  if (!created.ok()) ChildFail(report_fd, created.status());
  std::unique_ptr<RpcServer> server = std::move(*created);

  const size_t size = config.size;
  MemoryRegion memory;  // put: the ring of `window` slots; get: one block
  if (config.op != Op::kRpc) {
    const size_t bytes = config.op == Op::kPut ? size * static_cast<size_t>(config.slots) : size;
    Result<MemoryRegion> region = server->AllocateMemory(bytes);
    if (!region.ok()) ChildFail(report_fd, region.status());
    memory = std::move(*region);
    std::memset(memory.data(), 0x5a, memory.size());  // fault the pages in before timing
  }
  const MemoryRegion* region = &memory;
  const size_t slots = static_cast<size_t>(config.slots);
  auto next_slot = std::make_shared<size_t>(0);  // progress thread only

  // At most `window` puts are between ReceivePayload and Reply at once (the client keeps that
  // many in flight and issues the next only on a reply), so with --distinct-buffers a ring of
  // `window` slots is never written twice at once. By default every put lands in one slot, as
  // ucx_perftest's do: the bench measures movement, the transport tests check contents.
  server->Handle(kPutMethod, [region, size, slots, next_slot](ServerCall call) {
    if (call.payload_bytes() > size) {
      call.ReplyError(
          InvalidArgumentError("put of {} bytes into {}-byte slots", call.payload_bytes(), size));
      return;
    }
    const size_t slot = (*next_slot)++ % slots;
    const MutableBytes dest = region->bytes().subspan(slot * size, size);
    auto shared = std::make_shared<ServerCall>(std::move(call));
    shared->ReceivePayload(dest, region, [shared](Status status) {
      if (!status.ok()) {
        shared->ReplyError(status);
        return;
      }
      shared->Reply({});
    });
  });
  server->Handle(kGetMethod, [region, size](ServerCall call) {
    call.Reply({}, region->bytes().first(size), region);
  });
  server->Handle(kEchoMethod, [](ServerCall call) { call.Reply(call.request()); });
  const Status started = server->Start();
  if (!started.ok()) ChildFail(report_fd, started);
  WriteAll(report_fd, fmt::format("OK {}\n", server->port()));
  close(report_fd);

  char byte;
  for (;;) {
    const ssize_t n = read(life_fd, &byte, 1);
    if (n == 0 || (n < 0 && errno != EINTR)) break;
  }
  // A clean teardown releases UCX's shared-memory segments; the alarm ends the process should
  // it ever hang.
  alarm(10);
  memory = MemoryRegion();
  server.reset();
  _exit(0);
}

// The forked transport server, seen from the parent. Closing the life pipe tells the child to
// exit; the destructor does that and reaps it.
class ServerProcess {
 public:
  ServerProcess(const ServerProcess&) = delete;
  ServerProcess& operator=(const ServerProcess&) = delete;
  ~ServerProcess() { Stop().IgnoreError(); }

  // Forks; must run before this process creates any UCX object.
  static Result<std::unique_ptr<ServerProcess>> Start(const BenchConfig& config) {
    int report[2];
    int life[2];
    if (pipe2(report, O_CLOEXEC) != 0) return FromErrno(errno, "pipe");
    if (pipe2(life, O_CLOEXEC) != 0) {
      const int e = errno;
      close(report[0]);
      close(report[1]);
      return FromErrno(e, "pipe");
    }
    std::cout.flush();
    std::cerr.flush();
    const pid_t pid = fork();
    if (pid < 0) {
      const int e = errno;
      for (int fd : {report[0], report[1], life[0], life[1]}) close(fd);
      return FromErrno(e, "fork of the transport server");
    }
    if (pid == 0) {
      close(report[0]);
      close(life[1]);
      ServeInChild(config, report[1], life[0]);
    }
    close(report[1]);
    close(life[0]);
    std::unique_ptr<ServerProcess> process(new ServerProcess(pid, life[1]));
    Result<uint16_t> port = ReadReport(report[0]);
    close(report[0]);
    if (!port.ok()) return port.status();
    process->port_ = *port;
    return process;
  }

  uint16_t port() const { return port_; }

  // Tells the child to exit and reaps it; an error if it did not exit cleanly.
  Status Stop() {
    if (pid_ < 0) return Status::OK();
    close(life_fd_);
    life_fd_ = -1;
    const int code = ReapChild(std::exchange(pid_, -1), 15s);
    if (code != 0) return InternalError("the transport server process exited with {}", code);
    return Status::OK();
  }

 private:
  ServerProcess(pid_t pid, int life_fd) : pid_(pid), life_fd_(life_fd) {}

  static Result<uint16_t> ReadReport(int fd) {
    std::string line;
    const Clock::time_point deadline = Clock::now() + kServerStartTimeout;
    char buf[512];
    while (line.find('\n') == std::string::npos) {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      if (left <= 0) {
        return DeadlineExceededError("the transport server did not start within {} s",
                                     std::chrono::seconds(kServerStartTimeout).count());
      }
      pollfd p = {fd, POLLIN, 0};
      const int ready = poll(&p, 1, static_cast<int>(left));
      if (ready < 0 && errno != EINTR) return FromErrno(errno, "poll");
      if (ready <= 0) continue;
      const ssize_t n = read(fd, buf, sizeof(buf));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      line.append(buf, static_cast<size_t>(n));
    }
    line = line.substr(0, line.find('\n'));
    if (line.rfind("OK ", 0) == 0) {
      const int port = std::atoi(line.c_str() + 3);
      if (port > 0 && port < 65536) return static_cast<uint16_t>(port);
    }
    if (line.rfind("ERR ", 0) == 0) {
      return UnavailableError("the transport server failed to start: {}", line.substr(4));
    }
    return UnavailableError("the transport server exited before reporting its port{}",
                            line.empty() ? "" : fmt::format(" ('{}')", line));
  }

  pid_t pid_ = -1;
  int life_fd_ = -1;
  uint16_t port_ = 0;
};

// ---- the client side ------------------------------------------------------------------------

// The client, its connection and its registered buffers, for every round.
struct ClientSide {
  std::unique_ptr<RpcClient> client;
  MemoryRegion memory;             // put: `window` source slots; get: `window` destination slots
  std::vector<std::byte> message;  // rpc: the echo request
};

Result<std::unique_ptr<ClientSide>> OpenClient(const BenchConfig& config, uint16_t port) {
  auto side = std::make_unique<ClientSide>();
  transport::ClientOptions options;
  options.host = "127.0.0.1";
  options.port = port;
  options.client_name = "kvstash bench transport";
  options.transport.tls = config.tls;
  KVSTASH_ASSIGN_OR_RETURN(side->client, RpcClient::Create(options));
  KVSTASH_RETURN_IF_ERROR(side->client->Connect());
  if (config.op == Op::kRpc) {
    side->message.resize(config.size);
    for (size_t i = 0; i < side->message.size(); ++i) {
      side->message[i] = static_cast<std::byte>('a' + i % 26);
    }
    return side;
  }
  KVSTASH_ASSIGN_OR_RETURN(side->memory, side->client->AllocateMemory(config.size * config.slots));
  // Non-constant bytes in every page, so the pages are faulted in before timing and nothing
  // below could shortcut a constant block.
  uint64_t x = 0x9e3779b97f4a7c15ULL;
  std::byte* data = side->memory.data();
  for (size_t i = 0; i + sizeof(x) <= side->memory.size(); i += sizeof(x)) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    std::memcpy(data + i, &x, sizeof(x));
  }
  return side;
}

struct CallFigures {
  Clock::duration elapsed{};
  std::vector<double> latencies_us;  // when recorded
};

// `count` calls with up to `window` in flight: every completion issues the next call from its
// callback, on the client's progress thread, so the window refills without another thread.
// Everything but the promise is touched on the progress thread only.
class CallLoop : public std::enable_shared_from_this<CallLoop> {
 public:
  CallLoop(const BenchConfig& config, ClientSide& side, uint64_t count, bool record)
      : config_(config), side_(side), to_issue_(count), record_(record) {
    if (record_) figures_.latencies_us.reserve(count);
  }

  Result<CallFigures> Run() {
    std::future<Status> done = promise_.get_future();
    const int window = config_.op == Op::kRpc ? 1 : config_.window;
    auto self = shared_from_this();
    side_.client->RunOnProgressThread([self, window] {
      self->start_ = Clock::now();
      if (self->to_issue_ == 0) {
        self->Finish();
        return;
      }
      for (int slot = 0; slot < window && self->to_issue_ > 0 && self->failure_.ok(); ++slot) {
        self->Issue(slot);
      }
    });
    KVSTASH_RETURN_IF_ERROR(done.get());
    return std::move(figures_);
  }

 private:
  void Issue(int slot) {
    CallOptions options;
    options.deadline = Clock::now() + kCallTimeout;
    Bytes request;
    uint16_t method = kEchoMethod;
    const size_t size = config_.size;
    switch (config_.op) {
      case Op::kPut:
        method = kPutMethod;
        options.send_payload = side_.memory.bytes().subspan((slot % config_.slots) * size, size);
        options.send_region = &side_.memory;
        break;
      case Op::kGet:
        method = kGetMethod;
        options.recv_payload = side_.memory.bytes().subspan((slot % config_.slots) * size, size);
        options.recv_region = &side_.memory;
        break;
      case Op::kRpc:
        request = side_.message;
        break;
    }
    --to_issue_;
    ++outstanding_;
    const Clock::time_point issued = Clock::now();
    side_.client->Call(method, request, options,
                       [self = shared_from_this(), slot, issued](const Response& response) {
                         self->OnDone(slot, issued, response);
                       });
  }

  void OnDone(int slot, Clock::time_point issued, const Response& response) {
    const Clock::time_point now = Clock::now();
    --outstanding_;
    if (failure_.ok()) {
      if (!response.status.ok()) {
        failure_ = response.status;
      } else if (config_.op == Op::kGet && response.payload_bytes != config_.size) {
        failure_ = DataLossError("get returned {} payload bytes, expected {}",
                                 response.payload_bytes, config_.size);
      } else if (config_.op == Op::kRpc && response.message.size() != config_.size) {
        failure_ =
            DataLossError("echo returned {} bytes, sent {}", response.message.size(), config_.size);
      } else if (record_) {
        figures_.latencies_us.push_back(
            std::chrono::duration<double, std::micro>(now - issued).count());
      }
    }
    if (failure_.ok() && to_issue_ > 0) {
      Issue(slot);
    } else if (outstanding_ == 0) {
      figures_.elapsed = now - start_;
      Finish();
    }
  }

  void Finish() { promise_.set_value(failure_); }

  const BenchConfig& config_;
  ClientSide& side_;
  uint64_t to_issue_;
  uint64_t outstanding_ = 0;
  const bool record_;
  Status failure_;
  Clock::time_point start_;
  CallFigures figures_;
  std::promise<Status> promise_;
};

struct KvstashFigures {
  std::optional<double> gbps;  // put and get
  double calls_per_s = 0;
  std::optional<double> p50_us;
  std::optional<double> p99_us;
};

// Adds the op and phase to a failed call's status.
Status CallFailed(const BenchConfig& config, std::string_view phase, const Status& status) {
  return Status(status.code(),
                fmt::format("{} call failed ({}): {}", config.op_name, phase, status.message()));
}

// rpc --sync: one CallSync after another from this thread, as an engine thread calls; each
// time includes handing the call to the progress thread and waking this one.
Result<CallFigures> RunSyncCalls(const BenchConfig& config, ClientSide& side, uint64_t count,
                                 bool record) {
  CallFigures figures;
  if (record) figures.latencies_us.reserve(count);
  std::vector<std::byte> reply;
  const Clock::time_point start = Clock::now();
  for (uint64_t i = 0; i < count; ++i) {
    CallOptions options;
    options.deadline = Clock::now() + kCallTimeout;
    const Clock::time_point issued = Clock::now();
    KVSTASH_RETURN_IF_ERROR(side.client->CallSync(kEchoMethod, side.message, options, &reply));
    const Clock::time_point now = Clock::now();
    if (reply.size() != config.size) {
      return DataLossError("echo returned {} bytes, sent {}", reply.size(), config.size);
    }
    if (record) {
      figures.latencies_us.push_back(
          std::chrono::duration<double, std::micro>(now - issued).count());
    }
  }
  figures.elapsed = Clock::now() - start;
  return figures;
}

// `count` calls as the config says: CallSync from this thread (rpc --sync), or a CallLoop.
Result<CallFigures> RunCalls(const BenchConfig& config, ClientSide& side, uint64_t count,
                             bool record) {
  if (config.sync) return RunSyncCalls(config, side, count, record);
  if (count == 0) return CallFigures{};
  return std::make_shared<CallLoop>(config, side, count, record)->Run();
}

Result<KvstashFigures> RunKvstash(const BenchConfig& config, ClientSide& side) {
  Result<CallFigures> warmup = RunCalls(config, side, config.warmup, /*record=*/false);
  if (!warmup.ok()) return CallFailed(config, "warmup", warmup.status());
  Result<CallFigures> calls = RunCalls(config, side, config.iters, /*record=*/true);
  if (!calls.ok()) return CallFailed(config, "timed", calls.status());
  KvstashFigures figures;
  if (config.op != Op::kRpc) figures.gbps = Gbps(config.iters * config.size, calls->elapsed);
  const double seconds = std::chrono::duration<double>(calls->elapsed).count();
  figures.calls_per_s = seconds > 0 ? static_cast<double>(config.iters) / seconds : 0.0;
  figures.p50_us = Percentile(calls->latencies_us, 50);
  figures.p99_us = Percentile(calls->latencies_us, 99);
  return figures;
}

// ---- ucx_perftest ---------------------------------------------------------------------------

struct PerftestFigures {
  double gbps = 0;           // put, get: ucp_am_bw's overall bandwidth
  double round_trip_us = 0;  // rpc: twice ucp_am_lat's 50th percentile (it reports half)
};

// The path of `name` on PATH, or nullopt.
std::optional<std::string> FindOnPath(const std::string& name) {
  if (name.find('/') != std::string::npos) {
    return access(name.c_str(), X_OK) == 0 ? std::optional(name) : std::nullopt;
  }
  const char* path = std::getenv("PATH");
  std::istringstream dirs(path != nullptr ? path : "/usr/local/bin:/usr/bin:/bin");
  std::string dir;
  while (std::getline(dirs, dir, ':')) {
    const std::string candidate = (dir.empty() ? std::string(".") : dir) + "/" + name;
    if (access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return std::nullopt;
}

// A free TCP port on the loopback: bound, read and closed (the kernel does not hand it out again
// at once).
Result<uint16_t> PickFreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return FromErrno(errno, "socket");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t length = sizeof(addr);
  Status status;
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    status = FromErrno(errno, "binding 127.0.0.1:0");
  } else if (getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &length) != 0) {
    status = FromErrno(errno, "getsockname");
  }
  close(fd);
  if (!status.ok()) return status;
  return ntohs(addr.sin_port);
}

std::string LastLine(std::string_view text) {
  while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.remove_suffix(1);
  const size_t newline = text.rfind('\n');
  return std::string(newline == std::string_view::npos ? text : text.substr(newline + 1));
}

std::string Trimmed(std::string_view text) {
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) {
    text.remove_suffix(1);
  }
  return std::string(text);
}

// With -f the final line is: iterations, latency (or overhead) 50%ile, average, overall (us),
// bandwidth average, overall (MB/s, MB = 2^20 bytes), message rate average, overall.
Result<PerftestFigures> ParsePerftest(const BenchConfig& config, std::string_view out) {
  const std::string line = LastLine(out);
  std::istringstream fields(line);
  std::vector<double> values;
  std::string field;
  while (fields >> field) {
    char* end = nullptr;
    const double v = std::strtod(field.c_str(), &end);
    if (end == field.c_str() || *end != '\0') break;
    values.push_back(v);
  }
  if (values.size() < 8) {
    return InternalError("{} printed no final line of 8 figures; its last line: '{}'", kPerftest,
                         line);
  }
  PerftestFigures figures;
  if (config.op == Op::kRpc) {
    figures.round_trip_us = 2 * values[1];
    if (!(figures.round_trip_us > 0)) {
      return InternalError("{} reported a latency of {} us: '{}'", kPerftest, values[1], line);
    }
  } else {
    figures.gbps = values[5] * double(uint64_t{1} << 20) / 1e9;
    if (!(figures.gbps > 0)) {
      return InternalError("{} reported a bandwidth of {} MB/s: '{}'", kPerftest, values[5], line);
    }
  }
  return figures;
}

// One ucx_perftest run: a server, then a client (retried while the server is not listening
// yet), both with UCX_TLS=<tls>. The port is picked free, but another process can take it
// before the server binds it; then the run starts over on a new port.
// A ucx_perftest server runs in the background; its output stays in memory for error messages.
ChildOptions PerftestServerOptions(const BenchConfig& config) {
  ChildOptions options;
  options.env = config.perftest_env;
  options.output = ChildOptions::Output::kMemory;
  options.merge_stderr = true;
  return options;
}

Result<PerftestFigures> RunPerftest(const BenchConfig& config) {
  constexpr int kPortAttempts = 3;
  for (int port_attempt = 1;; ++port_attempt) {
    KVSTASH_ASSIGN_OR_RETURN(const uint16_t port, PickFreePort());
    KVSTASH_ASSIGN_OR_RETURN(
        std::unique_ptr<ChildProcess> server,
        ChildProcess::Create({config.perftest_path, "-p", std::to_string(port)},
                             PerftestServerOptions(config)));
    std::vector<std::string> client_argv = {config.perftest_path, "127.0.0.1", "-p",
                                            std::to_string(port)};
    const std::string size = std::to_string(config.size);
    const std::string iters = std::to_string(config.iters);
    const std::string warmup = std::to_string(config.warmup);
    client_argv.insert(client_argv.end(),
                       {"-t", PerftestTest(config), "-s", size, "-n", iters, "-w", warmup, "-f"});
    RunOptions options;
    options.env = config.perftest_env;
    options.timeout = kPerftestTimeout;
    for (int attempt = 1;; ++attempt) {
      KVSTASH_ASSIGN_OR_RETURN(ProcessOutput run, RunProgram(client_argv, options));
      if (run.exit_code == 0) {
        server->Wait(10s);
        return ParsePerftest(config, run.out);
      }
      const bool refused = run.err.find("Connection refused") != std::string::npos ||
                           run.out.find("Connection refused") != std::string::npos;
      const bool port_taken =
          server->Exited() && server->Output().find("Address already in use") != std::string::npos;
      if (port_taken && port_attempt < kPortAttempts) break;  // start over on another port
      if (!refused || attempt >= kPerftestConnectAttempts || server->Exited()) {
        return UnavailableError(
            "{} client (UCX_TLS={} {}) exited with {} after {} attempt(s): {}; server output: {}",
            kPerftest, config.tls, fmt::join(client_argv, " "), run.exit_code, attempt,
            Trimmed(run.err.empty() ? run.out : run.err), Trimmed(server->Output()));
      }
      std::this_thread::sleep_for(kPerftestConnectRetry);
    }
  }
}

// ---- figures -------------------------------------------------------------------------------

// The figures; the ratio compares the op's own: throughput for put and get, the round trip for
// rpc.
BenchSpec TransportSpec(Op op) {
  BenchSpec spec;
  spec.name = "transport";
  spec.command = "kvstash bench transport";
  spec.title =
      "the RPC transport between two processes against ucx_perftest over the same UCX "
      "transports";
  spec.limit = "perftest";
  // Its readers use "rounds_<figure>" (see harness.h).
  spec.flat_round_keys = true;
  spec.figures = {
      Higher("gbps", "GB/s",
             "kvstash, put and get: payload bytes of the timed calls / their wall time, with "
             "--window calls in flight; null for rpc"),
      Higher("perftest_gbps", "GB/s",
             "the limit for put and get: `ucx_perftest -t ucp_am_bw -s SIZE -n ITERS -w "
             "WARMUP`'s overall bandwidth (MB/s of 2^20 bytes) in GB/s, its server and client "
             "fresh processes each round; null for rpc and with --no-perftest"),
      Lower("p50_us", "us",
            "kvstash: median latency of the timed calls, issue to completion callback (with a "
            "window, including the wait behind the calls ahead)"),
      Lower("p99_us", "us", "the same, 99th percentile"),
      Higher("calls_per_s", "calls/s", "kvstash: timed calls / their wall time"),
      Lower("perftest_round_trip_us", "us",
            "the limit for rpc: twice the 50th percentile `ucx_perftest -t ucp_am_lat -s "
            "SIZE` reports (it reports half the round trip); null for put and get"),
  };
  if (op == Op::kRpc) {
    spec.ratios = {RatioOf("ratio", "p50_us", "perftest_round_trip_us")};
  } else {
    spec.ratios = {RatioOf("ratio", "gbps", "perftest_gbps")};
  }
  spec.ratios[0].help =
      "for put and get, gbps / perftest_gbps: the share of raw UCX active-message bandwidth the "
      "transport delivers with its framing, protocol and completion handling (get is compared "
      "with the same one-way ucp_am_bw, as perftest has no request-reply bandwidth test, so its "
      "ratio also carries the request each get sends first); for rpc, perftest_round_trip_us / "
      "p50_us (1 = as fast as raw UCX)";
  return spec;
}

// ---- the command ----------------------------------------------------------------------------

struct BenchTransportFlags {
  std::string size;
  std::string op;
  std::string tls = "shm";
  int64_t iters = 0;   // when given; else the default for the op and size
  int64_t warmup = 0;  // when given; else iters / 10
  int window = 8;
  int rounds = 3;
  OutputOptions output;
  bool no_perftest = false;
  bool sync = false;
  bool distinct_buffers = false;
  bool iters_given = false;
  bool warmup_given = false;
  bool window_given = false;
};

// UCX writes its log lines (warnings, errors) to standard output unless UCX_LOG_FILE says
// otherwise, and it reads that once, when the library loads; standard output must carry only the
// results (one JSON object with --json). So from construction on, file descriptor 1 is a copy of
// stderr (for this process, the server child and anything UCX prints), and the results go to the
// original standard output. Descriptor 1 stays on stderr until exit: UCX may still log then.
class ResultsOutput {
 public:
  ResultsOutput() {
    std::cout.flush();
    std::fflush(stdout);
    results_fd_ = dup(STDOUT_FILENO);
    if (results_fd_ >= 0 && dup2(STDERR_FILENO, STDOUT_FILENO) < 0) {
      close(results_fd_);
      results_fd_ = -1;
    }
  }
  ~ResultsOutput() {
    if (results_fd_ >= 0) close(results_fd_);
  }
  ResultsOutput(const ResultsOutput&) = delete;
  ResultsOutput& operator=(const ResultsOutput&) = delete;

  void Write(std::string_view text) { WriteAll(results_fd_ >= 0 ? results_fd_ : 1, text); }

 private:
  int results_fd_ = -1;
};

int Fail(int code, std::string_view message) {
  return cli::ErrorReporter("kvstash bench transport").Fail(code, message);
}

int RunBenchTransport(const BenchTransportFlags& flags) {
  BenchConfig config;
  config.op_name = flags.op;
  if (flags.op == "put") {
    config.op = Op::kPut;
  } else if (flags.op == "get") {
    config.op = Op::kGet;
  } else if (flags.op == "rpc") {
    config.op = Op::kRpc;
  } else {
    return Fail(kExitUsage, fmt::format("--op: '{}' is not one of put, get, rpc", flags.op));
  }
  const bool rpc = config.op == Op::kRpc;
  if (flags.size.empty()) {
    if (!rpc) return Fail(kExitUsage, fmt::format("--size is required for --op {}", flags.op));
    config.size = kDefaultRpcBytes;
  } else {
    Result<uint64_t> size = ParseBytes("--size", flags.size);
    if (!size.ok()) return Fail(kExitUsage, size.status().message());
    const uint64_t max = rpc ? kMaxRpcBytes : kMaxSizeBytes;
    if (*size < 1 || *size > max) {
      return Fail(kExitUsage, fmt::format("--size: {} bytes is outside 1..{} ({}){}", *size, max,
                                          FormatBytes(max), rpc ? " for --op rpc" : ""));
    }
    config.size = *size;
  }
  if (flags.tls != "shm" && flags.tls != "tcp") {
    return Fail(kExitUsage, fmt::format("--tls: '{}' is not one of shm, tcp", flags.tls));
  }
  config.tls = flags.tls;
  if (rpc && flags.window_given && flags.window != 1) {
    return Fail(
        kExitUsage,
        fmt::format("--window: {} with --op rpc, which measures one call at a time", flags.window));
  }
  if (flags.window < 1 || flags.window > kMaxWindow) {
    return Fail(kExitUsage, fmt::format("--window: {} is outside 1..{}", flags.window, kMaxWindow));
  }
  config.window = rpc ? 1 : flags.window;
  if (flags.distinct_buffers && rpc) {
    return Fail(kExitUsage, "--distinct-buffers: rpc moves no payload");
  }
  config.slots = flags.distinct_buffers ? config.window : 1;
  if (!rpc && config.size * static_cast<uint64_t>(config.slots) > kMaxWindowBytes) {
    return Fail(kExitUsage,
                fmt::format("--window: {} slots of {} bytes need {} of registered memory per "
                            "side, over the limit of {}",
                            config.window, config.size, FormatBytes(config.size * config.window),
                            FormatBytes(kMaxWindowBytes)));
  }
  if (flags.iters_given && (flags.iters < 1 || flags.iters > kMaxIters)) {
    return Fail(kExitUsage, fmt::format("--iters: {} is outside 1..{}", flags.iters, kMaxIters));
  }
  if (flags.iters_given) {
    config.iters = static_cast<uint64_t>(flags.iters);
  } else if (rpc) {
    config.iters = kRpcDefaultIters;
  } else {
    config.iters = std::clamp((kBytesPerRound + config.size - 1) / config.size, kMinDefaultIters,
                              kMaxDefaultIters);
  }
  if (flags.warmup_given && (flags.warmup < 0 || flags.warmup > kMaxIters)) {
    return Fail(kExitUsage, fmt::format("--warmup: {} is outside 0..{}", flags.warmup, kMaxIters));
  }
  config.warmup = flags.warmup_given ? static_cast<uint64_t>(flags.warmup) : config.iters / 10;
  if (flags.sync && !rpc) {
    return Fail(kExitUsage, fmt::format("--sync: only with --op rpc, not --op {}", flags.op));
  }
  config.sync = flags.sync;
  config.perftest = !flags.no_perftest;
  if (config.perftest) {
    std::optional<std::string> path = FindOnPath(kPerftest);
    if (!path.has_value()) {
      return Fail(kExitFailure,
                  fmt::format("{} is not installed (not found on PATH); install UCX's tools "
                              "(e.g. the ucx-utils package) or pass --no-perftest to measure "
                              "only kvstash",
                              kPerftest));
    }
    config.perftest_path = *path;
    config.perftest_env = EnvironmentWith("UCX_TLS", config.tls);
  }

  // The transport's info lines would interleave with the table; warnings still show, on stderr.
  if (spdlog::get_level() < spdlog::level::warn) SetLogLevel("warn").IgnoreError();
  ResultsOutput results;

  // The server process forks before this process creates any UCX object.
  Result<std::unique_ptr<ServerProcess>> server = ServerProcess::Start(config);
  if (!server.ok()) return Fail(kExitFailure, server.status().ToString());
  Result<std::unique_ptr<ClientSide>> client = OpenClient(config, (*server)->port());
  if (!client.ok()) {
    return Fail(kExitFailure, fmt::format("connecting to the transport server on port {}: {}",
                                          (*server)->port(), client.status().ToString()));
  }

  Result<std::unique_ptr<Report>> created = Report::Create(TransportSpec(config.op));
  if (!created.ok()) return Fail(kExitFailure, created.status().ToString());
  Report& report = **created;
  RoundSides sides;
  sides.measure = [&](Round& round) -> Status {
    KVSTASH_ASSIGN_OR_RETURN(KvstashFigures kvstash, RunKvstash(config, **client));
    round.Set("gbps", kvstash.gbps);
    round.Set("p50_us", kvstash.p50_us);
    round.Set("p99_us", kvstash.p99_us);
    round.Set("calls_per_s", kvstash.calls_per_s);
    return Status::OK();
  };
  if (config.perftest) {
    sides.limit = [&](Round& round) -> Status {
      Result<PerftestFigures> perftest = RunPerftest(config);
      if (!perftest.ok()) {
        return Status(perftest.status().code(),
                      fmt::format("{} (pass --no-perftest to measure only kvstash)",
                                  perftest.status().message()));
      }
      if (config.op == Op::kRpc) {
        round.Set("perftest_round_trip_us", perftest->round_trip_us);
      } else {
        round.Set("perftest_gbps", perftest->gbps);
      }
      return Status::OK();
    };
  }
  Progress progress = Progress::ToStderr(flags.output.progress);
  const Status run = RunRounds(report, flags.rounds, sides, progress);
  // The client goes first: the server then sees an orderly disconnect, not a lost peer.
  client->reset();
  const Status stopped = (*server)->Stop();
  if (!run.ok()) return Fail(kExitFailure, run.ToString());
  if (!stopped.ok()) std::cerr << "kvstash bench transport: warning: " << stopped.message() << "\n";

  report.Set("op", config.op_name);
  report.Set("size", config.size);
  report.Set("tls", config.tls);
  report.Set("window", config.window);
  report.Set("distinct_buffers", config.slots > 1);
  report.Set("iters", config.iters);
  report.Set("warmup", config.warmup);
  report.Set("perftest_test", config.perftest ? Json(PerftestTest(config)) : Json(nullptr));
  report.Set("sync", config.sync);
  report.Heading("op", config.op_name + (config.sync ? " (CallSync from the main thread)" : ""));
  report.Heading("size", fmt::format("{} ({} bytes{})", FormatBytes(config.size), config.size,
                                     rpc ? ", echo message" : ""));
  report.Heading("transport", fmt::format("UCX_TLS={}", config.tls));
  report.Heading("window", fmt::format("{} call(s) in flight, {} payload buffer(s) per side",
                                       config.window, config.slots));
  report.Heading("iters", fmt::format("{} per round after {} warmup", config.iters, config.warmup));
  report.Heading("perftest", config.perftest
                                 ? fmt::format("{} -s {}", PerftestTest(config), config.size)
                                 : std::string("skipped (--no-perftest)"));
  std::ostringstream text;
  Print(report, flags.output, text);
  results.Write(text.str());
  return kExitOk;
}

}  // namespace

void AddBenchTransportCommand(CLI::App& bench, int* exit_code) {
  auto flags = std::make_shared<BenchTransportFlags>();
  CLI::App* cmd = bench.add_subcommand(
      "transport",
      "Move --size byte payloads through the RPC transport between two processes on this "
      "machine (a forked server and this process as client, over loopback), and the same sizes "
      "with ucx_perftest over the same UCX transports.");
  cmd->add_option("--op", flags->op,
                  "What to measure. put: calls whose request payload (--size bytes, from "
                  "registered client memory) the server receives into registered memory (one "
                  "buffer, or a ring of --window slots with --distinct-buffers), then answers "
                  "empty. get: empty calls the server answers with a "
                  "--size byte payload from registered memory, received into registered client "
                  "memory. rpc: echo calls of a --size byte message (default 32), no payload, "
                  "one at a time")
      ->required();
  cmd->add_option("--size", flags->size,
                  "Payload bytes per call for put and get (1..64M; required), echo message bytes "
                  "for rpc (1..64K; default 32). Accepts an integer or a suffix K, M, G, KiB, MiB, "
                  "GiB (powers of two)");
  cmd->add_option("--tls", flags->tls,
                  "UCX transports: shm or tcp. Set as TransportOptions::tls on both kvstash "
                  "processes and as UCX_TLS for both ucx_perftest processes")
      ->capture_default_str();
  CLI::Option* iters = cmd->add_option(
      "--iters", flags->iters,
      "Timed calls per round (and ucx_perftest -n). Default: enough for about 1 GiB "
      "per round for put and get, within 100..20000; 20000 for rpc");
  CLI::Option* warmup = cmd->add_option(
      "--warmup", flags->warmup,
      "Untimed calls before each round's timed calls (and ucx_perftest -w). Default: "
      "--iters / 10");
  CLI::Option* window =
      cmd->add_option(
             "--window", flags->window,
             "Calls kept in flight for put and get: each completion issues the next call from "
             "its callback on the client's progress thread (1..1024; with --distinct-buffers, "
             "window x size at most 2 GiB). rpc always runs one call at a time")
          ->capture_default_str();
  const BenchSpec spec = TransportSpec(Op::kPut);
  AddRoundsFlag(*cmd, &flags->rounds, spec);
  AddOutputFlags(*cmd, &flags->output);
  cmd->add_flag("--distinct-buffers", flags->distinct_buffers,
                "put/get: give each call in the window its own payload buffer (window x size per "
                "side, so large windows leave the CPU caches) instead of one buffer per side as "
                "ucx_perftest uses");
  cmd->add_flag("--sync", flags->sync,
                "rpc only: issue each call with CallSync from the command's main thread (as an "
                "engine thread would) instead of from the client's progress thread; the "
                "latency then includes the hand-over to the progress thread and the wake-up");
  cmd->add_flag("--no-perftest", flags->no_perftest,
                "Skip ucx_perftest (e.g. where it is not installed); perftest figures and the "
                "ratio are null");
  cmd->footer(
      FiguresHelp(spec) +
      "GB/s is 1e9 bytes/s. Both sides send from and receive into one buffer per side (kvstash "
      "cycles through --window buffers with --distinct-buffers). ucx_perftest runs as a server "
      "`ucx_perftest -p PORT` and a client `ucx_perftest 127.0.0.1 -p PORT -t TEST -s SIZE -n "
      "ITERS -w WARMUP -f`, both with UCX_TLS=--tls. --json also carries op, size, tls, window, "
      "distinct_buffers, iters, warmup, perftest_test (null with --no-perftest), sync, and every "
      "figure per round as rounds_<figure> and rounds_order as well as in per_round.\n"
      "Exits 0 on success, 1 if a call, the server or ucx_perftest fails (ucx_perftest missing "
      "included, unless --no-perftest), 2 for bad arguments.");
  cmd->callback([flags, iters, warmup, window, exit_code] {
    flags->iters_given = iters->count() > 0;
    flags->warmup_given = warmup->count() > 0;
    flags->window_given = window->count() > 0;
    *exit_code = RunBenchTransport(*flags);
  });
}

}  // namespace kvstash::bench
