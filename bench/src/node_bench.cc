// `kvstash bench node`: a load generator against running offload nodes. N clients (threads,
// each with its own connections, sharing the process's UCX worker) store and read blocks for a
// while; every block read is checked against what was stored (the load and its checks are
// block_load.h's, shared with `kvstash bench peer`). A progress line on stderr each second, a
// summary at the end.

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <iostream>

#include "block_load.h"
#include "commands.h"
#include "kvstash/bench/harness.h"
#include "kvstash/connector/node_client.h"
#include "node_connection.h"

namespace kvstash::bench {
namespace {
using connector::NodeClient;
using Clock = std::chrono::steady_clock;

struct BenchNodeFlags {
  connector::NodeSource source;
  std::string key_namespace = "bench";
  std::string token;
  std::string tls;
  int clients = 8;
  double seconds = 10;
  double read_share = 0.5;
  int keys_per_client = 64;
  int workers = 0;
  int spin_us = 200;
  int batch = 1;
  int check_every = 8;
  int rounds = 1;
  OutputOptions output;
};

// The options of every bench client but its worker; InvalidArgument for a bad node source.
Result<connector::NodeClientOptions> ClientOptions(const BenchNodeFlags& flags) {
  connector::NodeClientOptions options;
  KVSTASH_RETURN_IF_ERROR(connector::ApplyNodeSource(flags.source, &options));
  options.key_namespace = flags.key_namespace;
  options.auth_token = flags.token;
  options.transport.tls = flags.tls;
  return options;
}

// The client's live nodes, "HOST:PORT HOST:PORT".
std::string NodeList(const connector::NodeClient& client) {
  std::string out;
  for (const connector::NodeAddress& node : client.nodes()) {
    out += (out.empty() ? "" : " ") + node.ToString();
  }
  return out;
}

BenchSpec NodeSpec() {
  BenchSpec spec;
  spec.name = "node";
  spec.command = "kvstash bench node";
  spec.title =
      "load on running offload nodes, every block read checked, against this machine's "
      "copy rate for their block size";
  spec.limit = "memcpy";
  spec.figures = {
      Higher("gbps", "GB/s", "kvstash: put_gbps + get_gbps, the bytes the nodes took and gave"),
      Higher("put_gbps", "GB/s",
             "bytes of the blocks stored / the round's --seconds, over all clients"),
      Higher("get_gbps", "GB/s", "bytes of the blocks read back, the same way"),
      Higher("ops_per_s", "blocks/s", "blocks stored and read per second, over all clients"),
      Lower("put_p50_us", "us",
            "median latency of a put operation (--batch blocks, all in flight)"),
      Lower("put_p99_us", "us", "its 99th percentile"),
      Lower("get_p50_us", "us",
            "median latency of a read operation (--batch blocks, all in flight); null "
            "without reads"),
      Lower("get_p99_us", "us", "its 99th percentile"),
      Higher("copy_limit_gbps", "GB/s",
             "the limit: one thread of this process copying blocks of the nodes' size into a "
             "region the size of their CPU tiers (at most 1 GiB) in a scattered order, as a "
             "node's tier receives them (on one host the transport copies blocks straight "
             "into the node's slots)"),
  };
  spec.ratios = {RatioOf("ratio", "gbps", "copy_limit_gbps",
                         "how much of this machine's copy rate the nodes deliver to "
                         "--clients clients")};
  return spec;
}

int RunBenchNode(const BenchNodeFlags& flags) {
  const cli::ErrorReporter reporter("kvstash bench node");
  auto fail = [&reporter](int code, std::string_view message) {
    return reporter.Fail(code, message);
  };
  const Result<connector::NodeClientOptions> options = ClientOptions(flags);
  if (!options.ok()) return fail(kExitUsage, options.status().message());
  if (flags.clients < 1 || flags.clients > 1024) {
    return fail(kExitUsage, fmt::format("--clients: {} is outside 1..1024", flags.clients));
  }
  if (!(flags.seconds > 0) || flags.seconds > 86400) {
    return fail(kExitUsage, fmt::format("--seconds: {} is outside (0, 86400]", flags.seconds));
  }
  if (!(flags.read_share >= 0 && flags.read_share <= 1)) {
    return fail(kExitUsage, fmt::format("--read-share: {} is outside 0..1", flags.read_share));
  }
  if (flags.workers < 0 || flags.workers > flags.clients) {
    return fail(kExitUsage, fmt::format("--workers: {} is outside 0..--clients ({})", flags.workers,
                                        flags.clients));
  }
  if (flags.keys_per_client < 1) {
    return fail(kExitUsage,
                fmt::format("--keys-per-client: {} is not positive", flags.keys_per_client));
  }
  // The nodes' block size and the CPU tiers the limit copies into.
  uint64_t block_bytes = 0;
  uint64_t capacity_blocks = 0;
  std::string node_list;
  {
    auto probe = NodeClient::Create(*options);
    if (!probe.ok()) return fail(kExitFailure, probe.status().message());
    const std::vector<connector::NodeAddress> nodes = (*probe)->nodes();
    if (nodes.empty()) {
      return fail(kExitFailure, fmt::format("cluster {} has no live offload nodes in etcd",
                                            flags.source.cluster));
    }
    node_list = NodeList(**probe);
    auto bytes = (*probe)->BlockBytes(nodes.front());
    if (!bytes.ok()) return fail(kExitFailure, bytes.status().message());
    block_bytes = *bytes;
    for (const connector::NodeAddress& node : nodes) {
      auto counters = (*probe)->Stats(node);
      if (!counters.ok()) return fail(kExitFailure, counters.status().message());
      if (auto it = counters->find("cpu.capacity_blocks"); it != counters->end()) {
        capacity_blocks += it->second;
      }
    }
  }

  // The content check itself must catch a wrong key and a flipped byte anywhere.
  if (Status s = CheckTheChecks(block_bytes); !s.ok()) return fail(kExitFailure, s.message());

  // The clients' UCX workers: --workers shared ones, clients spread over them round-robin; 0:
  // as many as a process's connectors spread their connections over (one per core, at most 4;
  // transport::ClientWorkerPool).
  const int worker_count =
      flags.workers != 0
          ? flags.workers
          : std::min(flags.clients,
                     static_cast<int>(transport::ClientWorkerPool::Create({})->size()));
  Result<ClientWorkers> workers = ClientWorkers::Create(worker_count, flags.tls, flags.spin_us);
  if (!workers.ok()) return fail(kExitFailure, workers.status().message());

  Result<std::unique_ptr<Report>> created = Report::Create(NodeSpec());
  if (!created.ok()) return fail(kExitFailure, created.status().ToString());
  Report& report = **created;
  Progress progress = Progress::ToStderr(flags.output.progress);
  LoadTotals outcome;
  const LoadSettings load = {.block_bytes = block_bytes,
                             .clients = flags.clients,
                             .seconds = flags.seconds,
                             .read_share = flags.read_share,
                             .keys_per_client = flags.keys_per_client,
                             .check_every = flags.check_every,
                             .batch = flags.batch};
  const Connect connect = [&](int client) {
    connector::NodeClientOptions client_options = *options;
    client_options.worker = workers->Of(client);
    return ConnectNodeClient(std::move(client_options));
  };
  RoundSides sides;
  // --seconds of load from --clients clients.
  sides.measure = [&](Round& round) -> Status {
    LoadCounts last;
    auto last_time = Clock::now();
    const LoadTick tick = [&](const LoadCounts& counts) {
      const auto now = Clock::now();
      const bool shown = progress.Update(
          fmt::format("{} clients  put {:.2f} GB/s  get {:.2f} GB/s  errors {}  mismatches {}",
                      flags.clients, Gbps((counts.puts - last.puts) * block_bytes, now - last_time),
                      Gbps((counts.gets - last.gets) * block_bytes, now - last_time), counts.errors,
                      counts.mismatches));
      if (shown) {
        last = counts;
        last_time = now;
      }
    };
    Result<LoadTotals> sum = RunLoad(load, connect, tick);
    if (!sum.ok()) return sum.status();
    const double put_gbps = sum->PutGbps(block_bytes);
    const double get_gbps = sum->GetGbps(block_bytes);
    const double secs = sum->seconds;
    round.Set("gbps", put_gbps + get_gbps);
    round.Set("put_gbps", put_gbps);
    round.Set("get_gbps", get_gbps);
    round.Set("ops_per_s", secs > 0 ? static_cast<double>(sum->puts + sum->gets) / secs : 0.0);
    round.Set("put_p50_us", Percentile(sum->put_us, 50));
    round.Set("put_p99_us", Percentile(sum->put_us, 99));
    round.Set("get_p50_us", Percentile(sum->get_us, 50));
    round.Set("get_p99_us", Percentile(sum->get_us, 99));
    sum->put_us.clear();
    sum->get_us.clear();
    outcome.Add(*sum);
    return Status::OK();
  };
  sides.limit = [&](Round& round) -> Status {
    round.Set("copy_limit_gbps",
              CopyLimitGbps(block_bytes, std::max<uint64_t>(capacity_blocks, 1) * block_bytes));
    return Status::OK();
  };
  if (Status s = RunRounds(report, flags.rounds, sides, progress); !s.ok()) {
    return fail(kExitFailure, s.ToString());
  }

  report.Set("clients", flags.clients);
  report.Set("seconds", outcome.seconds);
  report.Set("block_bytes", block_bytes);
  report.Set("batch", flags.batch);
  report.Set("read_share", flags.read_share);
  report.Set("workers", worker_count);
  report.Set("puts", outcome.puts);
  report.Set("gets", outcome.gets);
  report.Set("get_misses", outcome.misses);
  report.Set("errors", outcome.errors);
  report.Set("mismatches", outcome.mismatches);
  report.Heading("nodes", fmt::format("{}, blocks of {}, CPU tiers of {} blocks in all", node_list,
                                      FormatBytes(block_bytes), capacity_blocks));
  report.Heading("clients",
                 fmt::format("{} on {} UCX worker(s), {} block(s) per operation, {:.0f}% reads",
                             flags.clients, worker_count, flags.batch, 100 * flags.read_share));
  report.Heading("seconds", fmt::format("{} per round", flags.seconds));
  report.Footing("blocks", fmt::format("{} stored, {} read, {} evicted before their read (misses)",
                                       outcome.puts, outcome.gets, outcome.misses));
  report.Footing("errors",
                 fmt::format("{}, content mismatches {}", outcome.errors, outcome.mismatches));
  Print(report, flags.output, std::cout);
  return outcome.mismatches == 0 && outcome.errors == 0 ? kExitOk : kExitFailure;
}

}  // namespace

void AddBenchNodeCommand(CLI::App& bench, int* exit_code) {
  auto flags = std::make_shared<BenchNodeFlags>();
  const BenchSpec spec = NodeSpec();
  CLI::App* cmd = bench.add_subcommand(
      "node",
      "Load running offload nodes against this machine's copy rate: --clients clients "
      "(threads, each with its own connections, sharing --workers UCX progress threads) store "
      "and read blocks of the nodes' block size for --seconds; every block read back is "
      "checked against what was stored: every read, for the right key at every 4 KiB page "
      "(a block stored under another key, stale, shifted or torn at any page fails), and "
      "every --check-every'th read word for word (a byte corrupted anywhere fails). These "
      "checks cost a small share of the copies they check. A progress line on stderr each "
      "second; the summary gives GB/s, blocks/s, p50/p99 latency per operation, errors and content "
      "mismatches "
      "(exit 1 if any). Reads of blocks the nodes evicted count as misses, not errors.");
  cmd->add_option("--node", flags->source.nodes, "An offload node as HOST:PORT; repeat for many");
  cmd->add_option("--etcd", flags->source.etcd, connector::kEtcdHelp);
  cmd->add_option("--cluster", flags->source.cluster, connector::kClusterHelp);
  cmd->add_option("--replicas", flags->source.replicas, connector::kReplicasHelp)
      ->capture_default_str();
  cmd->add_option("--clients", flags->clients, "Concurrent clients (1..1024)")
      ->capture_default_str();
  cmd->add_option("--seconds", flags->seconds, "How long each round loads the nodes")
      ->capture_default_str();
  cmd->add_option("--read-share", flags->read_share,
                  "Share of operations that read a block the client stored (0..1)")
      ->capture_default_str();
  cmd->add_option("--keys-per-client", flags->keys_per_client,
                  "Reads pick among each client's last this many stored blocks (every put stores "
                  "a new key; the nodes evict the oldest when full, and reads of evicted blocks "
                  "count as misses)")
      ->capture_default_str();
  cmd->add_option("--workers", flags->workers,
                  "UCX workers (each with its progress thread) the clients share, round-robin; "
                  "0: as a process's connectors run, one per core (at most 4, and at most "
                  "--clients); --clients: one per client")
      ->capture_default_str();
  cmd->add_option("--check-every", flags->check_every,
                  "Check every word of every this many'th block read (1: of every read; each "
                  "such check reads the whole block again, about half a copy's cost)")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  cmd->add_option("--batch", flags->batch,
                  "Blocks per operation: a put stores this many new blocks, a read reads this "
                  "many, all in flight at once (as an engine moves a step's blocks); latency is "
                  "per operation")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  cmd->add_option("--spin-us", flags->spin_us,
                  "How long each worker's progress thread polls before it sleeps (us)")
      ->check(CLI::Range(0, 100000))
      ->capture_default_str();
  cmd->add_option("--namespace", flags->key_namespace, "Key namespace")->capture_default_str();
  cmd->add_option("--token", flags->token, "The nodes' auth token");
  cmd->add_option("--tls", flags->tls, "UCX transports (as UCX_TLS)");
  AddRoundsFlag(*cmd, &flags->rounds, spec);
  AddOutputFlags(*cmd, &flags->output);
  cmd->footer(FiguresHelp(spec) +
              "GB/s is 1e9 bytes/s. --json also carries clients, seconds (of load, all rounds), "
              "block_bytes, batch, read_share, workers, and over all rounds puts and gets "
              "(blocks), get_misses (reads of blocks evicted since), errors and mismatches.\n"
              "Exits 0 on success, 1 on any error or content mismatch or when the nodes cannot "
              "be reached, 2 for bad arguments.");
  cmd->callback([flags, exit_code] { *exit_code = RunBenchNode(*flags); });
}

}  // namespace kvstash::bench
