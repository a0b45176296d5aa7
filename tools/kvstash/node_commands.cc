// `kvstash put|get|lookup|touch|stats --node HOST:PORT ...`: talk to offload nodes by hand.

#include <fmt/format.h>

#include <fstream>
#include <iostream>
#include <iterator>

#include "commands.h"
#include "kvstash/common/cli.h"
#include "kvstash/common/hash.h"
#include "kvstash/common/token_file.h"
#include "kvstash/connector/node_client.h"
#include "nlohmann/json.hpp"

namespace kvstash::cli {
namespace {
using connector::NodeClient;

struct NodeFlags {
  connector::NodeSource source;
  std::string key_namespace = "default";
  std::string token;
  std::string token_file;
  std::string tls;
  int timeout_ms = 5000;
  std::vector<std::string> keys;
  std::string file;  // put: the block; get: where to write it
  bool prefix = false;
  bool json = false;
};

// The errors of `kvstash COMMAND`.
cli::ErrorReporter Errors(std::string_view command) {
  return cli::ErrorReporter(fmt::format("kvstash {}", command));
}

void AddConnectionFlags(CLI::App* cmd, NodeFlags& flags, bool keys) {
  cmd->add_option("--node", flags.source.nodes,
                  "An offload node as HOST:PORT; repeat for many nodes (each key goes to one, by "
                  "rendezvous hashing, as every kvstash client places it)");
  cmd->add_option("--etcd", flags.source.etcd, connector::kEtcdHelp);
  cmd->add_option("--cluster", flags.source.cluster, connector::kClusterHelp);
  cmd->add_option("--replicas", flags.source.replicas, connector::kReplicasHelp)
      ->capture_default_str();
  cmd->add_option("--namespace", flags.key_namespace, "Key namespace of the blocks")
      ->capture_default_str();
  cmd->add_option("--token", flags.token, "The nodes' auth token");
  cmd->add_option("--token-file", flags.token_file, "File whose first line is the auth token");
  cmd->add_option("--tls", flags.tls, "UCX transports (as UCX_TLS); default: UCX's choice");
  cmd->add_option("--timeout-ms", flags.timeout_ms, "Deadline of each call to a node")
      ->capture_default_str();
  if (keys) {
    cmd->add_option("--key", flags.keys,
                    "Block key: a hash in hex (0x2a, up to 32 digits) or decimal, optionally "
                    "/gGROUP (0x2a/g1)")
        ->required();
  }
}

Result<std::unique_ptr<NodeClient>> Connect(const NodeFlags& flags) {
  connector::NodeClientOptions options;
  KVSTASH_RETURN_IF_ERROR(connector::ApplyNodeSource(flags.source, &options));
  KVSTASH_ASSIGN_OR_RETURN(options.auth_token,
                           ResolveToken(flags.token, "--token", flags.token_file, "--token-file"));
  if (flags.timeout_ms < 1) {
    return InvalidArgumentError("--timeout-ms: {} is not a positive count", flags.timeout_ms);
  }
  options.key_namespace = flags.key_namespace;
  options.transport.tls = flags.tls;
  options.timeout = std::chrono::milliseconds(flags.timeout_ms);
  options.connect_timeout = std::min(options.timeout, std::chrono::milliseconds(2000));
  // A person asking waits for the answer: a lookup's budget is the whole deadline here.
  options.lookup_budget = options.timeout;
  return NodeClient::Create(options);
}

// The nodes of `key`, best-ranked first, as "HOST:PORT,HOST:PORT".
std::string PlacesOf(const NodeClient& client, const BlockKey& key) {
  std::string out;
  for (const connector::NodeAddress& node : client.PlacesOf(key)) {
    out += (out.empty() ? "" : ",") + node.ToString();
  }
  return out.empty() ? "no live node" : out;
}

// The best-ranked node of `key`; Unavailable when no node is live.
Result<connector::NodeAddress> HomeOf(const NodeClient& client, const BlockKey& key) {
  const std::vector<connector::NodeAddress> places = client.PlacesOf(key);
  if (places.empty()) return UnavailableError("no live offload node");
  return places.front();
}

Result<std::vector<BlockKey>> Keys(const NodeFlags& flags) {
  std::vector<BlockKey> keys;
  for (const std::string& text : flags.keys) {
    KVSTASH_ASSIGN_OR_RETURN(auto key, ParseBlockKey(text));
    keys.push_back(key);
  }
  return keys;
}

int RunPut(const NodeFlags& flags) {
  auto keys = Keys(flags);
  if (!keys.ok()) return Errors("put").Fail(kExitUsage, keys.status().message());
  if (keys->size() != 1) {
    return Errors("put").Fail(kExitUsage, "--key: give exactly one key to put");
  }
  std::ifstream in(flags.file, std::ios::binary);
  if (!in) {
    return Errors("put").Fail(kExitFailure, fmt::format("--file: cannot read '{}'", flags.file));
  }
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto client = Connect(flags);
  if (!client.ok()) {
    return Errors("put").Fail(cli::ExitCodeFor(client.status()), client.status().message());
  }
  const Result<connector::NodeAddress> home = HomeOf(**client, keys->front());
  if (!home.ok()) return Errors("put").Fail(kExitFailure, home.status().message());
  const connector::NodeAddress& node = *home;
  auto block_bytes = (*client)->BlockBytes(node);
  if (!block_bytes.ok()) return Errors("put").Fail(kExitFailure, block_bytes.status().message());
  if (bytes.size() != *block_bytes) {
    return Errors("put").Fail(
        kExitUsage, fmt::format("--file: '{}' holds {} bytes; node {} stores blocks of exactly {}",
                                flags.file, bytes.size(), node.ToString(), *block_bytes));
  }
  const transport::Bytes block = std::as_bytes(std::span(bytes));
  const Status put = (*client)->Put(*keys, std::span(&block, 1));
  if (!put.ok()) return Errors("put").Fail(kExitFailure, put.message());
  std::cout << fmt::format("stored {} ({} bytes, xxh3 {:#018x}) on {}\n", keys->front().ToString(),
                           bytes.size(), Xxh3Hash64(block), PlacesOf(**client, keys->front()));
  return kExitOk;
}

int RunGet(const NodeFlags& flags) {
  auto keys = Keys(flags);
  if (!keys.ok()) return Errors("get").Fail(kExitUsage, keys.status().message());
  if (keys->size() != 1) {
    return Errors("get").Fail(kExitUsage, "--key: give exactly one key to get");
  }
  auto client = Connect(flags);
  if (!client.ok()) {
    return Errors("get").Fail(cli::ExitCodeFor(client.status()), client.status().message());
  }
  const Result<connector::NodeAddress> home = HomeOf(**client, keys->front());
  if (!home.ok()) return Errors("get").Fail(kExitFailure, home.status().message());
  const connector::NodeAddress& node = *home;
  auto block_bytes = (*client)->BlockBytes(node);
  if (!block_bytes.ok()) return Errors("get").Fail(kExitFailure, block_bytes.status().message());
  std::vector<std::byte> block(*block_bytes);
  auto got = (*client)->Get(keys->front(), block);
  if (!got.ok()) return Errors("get").Fail(kExitFailure, got.status().message());
  block.resize(*got);
  if (!flags.file.empty()) {
    std::ofstream out(flags.file, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(block.data()), static_cast<std::streamsize>(*got));
    if (!out) {
      return Errors("get").Fail(kExitFailure, fmt::format("--out: cannot write '{}'", flags.file));
    }
  }
  std::cout << fmt::format("{}: {} bytes, xxh3 {:#018x}, from {}{}\n", keys->front().ToString(),
                           *got, Xxh3Hash64(block), node.ToString(),
                           flags.file.empty() ? "" : ", written to " + flags.file);
  return kExitOk;
}

std::string_view StateName(LookupResult s) {
  switch (s) {
    case LookupResult::kHit:
      return "hit";
    case LookupResult::kRetry:
      return "retry";
    case LookupResult::kMiss:
      break;
  }
  return "miss";
}

int RunLookup(const NodeFlags& flags) {
  auto keys = Keys(flags);
  if (!keys.ok()) return Errors("lookup").Fail(kExitUsage, keys.status().message());
  auto client = Connect(flags);
  if (!client.ok()) {
    return Errors("lookup").Fail(cli::ExitCodeFor(client.status()), client.status().message());
  }
  // A refusal (over a limit, a wrong token) is an error, never a column of misses.
  auto looked_up = (*client)->LookupStrict(*keys);
  if (!looked_up.ok()) return Errors("lookup").Fail(kExitFailure, looked_up.status().message());
  const std::vector<LookupResult>& states = *looked_up;
  // The scan the connector uses (docs/semantics.md §7.4); nullopt: a RETRY decides it.
  const ScanResult prefix = MaximalPrefix(states.size(), [&states](size_t i) { return states[i]; });
  if (flags.json) {
    nlohmann::json doc = {{"keys", nlohmann::json::array()}};
    for (size_t i = 0; i < keys->size(); ++i) {
      doc["keys"].push_back({{"key", (*keys)[i].ToString()},
                             {"state", StateName(states[i])},
                             {"node", PlacesOf(**client, (*keys)[i])}});
    }
    if (flags.prefix) doc["prefix"] = prefix.has_value() ? nlohmann::json(*prefix) : nullptr;
    doc["unreachable"] = (*client)->unreachable();
    std::cout << doc.dump() << "\n";
  } else {
    for (size_t i = 0; i < keys->size(); ++i) {
      std::cout << fmt::format("{} {} ({})\n", (*keys)[i].ToString(), StateName(states[i]),
                               PlacesOf(**client, (*keys)[i]));
    }
    if (flags.prefix) {
      std::cout << (prefix.has_value()
                        ? fmt::format("prefix {} of {} keys\n", *prefix, keys->size())
                        : std::string("prefix: retry (blocks being written or promoted)\n"));
    }
  }
  if ((*client)->unreachable() != 0) {
    std::cerr << "kvstash lookup: warning: some nodes could not be reached; their keys show as "
                 "miss\n";
  }
  return kExitOk;
}

int RunTouch(const NodeFlags& flags) {
  auto keys = Keys(flags);
  if (!keys.ok()) return Errors("touch").Fail(kExitUsage, keys.status().message());
  auto client = Connect(flags);
  if (!client.ok()) {
    return Errors("touch").Fail(cli::ExitCodeFor(client.status()), client.status().message());
  }
  if (const Status touched = (*client)->TouchSync(*keys); !touched.ok()) {
    return Errors("touch").Fail(kExitFailure, touched.message());
  }
  std::cout << fmt::format("touched {} key(s), the first most recent\n", keys->size());
  return kExitOk;
}

int RunStats(const NodeFlags& flags) {
  auto client = Connect(flags);
  if (!client.ok()) {
    return Errors("stats").Fail(cli::ExitCodeFor(client.status()), client.status().message());
  }
  nlohmann::json doc = nlohmann::json::object();
  int code = kExitOk;
  for (const connector::NodeAddress& node : (*client)->nodes()) {
    const std::string name = node.ToString();
    auto counters = (*client)->Stats(node);
    if (!counters.ok()) {
      code = Errors("stats").Fail(kExitFailure, counters.status().message());
      continue;
    }
    if (flags.json) {
      doc[name] = *counters;
    } else {
      std::cout << name << "\n";
      for (const auto& [counter, value] : *counters) {
        std::cout << fmt::format("  {:<32} {}\n", counter, value);
      }
    }
  }
  if (flags.json) std::cout << doc.dump() << "\n";
  return code;
}

}  // namespace

void AddNodeCommands(CLI::App& app, int* exit_code) {
  auto flags = std::make_shared<NodeFlags>();

  CLI::App* put = app.add_subcommand("put",
                                     "Store one block (a file of exactly the node's "
                                     "block size) under a key");
  AddConnectionFlags(put, *flags, true);
  put->add_option("--file", flags->file, "The block's bytes")->required();
  put->callback([flags, exit_code] { *exit_code = RunPut(*flags); });

  CLI::App* get = app.add_subcommand(
      "get", "Read one block: prints its size and xxh3 checksum, and writes it to --out");
  AddConnectionFlags(get, *flags, true);
  get->add_option("--out", flags->file, "File to write the block to");
  get->callback([flags, exit_code] { *exit_code = RunGet(*flags); });

  CLI::App* lookup = app.add_subcommand(
      "lookup",
      "Look keys up (hit, miss, or retry while a block is being written or promoted "
      "from SSD); a node that cannot be reached answers miss, with a warning; a node that "
      "refuses the lookup (too many keys, a wrong token) is an error (exit 1)");
  AddConnectionFlags(lookup, *flags, true);
  lookup->add_flag("--prefix", flags->prefix,
                   "Also print how many leading keys are hits (the maximal prefix)");
  lookup->add_flag("--json", flags->json, "One JSON object on stdout");
  lookup->callback([flags, exit_code] { *exit_code = RunLookup(*flags); });

  CLI::App* touch = app.add_subcommand(
      "touch",
      "Mark blocks used, the first key most recent (LRU moves them to the most recent end, "
      "ARC to its frequent list); keys a node does not hold are ignored");
  AddConnectionFlags(touch, *flags, true);
  touch->callback([flags, exit_code] { *exit_code = RunTouch(*flags); });

  CLI::App* stats = app.add_subcommand("stats", "Print each node's counters");
  AddConnectionFlags(stats, *flags, false);
  stats->add_flag("--json", flags->json, "One JSON object on stdout, by node");
  stats->callback([flags, exit_code] { *exit_code = RunStats(*flags); });
}

}  // namespace kvstash::cli
