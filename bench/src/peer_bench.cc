// `kvstash bench peer`: kvstash against what users would pick instead, Redis and memcached, on
// this machine in one run. For every cell (a block size and a number of clients) and round it
// starts each store fresh (kvstashd over TCP and over shared memory, memcached, Redis over TCP
// and over a unix socket), runs `kvstash bench node`'s load against it (block_load.h: the same
// puts, reads and content checks through each store's own client library) and stops it, then
// measures this machine's copy rate for the block size; the systems of a cell run back to back,
// the first one rotating from round to round. It prints the medians as a table (systems x cells)
// with kvstash's ratio to the best peer, or --json.

#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <map>
#include <string_view>
#include <thread>

#include "block_load.h"
#include "commands.h"
#include "kvstash/bench/harness.h"
#include "kvstash/common/byte_units.h"
#include "kvstash/transport/stream.h"
#include "node_connection.h"
#include "peer_clients.h"
#include "peer_servers.h"

namespace kvstash::bench {
namespace {

using Clock = std::chrono::steady_clock;

// ---- what is measured ---------------------------------------------------------------------------

enum class Store : uint8_t { kKvstash, kMemcached, kRedis, kCopy };

// A system of the table: a store reached one way, or the machine's copy limit.
struct System {
  std::string_view name;   // figure names, --json: "kvstash_tcp"
  std::string_view flag;   // --systems: "kvstash-tcp"
  std::string_view label;  // table rows: "kvstash TCP"
  Store store;
  std::string_view tls;  // kvstash: its UCX transports
  bool unix_socket = false;
  bool stream = false;  // kvstash: the stream transport (kvstashd --transport stream)
};

constexpr System kKvstashTcp = {"kvstash_tcp", "kvstash-tcp", "kvstash TCP", Store::kKvstash,
                                "tcp"};
constexpr System kKvstashStream = {
    "kvstash_stream", "kvstash-stream", "kvstash stream (TCP)", Store::kKvstash, "", false, true};
constexpr System kMemcachedTcp = {"memcached_tcp", "memcached-tcp", "memcached TCP",
                                  Store::kMemcached, ""};
constexpr System kRedisTcp = {"redis_tcp", "redis-tcp", "Redis TCP", Store::kRedis, ""};
constexpr System kKvstashShm = {"kvstash_shm", "kvstash-shm", "kvstash shared memory",
                                Store::kKvstash, "shm"};
constexpr System kRedisUnix = {"redis_unix",  "redis-unix", "Redis unix socket",
                               Store::kRedis, "",           true};
constexpr System kCopyLimit = {"copy_limit", "", "memory copy limit (same run)", Store::kCopy, ""};
// The table's rows, in the order.
constexpr const System* kSystems[] = {&kKvstashTcp, &kKvstashStream, &kMemcachedTcp,
                                      &kRedisTcp,   &kKvstashShm,    &kRedisUnix};

// A column of the table: blocks of one size from a number of clients.
struct Cell {
  uint64_t block_bytes = 0;
  int clients = 0;
  std::string name;   // in figure names: "256KiB_x8"
  std::string label;  // "256 KiB x 8"
};

std::string CompactBytes(uint64_t bytes) {
  if (bytes % (uint64_t{1} << 20) == 0) return fmt::format("{}MiB", bytes >> 20);
  if (bytes % (uint64_t{1} << 10) == 0) return fmt::format("{}KiB", bytes >> 10);
  return fmt::format("{}B", bytes);
}

std::string Figure(const System& system, const Cell& cell) {
  return fmt::format("{}_{}", system.name, cell.name);
}
std::string BestTcpPeer(const Cell& cell) { return "best_tcp_peer_" + cell.name; }
std::string TcpRatio(const Cell& cell) { return "tcp_ratio_" + cell.name; }
std::string StreamRatio(const Cell& cell) { return "stream_ratio_" + cell.name; }
std::string ShmRatio(const Cell& cell) { return "shm_ratio_" + cell.name; }
std::string ShmCopyRatio(const Cell& cell) { return "shm_copy_ratio_" + cell.name; }

struct PeerFlags {
  std::vector<std::string> sizes = {"256KiB", "2MiB"};
  std::vector<int> clients = {1, 8};
  std::vector<std::string> systems = {"kvstash-tcp", "kvstash-stream", "memcached-tcp",
                                      "redis-tcp",   "kvstash-shm",    "redis-unix"};
  double seconds = 2;
  int rounds = 5;
  double read_share = 0.5;
  int keys_per_client = 64;
  int check_every = 8;
  std::string cpu_bytes = "2GiB";
  double delay_s = 0.3;
  double warmup_s = 0;
  int busy = 0;
  int workers = 0;
  int spin_us = 200;
  std::string kvstashd;
  std::string redis_server = "redis-server";
  std::string memcached = "memcached";
  std::string memcached_protocol = "binary";
  int tamper_every = 0;
  bool abort_clients = false;
  OutputOptions output;
};

// The run's settings, checked.
struct Plan {
  std::vector<uint64_t> sizes;
  std::vector<Cell> cells;
  std::vector<const System*> systems;  // selected, in the table's order
  uint64_t cpu_bytes = 0;
  MemcachedProtocol memcached_protocol = MemcachedProtocol::kBinary;
  std::string kvstashd;
  bool tcp_ratio = false, stream_ratio = false, shm_ratio = false, shm_copy_ratio = false;
  bool best_tcp_peer = false;
};

bool Has(const Plan& plan, const System& system) {
  return std::find(plan.systems.begin(), plan.systems.end(), &system) != plan.systems.end();
}

BenchSpec PeerSpec(const Plan& plan) {
  BenchSpec spec;
  spec.name = "peer";
  spec.command = "kvstash bench peer";
  spec.title =
      "kvstash against Redis and memcached started here, the same load and checks, against "
      "this machine's copy rate";
  for (const Cell& cell : plan.cells) {
    for (const System* system : plan.systems) {
      spec.figures.push_back(
          Higher(Figure(*system, cell), "GB/s",
                 fmt::format("{}: put + get GB/s, {}", system->label, cell.label)));
    }
    spec.figures.push_back(
        Higher(Figure(kCopyLimit, cell), "GB/s", fmt::format("the copy limit for {}", cell.label)));
    if (plan.best_tcp_peer) {
      spec.figures.push_back(Higher(BestTcpPeer(cell), "GB/s",
                                    "the faster of memcached TCP and Redis TCP in the round"));
    }
    if (plan.tcp_ratio) {
      spec.ratios.push_back(RatioOf(TcpRatio(cell), Figure(kKvstashTcp, cell), BestTcpPeer(cell),
                                    "kvstash TCP / the best TCP peer", 1.0));
    }
    if (plan.stream_ratio) {
      spec.ratios.push_back(RatioOf(StreamRatio(cell), Figure(kKvstashStream, cell),
                                    BestTcpPeer(cell), "kvstash stream / the best TCP peer", 1.0));
    }
    if (plan.shm_ratio) {
      spec.ratios.push_back(RatioOf(ShmRatio(cell), Figure(kKvstashShm, cell),
                                    Figure(kRedisUnix, cell),
                                    "kvstash shared memory / Redis unix socket", 1.0));
    }
    if (plan.shm_copy_ratio) {
      spec.ratios.push_back(RatioOf(ShmCopyRatio(cell), Figure(kKvstashShm, cell),
                                    Figure(kCopyLimit, cell),
                                    "kvstash shared memory / the copy limit", 0.6));
    }
  }
  return spec;
}

// ---- around the measurements --------------------------------------------------------------------

// Set by SIGINT and SIGTERM while the bench runs: the round in progress stops, the stores are
// stopped, and the bench exits 1.
std::atomic<bool> g_interrupted{false};

extern "C" void OnInterrupt(int /*signal*/) { g_interrupted.store(true); }

// SIGINT and SIGTERM set g_interrupted while it lives; the previous handlers come back after.
class InterruptScope {
 public:
  InterruptScope() {
    struct sigaction action = {};
    action.sa_handler = OnInterrupt;
    sigemptyset(&action.sa_mask);
    sigaction(SIGINT, &action, &old_int_);
    sigaction(SIGTERM, &action, &old_term_);
  }
  ~InterruptScope() {
    sigaction(SIGINT, &old_int_, nullptr);
    sigaction(SIGTERM, &old_term_, nullptr);
  }
  InterruptScope(const InterruptScope&) = delete;
  InterruptScope& operator=(const InterruptScope&) = delete;

