// `kvstashd`: the kvstash offload node daemon. Serves one node's tiered store (CPU, optionally
// SSD) to engine workers over UCX until SIGTERM or SIGINT, then stops accepting, ends every
// session, flushes the store and exits 0. A signal during start-up abandons it (see StopSignals).

#include <signal.h>
#include <unistd.h>

#include <condition_variable>
#include <cstdio>
#include <iostream>
#include <mutex>
#include <optional>
#include <thread>

#include "daemon_config.h"
#include "kvstash/common/byte_units.h"
#include "kvstash/common/cli.h"
#include "kvstash/common/logging.h"
#include "kvstash/node/metrics.h"
#include "kvstash/node/node_server.h"
#include "memory_check.h"
#include "shm_directory.h"

namespace kvstash::node {
namespace {

// SIGTERM and SIGINT, taken from the first line of main by a thread of their own (sigwait, never
// a handler: the mask is set before any other thread starts, so every thread inherits it and
// only this thread takes them).
//
// While the node starts, a signal abandons the start-up: main sees stop_requested() between
// its steps and unwinds. A step can take long (UCX writes a posix shared-memory file of the
// whole tier before it returns; a store prefaults its memory) and cannot be interrupted, so
// if main has not returned within kStartGrace the thread removes the node's shared-memory
// directory (the file being filled is there) and ends the process: nothing else a start-up
// makes outlives it (System V segments are removed as they are made, the SSD index recovers
// as after a crash). Once serving, a signal only wakes WaitForStop.
//
// Thread-safe.
class StopSignals {
 public:
  static constexpr std::chrono::milliseconds kStartGrace{500};

  // Call before any other thread starts.
  StopSignals() {
    sigemptyset(&set_);
    sigaddset(&set_, SIGTERM);
    sigaddset(&set_, SIGINT);
    pthread_sigmask(SIG_BLOCK, &set_, nullptr);
    thread_ = std::thread([this] { Run(); });
  }
  ~StopSignals() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      closing_ = true;
    }
    cv_.notify_all();
    // Wakes its sigwait: a signal sent to that thread is taken there, and closing_ says why.
    pthread_kill(thread_.native_handle(), SIGTERM);
    thread_.join();
  }

  // What an abandoned start-up removes; null: nothing. The caller clears it before it destroys
  // `dir`.
  void SetCleanup(ShmDirectory* dir) {
    std::lock_guard<std::mutex> lock(mu_);
    cleanup_ = dir;
  }
  bool stop_requested() {
    std::lock_guard<std::mutex> lock(mu_);
    return signal_ != 0;
  }
  // The node serves: a signal no longer ends the process from the signal thread.
  void Serving() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      serving_ = true;
    }
    cv_.notify_all();
  }
  // Blocks until a signal came; its number.
  int WaitForStop() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return signal_ != 0; });
    return signal_;
  }
  int signal_number() {
    std::lock_guard<std::mutex> lock(mu_);
    return signal_;
  }

 private:
  void Run() {
    for (;;) {
      int got = 0;
      const int waited = sigwait(&set_, &got);
      std::unique_lock<std::mutex> lock(mu_);
      if (closing_) return;
      if (waited != 0 || signal_ != 0) continue;
      signal_ = got;
      cv_.notify_all();
      if (serving_) continue;
      KVSTASH_LOG_WARN("{} while starting: abandoning the start-up", Name(got));
      // Main returns (closing_) or reaches the serving loop, which stops the node as usual.
      if (cv_.wait_for(lock, kStartGrace, [this] { return closing_ || serving_; })) {
        if (closing_) return;
        continue;
      }
      // Main is inside a step that does not return soon.
      if (cleanup_ != nullptr) cleanup_->RemoveNow();
      const std::string line = fmt::format("kvstashd: stopped by {} while starting\n", Name(got));
      (void)!::write(STDERR_FILENO, line.data(), line.size());
      ::_exit(cli::kExitOk);
    }
  }

  static const char* Name(int signal_number) {
    return signal_number == SIGTERM ? "SIGTERM" : "SIGINT";
  }

  sigset_t set_;
  std::mutex mu_;
  std::condition_variable cv_;
  int signal_ = 0;  // the first signal taken; 0: none yet
  bool serving_ = false;
  bool closing_ = false;
  ShmDirectory* cleanup_ = nullptr;
  std::thread thread_;
};

}  // namespace
}  // namespace kvstash::node

