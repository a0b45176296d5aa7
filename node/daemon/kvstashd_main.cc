// `kvstashd`: the kvstash offload node daemon. Serves one node's tiered store (CPU, optionally
// SSD) to engine workers over UCX until SIGTERM or SIGINT, then stops accepting, ends every
// session, flushes the store and exits 0.

#include <signal.h>

#include <cstdio>
#include <iostream>

#include "daemon_config.h"
#include "kvstash/common/byte_units.h"
#include "kvstash/common/cli.h"
#include "kvstash/common/logging.h"
#include "kvstash/node/metrics.h"
#include "kvstash/node/node_server.h"

int main(int argc, char** argv) {
  using namespace kvstash;
  using cli::kExitFailure;
  using cli::kExitOk;
  using cli::kExitUsage;
  const cli::ErrorReporter errors("kvstashd");
  CLI::App app(
      "kvstashd: the kvstash offload node. Keeps KV-cache blocks for engine workers in a CPU "
      "tier (and optionally an SSD tier), answers prefix and sliding-window lookups, and moves "
      "blocks over UCX (shared memory on one host, the network otherwise). Runs until SIGTERM "
      "or SIGINT, then stops accepting, ends every session, flushes and exits 0.",
      "kvstashd");
  node::DaemonFlags flags;
  node::AddDaemonFlags(app, flags);
  app.footer(
      "Exit status: 0 after a clean stop, 1 if the node cannot start or flush, 2 for bad "
      "settings. On start it prints one line `kvstashd listening on ADDRESS:PORT` on stdout.");
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    app.exit(e);
    return kExitUsage;
  }
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

  // The signals are taken by sigwait below, never by a handler: block them before any thread
  // starts so every thread inherits the mask.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  signal(SIGPIPE, SIG_IGN);

  Result<std::unique_ptr<node::NodeServer>> started = node::NodeServer::Create(*options);
  if (!started.ok()) {
    return errors.Fail(kExitFailure, fmt::format("cannot start: {}", started.status().ToString()));
  }
  std::unique_ptr<node::NodeServer> server = std::move(*started);
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
      options->server.namespace_tokens.empty()
          ? (options->server.auth_token.empty() ? std::string("off") : std::string("token"))
          : fmt::format("{} namespace token(s){}", options->server.namespace_tokens.size(),
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
  // Joins the cluster once it serves: a client that learns of it from etcd can connect at once.
  std::unique_ptr<membership::Registration> registration;
  if (registration_options->has_value()) {
    // The port is known only now (--port 0).
    auto final_options = node::RegistrationOf(flags, *options, server->port());
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

  int signal_number = 0;
  sigwait(&stop_signals, &signal_number);
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