 private:
  struct sigaction old_int_ = {};
  struct sigaction old_term_ = {};
};

// --busy: processes that spin on a core each while they live, as another tenant of the
// machine would. They die with the bench (PR_SET_PDEATHSIG). Not thread-safe.
class BusyProcesses {
 public:
  BusyProcesses() = default;
  ~BusyProcesses() {
    for (const pid_t pid : pids_) kill(pid, SIGKILL);
    for (const pid_t pid : pids_) {
      while (waitpid(pid, nullptr, 0) < 0 && errno == EINTR) {
      }
    }
  }
  BusyProcesses(const BusyProcesses&) = delete;
  BusyProcesses& operator=(const BusyProcesses&) = delete;

  Status Start(int count) {
    for (int i = 0; i < count; ++i) {
      const pid_t pid = fork();
      if (pid < 0) return FromErrno(errno, "fork for --busy");
      if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() == 1) _exit(0);
        volatile uint64_t spin = 0;
        for (;;) spin = spin + 1;
      }
      pids_.push_back(pid);
    }
    return Status::OK();
  }

 private:
  std::vector<pid_t> pids_;
};

// A directory of the bench's own (Redis's socket and working directory), removed with what
// is in it.
class ScratchDir {
 public:
  static Result<ScratchDir> Create() {
    std::string pattern =
        (std::filesystem::temp_directory_path() / "kvstash-bench-peer-XXXXXX").string();
    if (mkdtemp(pattern.data()) == nullptr) {
      return FromErrno(errno, fmt::format("mkdtemp {}", pattern));
    }
    return ScratchDir(pattern);
  }
  ScratchDir(ScratchDir&& other) noexcept : path_(std::exchange(other.path_, {})) {}
  ScratchDir& operator=(ScratchDir&&) = delete;
  ~ScratchDir() {
    if (path_.empty()) return;
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  const std::string& path() const { return path_; }

 private:
  explicit ScratchDir(std::string path) : path_(std::move(path)) {}
  std::string path_;
};

// Test hook (--tamper-every N): after every N'th block a peer stores, the block is stored
// again under its key with one byte changed, as another writer would behind the bench's back,
// so the store then returns wrong bytes for that key and the checks must count mismatches.
class TamperingConnection final : public BlockConnection {
 public:
  TamperingConnection(std::unique_ptr<BlockConnection> inner, int every)
      : inner_(std::move(inner)), every_(static_cast<uint64_t>(every)) {}