int main(int argc, char** argv) {
  using namespace kvstash;
  using cli::kExitFailure;
  using cli::kExitOk;
  using cli::kExitUsage;
  const cli::ErrorReporter errors("kvstashd");
  // Before anything else: a signal at any point of the start-up stops it.
  node::StopSignals signals;
  signal(SIGPIPE, SIG_IGN);
  const auto abandoned = [&] {
    std::cerr << "kvstashd: stopped by "
              << (signals.signal_number() == SIGTERM ? "SIGTERM" : "SIGINT") << " while starting"
              << std::endl;
    return kExitOk;
  };
  CLI::App app(
      "kvstashd: the kvstash offload node. Keeps KV-cache blocks for engine workers in a CPU "
      "tier (and optionally an SSD tier), answers prefix and sliding-window lookups, and moves "
      "blocks over UCX (shared memory on one host, the network otherwise). Runs until SIGTERM "
      "or SIGINT, then stops accepting, ends every session, flushes and exits 0.",
      "kvstashd");
  node::DaemonFlags flags;
  node::AddDaemonFlags(app, flags);
  app.footer(
      "Exit status: 0 after a clean stop (a SIGTERM or SIGINT during start-up abandons it and "
      "stops within a second), 1 if the node cannot start or flush, 2 for bad settings (a "
      "--cpu-bytes this machine cannot give among them). On start it prints one line "
      "`kvstashd listening on ADDRESS:PORT` on stdout.");
  if (std::optional<int> exit = cli::ParseCommandLine(app, argc, argv)) return *exit;
  if (Status s = SetLogLevel(flags.log_level); !s.ok()) {
    return errors.Fail(kExitUsage, fmt::format("log-level: {}", s.message()));
  }
  Result<node::NodeOptions> options = node::ToNodeOptions(flags);
  if (!options.ok()) {
    return errors.Fail(cli::ExitCodeFor(options.status()), options.status().message());
  }
  // Checked before anything starts (with the port asked for; the one listened on comes later).
  auto registration_options =
      node::RegistrationOf(flags, *options, static_cast<uint16_t>(flags.port));
  if (!registration_options.ok()) {
    return errors.Fail(kExitUsage, registration_options.status().message());
  }

  if (signals.stop_requested()) return abandoned();

  // The node's own shared-memory directory, made after the leftovers of dead nodes are gone
  // (they hold memory the check below counts as taken).
  // Declared after `signals` and destroyed before it; cleared from it first.
  struct ClearCleanup {
    node::StopSignals& signals;
    ~ClearCleanup() { signals.SetCleanup(nullptr); }
  };
  std::unique_ptr<node::ShmDirectory> shm;
  const ClearCleanup clear_cleanup{signals};
  if (Result<std::unique_ptr<node::ShmDirectory>> made = node::ShmDirectory::Create(flags.shm_dir);
      made.ok()) {
    shm = std::move(*made);
    signals.SetCleanup(shm.get());
    if (shm->stale_files() > 0) {
      KVSTASH_LOG_WARN("removed {} shared-memory file(s) of {} left by nodes that died",
                       shm->stale_files(), FormatBytes(shm->stale_bytes()));
    }
    options->server.transport.shm_dir = shm->path();
  } else if (flags.shm_dir == node::DaemonFlags().shm_dir) {
    // The default: a host without a usable /dev/shm (or where another user took
    // kvstashd-<uid> there) still serves, from System V segments.
    KVSTASH_LOG_WARN(
        "{}; UCX's shared-memory files go where it puts them, and a node killed while it makes "
        "one leaves it behind",
        made.status().message());
  } else {
    return errors.Fail(kExitFailure, made.status().message());
  }
  {
    Result<size_t> cpu_bytes = store::CpuMemoryBytes(options->store);
    if (!cpu_bytes.ok()) return errors.Fail(cpu_bytes.status());
    Result<node::HostMemory> host =
        node::ReadHostMemory(shm ? shm->path() : flags.shm_dir, flags.tls);
    if (!host.ok()) return errors.Fail(kExitFailure, host.status().message());
    if (Status fits = node::CheckCpuTierFits(*cpu_bytes, *host); !fits.ok()) {
      return errors.Fail(fits);
    }
  }
  if (signals.stop_requested()) return abandoned();

  Result<std::unique_ptr<node::NodeServer>> started = node::NodeServer::Create(*options);
  if (!started.ok()) {
    return errors.Fail(kExitFailure, fmt::format("cannot start: {}", started.status().ToString()));
  }
  std::unique_ptr<node::NodeServer> server = std::move(*started);
  if (signals.stop_requested()) {
    (void)server->Shutdown();
    return abandoned();
  }
  const auto& store = options->store;
  KVSTASH_LOG_INFO(
      "kvstashd listening on {}:{}: blocks of {}, CPU tier {} blocks ({}, {}{}), SSD tier {}, "
      "auth {}, namespace quotas {}",
      options->server.bind_address, server->port(), FormatBytes(store.block_bytes),
      store.cpu_capacity_blocks, FormatBytes(store.block_bytes * store.cpu_capacity_blocks),
      flags.cpu_policy, server->shares_cpu_memory() ? ", shared with local clients" : "",
      store.ssd ? fmt::format("{} in {} ({}, {})", FormatBytes(store.ssd->capacity_bytes),
                              store.ssd->dir, flags.ssd_policy, flags.cascade)
                : std::string("off"),
      options->server.tenant_tokens.empty()
          ? (options->server.auth_token.empty() ? std::string("off") : std::string("token"))
          : fmt::format("{} namespace token(s){}", options->server.tenant_tokens.size(),
                        options->server.auth_token.empty() ? ", other namespaces refused"
                                                           : ", others by token"),
      options->namespace_quota_blocks.empty() && !options->default_namespace_quota_blocks
          ? std::string("off (shared capacity)")
          : fmt::format("{} named, default {}", options->namespace_quota_blocks.size(),
                        options->default_namespace_quota_blocks
                            ? fmt::format("{} blocks", *options->default_namespace_quota_blocks)
                            : std::string("none")));
  std::cout << "kvstashd listening on " << options->server.bind_address << ":" << server->port()
            << std::endl;
  if (const events::EventPublisher* events = server->kv_events()) {
    std::cout << "kvstashd KV events on " << events->endpoint()
              << (events->replay_endpoint().empty() ? ""
                                                    : ", replay on " + events->replay_endpoint())
              << std::endl;
  }
  // Joins the cluster once it serves: a client that learns of it from etcd can connect at once.
  std::unique_ptr<membership::Registration> registration;
  if (registration_options->has_value()) {
    // The port is known only now (--port 0).
    auto final_options = node::RegistrationOf(flags, *options, server->port());
    // Its events as bound, for a router that finds the node in etcd (kvstash-router --etcd).
    if (const events::EventPublisher* events = server->kv_events(); events && final_options.ok()) {
      (**final_options).record.kv_events = events->endpoint();
      (**final_options).record.kv_events_replay = events->replay_endpoint();
    }
    Result<std::unique_ptr<membership::Registration>> created =
        final_options.ok()
            ? membership::Registration::Create(std::move(**final_options))
            : Result<std::unique_ptr<membership::Registration>>(final_options.status());
    if (!created.ok()) {
      (void)server->Shutdown();
      return errors.Fail(kExitFailure, fmt::format("cannot start: {}", created.status().message()));
    }
    registration = std::move(*created);
    KVSTASH_LOG_INFO("joining cluster '{}' in etcd at {} as {}", flags.cluster, flags.etcd,
                     registration->key());
  }
  std::unique_ptr<node::MetricsEndpoint> metrics;
  if (const std::string address = *node::MetricsAddress(flags); !address.empty()) {
    Result<std::unique_ptr<node::MetricsEndpoint>> endpoint =
        node::MetricsEndpoint::Create(address, *server, registration.get());
    if (!endpoint.ok()) {
      (void)server->Shutdown();
      return errors.Fail(kExitFailure,
                         fmt::format("cannot start: {}", endpoint.status().message()));
    }
    metrics = std::move(*endpoint);
    const std::string host = address.substr(0, address.rfind(':'));
    std::cout << "kvstashd metrics on http://" << host << ":" << metrics->port() << "/metrics"
              << std::endl;
  }

  signals.Serving();
  const int signal_number = signals.WaitForStop();
  KVSTASH_LOG_INFO("{}: stopping (no new connections; sessions end; store flushes)",
                   signal_number == SIGTERM ? "SIGTERM" : "SIGINT");
  // Leaves the cluster first, so clients stop placing blocks here while it stops.
  if (registration != nullptr) registration->Stop();
  metrics.reset();
  const Status stopped = server->Shutdown();
  server.reset();
  if (!stopped.ok()) {
    return errors.Fail(kExitFailure, fmt::format("stopping: {}", stopped.ToString()));
  }
  KVSTASH_LOG_INFO("stopped cleanly");
  return kExitOk;
}
