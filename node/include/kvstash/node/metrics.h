#pragma once

// Prometheus metrics of a node, served over HTTP at /metrics (and /healthz, which answers 200
// with `kvstash_up 1` while the daemon runs). The values are read from the node's counters and
// latency histograms at every scrape, so the request path pays only for the relaxed atomic adds
// that keep them. The HTTP server (kvstash::http's connection front; its bounds in metrics.cc)
// keeps answering under slow or silent clients and when the process runs out of file
// descriptors: requests have deadlines, waiting connections hold no thread, /healthz has a
// thread no scrape can take, and accept backs off.

#include <memory>
#include <string>

#include "kvstash/common/status.h"
#include "kvstash/membership/membership.h"
#include "kvstash/node/node_server.h"

namespace kvstash::node {

// Owns the HTTP server and its threads; destroying it stops them (within one handler's
// time). port() is thread-safe.
class MetricsEndpoint {
 public:
  // Serves `node`'s metrics on `address` ("HOST:PORT"; port 0 picks a free one), and those of
  // its etcd `registration` when it has one. Both must outlive the endpoint.
  static Result<std::unique_ptr<MetricsEndpoint>> Create(
      const std::string& address, NodeServer& node,
      const membership::Registration* registration = nullptr);
  ~MetricsEndpoint();
  uint16_t port() const;

  class Impl;

 private:
  explicit MetricsEndpoint(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvstash::node
