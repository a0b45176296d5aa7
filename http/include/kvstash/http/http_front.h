#pragma once

// An HTTP server's connections, in front of cpp-httplib's request parsing and routing: the
// listening socket (a real backlog), one I/O thread that accepts and reads each request's line
// and headers without a thread of its own, and lanes of threads that httplib runs complete
// requests on. httplib 0.11.4's own server gives each connection a pool thread from accept on,
// so 32 clients sending a header byte a second hold all 32, and its accept loop stops the
// server at ENFILE; here a connection takes a thread only once its request's head has arrived,
// and a health check has a lane of its own that no other request can take. Both of kvstash's
// HTTP servers stand on it: the engine worker's API (kvstash::worker) and a node's /metrics and
// /healthz (kvstash::node).

#include <httplib.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "kvstash/common/status.h"

namespace kvstash::http {

// Which threads serve a request. kHealth and kInfo take only bodiless requests whose client
// can take the answer at once (so that nothing there waits on a client), each lane its own
// threads; everything else goes to kRequests. The worker: /health, the informational GETs, and
// completions; a node: /healthz, /metrics, and anything else.
enum class Lane : uint8_t { kRequests, kInfo, kHealth };

// What the I/O thread does with a new connection when max_connections are open.
enum class AtLimit : uint8_t {
  // Accepts no more until one closes: the others wait in the listen backlog.
  kWait,
  // Closes the oldest connection still waiting for a request (its line and headers, or its
  // next one) to take the new one, so that a flood of slow clients cannot keep a prober out;
  // waits as kWait when every open connection has its request.
  kCloseOldestWaiting,
};

struct FrontOptions {
  // Names the server in its log lines ("kvstash worker on port 8000: ...").
  std::string name = "HTTP server";
  std::string listen = "127.0.0.1";
  uint16_t port = 0;   // 0: a free port
  int backlog = 4096;  // listen(2)'s; the kernel caps it at net.core.somaxconn
  size_t request_threads = 32;
  size_t info_threads = 2;
  size_t health_threads = 1;
  // Connections open at once; what happens past it is at_limit's.
  size_t max_connections = 1024;
  AtLimit at_limit = AtLimit::kWait;
  // A request's line and headers must arrive within header_timeout of its first byte (of the
  // accept, for a connection's first request); its body within read_timeout of its headers. A
  // write that the client leaves unread for write_timeout fails.
  std::chrono::milliseconds header_timeout{10000};
  std::chrono::milliseconds read_timeout{30000};
  std::chrono::milliseconds write_timeout{10000};
  // How long an idle connection is kept for its client's next request.
  std::chrono::milliseconds keep_alive{2000};
  // Requests served on one connection before its answer closes it (1: every answer does).
  size_t max_requests_per_connection = 100;
  size_t max_header_bytes = size_t{64} << 10;
  // The lane of a request with this method and path (without its query).
  std::function<Lane(std::string_view method, std::string_view path)> classify;
  // The body of an error the I/O thread answers itself (408, 431), as the API spells errors
  // (unset: the message as plain text), and its Content-Type.
  std::function<std::string(int status, std::string_view code, std::string_view message)>
      error_body;
  std::string error_content_type = "text/plain; charset=utf-8";
  // Called (once, from the I/O thread) if it fails and stops accepting for good.
  std::function<void(const Status&)> on_failure;
};

// Owns the listening socket, the I/O thread, the lanes and every connection, and the
// httplib::Server whose routes the caller registers (router(), before Start) and whose
// process_request parses, routes and answers each request. Thread-safe: Closing and Shutdown
// from any thread; the static functions from a handler, on the thread serving its request.
class HttpFront {
 public:
  // Binds options.listen:options.port and listens. Unavailable when it cannot (the port is
  // taken, no such address); InvalidArgument for options out of range.
  static Result<std::unique_ptr<HttpFront>> Create(FrontOptions options);
  ~HttpFront();  // Shutdown

  uint16_t port() const;
  // Register routes and handlers here before Start.
  httplib::Server& router();

  // Starts the I/O thread and the lanes.
  void Start();
  // From now on every answer closes its connection (a stopping server).
  void Closing();
  // Closes the port and every connection: idle ones at once; busy ones whose answer is being
  // written (Answering) get until `drain_until` to finish, the others are shut down so that
  // their reads and writes fail now; joins the threads. Handlers must not wait on anything
  // but their connection by then. Idempotent.
  void Shutdown(std::chrono::steady_clock::time_point drain_until = {});

  // On a handler's thread: whether its client has closed or reset the connection.
  static bool ClientGone();
  // On a handler's thread: whether a read of its request ran out of read_timeout.
  static bool ReadTimedOut();
  // On a handler's thread: the request is read, and what remains is to answer it (Shutdown
  // lets the answer be written). Health and info requests are answering from the start.
  static void Answering();

  class Impl;

 private:
  explicit HttpFront(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvstash::http