  Status Put(std::span<const uint64_t> keys,
             std::span<const std::span<const std::byte>> blocks) override {
    KVSTASH_RETURN_IF_ERROR(inner_->Put(keys, blocks));
    for (size_t i = 0; i < keys.size(); ++i) {
      if (++puts_ % every_ != 0) continue;
      copy_.assign(blocks[i].begin(), blocks[i].end());
      // Inside a page, away from the words every read checks: only the word-for-word check
      // sees it.
      copy_[copy_.size() / 2 + 100] ^= std::byte{0x20};
      const std::span<const std::byte> changed(copy_);
      KVSTASH_RETURN_IF_ERROR(inner_->Put(keys.subspan(i, 1), std::span(&changed, 1)));
    }
    return Status::OK();
  }
  std::vector<Result<size_t>> Get(std::span<const uint64_t> keys,
                                  std::span<const std::span<std::byte>> outs) override {
    return inner_->Get(keys, outs);
  }

 private:
  std::unique_ptr<BlockConnection> inner_;
  uint64_t every_;
  uint64_t puts_ = 0;
  std::vector<std::byte> copy_;
};

// kvstashd next to this program (an installed bin/), or in the build tree beside it
// (build/tools/kvstash/kvstash -> build/node/kvstashd), else on PATH.
std::string FindKvstashd() {
  std::error_code error;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", error);
  if (!error) {
    for (const std::filesystem::path& candidate :
         {self.parent_path() / "kvstashd", self.parent_path() / "../../node/kvstashd"}) {
      if (access(candidate.c_str(), X_OK) == 0) return candidate.lexically_normal().string();
    }
  }
  return "kvstashd";
}

// What one measurement gave: its figure (none when the clients could not run) and what the
// clients did.
struct Measurement {
  std::optional<double> gbps;
  LoadTotals totals;
};

// ---- one measurement ----------------------------------------------------------------------------

struct Context {
  const PeerFlags& flags;
  const Plan& plan;
  const std::string& scratch;
  Progress& progress;
};

// Sleeps `seconds`, or less when interrupted.
void Delay(double seconds) {
  const auto end = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                      std::chrono::duration<double>(seconds));
  while (Clock::now() < end && !g_interrupted.load()) {
    std::this_thread::sleep_for(
        std::min<Clock::duration>(end - Clock::now(), std::chrono::milliseconds(10)));
  }
}

// The clients' side of a measurement: --clients connections to the store on `port` (or its
// unix socket), kvstash's on `workers`, and the load through them.
Result<LoadTotals> RunClients(const Context& context, const System& system, const Cell& cell,
                              int round, uint16_t port, const std::string& unix_path,
                              const ClientWorkers& workers) {
  const PeerFlags& flags = context.flags;
  const Connect connect = [&](int client) -> Result<std::unique_ptr<BlockConnection>> {
    Result<std::unique_ptr<BlockConnection>> connection = InternalError("no store");
    switch (system.store) {
      case Store::kKvstash: {
        connector::NodeClientOptions options;
        options.nodes = {connector::NodeAddress{"127.0.0.1", port}};
        options.key_namespace = "bench";
        options.transport.tls = std::string(system.tls);
        options.worker = workers.Of(client);
        if (system.stream) {
          options.connect = [](const transport::ClientOptions& client_options)
              -> Result<std::unique_ptr<transport::Channel>> {
            KVSTASH_ASSIGN_OR_RETURN(std::unique_ptr<transport::StreamClient> stream,
                                     transport::StreamClient::Create(client_options));
            return std::unique_ptr<transport::Channel>(std::move(stream));
          };
        }
        return ConnectNodeClient(std::move(options));  // an overwrite would be skipped
      }
      case Store::kMemcached:
        connection = ConnectMemcached("127.0.0.1", port, context.plan.memcached_protocol);
        break;
      case Store::kRedis: {
        RedisAddress address;
        address.port = port;
        if (system.unix_socket) address.unix_path = unix_path;
        connection = ConnectRedis(address);
        break;
      }
      case Store::kCopy:
        break;
    }
    if (!connection.ok() || flags.tamper_every == 0) return connection;
    return std::unique_ptr<BlockConnection>(
        std::make_unique<TamperingConnection>(std::move(*connection), flags.tamper_every));
  };
  LoadSettings load = {.block_bytes = cell.block_bytes,
                       .clients = cell.clients,
                       .seconds = flags.seconds,
                       .read_share = flags.read_share,
                       .keys_per_client = flags.keys_per_client,
                       .check_every = flags.check_every,
                       .batch = 1,
                       .cancel = &g_interrupted};
  const LoadTick tick = [&](const LoadCounts& counts) {
    context.progress.Update(
        fmt::format("round {}/{}  {}  {}: {} put, {} read, {} errors, {} "
                    "mismatches",
                    round, flags.rounds, cell.label, system.label, counts.puts, counts.gets,
                    counts.errors, counts.mismatches));
  };
  if (flags.warmup_s > 0) {
    // Unmeasured load first, on keys of their own, through connections of their own.
    LoadSettings warmup = load;
    warmup.seconds = flags.warmup_s;
    Result<LoadTotals> warm = RunLoad(warmup, connect, tick);
    if (!warm.ok()) {
      return Status(warm.status().code(), fmt::format("{}, {}: warm-up: {}", system.label,
                                                      cell.label, warm.status().message()));
    }
    load.first_sequence = uint64_t{1} << 32;
  }
  Result<LoadTotals> totals = RunLoad(load, connect, tick);
  if (!totals.ok()) {
    return Status(totals.status().code(),
                  fmt::format("{}, {}: {}", system.label, cell.label, totals.status().message()));
  }
  return totals;
}

