#include "peer_servers.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <pwd.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <functional>
#include <optional>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

namespace kvstash::bench {
namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

// A server that ignores SIGTERM this long is killed.
constexpr auto kStopTimeout = 10s;
// Tries at a free port: another process may take the port between our pick and the server's
// bind, and then the server exits at once.
constexpr int kPortTries = 3;

// A port nothing listens on now: bound with port 0 and released.
Result<uint16_t> FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return FromErrno(errno, "socket for a free port");
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof address;
  if (bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
    const int e = errno;
    close(fd);
    return FromErrno(e, "binding 127.0.0.1:0 for a free port");
  }
  close(fd);
  return ntohs(address.sin_port);
}

// Whether a connection to `address` is accepted now.
bool Accepts(const sockaddr* address, socklen_t length, int family) {
  const int fd = socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  const bool ok = connect(fd, address, length) == 0;
  close(fd);
  return ok;
}

bool TcpListening(uint16_t port) {
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = htons(port);
  return Accepts(reinterpret_cast<const sockaddr*>(&address), sizeof address, AF_INET);
}

bool UnixListening(const std::string& path) {
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  if (path.size() >= sizeof address.sun_path) return false;
  std::memcpy(address.sun_path, path.c_str(), path.size() + 1);
  return Accepts(reinterpret_cast<const sockaddr*>(&address), sizeof address, AF_UNIX);
}

// The last lines of a child's output, for an error message.
std::string Tail(const ChildProcess& child) {
  std::string out = child.Output();
  while (!out.empty() && (out.back() == '\n' || out.back() == ' ')) out.pop_back();
  constexpr size_t kTail = 600;
  if (out.size() > kTail) out = "..." + out.substr(out.size() - kTail);
  return out.empty() ? "no output" : out;
}

std::string CommandLine(const std::vector<std::string>& argv) {
  std::string line;
  for (const std::string& a : argv) line += (line.empty() ? "" : " ") + (a.empty() ? "''" : a);
  return line;
}

// Starts `argv` and waits until `ready` returns a port: the started server, or why not.
// FailedPrecondition when the child exited before it was ready (a caller may retry on
// another port), DeadlineExceeded past the start timeout, Cancelled when cancelled.
Result<std::unique_ptr<StoreServer>> StartAndWait(
    const std::string& name, const std::vector<std::string>& argv, const StoreSettings& settings,
    const std::function<std::optional<uint16_t>(const ChildProcess&)>& ready,
    std::string unix_path) {
  ChildOptions options;
  options.output = ChildOptions::Output::kMemory;
  options.merge_stderr = true;
  Result<std::unique_ptr<ChildProcess>> child = ChildProcess::Create(argv, options);
  if (!child.ok()) {
    return Status(child.status().code(), fmt::format("{}: {}", name, child.status().message()));
  }
  const auto deadline = Clock::now() + settings.start_timeout;
  for (;;) {
    if (const std::optional<uint16_t> port = ready(**child)) {
      return std::make_unique<StoreServer>(name, std::move(*child), *port, std::move(unix_path));
    }
    if ((*child)->Exited()) {
      return FailedPreconditionError("{} exited with status {} before it listened ({}): {}", name,
                                     (*child)->Wait(), CommandLine(argv), Tail(**child));
    }
    if (settings.cancel != nullptr && settings.cancel->load()) {
      return CancelledError("interrupted while {} started", name);
    }
    if (Clock::now() > deadline) {
      return DeadlineExceededError("{} did not listen within {} ms ({}): {}", name,
                                   settings.start_timeout.count(), CommandLine(argv),
                                   Tail(**child));
    }
    std::this_thread::sleep_for(5ms);
  }
}

// StartAndWait on a free port, tried again on another when the server exits at once.
Result<std::unique_ptr<StoreServer>> StartOnFreePort(
    const std::string& name, const std::function<std::vector<std::string>(uint16_t)>& argv_of,
    const StoreSettings& settings, const std::function<bool(uint16_t)>& ready_on,
    const std::string& unix_path) {
  Status last;
  for (int attempt = 0; attempt < kPortTries; ++attempt) {
    const Result<uint16_t> port = FreePort();
    if (!port.ok()) return port.status();
    const uint16_t p = *port;
    Result<std::unique_ptr<StoreServer>> server = StartAndWait(
        name, argv_of(p), settings,
        [&](const ChildProcess&) -> std::optional<uint16_t> {
          if (ready_on(p)) return p;
          return std::nullopt;
        },
        unix_path);
    if (server.ok() || server.status().code() != StatusCode::kFailedPrecondition) return server;
    last = server.status();
  }
  return last;
}

