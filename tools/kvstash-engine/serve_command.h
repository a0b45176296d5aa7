#pragma once

// `kvstash-engine serve`: a worker serving the engine over kvstash::worker's OpenAI-compatible
// HTTP API, and `kvstash-engine chat --decode-worker`: a multi-turn conversation driven through
// such workers (a prefill worker, then a decode worker, per turn) with kvstash::worker's client.

#include <cstddef>
#include <cstdint>
#include <string>

#include "cli_common.h"

namespace kvstash::engine::cli {

struct ServeFlags {
  std::string listen = "127.0.0.1";
  uint16_t port = 7390;  // 0: any free port
  std::string role = "both";
  size_t max_body_bytes = size_t{16} << 20;
  size_t http_threads = 32;
  size_t max_connections = 0;  // 0: RLIMIT_NOFILE's soft limit less 128
  int listen_backlog = 4096;
  int header_timeout_ms = 10000;
  int read_timeout_ms = 30000;
  int write_timeout_ms = 10000;
  int stop_grace_ms = 1000;
  std::string kv_events;         // ZMQ endpoint of the prefix cache's KV events; empty: off
  std::string kv_events_replay;  // their replay ROUTER; empty: none
  std::string kv_events_topic;   // the topic ("" as vLLM's default)
  // Keep a key in --etcd's --cluster under /kvstash/<cluster>/workers/ while serving, for
  // routers to find (kvstash-router --etcd), at `advertise` (HOST or HOST:PORT; default the
  // --listen address and port).
  bool register_worker = false;
  std::string advertise;
  int64_t etcd_ttl_s = 10;
};

// Runs until SIGTERM or SIGINT; then gives the requests it has --stop-grace-ms to finish,
// cancels the rest, lands the pushes of those answered, exits 0.
int RunServe(const ModelFlags& model, const ServeFlags& serve);

struct RemoteChatFlags {
  std::string prefill_worker;  // HOST:PORT, or empty: the decode worker computes the prompt
  std::string decode_worker;   // HOST:PORT
  std::string router;          // HOST:PORT of a kvstash-router, instead of the two workers
  bool compare = true;         // also compute each turn here without any cache
  uint32_t timeout_ms = 600000;
};

int RunRemoteChat(const ModelFlags& model, const RemoteChatFlags& remote, size_t turns,
                  size_t user_tokens, size_t max_new, uint64_t seed);

}  // namespace kvstash::engine::cli