std::string SignalName(int status) {
  if (status <= 128) return fmt::format("exit status {}", status);
  const char* name = strsignal(status - 128);
  return fmt::format("signal {} ({})", status - 128, name != nullptr ? name : "?");
}

// RunClients in a process of its own, forked for the measurement as an engine process of its
// own would run: every measurement starts from a clean process (no UCX state, worker pool or
// connection left by the one before), and a client library that crashes costs this
// measurement, counted as an error, not the run. The child reports its outcome as JSON on a
// pipe and exits at once (_exit: no teardown that could crash after the report). A status only
// for an interrupted run (Cancelled) or a child that cannot be started.
Result<Measurement> RunClientsInChild(const Context& context, const System& system,
                                      const Cell& cell, int round, uint16_t port,
                                      const std::string& unix_path) {
  const PeerFlags& flags = context.flags;
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return FromErrno(errno, "pipe for the clients' process");
  std::cout.flush();
  std::cerr.flush();
  const pid_t pid = fork();
  if (pid < 0) {
    const int e = errno;
    close(fds[0]);
    close(fds[1]);
    return FromErrno(e, "fork for the clients' process");
  }
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    close(fds[0]);
    Json report;
    // Held past the report: their teardown is left to the kernel.
    auto* workers = new Result<ClientWorkers>(ClientWorkers::Create(0, "", 0));
    if (system.store == Store::kKvstash && !system.stream) {
      *workers = ClientWorkers::Create(flags.workers, std::string(system.tls), flags.spin_us);
    }
    const Result<LoadTotals> totals =
        workers->ok() ? RunClients(context, system, cell, round, port, unix_path, **workers)
                      : Result<LoadTotals>(workers->status());
    if (totals.ok()) {
      report = {{"puts", totals->puts},
                {"gets", totals->gets},
                {"misses", totals->misses},
                {"errors", totals->errors},
                {"mismatches", totals->mismatches},
                {"seconds", totals->seconds},
                {"first_error", totals->first_error}};
    } else {
      report = {{"code", static_cast<int>(totals.status().code())},
                {"message", std::string(totals.status().message())}};
    }
    if (flags.abort_clients) std::abort();  // test hook: a client library that crashes
    const std::string text = report.dump();
    for (size_t done = 0; done < text.size();) {
      const ssize_t n = write(fds[1], text.data() + done, text.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      done += static_cast<size_t>(n);
    }
    _exit(0);
  }
  close(fds[1]);
  // Read the report until the child closes its end; a child far past its load is killed.
  const auto deadline =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(
                         std::chrono::duration<double>(flags.warmup_s + flags.seconds + 120));
  std::string text;
  bool forwarded = false;
  for (;;) {
    if (g_interrupted.load() && !forwarded) {
      kill(pid, SIGINT);  // the load stops and reports Cancelled
      forwarded = true;
    }
    if (Clock::now() > deadline) kill(pid, SIGKILL);
    pollfd p{fds[0], POLLIN, 0};
    if (poll(&p, 1, 100) <= 0) continue;
    char chunk[4096];
    const ssize_t n = read(fds[0], chunk, sizeof chunk);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    text.append(chunk, static_cast<size_t>(n));
  }
  close(fds[0]);
  int wstatus = 0;
  while (waitpid(pid, &wstatus, 0) < 0 && errno == EINTR) {
  }
  const int status = WIFEXITED(wstatus) ? WEXITSTATUS(wstatus) : 128 + WTERMSIG(wstatus);
  const Json report = Json::parse(text, nullptr, false);
  Measurement measured;
  if (!report.is_object()) {
    // Died before it reported: no figure, one error.
    measured.totals.errors = 1;
    measured.totals.first_error = fmt::format(
        "{}, {}: the clients' process ended with {} before it reported (its "
        "messages are above)",
        system.label, cell.label, SignalName(status));
    return measured;
  }
  if (report.contains("code")) {
    const auto code = static_cast<StatusCode>(report.at("code").get<int>());
    const std::string message = report.at("message").get<std::string>();
    if (code == StatusCode::kCancelled) return CancelledError("{}", message);
    // A client that could not connect: no figure, one error.
    measured.totals.errors = 1;
    measured.totals.first_error = message;
    return measured;
  }
  LoadTotals& t = measured.totals;
  t.puts = report.at("puts").get<uint64_t>();
  t.gets = report.at("gets").get<uint64_t>();
  t.misses = report.at("misses").get<uint64_t>();
  t.errors = report.at("errors").get<uint64_t>();
  t.mismatches = report.at("mismatches").get<uint64_t>();
  t.seconds = report.at("seconds").get<double>();
  t.first_error = report.at("first_error").get<std::string>();
  measured.gbps = t.PutGbps(cell.block_bytes) + t.GetGbps(cell.block_bytes);
  return measured;
}

