#include "cli_common.h"

#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>

#include "kvstash/common/hash.h"
#include "kvstash/common/token_file.h"
#include "kvstash/engine/node_offload.h"

namespace kvstash::engine::cli {

void AddModelFlags(CLI::App* app, ModelFlags& f) {
  app->add_option("--model", f.model,
                  "builtin:NAME (tiny-full, tiny-swa, tiny-hybrid, tiny-state-hybrid) or a JSON "
                  "model config file")
      ->capture_default_str();
  app->add_option("--weights", f.weights,
                  "safetensors file with the weights (default: deterministic from the seed)");
  app->add_option("--seed", f.seed, "weights seed (default: the config's)")
      ->each([&f](const std::string&) { f.seed_set = true; });
  app->add_option("--block-size", f.block_size,
                  "tokens per page of one attention layer (default: a state's page for state "
                  "models, else 16)");
  app->add_option("--attn-pack", f.attn_pack,
                  "full-attention layers sharing one page; divides their block size (and the "
                  "prefix-cache granularity) by N")
      ->capture_default_str()
      ->check(CLI::Range(1u, 64u));
  app->add_option("--num-blocks", f.num_blocks, "pages in the KV-cache pool (block 0 is null)")
      ->capture_default_str()
      ->check(CLI::Range(size_t{2}, size_t{1} << 24));
  app->add_option("--max-batched-tokens", f.max_batched_tokens,
                  "token budget of one step: longer prompts prefill in chunks of this size")
      ->capture_default_str()
      ->check(CLI::Range(size_t{1}, size_t{1} << 20));
  app->add_option("--max-num-seqs", f.max_num_seqs, "requests running at once at most")
      ->capture_default_str()
      ->check(CLI::Range(size_t{1}, size_t{4096}));
  app->add_flag("--no-prefix-cache", f.no_prefix_cache, "turn prefix caching off");
  app->add_flag("--swa-ring", f.swa_ring,
                "keep each sliding-window layer's KV of a request in place, in a ring of its "
                "window's tokens outside the KV-cache pool (as some accelerators require); the "
                "pool then holds only the blocks the prefix cache keeps, copied in the usual "
                "layout, so prefix-cache hits still work");
  app->add_option("--device", f.device,
                  "where the model runs: cpu, cuda (the first visible GPU; the KV-cache pool in "
                  "GPU memory, blocks to and from offload nodes through a pinned host mirror on "
                  "a copy stream of their own), or cpu-staged (the CPU, with the pool kept apart "
                  "from the host pages offload moves, as on a GPU: for testing that path)")
      ->capture_default_str()
      ->check(CLI::IsMember({"cpu", "cuda", "cpu-staged"}));
  app->add_option("--nodes", f.nodes,
                  "offload nodes (kvstashd) to share KV through, HOST:PORT[,HOST:PORT...]: "
                  "prompts load what the nodes hold and push the full blocks they compute. Each "
                  "node's --block-bytes must be the engine's page plus a 56-byte trailer (4152 "
                  "for the built-ins); a wrong size is named at start");
  app->add_option("--etcd", f.etcd, connector::kEtcdHelp);
  app->add_option("--cluster", f.cluster, connector::kClusterHelp);
  app->add_option("--replicas", f.replicas, connector::kReplicasHelp)->capture_default_str();
  app->add_option("--namespace", f.key_namespace, "key namespace on the nodes")
      ->capture_default_str();
  app->add_option("--auth-token-file", f.auth_token_file,
                  "file whose first line is the nodes' auth token");
  app->add_option("--node-timeout-ms", f.node_timeout_ms,
                  "deadline of every node call; a node slower than this is a miss and the "
                  "tokens it held are recomputed")
      ->capture_default_str()
      ->check(CLI::Range(1u, 600000u));
  app->add_option("--lookup-budget-ms", f.lookup_budget_ms,
                  "how long a lookup waits for the nodes: keys of a node that has not answered "
                  "by then (stopped, cut off, slow) are misses and their tokens are computed; a "
                  "node that keeps not answering is skipped until it answers a probe")
      ->capture_default_str()
      ->check(CLI::Range(1u, 600000u));
}

Result<std::unique_ptr<Engine>> MakeEngine(const ModelFlags& f, bool record_cache_events) {
  Result<ModelConfig> loaded = ModelConfig::Load(f.model);
  // A --model that names no model is a bad argument (exit 2), whatever the loader calls it.
  if (!loaded.ok()) return InvalidArgumentError("--model: {}", loaded.status().message());
  ModelConfig config = std::move(loaded).value();
  EngineOptions o;
  o.block_size = f.block_size;
  o.attn_pack = f.attn_pack;
  o.num_blocks = f.num_blocks;
  o.prefix_caching = !f.no_prefix_cache;
  o.swa_ring = f.swa_ring;
  o.record_cache_events = record_cache_events;
  o.device = f.device;
  o.scheduler.max_num_batched_tokens = f.max_batched_tokens;
  o.scheduler.max_num_seqs = f.max_num_seqs;
  if (f.seed_set) o.seed = f.seed;
  o.weights_path = f.weights;
  if (HasNodes(f) || !f.cluster.empty()) {
    connector::NodeClientOptions nodes;
    connector::NodeSource source;
    if (!f.nodes.empty()) source.nodes = {f.nodes};
    source.etcd = f.etcd;
    source.cluster = f.cluster;
    source.replicas = f.replicas;
    if (Status s = connector::ApplyNodeSource(source, &nodes); !s.ok()) {
      return InvalidArgumentError("{}", s.message());
    }
    nodes.key_namespace = f.key_namespace;
    nodes.timeout = std::chrono::milliseconds(f.node_timeout_ms);
    nodes.connect_timeout = std::chrono::milliseconds(f.node_timeout_ms);
    nodes.lookup_budget = std::chrono::milliseconds(f.lookup_budget_ms);
    if (!f.auth_token_file.empty()) {
      KVSTASH_ASSIGN_OR_RETURN(nodes.auth_token,
                               ReadTokenFile(f.auth_token_file, "--auth-token-file"));
    }
    o.offload = NodeOffload(std::move(nodes));
  }
  return Engine::Create(std::move(config), o);
}

Result<std::vector<uint32_t>> ParseTokens(const std::string& text) {
  std::vector<uint32_t> tokens;
  std::istringstream in(text);
  std::string word;
  while (in >> word) {
    char* end = nullptr;
    errno = 0;
    const unsigned long long v = std::strtoull(word.c_str(), &end, 10);
    if (word[0] == '-' || *end != '\0' || errno != 0 || v > UINT32_MAX) {
      return InvalidArgumentError("prompt: '{}' is not a token id", word);
    }
    tokens.push_back(static_cast<uint32_t>(v));
  }
  if (tokens.empty()) return InvalidArgumentError("prompt: no token ids");
  return tokens;
}

std::string Join(std::span<const uint32_t> tokens) {
  std::string s;
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (i) s += ' ';
    s += std::to_string(tokens[i]);
  }
  return s;
}

std::vector<uint32_t> RandomTokens(size_t n, uint32_t vocab, uint64_t seed) {
  std::vector<uint32_t> t(n);
  for (size_t i = 0; i < n; ++i) t[i] = static_cast<uint32_t>(Mix64(seed * 1000003 + i) % vocab);
  return t;
}

}  // namespace kvstash::engine::cli