// The name of the user this process runs as (memcached refuses root without -u).
std::string UserName() {
  if (const passwd* pw = getpwuid(geteuid()); pw != nullptr) return pw->pw_name;
  return "root";
}

uint64_t RoundUpMib(uint64_t bytes) {
  constexpr uint64_t kMib = uint64_t{1} << 20;
  return (bytes + kMib - 1) / kMib;
}

}  // namespace

StoreServer::StoreServer(std::string name, std::unique_ptr<ChildProcess> child, uint16_t port,
                         std::string unix_path)
    : name_(std::move(name)),
      child_(std::move(child)),
      port_(port),
      unix_path_(std::move(unix_path)) {}

StoreServer::~StoreServer() { Stop(); }

int StoreServer::Stop() {
  if (child_->Exited()) return child_->Wait();
  kill(child_->pid(), SIGTERM);
  return child_->Wait(std::chrono::duration_cast<std::chrono::milliseconds>(kStopTimeout));
}

Result<std::unique_ptr<StoreServer>> StartKvstashd(const StoreSettings& settings,
                                                   const std::string& tls, bool stream) {
  std::vector<std::string> argv = {settings.program,
                                   "--listen",
                                   "127.0.0.1",
                                   "--port",
                                   "0",
                                   "--metrics-address",
                                   "off",
                                   "--log-level",
                                   "warn",
                                   "--block-bytes",
                                   std::to_string(settings.block_bytes),
                                   "--cpu-bytes",
                                   std::to_string(settings.memory_bytes)};
  if (stream) {
    argv.insert(argv.end(), {"--transport", "stream"});
  } else {
    argv.insert(argv.end(), {"--tls", tls});
  }
  // UCX may print before it; the start line names the port.
  constexpr std::string_view kStart = "kvstashd listening on 127.0.0.1:";
  return StartAndWait(
      "kvstashd", argv, settings,
      [&](const ChildProcess& child) -> std::optional<uint16_t> {
        const std::string out = child.Output();
        const size_t at = out.find(kStart);
        if (at == std::string::npos) return std::nullopt;
        const size_t digits = at + kStart.size();
        const size_t end = out.find_first_not_of("0123456789", digits);
        if (end == std::string::npos || end == digits) return std::nullopt;  // not all written
        return static_cast<uint16_t>(std::stoul(out.substr(digits, end - digits)));
      },
      "");
}

Result<std::unique_ptr<StoreServer>> StartRedis(const StoreSettings& settings) {
  const std::string unix_path = settings.dir + "/redis.sock";
  return StartOnFreePort(
      "redis-server",
      [&](uint16_t port) {
        return std::vector<std::string>{settings.program,
                                        "--port",
                                        std::to_string(port),
                                        "--bind",
                                        "127.0.0.1",
                                        "--unixsocket",
                                        unix_path,
                                        "--unixsocketperm",
                                        "700",
                                        "--dir",
                                        settings.dir,
                                        "--save",
                                        "",
                                        "--appendonly",
                                        "no",
                                        "--maxmemory",
                                        std::to_string(settings.memory_bytes),
                                        "--maxmemory-policy",
                                        "allkeys-lru",
                                        "--daemonize",
                                        "no"};
      },
      settings, [&](uint16_t port) { return TcpListening(port) && UnixListening(unix_path); },
      unix_path);
}

Result<std::unique_ptr<StoreServer>> StartMemcached(const StoreSettings& settings) {
  // An item holds its key and a header besides the value: room for twice the block.
  const uint64_t item_mib = std::max<uint64_t>(1, RoundUpMib(2 * settings.block_bytes));
  const uint64_t memory_mib = std::max<uint64_t>(RoundUpMib(settings.memory_bytes), 2 * item_mib);
  return StartOnFreePort(
      "memcached",
      [&](uint16_t port) {
        std::vector<std::string> argv = {settings.program,
                                         "--listen=127.0.0.1",
                                         "--port=" + std::to_string(port),
                                         "--udp-port=0",
                                         "--memory-limit=" + std::to_string(memory_mib),
                                         "--max-item-size=" + std::to_string(item_mib) + "m"};
        if (geteuid() == 0) argv.push_back("--user=" + UserName());
        return argv;
      },
      settings, [](uint16_t port) { return TcpListening(port); }, "");
}

}  // namespace kvstash::bench