// Starts `system`'s store for `cell`, waits --delay-s, runs the clients against it in a
// process of their own and stops it. A status only for an interrupted run or a store that
// cannot be started.
Result<Measurement> MeasureStore(const Context& context, const System& system, const Cell& cell,
                                 int round) {
  const PeerFlags& flags = context.flags;
  StoreSettings settings;
  settings.block_bytes = cell.block_bytes;
  settings.memory_bytes = context.plan.cpu_bytes;
  settings.dir = context.scratch;
  settings.cancel = &g_interrupted;
  Result<std::unique_ptr<StoreServer>> server = InternalError("no store");
  switch (system.store) {
    case Store::kKvstash:
      settings.program = context.plan.kvstashd;
      server = StartKvstashd(settings, std::string(system.tls), system.stream);
      break;
    case Store::kMemcached:
      settings.program = flags.memcached;
      server = StartMemcached(settings);
      break;
    case Store::kRedis:
      settings.program = flags.redis_server;
      server = StartRedis(settings);
      break;
    case Store::kCopy:
      return InternalError("the copy limit is no store");
  }
  if (!server.ok()) return server.status();
  Delay(flags.delay_s);
  Result<Measurement> measured =
      RunClientsInChild(context, system, cell, round, (*server)->port(), (*server)->unix_path());
  if (measured.ok() && !(*server)->running()) {
    LoadTotals& t = measured->totals;
    if (t.errors++ == 0) {
      t.first_error = fmt::format("{}, {}: the store exited during the load ({})", system.label,
                                  cell.label, SignalName((*server)->Stop()));
    }
  }
  return measured;
}

// ---- the run ------------------------------------------------------------------------------------

Result<Plan> MakePlan(const PeerFlags& flags) {
  Plan plan;
  for (const std::string& text : flags.sizes) {
    Result<uint64_t> bytes = ParseBytes("--sizes", text);
    if (!bytes.ok()) return bytes.status();
    if (*bytes < 4096 || *bytes > (uint64_t{64} << 20) || *bytes % 4096 != 0) {
      return InvalidArgumentError("--sizes: {} is not a multiple of 4 KiB in 4 KiB..64 MiB", text);
    }
    plan.sizes.push_back(*bytes);
  }
  for (const int clients : flags.clients) {
    if (clients < 1 || clients > 1024) {
      return InvalidArgumentError("--clients: {} is outside 1..1024", clients);
    }
  }
  if (plan.sizes.empty() || flags.clients.empty()) {
    return InvalidArgumentError("--sizes and --clients need a value each");
  }
  for (const uint64_t size : plan.sizes) {
    for (const int clients : flags.clients) {
      plan.cells.push_back(Cell{size, clients, fmt::format("{}_x{}", CompactBytes(size), clients),
                                fmt::format("{} x {}", FormatBytes(size), clients)});
    }
  }
  for (const std::string& flag : flags.systems) {
    const auto it = std::find_if(std::begin(kSystems), std::end(kSystems),
                                 [&](const System* s) { return s->flag == flag; });
    if (it == std::end(kSystems)) {
      return InvalidArgumentError(
          "--systems: '{}' is not one of kvstash-tcp, kvstash-stream, memcached-tcp, redis-tcp, "
          "kvstash-shm, redis-unix",
          flag);
    }
  }
  for (const System* system : kSystems) {
    if (std::find(flags.systems.begin(), flags.systems.end(), system->flag) !=
        flags.systems.end()) {
      plan.systems.push_back(system);
    }
  }
  if (plan.systems.empty()) return InvalidArgumentError("--systems: none given");
  Result<uint64_t> cpu_bytes = ParseBytes("--cpu-bytes", flags.cpu_bytes);
  if (!cpu_bytes.ok()) return cpu_bytes.status();
  const uint64_t largest = *std::max_element(plan.sizes.begin(), plan.sizes.end());
  if (*cpu_bytes < 8 * largest) {
    return InvalidArgumentError("--cpu-bytes: {} holds fewer than 8 blocks of {}", flags.cpu_bytes,
                                FormatBytes(largest));
  }
  plan.cpu_bytes = *cpu_bytes;
  if (!(flags.seconds > 0) || flags.seconds > 3600) {
    return InvalidArgumentError("--seconds: {} is outside (0, 3600]", flags.seconds);
  }
  if (!(flags.read_share >= 0 && flags.read_share <= 1)) {
    return InvalidArgumentError("--read-share: {} is outside 0..1", flags.read_share);
  }
  if (!(flags.warmup_s >= 0 && flags.warmup_s <= 3600)) {
    return InvalidArgumentError("--warmup-s: {} is outside 0..3600", flags.warmup_s);
  }
  if (!(flags.delay_s >= 0 && flags.delay_s <= 60)) {
    return InvalidArgumentError("--delay-s: {} is outside 0..60", flags.delay_s);
  }
  plan.memcached_protocol =
      flags.memcached_protocol == "ascii" ? MemcachedProtocol::kAscii : MemcachedProtocol::kBinary;
  plan.kvstashd = flags.kvstashd.empty() ? FindKvstashd() : flags.kvstashd;
  const bool tcp_peer = Has(plan, kMemcachedTcp) || Has(plan, kRedisTcp);
  plan.tcp_ratio = Has(plan, kKvstashTcp) && tcp_peer;
  plan.stream_ratio = Has(plan, kKvstashStream) && tcp_peer;
  plan.best_tcp_peer = plan.tcp_ratio || plan.stream_ratio;
  plan.shm_ratio = Has(plan, kKvstashShm) && Has(plan, kRedisUnix);
  plan.shm_copy_ratio = Has(plan, kKvstashShm);
  return plan;
}

