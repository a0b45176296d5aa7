#pragma once

// A kvstash engine worker's network server: one engine served over an OpenAI-compatible HTTP
// API (POST /v1/completions, GET /v1/models, /health, /metrics, /kvstash/stats; README.md has
// the fields). Requests in flight run batched in the one engine.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "kvstash/common/status.h"
#include "kvstash/engine/engine.h"
#include "kvstash/events/publisher.h"
#include "kvstash/worker/protocol.h"

namespace kvstash::worker {

struct ServerOptions {
  std::string listen = "127.0.0.1";  // an address or host name to bind
  uint16_t port = 7390;              // 0: a free port (port() says which)
  Role role = Role::kBoth;
  // Longest request body accepted; a longer one is answered 413 and its connection closed.
  size_t max_body_bytes = size_t{16} << 20;
  // Requests served at once (completions in flight at most); more wait for one of these
  // threads (and the requests on them for a place in the engine's batch). /health and the
  // informational GETs (/v1/models, /metrics, /kvstash/stats) have threads of their own.
  size_t http_threads = 32;
  // Connections open at once (idle ones included); past it new ones wait in the listen
  // backlog, of `listen_backlog` connections (the kernel caps it at net.core.somaxconn).
  size_t max_connections = 1024;
  int listen_backlog = 4096;
  // A request's line and headers must arrive within header_timeout_ms (no thread waits for
  // them), its body within read_timeout_ms of its headers; a write its client leaves unread
  // for write_timeout_ms fails (a stream's request is cancelled).
  int header_timeout_ms = 10000;
  int read_timeout_ms = 30000;
  int write_timeout_ms = 10000;
  // How long an idle connection is kept open for its client's next request.
  int keep_alive_seconds = 2;
  // After Stop, how long the requests in flight may take to finish before they are cancelled
  // (answered 503).
  int stop_grace_ms = 1000;
  size_t num_nodes = 0;  // offload nodes the engine shares KV through (GET /v1/models says)
  // KV events of the engine's prefix cache (docs/semantics.md §19), published when
  // `kv_events.endpoint` is set; the engine must record them (EngineOptions'
  // record_cache_events).
  events::PublisherOptions kv_events;
};

// Serves one engine. The engine runs on the thread that calls Serve (the only thread that
// touches it); HTTP handler threads parse requests, hand them to that thread and wait for their
// completion. The engine is borrowed and must outlive the server. Thread-safe: Stop may be
// called from any thread, Serve from one.
class WorkerServer {
 public:
  // Binds options.listen:options.port. Unavailable when it cannot (port in use, no such
  // address); InvalidArgument for options out of range (no threads, a zero body limit).
  static Result<std::unique_ptr<WorkerServer>> Create(engine::Engine* engine,
                                                      const ServerOptions& options);
  virtual ~WorkerServer() = default;

  // The port bound (the free one picked when options.port was 0).
  virtual uint16_t port() const = 0;

  // Serves until Stop: runs the engine on this thread, batching every request in flight. A
  // request whose client closes its connection is cancelled (its KV freed) within a step.
  // After Stop it answers new requests 503, gives the ones in flight (streams included) up to
  // stop_grace_ms to finish and cancels the rest (503, or an error event on a stream), waits
  // for the blocks of those answered to land on the nodes, closes the port and every
  // connection, and returns OK; Unavailable if the HTTP side failed on its own first (it
  // stops the same way).
  virtual Status Serve() = 0;

  // Asks Serve to stop as it says. Returns at once; idempotent.
  virtual void Stop() = 0;

  // The KV events' publisher (its endpoints as bound), or null when the worker publishes none.
  virtual const events::EventPublisher* kv_events() const = 0;
};

}  // namespace kvstash::worker
