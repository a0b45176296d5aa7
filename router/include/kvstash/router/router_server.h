// The router's HTTP face: an OpenAI-compatible front door (POST /v1/completions, streamed or
// not; GET /v1/models, /health, /metrics, /kvstash/router) over a Router, on kvstash::http's
// connection front.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "kvstash/common/status.h"
#include "kvstash/router/router.h"

namespace kvstash::router {

struct RouterServerOptions {
  std::string listen = "127.0.0.1";
  uint16_t port = 0;  // 0: a free port
  size_t request_threads = 64;
  size_t max_body_bytes = size_t{16} << 20;
};

// Serves one Router (borrowed: it must outlive the server). Thread-safe: Stop from any thread.
class RouterServer {
 public:
  // Binds and listens; Unavailable when the port is taken.
  static Result<std::unique_ptr<RouterServer>> Create(const RouterServerOptions& options,
                                                      Router* router);
  virtual ~RouterServer() = default;
  virtual uint16_t port() const = 0;
  // Serves until Stop; returns what made it stop (OK for Stop).
  virtual Status Serve() = 0;
  // Stops serving: requests in flight get until `drain` to finish.
  virtual void Stop(std::chrono::milliseconds drain = std::chrono::milliseconds(5000)) = 0;
};

// GET /metrics of a router: its totals and each worker's state as Prometheus text.
std::string RouterMetricsText(const Router& router);
// GET /kvstash/router: the same as JSON ("totals", "prefill_workers", "decode_workers").
std::string RouterStateJson(const Router& router);

}  // namespace kvstash::router