// The table: a row per system (GB/s, medians), the copy limit, kvstash's ratios.
std::string SummaryTable(const Report& report, const Plan& plan) {
  std::vector<std::vector<std::string>> rows;
  std::vector<std::string> header = {
      fmt::format("put+get GB/s (medians over {} rounds)", report.rounds().size())};
  for (const Cell& cell : plan.cells) header.push_back(cell.label);
  rows.push_back(header);
  auto add = [&](std::string label, const std::function<std::optional<double>(const Cell&)>& of) {
    std::vector<std::string> row = {std::move(label)};
    for (const Cell& cell : plan.cells) row.push_back(FormatFigure(of(cell)));
    rows.push_back(std::move(row));
  };
  for (const System* system : plan.systems) {
    add(std::string(system->label),
        [&](const Cell& c) { return report.Median(Figure(*system, c)); });
  }
  add(std::string(kCopyLimit.label),
      [&](const Cell& c) { return report.Median(Figure(kCopyLimit, c)); });
  if (plan.tcp_ratio) {
    add("ratio kvstash TCP / best TCP peer",
        [&](const Cell& c) { return report.RatioMedian(TcpRatio(c)); });
  }
  if (plan.stream_ratio) {
    add("ratio kvstash stream / best TCP peer",
        [&](const Cell& c) { return report.RatioMedian(StreamRatio(c)); });
  }
  if (plan.shm_ratio) {
    add("ratio kvstash shm / Redis unix",
        [&](const Cell& c) { return report.RatioMedian(ShmRatio(c)); });
  }
  if (plan.shm_copy_ratio) {
    add("ratio kvstash shm / copy limit",
        [&](const Cell& c) { return report.RatioMedian(ShmCopyRatio(c)); });
  }
  std::vector<size_t> width(header.size(), 0);
  for (const auto& row : rows) {
    for (size_t c = 0; c < row.size(); ++c) width[c] = std::max(width[c], row[c].size());
  }
  std::string out;
  for (const auto& row : rows) {
    std::string line = fmt::format("{:<{}}", row[0], width[0]);
    for (size_t c = 1; c < row.size(); ++c) line += fmt::format("  {:>{}}", row[c], width[c]);
    out += line + "\n";
  }
  return out;
}

