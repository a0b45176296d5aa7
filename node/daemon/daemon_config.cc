#include "daemon_config.h"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <fstream>
#include <map>
#include <sstream>

#include "kvstash/common/byte_units.h"
#include "kvstash/common/token_file.h"
#include "kvstash/transport/stream.h"

namespace kvstash::node {

void AddDaemonFlags(CLI::App& app, DaemonFlags& flags) {
  app.allow_config_extras(CLI::config_extras_mode::error);
  app.set_config("--config", "",
                 "TOML file with any of these settings as `name = value` (the long flag name "
                 "without dashes, e.g. cpu-bytes = \"8GiB\"); flags given on the command line win "
                 "over the file");
  app.add_option("--listen", flags.listen, "Address to listen on (TCP bootstrap of every client)")
      ->capture_default_str();
  app.add_option("--port", flags.port, "Port to listen on (0: any free port, printed at start)")
      ->capture_default_str();
  app.add_option("--transport", flags.transport,
                 "What carries the calls: ucx (UCX: shared memory with clients on this host, "
                 "TCP or InfiniBand across hosts, as --tls says) or stream (kvstash's own over "
                 "plain TCP, one socket per client; no memory shared, so the node maps its own "
                 "tier and faults it in before it listens). Over TCP, UCX 1.13 can abort a client "
                 "process when a node stalls or dies mid-transfer; stream never does")
      ->capture_default_str();
  app.add_option("--tls", flags.tls,
                 "UCX transports for block traffic, as UCX_TLS names them (shm, tcp, "
                 "shm,tcp...). Default: UCX_TLS, else UCX's own choice");
  app.add_option("--kv-events", flags.kv_events,
                 "Publish what the node stores and removes, in vLLM's KV events schema, on this "
                 "ZMQ endpoint (PUB; tcp://*:5557 binds, tcp://HOST:PORT connects to a "
                 "subscriber that binds): one topic per namespace, its name; media CPU and SSD "
                 "(docs/semantics.md §19). Default: off");
  app.add_option("--kv-events-replay", flags.kv_events_replay,
                 "With --kv-events: a ZMQ ROUTER endpoint (bound, e.g. tcp://*:5558) that "
                 "replays buffered event batches from a sequence number, as vLLM's publisher "
                 "does");
  app.add_option("--block-bytes", flags.block_bytes,
                 "Size of every block this node stores (clients learn it at hello); 4KiB..1GiB")
      ->capture_default_str();
  app.add_option("--cpu-bytes", flags.cpu_bytes,
                 "Memory for the CPU tier; it holds cpu-bytes / block-bytes blocks. Checked "
                 "before anything is allocated: more than MemAvailable, than shared memory can "
                 "hold (a System V segment, else --shm-dir's free space) or than RLIMIT_MEMLOCK "
                 "(where an InfiniBand device pins it) is refused with exit status 2")
      ->capture_default_str();
  app.add_option("--cpu-admission", flags.cpu_admission,
                 "What the CPU tier stores: all (every block offered), filter (a block on its "
                 "second lookup: fewer one-off blocks when the tier holds a small share of what "
                 "is reused, fewer hits when it holds much) or adaptive (the node switches the "
                 "filter on and off by itself, by which of two sampled shadow tiers hits more; "
                 "stats cpu.reuse_filter_on; docs/semantics.md §2a)")
      ->check(CLI::IsMember({"all", "filter", "adaptive"}))
      ->capture_default_str();
  app.add_option("--cpu-policy", flags.cpu_policy,
                 "Eviction policy of the CPU tier: lru, arc (vLLM's) or aflru (age over frequency, "
                 "docs/semantics.md §4a)")
      ->capture_default_str();
  app.add_flag("--huge-pages", flags.huge_pages,
               "Back the CPU tier with transparent huge pages (advisory), for fewer TLB misses "
               "once its memory is in. Off by default, 4 KiB pages whatever the system's "
               "default: a fresh huge page costs several times its 4 KiB pages to fault in where "
               "the kernel gets it back from a hypervisor, and a node faults its tier in while "
               "it serves (on a 2-core VM, a fresh node over TCP moved half as many bytes in its "
               "first seconds with it)");
  app.add_option("--shm-dir", flags.shm_dir,
                 "Directory (a tmpfs) where the CPU tier's shared memory is created when UCX "
                 "makes it a file (its posix allocator: where no System V segment can hold the "
                 "tier). The node works in a subdirectory kvstashd-UID/node-PID-* of its own, "
                 "locked while it lives; a node starting removes those of nodes that died. "
                 "--cpu-bytes must fit in its free space, or in a System V segment, and in "
                 "MemAvailable, or the node refuses to start")
      ->capture_default_str();
  app.add_option("--ssd-dir", flags.ssd_dir,
                 "Directory of the SSD tier (created if missing; its blocks survive restarts). "
                 "Default: no SSD tier");
  app.add_option("--ssd-bytes", flags.ssd_bytes,
                 "Capacity of the SSD tier (required with --ssd-dir)");
  app.add_option("--ssd-policy", flags.ssd_policy,
                 "Eviction policy of the SSD tier: lru, arc or aflru")
      ->capture_default_str();
  app.add_option("--cascade", flags.cascade,
                 "When a committed block reaches the SSD tier: write-through (at once) or "
                 "write-back (when the CPU tier evicts it, and at shutdown)")
      ->capture_default_str();
  app.add_flag("--ssd-sync", flags.ssd_sync,
               "fdatasync every SSD store before it commits (survives power loss, slower)");
  app.add_option("--auth-token", flags.auth_token,
                 "Token every client must present at hello (default: none required). Prefer "
                 "--auth-token-file: command lines are visible to other users");
  app.add_option("--auth-token-file", flags.auth_token_file,
                 "File whose first line is the auth token");
  app.add_option("--namespace-token-file", flags.namespace_token_file,
                 "File of per-namespace tokens, one `NAMESPACE TOKEN` per line (# comments). A "
                 "client of a listed namespace must present that namespace's token; a client of "
                 "any other namespace is refused unless --auth-token(-file) is set, and then "
                 "needs that token");
  app.add_option("--max-keys-per-request", flags.max_keys_per_request,
                 "Most keys one request may carry (1..1048576). Clients learn it at hello and "
                 "split longer batches into several calls: a lower limit costs round trips, "
                 "never hits")
      ->capture_default_str();
  app.add_option("--max-message-bytes", flags.max_message_bytes,
                 "Largest request message accepted (at least 4KiB); clients learn it at hello "
                 "and split their batches to fit")
      ->capture_default_str();
  app.add_option("--max-payload-bytes", flags.max_payload_bytes,
                 "Largest payload accepted in one request (at least block-bytes)")
      ->capture_default_str();
  app.add_option(
         "--max-batch-bytes", flags.max_batch_bytes,
         "Largest payload of one call of many small blocks (GetBlocks, PutBlocks), at "
         "most max-payload-bytes and 4MiB; clients send blocks of 64KiB or less many to a call, "
         "one round trip per node instead of one per block. The node keeps 16 times "
         "this in shared memory for them. 0: no such calls, one per block")
      ->capture_default_str();
  app.add_option("--metrics-address", flags.metrics_address,
                 "HOST:PORT of the HTTP endpoint with Prometheus metrics at /metrics and a "
                 "health check at /healthz (port 0: any free port, printed at start); off: none")
      ->capture_default_str();
  app.add_option("--lease-timeout-ms", flags.lease_timeout_ms,
                 "A client silent this long (no request) loses its pins and unfinished stores; "
                 "a client that disconnects or dies loses them at once")
      ->capture_default_str();
  app.add_option("--spin-us", flags.spin_us,
                 "How long the progress thread polls for traffic before it sleeps (0..100000 "
                 "us). Polling answers in microseconds but keeps a core busy while clients are "
                 "active; on a box whose cores the engines need, lower it")
      ->capture_default_str();
  app.add_option("--progress-threads", flags.progress_threads,
                 "Threads serving clients' connections, each with its own UCX worker "
                 "(1..64; 0: one per core, at most 4). A connection is served by one of them "
                 "from its hello on, so many clients are served in parallel; more threads than "
                 "cores only add switching")
      ->capture_default_str();
  app.add_option("--namespace-quota", flags.namespace_quota,
                 "NAME=BYTES (repeatable; in the config file a list, namespace-quota = "
                 "[\"tenant-a=256MiB\"]): the most CPU-tier memory the namespace NAME (the one "
                 "its clients name at hello) may hold, in whole blocks (rounded down), from one "
                 "block to cpu-bytes. A namespace at its quota makes room by evicting its own "
                 "least recently used idle blocks, never another namespace's; when all of its "
                 "blocks are pinned or being written its stores are refused (ResourceExhausted) "
                 "and counted (kvstash_quota_refusals_total). A quota is a ceiling, not a "
                 "reservation: namespaces under theirs, and those without one, share the rest of "
                 "the tier as usual. Quotas bound the CPU tier only; the SSD tier holds what the "
                 "CPU tier cascades to it")
      ->take_all();
  app.add_option("--default-namespace-quota", flags.default_namespace_quota,
                 "BYTES: the quota (as --namespace-quota) of every namespace not named there. "
                 "Default: none, every namespace shares the whole tier");
  app.add_option("--log-level", flags.log_level, "trace, debug, info, warn, error or off")
      ->capture_default_str();
  app.add_option("--etcd", flags.etcd,
                 "URL[,URL...] of the etcd cluster that keeps the membership (http://HOST:PORT; "
                 "plain HTTP, etcd's v3 JSON gateway). The node registers itself under "
                 "/kvstash/<cluster>/nodes/<advertise> with its address, block size, tiers and "
                 "policy, bound to a lease it keeps alive, and deletes the key at SIGTERM/SIGINT. "
                 "While etcd cannot be reached the node serves on and retries every second "
                 "(logged, and kvstash_etcd_registered reads 0). Default: no membership, clients "
                 "list the node themselves");
  app.add_option("--cluster", flags.cluster,
                 "Name of the cluster to join in etcd (letters, digits, '.', '_', '-'); required "
                 "with --etcd");
  app.add_option("--advertise", flags.advertise,
                 "HOST or HOST:PORT that clients connect to, as published in etcd. Default: the "
                 "--listen address and the port listened on; required when listening on every "
                 "address (0.0.0.0)");
  app.add_option("--zone", flags.zone,
                 "Failure domain of this node (a rack, a host, a power domain; letters, digits, "
                 "'.', '_', '-'), published in etcd with --etcd: clients keeping --replicas R > 1 "
                 "put a block's replicas in distinct zones while there are enough. Default: none");
  app.add_option("--etcd-ttl-s", flags.etcd_ttl_s,
                 "TTL of the node's etcd lease in seconds (2..3600), refreshed every third of "
                 "it: a node that dies leaves the membership this long after")
      ->capture_default_str();
}

Status ParseDaemonConfig(std::string_view toml, DaemonFlags* flags) {
  CLI::App app("kvstashd settings");
  AddDaemonFlags(app, *flags);
  std::istringstream in{std::string(toml)};
  try {
    app.parse_from_stream(in);
  } catch (const CLI::Error& e) {
    return InvalidArgumentError("config: {}", e.what());
  }
  return Status::OK();
}

Result<std::optional<membership::RegistrationOptions>> RegistrationOf(const DaemonFlags& flags,
                                                                      const NodeOptions& options,
                                                                      uint16_t port) {
  if (flags.etcd.empty()) {
    if (!flags.cluster.empty()) return InvalidArgumentError("cluster: given without --etcd");
    if (!flags.advertise.empty()) return InvalidArgumentError("advertise: given without --etcd");
    if (!flags.zone.empty()) return InvalidArgumentError("zone: given without --etcd");
    return std::optional<membership::RegistrationOptions>();
  }
  membership::RegistrationOptions registration;
  auto endpoints = membership::ParseEtcdEndpoints(flags.etcd);
  if (!endpoints.ok()) return InvalidArgumentError("etcd: {}", endpoints.status().message());
  registration.etcd.endpoints = std::move(*endpoints);
  if (flags.cluster.empty()) return InvalidArgumentError("cluster: required with --etcd");
  if (Status s = membership::ValidateClusterName(flags.cluster); !s.ok()) {
    return InvalidArgumentError("cluster: {}", s.message());
  }
  registration.cluster = flags.cluster;
  if (flags.etcd_ttl_s < 2 || flags.etcd_ttl_s > 3600) {
    return InvalidArgumentError("etcd-ttl-s: {} is not within 2..3600", flags.etcd_ttl_s);
  }
  registration.ttl_s = flags.etcd_ttl_s;
  Result<std::string> address =
      membership::AdvertisedAddress(flags.advertise, options.server.bind_address, port);
  if (!address.ok()) {
    if (flags.advertise.empty()) {
      return InvalidArgumentError(
          "advertise: required with --etcd when listening on every address ({}): give the "
          "address clients reach this node at",
          options.server.bind_address.empty() ? std::string("any") : options.server.bind_address);
    }
    return InvalidArgumentError("advertise: {}", address.status().message());
  }
  registration.record.address = *address;
  registration.record.block_bytes = options.store.block_bytes;
  registration.record.cpu_bytes = options.store.block_bytes * options.store.cpu_capacity_blocks;
  registration.record.ssd_bytes = options.store.ssd ? options.store.ssd->capacity_bytes : 0;
  registration.record.policy = flags.cpu_policy;
  if (!flags.zone.empty()) {
    if (Status valid = membership::ValidateClusterName(flags.zone); !valid.ok()) {
      return InvalidArgumentError("zone: {}", valid.message());
    }
  }
  registration.record.zone = flags.zone;
  return std::optional<membership::RegistrationOptions>(std::move(registration));
}

namespace {

Result<store::EvictionPolicy> Policy(std::string_view setting, const std::string& name) {
  auto policy = store::ParseEvictionPolicy(name);
  if (!policy.ok()) {
    return InvalidArgumentError("{}: '{}' is not lru, arc or aflru", setting, name);
  }
  return *policy;
}

// `NAMESPACE TOKEN` lines; blank lines and # comments skipped. Errors name the file and line,
// never a token.
Result<std::map<std::string, std::string>> ReadNamespaceTokens(const std::string& path) {
  std::ifstream in(path);
  if (!in) {
    const int e = errno;
    return Status(
        e == EACCES ? StatusCode::kPermissionDenied : StatusCode::kNotFound,
        fmt::format("namespace-token-file: cannot read '{}': {}", path, std::strerror(e)));
  }
  std::map<std::string, std::string> tokens;
  std::string line;
  for (int number = 1; std::getline(in, line); ++number) {
    while (!line.empty() && (line.back() == '\r' || line.back() == ' ' || line.back() == '\t')) {
      line.pop_back();
    }
    const size_t start = line.find_first_not_of(" \t");
    if (start == std::string::npos || line[start] == '#') continue;
    std::istringstream fields(line.substr(start));
    std::string ns, token, extra;
    if (!(fields >> ns >> token) || (fields >> extra)) {
      return InvalidArgumentError("namespace-token-file: '{}' line {} is not `NAMESPACE TOKEN`",
                                  path, number);
    }
    if (!tokens.emplace(ns, token).second) {
      return InvalidArgumentError("namespace-token-file: '{}' line {} names namespace '{}' again",
                                  path, number, ns);
    }
  }
  if (tokens.empty()) {
    return InvalidArgumentError("namespace-token-file: '{}' lists no namespace", path);
  }
  return tokens;
}

// A quota of `text` bytes in whole blocks: at least one block, at most the CPU tier. `what`
// names the setting in errors.
Result<size_t> QuotaBlocks(std::string_view what, std::string_view text, uint64_t block,
                           size_t cpu_blocks) {
  KVSTASH_ASSIGN_OR_RETURN(const uint64_t bytes, ParseBytes(what, text));
  if (bytes < block) {
    return InvalidArgumentError("{}: {} is below one block of {}", what, FormatBytes(bytes),
                                FormatBytes(block));
  }
  if (bytes > block * cpu_blocks) {
    return InvalidArgumentError("{}: {} is above the CPU tier's {}", what, FormatBytes(bytes),
                                FormatBytes(block * cpu_blocks));
  }
  return static_cast<size_t>(bytes / block);
}

// --namespace-quota NAME=BYTES entries and --default-namespace-quota into `options`.
Status NamespaceQuotas(const DaemonFlags& flags, uint64_t block, NodeOptions* options) {
  const size_t cpu_blocks = options->store.cpu_capacity_blocks;
  for (const std::string& entry : flags.namespace_quota) {
    // The size has no '=', the name may.
    const size_t eq = entry.rfind('=');
    if (eq == std::string::npos || eq == 0 || eq + 1 == entry.size()) {
      return InvalidArgumentError("namespace-quota: '{}' is not NAME=BYTES", entry);
    }
    const std::string name = entry.substr(0, eq);
    if (name == kOtherNamespaces) {
      return InvalidArgumentError(
          "namespace-quota: '{}': the name '{}' is reserved (the metrics sum namespaces past "
          "the first {} under it)",
          entry, name, kMaxNamedNamespaces);
    }
    KVSTASH_ASSIGN_OR_RETURN(
        const size_t blocks,
        QuotaBlocks(fmt::format("namespace-quota: '{}'", name),
                    std::string_view(entry).substr(eq + 1), block, cpu_blocks));
    if (!options->namespace_quota_blocks.emplace(name, blocks).second) {
      return InvalidArgumentError("namespace-quota: namespace '{}' is given twice", name);
    }
  }
  if (!flags.default_namespace_quota.empty()) {
    KVSTASH_ASSIGN_OR_RETURN(
        options->default_namespace_quota_blocks,
        QuotaBlocks("default-namespace-quota", flags.default_namespace_quota, block, cpu_blocks));
  }
  return Status::OK();
}

}  // namespace

Result<std::string> MetricsAddress(const DaemonFlags& flags) {
  if (flags.metrics_address == "off") return std::string();
  const size_t colon = flags.metrics_address.rfind(':');
  unsigned port = 0;
  const std::string_view text(flags.metrics_address);
  const std::string_view digits = colon == std::string::npos ? "" : text.substr(colon + 1);
  auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), port);
  if (colon == std::string::npos || colon == 0 || digits.empty() || ec != std::errc() ||
      end != digits.data() + digits.size() || port > 65535) {
    return InvalidArgumentError("metrics-address: '{}' is not HOST:PORT or off",
                                flags.metrics_address);
  }
  return flags.metrics_address;
}

