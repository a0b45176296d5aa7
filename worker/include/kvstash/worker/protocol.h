#pragma once

// What a kvstash engine worker and its clients exchange over its OpenAI-compatible HTTP API
// (README.md, "A worker that stays up"), as plain values: the requests, the completions with
// their usage, the model a worker serves and its running totals. The JSON spelling lives in one
// place (worker/src/protocol.cc), shared by the server and the client.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kvstash/common/client_counters.h"
#include "kvstash/common/status.h"
#include "kvstash/engine/cache_hit.h"

namespace kvstash::worker {

// What a worker does with a request. kBoth: the whole request here; kPrefill: compute the
// prompt, push every full block to the offload nodes, answer with the first token once the
// blocks are on the nodes; kDecode: pull what the nodes hold of the prompt, compute the rest,
// generate.
enum class Role : uint8_t { kBoth, kPrefill, kDecode };

// "both", "prefill", "decode".
std::string_view RoleName(Role role);
// InvalidArgument for anything but those three names.
Result<Role> ParseRole(std::string_view name);

// POST /v1/completions: {"model", "prompt": [token ids] or [[token ids]], "max_tokens",
// "stream"}.
struct CompletionRequest {
  std::optional<std::string> model;  // unset: the worker's model
  std::vector<uint32_t> prompt;
  size_t max_tokens = 16;
  bool stream = false;
};

// The "usage" object of a completion: OpenAI's figures, then kvstash's own.
struct CompletionUsage {
  size_t prompt_tokens = 0;
  size_t completion_tokens = 0;  // total_tokens is their sum
  // Prompt tokens the worker's own prefix cache held: prompt_tokens_details.cached_tokens, as
  // OpenAI names cached tokens, and kvstash.local_hit_tokens.
  size_t local_hit_tokens = 0;
  size_t node_tokens = 0;      // kvstash.node_tokens: prompt tokens loaded from offload nodes
  size_t computed_tokens = 0;  // kvstash.computed_tokens: prompt tokens run through the model
  double ttft_ms = 0;          // kvstash.ttft_ms: arrival to the first generated token
  double latency_ms = 0;       // kvstash.latency_ms: arrival to the answer (pushes landed)
};

// One finished completion (choices[0] of OpenAI's completion object).
struct Completion {
  std::string id;  // "cmpl-..."
  std::string model;
  std::vector<uint32_t> tokens;  // choices[0].token_ids; choices[0].text is them joined by ' '
  std::string finish_reason;     // "length": the engine samples greedily up to max_tokens
  CompletionUsage usage;
  // usage.kvstash.router as JSON text when kvstash-router answered (where the completion went
  // and why: docs/semantics.md §20), else empty. Read, never written, by the worker's API.
  std::string router;
};

// GET /v1/models: the one model a worker serves (the list's only entry) and, under "kvstash",
// what a client needs to trust its blocks.
struct WorkerInfo {
  std::string model;
  uint64_t fingerprint = 0;  // model, weights and layout; "0x%016x" on the wire
  uint32_t block_size = 0;
  uint32_t attn_pack = 1;
  Role role = Role::kBoth;
  size_t nodes = 0;  // offload nodes it shares KV through
  // What a router needs to compute a prompt's hit here as the engine does
  // (kvstash::router::CacheLayout): the KV-cache groups (kind, block size, window or chunk),
  // the block size prompts are hashed at, and the salt of their first block. Empty groups: a
  // worker that does not say (the fields are optional on the wire).
  std::vector<engine::AttentionSpec> groups;
  uint32_t hash_block_size = 0;
  std::string cache_salt;
  // Its KV events (docs/semantics.md §19), when it publishes them: the endpoints as bound, and
  // the topic.
  std::string kv_events;
  std::string kv_events_replay;
  std::string kv_events_topic;
};

// A group's kind as vLLM names it (KVCacheSpecKind): in KV events and in the model list.
std::string_view SpecKindName(engine::AttentionSpec::Kind kind);

// The most groups a model list may state (a hostile or broken worker's list is refused).
inline constexpr size_t kMaxCacheGroups = 64;

// GET /kvstash/stats (and GET /metrics, as Prometheus counters): the worker's running totals
// since it started.
struct WorkerTotals {
  // Completions answered (a request the engine failed counts in failed_requests instead) and
  // their figures summed.
  uint64_t requests = 0;
  uint64_t failed_requests = 0;
  // Completions dropped before their end: their client closed its connection, or the worker
  // stopped before they finished.
  uint64_t cancelled_requests = 0;
  uint64_t prompt_tokens = 0;
  uint64_t generation_tokens = 0;
  uint64_t local_hit_tokens = 0;
  uint64_t node_tokens = 0;
  uint64_t computed_tokens = 0;
  uint64_t running_requests = 0;  // in the engine now (a gauge)
  // The engine's counters.
  uint64_t steps = 0;
  uint64_t prefill_tokens = 0;
  uint64_t decode_tokens = 0;
  uint64_t preemptions = 0;
  uint64_t load_failures = 0;  // loads from the nodes that fell back to recomputing
  // The offload's counters (engine::OffloadStats; zero without offload nodes).
  uint64_t loaded_bytes = 0;
  uint64_t stored_bytes = 0;
  uint64_t blocks_loaded = 0;
  uint64_t blocks_stored = 0;
  // The offload node client's counters: every row of its registry
  // (kvstash/common/client_counters.h), each under its export_name (node_unreachable,
  // node_refusals, touched_keys, ...).
  ClientCounters client;
};

// The most tokens one request may ask for (max_tokens).
inline constexpr size_t kMaxCompletionTokens = size_t{1} << 20;

}  // namespace kvstash::worker