int RunBenchPeer(const PeerFlags& flags) {
  const cli::ErrorReporter reporter("kvstash bench peer");
  auto fail = [&reporter](int code, std::string_view message) {
    return reporter.Fail(code, message);
  };
  Result<Plan> planned = MakePlan(flags);
  if (!planned.ok()) return fail(kExitUsage, planned.status().message());
  const Plan& plan = *planned;
  for (const Cell& cell : plan.cells) {
    if (Status s = CheckTheChecks(cell.block_bytes); !s.ok()) {
      return fail(kExitFailure, s.message());
    }
  }
  Result<std::unique_ptr<Report>> created = Report::Create(PeerSpec(plan));
  if (!created.ok()) return fail(kExitFailure, created.status().ToString());
  Report& report = **created;
  Result<ScratchDir> scratch = ScratchDir::Create();
  if (!scratch.ok()) return fail(kExitFailure, scratch.status().message());

  g_interrupted = false;
  const InterruptScope interrupts;
  BusyProcesses busy;
  if (Status s = busy.Start(flags.busy); !s.ok()) return fail(kExitFailure, s.message());
  Progress progress = Progress::ToStderr(flags.output.progress);
  const Context context{flags, plan, scratch->path(), progress};

  // A round runs every cell; in a cell, every system and the copy limit back to back, the
  // first rotating from round to round.
  std::vector<const System*> entries = plan.systems;
  entries.push_back(&kCopyLimit);
  std::map<std::string_view, LoadTotals> outcomes;
  Json orders = Json::array();
  for (int r = 1; r <= flags.rounds; ++r) {
    Round round(report.spec(), r, false);
    std::vector<const System*> order = entries;
    std::rotate(order.begin(), order.begin() + (r - 1) % order.size(), order.end());
    Json names = Json::array();
    for (const System* s : order) names.push_back(s->name);
    orders.push_back(std::move(names));
    for (const Cell& cell : plan.cells) {
      for (const System* system : order) {
        if (g_interrupted.load()) {
          progress.Finish();
          return fail(kExitFailure, fmt::format("round {}: interrupted", r));
        }
        if (system->store == Store::kCopy) {
          round.Set(Figure(kCopyLimit, cell), CopyLimitGbps(cell.block_bytes, plan.cpu_bytes));
          continue;
        }
        Result<Measurement> measured = MeasureStore(context, *system, cell, r);
        if (!measured.ok()) {
          progress.Finish();
          return fail(kExitFailure, fmt::format("round {}: {}", r, measured.status().message()));
        }
        const std::optional<double> gbps = measured->gbps;
        round.Set(Figure(*system, cell), gbps);
        outcomes[system->name].Add(measured->totals);
        progress.Update(fmt::format("round {}/{}  {}  {}: {} GB/s", r, flags.rounds, cell.label,
                                    system->label, FormatFigure(gbps)));
      }
      if (plan.best_tcp_peer) {
        std::optional<double> best;
        for (const System* peer : {&kMemcachedTcp, &kRedisTcp}) {
          if (!Has(plan, *peer)) continue;
          const std::optional<double> v = round.Get(Figure(*peer, cell));
          if (v.has_value()) best = std::max(best.value_or(0.0), *v);
        }
        round.Set(BestTcpPeer(cell), best);
      }
    }
    report.AddRound(std::move(round));
  }
  progress.Finish();

  uint64_t errors = 0, mismatches = 0;
  Json systems = Json::object();
  std::string error_line, mismatch_line;
  std::vector<std::string> first_errors;
  for (const System* system : plan.systems) {
    const LoadTotals& t = outcomes[system->name];
    errors += t.errors;
    mismatches += t.mismatches;
    systems[std::string(system->name)] = {{"puts", t.puts},
                                          {"gets", t.gets},
                                          {"get_misses", t.misses},
                                          {"errors", t.errors},
                                          {"mismatches", t.mismatches},
                                          {"seconds", t.seconds},
                                          {"first_error", t.first_error}};
    if (!t.first_error.empty()) {
      first_errors.push_back(fmt::format("{}: {}", system->name, t.first_error));
    }
    error_line += fmt::format("{}{} {}", error_line.empty() ? "" : ", ", system->name, t.errors);
    mismatch_line +=
        fmt::format("{}{} {}", mismatch_line.empty() ? "" : ", ", system->name, t.mismatches);
  }
  Json sizes = Json::array(), clients = Json::array(), selected = Json::array();
  for (const uint64_t s : plan.sizes) sizes.push_back(s);
  for (const int c : flags.clients) clients.push_back(c);
  for (const System* s : plan.systems) selected.push_back(s->name);
  report.Set("block_sizes", sizes);
  report.Set("clients", clients);
  report.Set("systems", selected);
  report.Set("seconds", flags.seconds);
  report.Set("delay_s", flags.delay_s);
  report.Set("warmup_s", flags.warmup_s);
  report.Set("busy", flags.busy);
  report.Set("cpu_bytes", plan.cpu_bytes);
  report.Set("read_share", flags.read_share);
  report.Set("keys_per_client", flags.keys_per_client);
  report.Set("check_every", flags.check_every);
  report.Set("workers", flags.workers);
  report.Set("memcached_protocol", flags.memcached_protocol);
  report.Set("orders", orders);
  report.Set("outcomes", systems);
  report.Set("errors", errors);
  report.Set("mismatches", mismatches);
  std::string cells;
  for (const Cell& cell : plan.cells) cells += (cells.empty() ? "" : ", ") + cell.label;
  report.Heading("cells", fmt::format("{} (block size x clients)", cells));
  report.Heading("stores",
                 fmt::format("started fresh for each measurement, {} of memory each, "
                             "clients {} s after they listen; memcached over its {} "
                             "protocol",
                             FormatBytes(plan.cpu_bytes), flags.delay_s, flags.memcached_protocol));
  report.Heading(
      "load",
      fmt::format("{} s per system{}, {:.0f}% reads among each client's "
                  "last {} blocks, every {}th read checked word for word",
                  flags.seconds,
                  flags.warmup_s > 0 ? fmt::format(" after {} s of warm-up", flags.warmup_s) : "",
                  100 * flags.read_share, flags.keys_per_client, flags.check_every));
  report.Heading("busy", fmt::format("{} other process(es) spinning", flags.busy));
  report.Footing("errors", error_line);
  report.Footing("mismatches", mismatch_line);
  for (const std::string& line : first_errors) report.Footing("first error", line);
  if (flags.output.json) {
    Print(report, flags.output, std::cout);
  } else {
    std::cout << report.ToTable() << "\n" << SummaryTable(report, plan);
    std::cout.flush();
  }
  return errors == 0 && mismatches == 0 ? kExitOk : kExitFailure;
}

}  // namespace