Result<NodeOptions> ToNodeOptions(const DaemonFlags& flags) {
  KVSTASH_RETURN_IF_ERROR(MetricsAddress(flags).status());
  NodeOptions options;
  if (flags.port < 0 || flags.port > 65535) {
    return InvalidArgumentError("port: {} is outside 0..65535", flags.port);
  }
  options.server.bind_address = flags.listen;
  options.server.port = static_cast<uint16_t>(flags.port);
  options.server.transport.tls = flags.tls;
  if (flags.transport == "stream") {
    if (!flags.tls.empty()) {
      return InvalidArgumentError("tls: '{}' names UCX transports, and transport is stream",
                                  flags.tls);
    }
    options.listen =
        [](const transport::ServerOptions& server) -> Result<std::unique_ptr<transport::Listener>> {
      KVSTASH_ASSIGN_OR_RETURN(std::unique_ptr<transport::StreamServer> stream,
                               transport::StreamServer::Create(server));
      return std::unique_ptr<transport::Listener>(std::move(stream));
    };
  } else if (flags.transport != "ucx") {
    return InvalidArgumentError("transport: '{}' is not ucx or stream", flags.transport);
  }
  if (!flags.kv_events_replay.empty() && flags.kv_events.empty()) {
    return InvalidArgumentError("kv-events-replay: '{}' needs --kv-events", flags.kv_events_replay);
  }
  options.kv_events.publisher.endpoint = flags.kv_events;
  options.kv_events.publisher.replay_endpoint = flags.kv_events_replay;
  KVSTASH_ASSIGN_OR_RETURN(const uint64_t block, ParseBytes("block-bytes", flags.block_bytes));
  if (block < 4096 || block > (uint64_t{1} << 30)) {
    return InvalidArgumentError("block-bytes: {} is outside 4KiB..1GiB", FormatBytes(block));
  }
  KVSTASH_ASSIGN_OR_RETURN(const uint64_t cpu, ParseBytes("cpu-bytes", flags.cpu_bytes));
  if (cpu < block) {
    return InvalidArgumentError("cpu-bytes: {} holds no block of {}", FormatBytes(cpu),
                                FormatBytes(block));
  }
  options.store.block_bytes = block;
  options.store.cpu_capacity_blocks = cpu / block;
  KVSTASH_ASSIGN_OR_RETURN(options.store.cpu_policy, Policy("cpu-policy", flags.cpu_policy));
  KVSTASH_ASSIGN_OR_RETURN(options.store.cpu_admission, store::ParseAdmission(flags.cpu_admission));
  options.store.huge_pages = flags.huge_pages;
  KVSTASH_RETURN_IF_ERROR(NamespaceQuotas(flags, block, &options));
  auto cascade = store::ParseCascadeMode(flags.cascade);
  if (!cascade.ok()) {
    return InvalidArgumentError("cascade: '{}' is not write-through or write-back", flags.cascade);
  }
  options.store.cascade = *cascade;
  if (!flags.ssd_dir.empty()) {
    if (flags.ssd_bytes.empty()) return InvalidArgumentError("ssd-bytes: required with ssd-dir");
    store::SsdTierOptions ssd;
    ssd.dir = flags.ssd_dir;
    KVSTASH_ASSIGN_OR_RETURN(ssd.capacity_bytes, ParseBytes("ssd-bytes", flags.ssd_bytes));
    if (ssd.capacity_bytes < block) {
      return InvalidArgumentError("ssd-bytes: {} holds no block of {}",
                                  FormatBytes(ssd.capacity_bytes), FormatBytes(block));
    }
    KVSTASH_ASSIGN_OR_RETURN(ssd.policy, Policy("ssd-policy", flags.ssd_policy));
    ssd.sync = flags.ssd_sync;
    options.store.ssd = ssd;
  } else if (!flags.ssd_bytes.empty()) {
    return InvalidArgumentError("ssd-bytes: given without ssd-dir");
  }
  KVSTASH_ASSIGN_OR_RETURN(
      options.server.auth_token,
      ResolveToken(flags.auth_token, "auth-token", flags.auth_token_file, "auth-token-file"));
  if (!flags.namespace_token_file.empty()) {
    KVSTASH_ASSIGN_OR_RETURN(options.server.tenant_tokens,
                             ReadNamespaceTokens(flags.namespace_token_file));
  }
  if (flags.max_keys_per_request < 1 || flags.max_keys_per_request > (1 << 20)) {
    return InvalidArgumentError("max-keys-per-request: {} is outside 1..1048576",
                                flags.max_keys_per_request);
  }
  options.max_keys_per_request = static_cast<uint32_t>(flags.max_keys_per_request);
  if (flags.lease_timeout_ms < 10) {
    return InvalidArgumentError("lease-timeout-ms: {} is below 10", flags.lease_timeout_ms);
  }
  options.lease_timeout = std::chrono::milliseconds(flags.lease_timeout_ms);
  if (flags.spin_us < 0 || flags.spin_us > 100000) {
    return InvalidArgumentError("spin-us: {} is outside 0..100000", flags.spin_us);
  }
  options.server.transport.spin_before_sleep = std::chrono::microseconds(flags.spin_us);
  if (flags.progress_threads < 0 ||
      flags.progress_threads > static_cast<int>(transport::kMaxProgressThreads)) {
    return InvalidArgumentError("progress-threads: {} is outside 0..{}", flags.progress_threads,
                                transport::kMaxProgressThreads);
  }
  options.server.transport.progress_threads = static_cast<size_t>(flags.progress_threads);
  KVSTASH_ASSIGN_OR_RETURN(options.server.transport.max_message_bytes,
                           ParseBytes("max-message-bytes", flags.max_message_bytes));
  KVSTASH_ASSIGN_OR_RETURN(options.server.transport.max_payload_bytes,
                           ParseBytes("max-payload-bytes", flags.max_payload_bytes));
  if (options.server.transport.max_payload_bytes < block) {
    return InvalidArgumentError("max-payload-bytes: {} is below block-bytes {}",
                                FormatBytes(options.server.transport.max_payload_bytes),
                                FormatBytes(block));
  }
  KVSTASH_ASSIGN_OR_RETURN(options.max_batch_bytes,
                           ParseBytes("max-batch-bytes", flags.max_batch_bytes));
  if (options.max_batch_bytes >
      std::min<uint64_t>(options.server.transport.max_payload_bytes, kMaxBatchBytes)) {
    return InvalidArgumentError("max-batch-bytes: {} is outside 0..{} (and max-payload-bytes)",
                                FormatBytes(options.max_batch_bytes), FormatBytes(kMaxBatchBytes));
  }
  if (options.server.transport.max_message_bytes < 4096) {
    return InvalidArgumentError("max-message-bytes: {} is below 4KiB",
                                FormatBytes(options.server.transport.max_message_bytes));
  }
  return options;
}

}  // namespace kvstash::node
