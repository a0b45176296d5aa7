#pragma once

// What the kvstash-engine subcommands share: the model and offload flags, building an engine
// from them, token-id text, and exit codes.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "kvstash/common/cli.h"
#include "kvstash/common/status.h"
#include "kvstash/engine/engine.h"

namespace kvstash::engine::cli {

using ::kvstash::cli::kExitFailure;
using ::kvstash::cli::kExitOk;
using ::kvstash::cli::kExitUsage;
// The errors of kvstash-engine: "kvstash-engine: message" on stderr, exit 2 for bad input.
inline const ::kvstash::cli::ErrorReporter kErrors("kvstash-engine");

struct ModelFlags {
  std::string model = "builtin:tiny-hybrid";
  std::string weights;
  uint64_t seed = 0;
  bool seed_set = false;
  uint32_t block_size = 0;
  uint32_t attn_pack = 1;
  size_t num_blocks = 4096;
  size_t max_batched_tokens = 256;
  size_t max_num_seqs = 16;
  bool no_prefix_cache = false;
  bool swa_ring = false;
  std::string device = "cpu";
  std::string nodes;  // HOST:PORT[,HOST:PORT...]
  std::string etcd;   // or a cluster's live nodes in etcd
  std::string cluster;
  size_t replicas = 1;
  std::string key_namespace = "kvstash-engine";
  std::string auth_token_file;
  uint32_t node_timeout_ms = 2000;
  uint32_t lookup_budget_ms = 50;
};

void AddModelFlags(CLI::App* app, ModelFlags& f);
// Whether the flags name offload nodes (--nodes, or --etcd with --cluster).
inline bool HasNodes(const ModelFlags& f) { return !f.nodes.empty() || !f.etcd.empty(); }
// The engine the flags describe; with --nodes (or --etcd), over those offload nodes.
// `record_cache_events`: the engine records its prefix cache's events (a worker publishing
// them drains them).
Result<std::unique_ptr<Engine>> MakeEngine(const ModelFlags& f, bool record_cache_events = false);
// "1 2 3" -> {1, 2, 3}; InvalidArgument naming the first word that is not a token id.
Result<std::vector<uint32_t>> ParseTokens(const std::string& text);
std::string Join(std::span<const uint32_t> tokens);
// Pseudo-random token ids, the same for the same seed.
std::vector<uint32_t> RandomTokens(size_t n, uint32_t vocab, uint64_t seed);

}  // namespace kvstash::engine::cli