void AddBenchPeerCommand(CLI::App& bench, int* exit_code) {
  auto flags = std::make_shared<PeerFlags>();
  CLI::App* cmd = bench.add_subcommand(
      "peer",
      "kvstash against what users would run instead, on this machine in one run: for every "
      "cell (a block size from --sizes and a number of clients from --clients) and round, it "
      "starts each store fresh on loopback (kvstashd over UCX's TCP, over its own stream transport "
      "and over shared memory, "
      "memcached over TCP, Redis over TCP and over a unix socket; each with --cpu-bytes of "
      "memory and evicting its least recently used blocks when full), waits --delay-s, runs "
      "`kvstash bench node`'s load against it for --seconds and stops it; then it measures "
      "this machine's copy limit for the block size (as `kvstash bench node` does). The load: "
      "each client thread, with its own connection (a node client, hiredis, libmemcached), "
      "stores new blocks and reads back among its last --keys-per-client, and every block read "
      "is checked: for the right key at every 4 KiB page, and every --check-every'th read word "
      "for word. Reads of evicted blocks count as misses, not errors. The systems of a cell run "
      "back to back, the first one rotating from round to round (a machine's drift weighs on "
      "all). Prints the medians as a table with kvstash's ratio to the best peer (TCP against "
      "the faster of memcached and Redis over TCP, shared memory against Redis's unix socket) "
      "and to the copy limit; exits 1 on any error or content mismatch. The stores are stopped "
      "at the end, on an error and on SIGINT.");
  cmd->add_option("--sizes", flags->sizes, "Block sizes, one cell column each with --clients")
      ->delimiter(',')
      ->capture_default_str();
  cmd->add_option("--clients", flags->clients, "Numbers of client threads (1..1024)")
      ->delimiter(',')
      ->capture_default_str();
  cmd->add_option("--systems", flags->systems,
                  "Systems to run: kvstash-tcp (UCX over TCP), kvstash-stream (kvstashd "
                  "--transport stream), memcached-tcp, redis-tcp, kvstash-shm, redis-unix")
      ->delimiter(',')
      ->capture_default_str();
  cmd->add_option("--seconds", flags->seconds, "Load on each system per cell and round")
      ->capture_default_str();
  cmd->add_option("--rounds", flags->rounds,
                  "Paired rounds: each runs every cell, and in a cell every system and the copy "
                  "limit back to back, the first one rotating from round to round (round r "
                  "starts with the r'th), so the machine's drift weighs on all; every figure is "
                  "the median over rounds, every ratio the median of the rounds' own ratios")
      ->check(CLI::Range(1, kMaxRounds))
      ->capture_default_str();
  cmd->add_option("--cpu-bytes", flags->cpu_bytes,
                  "Memory of every store: kvstashd's --cpu-bytes, Redis's maxmemory, memcached's "
                  "-m")
      ->capture_default_str();
  cmd->add_option("--delay-s", flags->delay_s,
                  "The clients start this long after a store listens (a node that has just "
                  "started may still be preparing its tier)")
      ->capture_default_str();
  cmd->add_option("--warmup-s", flags->warmup_s,
                  "Unmeasured load on each store before the measured --seconds (its own keys "
                  "and connections): 0 measures from the first connection on, as an engine "
                  "meeting a node that has just started; more measures the steady state")
      ->capture_default_str();
  cmd->add_option("--busy", flags->busy,
                  "Processes kept spinning, one core each, during the whole run (another "
                  "tenant of the machine)")
      ->check(CLI::Range(0, 64))
      ->capture_default_str();
  cmd->add_option("--read-share", flags->read_share,
                  "Share of operations that read a block the client stored (0..1)")
      ->capture_default_str();
  cmd->add_option("--keys-per-client", flags->keys_per_client,
                  "Reads pick among each client's last this many stored blocks")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  cmd->add_option("--check-every", flags->check_every,
                  "Check every word of every this many'th block read (1: of every read)")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  cmd->add_option("--workers", flags->workers,
                  "kvstash: UCX workers (each with its progress thread) the clients share, "
                  "round-robin; 0: the process's pool, as connectors run (one per core, at most "
                  "4); --clients: one per client")
      ->check(CLI::Range(0, 1024))
      ->capture_default_str();
  cmd->add_option("--spin-us", flags->spin_us,
                  "kvstash: how long each client worker's progress thread polls before it sleeps")
      ->check(CLI::Range(0, 100000))
      ->capture_default_str();
  cmd->add_option("--kvstashd", flags->kvstashd,
                  "The kvstashd to start. Default: next to this program, or in its build tree "
                  "(build/node/kvstashd), else on PATH");
  cmd->add_option("--redis-server", flags->redis_server, "The redis-server to start")
      ->capture_default_str();
  cmd->add_option("--memcached", flags->memcached, "The memcached to start")->capture_default_str();
  cmd->add_option("--memcached-protocol", flags->memcached_protocol,
                  "libmemcached's protocol: binary or ascii")
      ->check(CLI::IsMember({"binary", "ascii"}))
      ->capture_default_str();
  cmd->add_option("--tamper-every", flags->tamper_every,
                  "Test hook: the peers' every N'th stored block is stored again with a byte "
                  "changed (kvstash nodes skip a block they hold)")
      ->check(CLI::Range(0, 1 << 20))
      ->group("");
  cmd->add_flag("--abort-clients", flags->abort_clients,
                "Test hook: every clients' process aborts before it reports, as a client library "
                "that crashes")
      ->group("");
  AddOutputFlags(*cmd, &flags->output);
  cmd->footer(
      "Figures (table rows and --json keys), each the median over rounds, per cell <size>_x<n> "
      "(256KiB_x8: blocks of 256 KiB from 8 clients):\n"
      "  <system>_<cell> (GB/s, higher is better): bytes the store took and gave (puts + reads) "
      "per second of load, over all clients; systems kvstash_tcp, kvstash_stream, memcached_tcp, "
      "redis_tcp, kvstash_shm, redis_unix\n"
      "  copy_limit_<cell> (GB/s): one thread of this process copying blocks of the size into a "
      "region of --cpu-bytes (at most 1 GiB) in a scattered order\n"
      "  best_tcp_peer_<cell> (GB/s): the faster of memcached_tcp and redis_tcp in the round\n"
      "  tcp_ratio_<cell> = kvstash_tcp / best_tcp_peer, stream_ratio_<cell> = kvstash_stream / "
      "best_tcp_peer, shm_ratio_<cell> = kvstash_shm / redis_unix, shm_copy_ratio_<cell> = "
      "kvstash_shm / copy_limit: the medians of the rounds' own ratios (goals 1, 1, 1 and 0.6)\n"
      "--json also carries the settings, \"orders\" (each round's order of systems), "
      "\"outcomes\" (per system: puts, gets, get_misses, errors, mismatches, seconds over all "
      "rounds), and the totals \"errors\" and \"mismatches\".\n"
      "Exits 0 on success, 1 on any error or content mismatch or when a store cannot be "
      "started, 2 for bad arguments.");
  cmd->callback([flags, exit_code] { *exit_code = RunBenchPeer(*flags); });
}

}  // namespace kvstash::bench
