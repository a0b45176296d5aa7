#pragma once

// The settings of `kvstashd`: command-line flags, and the same settings in a TOML file given
// with --config (flags win over the file). Kept apart from main so tests can check parsing and
// validation without starting a daemon.

#include <CLI/CLI.hpp>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kvstash/common/status.h"
#include "kvstash/membership/membership.h"
#include "kvstash/node/node_server.h"

namespace kvstash::node {

inline constexpr uint16_t kDefaultPort = 7373;

// The settings as written (sizes as text, "1GiB"), before validation.
struct DaemonFlags {
  std::string listen = "127.0.0.1";
  int port = kDefaultPort;
  std::string transport = "ucx";  // ucx or stream (transport/stream.h)
  std::string tls;                // UCX transports; empty: UCX_TLS or UCX's choice
  std::string kv_events;          // ZMQ endpoint of the KV events' PUB socket; empty: off
  std::string kv_events_replay;   // ZMQ endpoint of their replay ROUTER; empty: none
  std::string block_bytes = "256KiB";
  std::string cpu_bytes = "1GiB";
  std::string cpu_policy = "lru";
  std::string cpu_admission = "all";
  bool huge_pages = false;           // the CPU tier in transparent huge pages
  std::string shm_dir = "/dev/shm";  // where UCX's posix allocator writes (shm_directory.h)
  std::string ssd_dir;
  std::string ssd_bytes;
  std::string ssd_policy = "lru";
  std::string cascade = "write-through";
  bool ssd_sync = false;
  std::string auth_token;
  std::string auth_token_file;
  std::string namespace_token_file;
  int max_keys_per_request = 4096;
  std::string max_message_bytes = "4MiB";
  std::string max_payload_bytes = "64MiB";
  std::string max_batch_bytes = "1MiB";  // "0": no batched calls
  std::string log_level = "info";
  std::string metrics_address = "127.0.0.1:7374";  // "off": no metrics endpoint
  int lease_timeout_ms = 30000;
  int spin_us = 200;
  int progress_threads = 0;                  // 0: one per core, at most 4
  std::vector<std::string> namespace_quota;  // NAME=BYTES, one per namespace
  std::string default_namespace_quota;       // BYTES; empty: none (shared capacity)
  std::string etcd;                          // URL[,URL...]; empty: no membership
  std::string cluster;
  std::string advertise;  // HOST[:PORT] clients reach this node at
  std::string zone;       // failure domain published in etcd; empty: none
  int etcd_ttl_s = 10;
};

// Adds every flag (and --config) to `app`, bound to `flags`.
void AddDaemonFlags(CLI::App& app, DaemonFlags& flags);

// Reads settings from the text of a TOML config file into `flags` (those it does not name keep
// their values), with the reader --config FILE uses: CLI11 reads the file as a stream and hands
// its items to the same flags. For tests and the config's fuzz target. InvalidArgument with
// CLI11's message for text it cannot read, an unknown setting or a bad value.
Status ParseDaemonConfig(std::string_view toml, DaemonFlags* flags);

// The metrics endpoint's HOST:PORT, or "" when it is off; InvalidArgument for anything else.
Result<std::string> MetricsAddress(const DaemonFlags& flags);

// Validates the settings and turns them into the node's options. InvalidArgument names the
// setting and the value; a token file that cannot be read is NotFound/PermissionDenied.
Result<NodeOptions> ToNodeOptions(const DaemonFlags& flags);

// The etcd registration the settings ask for (nullopt without --etcd), for a node listening on
// `port` with `options`. InvalidArgument for --cluster or --advertise without --etcd, --etcd
// without --cluster, a bad endpoint, cluster name or TTL, and a node listening on every address
// (0.0.0.0, ::) without --advertise, since clients cannot connect to that.
Result<std::optional<membership::RegistrationOptions>> RegistrationOf(const DaemonFlags& flags,
                                                                      const NodeOptions& options,
                                                                      uint16_t port);

}  // namespace kvstash::node
