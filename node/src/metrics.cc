#include "kvstash/node/metrics.h"

#include <prometheus/collectable.h>
#include <prometheus/metric_family.h>
#include <prometheus/text_serializer.h>

#include <asio.hpp>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <thread>

#include "counters.h"
#include "kvstash/common/logging.h"

namespace kvstash::node {
namespace {

using prometheus::ClientMetric;
using prometheus::MetricFamily;
using prometheus::MetricType;

// kvstash_request_seconds: one histogram per wire method, with cumulative buckets as
// Prometheus wants them.
MetricFamily RequestSeconds(const std::vector<MethodLatency>& latencies) {
  MetricFamily family{"kvstash_request_seconds",
                      "Request latency by method: from dispatch until the reply is handed to "
                      "the transport (put_block: including its payload's arrival; get_block "
                      "and echo: until the reply's payload has been sent)",
                      MetricType::Histogram,
                      {}};
  for (const MethodLatency& latency : latencies) {
    ClientMetric metric;
    metric.label = {{"method", latency.method}};
    uint64_t cumulative = 0;
    for (size_t i = 0; i < kLatencyBuckets.size(); ++i) {
      cumulative += latency.buckets[i];
      metric.histogram.bucket.push_back(
          {cumulative, std::chrono::duration<double>(kLatencyBuckets[i]).count()});
    }
    metric.histogram.bucket.push_back({latency.count, std::numeric_limits<double>::infinity()});
    metric.histogram.sample_count = latency.count;
    metric.histogram.sample_sum = std::chrono::duration<double>(latency.sum).count();
    family.metric.push_back(std::move(metric));
  }
  return family;
}

// Per-namespace families, from the node's namespace table (names bounded by
// kMaxNamedNamespaces, the rest under "other").
std::vector<MetricFamily> NamespaceFamilies(const std::vector<NamespaceStats>& namespaces) {
  MetricFamily blocks{"kvstash_namespace_blocks",
                      "Blocks a namespace holds (readable or being written), by tier; namespaces "
                      "with a quota or seen at hello, the first 256, the rest summed as \"other\"",
                      MetricType::Gauge,
                      {}};
  MetricFamily quotas{"kvstash_namespace_quota_blocks",
                      "A namespace's quota (the most blocks it may hold), by tier",
                      MetricType::Gauge,
                      {}};
  MetricFamily refusals{"kvstash_quota_refusals_total",
                        "Blocks a namespace's clients asked to store and were refused because "
                        "the namespace was at its quota with none of its own blocks idle to evict",
                        MetricType::Counter,
                        {}};
  for (const NamespaceStats& ns : namespaces) {
    ClientMetric held;
    held.label = {{"namespace", ns.name}, {"tier", "cpu"}};
    held.gauge.value = static_cast<double>(ns.cpu_blocks);
    blocks.metric.push_back(std::move(held));
    if (ns.cpu_quota_blocks) {
      ClientMetric quota;
      quota.label = {{"namespace", ns.name}, {"tier", "cpu"}};
      quota.gauge.value = static_cast<double>(*ns.cpu_quota_blocks);
      quotas.metric.push_back(std::move(quota));
    }
    ClientMetric refused;
    refused.label = {{"namespace", ns.name}};
    refused.counter.value = static_cast<double>(ns.quota_refusals);
    refusals.metric.push_back(std::move(refused));
  }
  return {std::move(blocks), std::move(quotas), std::move(refusals)};
}

MetricFamily FaultedShare(const NodeServer& node) {
  ClientMetric share;
  share.gauge.value = node.memory_faulted_share();
  return MetricFamily{"kvstash_cpu_memory_faulted_ratio",
                      "Share of the CPU tier's memory faulted in (the node serves from the start "
                      "and faults its memory in in the background)",
                      MetricType::Gauge,
                      {share}};
}

// The node's registration in etcd (--etcd).
std::vector<MetricFamily> EtcdFamilies(const membership::Registration& registration) {
  const membership::RegistrationStats stats = registration.stats();
  ClientMetric registered;
  registered.gauge.value = stats.registered ? 1 : 0;
  ClientMetric registrations;
  registrations.counter.value = static_cast<double>(stats.registrations);
  ClientMetric errors;
  errors.counter.value = static_cast<double>(stats.errors);
  return {
      MetricFamily{"kvstash_etcd_registered",
                   "1 while the node's key is in etcd as far as it knows; 0 while etcd "
                   "cannot be reached (the node serves on and retries every second)",
                   MetricType::Gauge,
                   {registered}},
      MetricFamily{"kvstash_etcd_registrations_total",
                   "Times the node wrote its key to etcd (again after a lease was lost)",
                   MetricType::Counter,
                   {registrations}},
      MetricFamily{
          "kvstash_etcd_errors_total", "Calls to etcd that failed", MetricType::Counter, {errors}}};
}

class NodeCollectable : public prometheus::Collectable {
 public:
  NodeCollectable(NodeServer& node, const membership::Registration* registration)
      : node_(node), registration_(registration) {}

  std::vector<MetricFamily> Collect() const override {
    const std::map<std::string, uint64_t> counters = node_.Counters();
    // The registry's exported counters, each family where its first counter is; a counter the
    // node does not report now (ARC's lists under LRU) reads 0.
    std::vector<MetricFamily> families;
    std::map<const MetricFamilyDef*, size_t> index;
    for (const CounterDef& def : CounterDefs()) {
      if (def.family == nullptr) continue;
      auto [it, added] = index.try_emplace(def.family, families.size());
      if (added) families.push_back({def.family->name, def.family->help, def.family->type, {}});
      auto value = counters.find(def.name);
      ClientMetric metric;
      for (const auto& [name, label] : def.labels) metric.label.push_back({name, label});
      const double v = value == counters.end() ? 0.0 : static_cast<double>(value->second);
      if (def.family->type == MetricType::Counter) {
        metric.counter.value = v;
      } else {
        metric.gauge.value = v;
      }
      families[it->second].metric.push_back(std::move(metric));
    }
    families.push_back(RequestSeconds(node_.Latencies()));
    families.push_back(FaultedShare(node_));
    for (MetricFamily& family : NamespaceFamilies(node_.Namespaces())) {
      families.push_back(std::move(family));
    }
    if (registration_ != nullptr) {
      for (MetricFamily& family : EtcdFamilies(*registration_)) {
        families.push_back(std::move(family));
      }
    }
    return families;
  }

 private:
  NodeServer& node_;
  const membership::Registration* registration_;  // null without --etcd
};

// /healthz: answers while the daemon serves (it is ready as soon as it listens), with the share
// of its memory faulted in.
class Up : public prometheus::Collectable {
 public:
  explicit Up(const NodeServer& node) : node_(node) {}
  std::vector<MetricFamily> Collect() const override {
    ClientMetric up;
    up.gauge.value = 1;
    return {MetricFamily{"kvstash_up", "1 while the node serves", MetricType::Gauge, {up}},
            FaultedShare(node_)};
  }

 private:
  const NodeServer& node_;
};

// The node's HTTP endpoint: GET (or HEAD) of a few fixed paths, each body made when asked.
//
// On Asio rather than civetweb (prometheus-cpp's Exposer): civetweb gives a connection one of its
// worker threads from accept until its request is in, so as many silent or trickling clients as
// it has threads block /healthz for request_timeout_ms (30 s by default, one thread here
// before), and its accept loop retries at once when accept fails with EMFILE, spinning a core
// for as long as the descriptors run short. Here a connection waiting for its request costs a
// socket and a timer, no thread:
//   - the whole request (line and headers, at most kMaxRequestBytes) must arrive within
//     kRequestTimeout and the answer leave within kWriteTimeout, else the connection is closed;
//   - at kMaxConnections the oldest connection still waiting for its request is closed to make
//     room, so a flood of slow clients cannot keep a prober out;
//   - bodies are made on kThreads threads, so a slow scrape of /metrics does not hold /healthz;
//   - accept failures for want of descriptors or memory (EMFILE, ENFILE, ENOBUFS, ENOMEM) are
//     retried every kAcceptBackoff, while the connections already open are served, and logged
//     once per episode (its start, and its end once accepts have not failed for kEpisodeEnd).
// Each answer closes its connection (HTTP/1.1 with Connection: close; Prometheus reconnects).
//
// Owns its threads and sockets; the destructor stops them. port() is thread-safe.
class HttpEndpoint {
 public:
  using Route = std::function<std::string()>;

  static constexpr size_t kThreads = 4;
  static constexpr size_t kMaxConnections = 128;
  static constexpr size_t kMaxRequestBytes = 8192;
  static constexpr std::chrono::milliseconds kRequestTimeout{5000};
  static constexpr std::chrono::milliseconds kWriteTimeout{10000};
  static constexpr std::chrono::milliseconds kAcceptBackoff{100};
  static constexpr std::chrono::milliseconds kEpisodeEnd{1000};

  // Listens on `address` (HOST:PORT, port 0: any free one; HOST may be bracketed IPv6).
  // Unavailable naming the address when it cannot listen there.
  static Result<std::unique_ptr<HttpEndpoint>> Create(const std::string& address,
                                                      std::map<std::string, Route> routes) {
    auto endpoint = std::unique_ptr<HttpEndpoint>(new HttpEndpoint(std::move(routes)));
    KVSTASH_RETURN_IF_ERROR(endpoint->Listen(address));
    endpoint->Accept();
    for (size_t i = 0; i < kThreads; ++i) {
      endpoint->threads_.emplace_back([io = &endpoint->io_] { io->run(); });
    }
    return endpoint;
  }

  ~HttpEndpoint() {
    io_.stop();
    for (std::thread& thread : threads_) thread.join();
  }

  uint16_t port() const { return port_; }

 private:
  class Connection;
  using tcp = asio::ip::tcp;

  explicit HttpEndpoint(std::map<std::string, Route> routes)
      : routes_(std::move(routes)),
        accept_strand_(asio::make_strand(io_)),
        acceptor_(accept_strand_),
        backoff_(accept_strand_),
        quiet_(accept_strand_) {}

  Status Listen(const std::string& address) {
    const size_t colon = address.rfind(':');
    std::string host = address.substr(0, colon);
    const std::string service = address.substr(colon + 1);
    if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
      host = host.substr(1, host.size() - 2);
    }
    asio::error_code ec;
    tcp::resolver resolver(io_);
    const auto endpoints = resolver.resolve(host, service, tcp::resolver::passive, ec);
    if (ec || endpoints.empty()) {
      return UnavailableError("metrics address {}: {}", address,
                              ec ? ec.message() : std::string("no such address"));
    }
    const tcp::endpoint endpoint = endpoints.begin()->endpoint();
    if (acceptor_.open(endpoint.protocol(), ec); !ec) {
      acceptor_.set_option(tcp::acceptor::reuse_address(true), ec);
      if (!ec) acceptor_.bind(endpoint, ec);
      if (!ec) acceptor_.listen(asio::socket_base::max_listen_connections, ec);
    }
    if (ec) return UnavailableError("metrics address {}: {}", address, ec.message());
    port_ = acceptor_.local_endpoint(ec).port();
    address_ = fmt::format("{}:{}", address.substr(0, colon), port_);
    return Status::OK();
  }

  void Accept() {
    acceptor_.async_accept(asio::make_strand(io_), [this](asio::error_code ec, tcp::socket peer) {
      if (ec == asio::error::operation_aborted) return;
      if (ec) {
        const int e = ec.value();
        if (ec.category() == asio::error::get_system_category() &&
            (e == EMFILE || e == ENFILE || e == ENOBUFS || e == ENOMEM)) {
          Starved(ec);
          backoff_.expires_after(kAcceptBackoff);
          backoff_.async_wait([this](asio::error_code waited) {
            if (!waited) Accept();
          });
          return;
        }
        Accept();  // that one connection failed (reset before it was taken, ...)
        return;
      }
      if (starved_ && !quiet_pending_) AwaitEpisodeEnd(kEpisodeEnd);
      Serve(std::move(peer));
      Accept();
    });
  }

  // An accept failed for want of descriptors or memory: logged at the start of an episode only.
  void Starved(const asio::error_code& ec) {
    const auto now = std::chrono::steady_clock::now();
    last_failure_ = now;
    ++failures_;
    if (starved_) return;
    starved_ = true;
    starved_since_ = now;
    failures_ = 1;
    KVSTASH_LOG_WARN(
        "metrics endpoint {}: cannot accept connections ({}); retrying every {} ms, serving the "
        "{} open meanwhile",
        address_, ec.message(), kAcceptBackoff.count(), open_connections());
  }

  // Accepts succeed again: the episode ends once none has failed for kEpisodeEnd (a connection
  // closing frees one descriptor, and the next accept may fail again: the same episode).
  void AwaitEpisodeEnd(std::chrono::steady_clock::duration after) {
    quiet_pending_ = true;
    quiet_.expires_after(after);
    quiet_.async_wait([this](asio::error_code ec) {
      quiet_pending_ = false;
      if (ec || !starved_) return;
      const auto quiet_for = std::chrono::steady_clock::now() - last_failure_;
      if (quiet_for < kEpisodeEnd) {
        AwaitEpisodeEnd(kEpisodeEnd - quiet_for);
        return;
      }
      starved_ = false;
      KVSTASH_LOG_WARN(
          "metrics endpoint {}: accepting connections again ({} ms without descriptors, {} "
          "accepts retried)",
          address_,
          std::chrono::duration_cast<std::chrono::milliseconds>(last_failure_ - starved_since_)
              .count(),
          failures_);
    });
  }

  void Serve(tcp::socket peer);
  // The connection ended (or is ending): it no longer counts.
  void Forget(uint64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    connections_.erase(id);
  }
  // It has its request: it may no longer be closed to make room.
  void Answering(uint64_t id);
  size_t open_connections() {
    std::lock_guard<std::mutex> lock(mu_);
    return connections_.size();
  }

  // The response to a request whose line is `line` ("GET /healthz HTTP/1.1").
  std::string Respond(std::string_view line) const {
    const size_t method_end = line.find(' ');
    const size_t target_end = line.find(' ', method_end == line.npos ? line.npos : method_end + 1);
    if (method_end == line.npos || target_end == line.npos) {
      return Response(400, "Bad Request", "malformed request line\n", true);
    }
    const std::string_view method = line.substr(0, method_end);
    std::string_view path = line.substr(method_end + 1, target_end - method_end - 1);
    path = path.substr(0, path.find('?'));
    if (method != "GET" && method != "HEAD") {
      return Response(405, "Method Not Allowed", "only GET and HEAD\n", true);
    }
    const auto route = routes_.find(std::string(path));
    if (route == routes_.end()) return Response(404, "Not Found", "no such path\n", true);
    return Response(200, "OK", route->second(), method == "GET");
  }

  static std::string Response(int code, std::string_view reason, const std::string& body,
                              bool with_body) {
    std::string out = fmt::format(
        "HTTP/1.1 {} {}\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
        "Content-Length: {}\r\nConnection: close\r\n\r\n",
        code, reason, body.size());
    if (with_body) out += body;
    return out;
  }

  const std::map<std::string, Route> routes_;
  asio::io_context io_;  // first: destroyed last, with the handlers that hold connections
  // The acceptor's handlers and its timers', one at a time.
  asio::strand<asio::io_context::executor_type> accept_strand_;
  tcp::acceptor acceptor_;
  asio::steady_timer backoff_;
  asio::steady_timer quiet_;
  std::string address_;
  uint16_t port_ = 0;
  // An episode without descriptors; on accept_strand_.
  bool starved_ = false;
  bool quiet_pending_ = false;
  std::chrono::steady_clock::time_point starved_since_;
  std::chrono::steady_clock::time_point last_failure_;
  uint64_t failures_ = 0;
  std::mutex mu_;
  // Open connections by accept order, and whether each still waits for its request.
  struct Open {
    std::weak_ptr<Connection> connection;
    bool waiting = true;
  };
  std::map<uint64_t, Open> connections_;  // guarded by mu_
  uint64_t next_id_ = 0;                  // guarded by mu_
  std::vector<std::thread> threads_;
};

// One connection, on a strand of its own (its socket's executor, shared by its timer): its
// handlers never run at once. Kept alive by its pending handlers.
class HttpEndpoint::Connection : public std::enable_shared_from_this<Connection> {
 public:
  Connection(HttpEndpoint& endpoint, uint64_t id, tcp::socket socket)
      : endpoint_(endpoint),
        id_(id),
        socket_(std::move(socket)),
        timer_(socket_.get_executor()),
        request_(kMaxRequestBytes) {}

  void Start() {
    auto self = shared_from_this();
    timer_.expires_after(kRequestTimeout);
    timer_.async_wait([self](asio::error_code ec) {
      if (!ec) self->Close();
    });
    asio::async_read_until(socket_, request_, "\r\n\r\n",
                           [self](asio::error_code ec, size_t) { self->OnRequest(ec); });
  }

  // Closes the socket, which ends its pending reads and writes. Idempotent; on the strand.
  void Close() {
    if (closed_) return;
    closed_ = true;
    asio::error_code ignored;
    timer_.cancel();
    socket_.shutdown(tcp::socket::shutdown_both, ignored);
    socket_.close(ignored);
    endpoint_.Forget(id_);
  }

  // Close from any thread.
  void CloseSoon() {
    asio::post(socket_.get_executor(), [self = shared_from_this()] { self->Close(); });
  }

 private:
  void OnRequest(asio::error_code ec) {
    if (closed_) return;
    if (ec == asio::error::not_found) {  // the request outgrew kMaxRequestBytes
      Send(Response(431, "Request Header Fields Too Large", "request too large\n", true));
      return;
    }
    if (ec) {
      Close();
      return;
    }
    endpoint_.Answering(id_);
    const std::string_view data(static_cast<const char*>(request_.data().data()),
                                request_.data().size());
    Send(endpoint_.Respond(data.substr(0, data.find("\r\n"))));
  }

  void Send(std::string response) {
    response_ = std::move(response);
    timer_.expires_after(kWriteTimeout);
    auto self = shared_from_this();
    timer_.async_wait([self](asio::error_code ec) {
      if (!ec) self->Close();
    });
    asio::async_write(socket_, asio::buffer(response_),
                      [self](asio::error_code, size_t) { self->Close(); });
  }

  HttpEndpoint& endpoint_;
  const uint64_t id_;
  tcp::socket socket_;
  asio::steady_timer timer_;
  asio::streambuf request_;
  std::string response_;
  bool closed_ = false;
};

void HttpEndpoint::Serve(tcp::socket peer) {
  std::shared_ptr<Connection> evict;
  std::shared_ptr<Connection> connection;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (connections_.size() >= kMaxConnections) {
      for (auto& [id, open] : connections_) {
        if (!open.waiting) continue;
        evict = open.connection.lock();
        open.waiting = false;  // closing: not chosen twice
        if (evict) break;
      }
    }
    const uint64_t id = next_id_++;
    connection = std::make_shared<Connection>(*this, id, std::move(peer));
    connections_.emplace(id, Open{connection, true});
  }
  if (evict) evict->CloseSoon();
  connection->Start();
}

void HttpEndpoint::Answering(uint64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  if (auto it = connections_.find(id); it != connections_.end()) it->second.waiting = false;
}

// The text exposition of `collectable`'s families.
std::string Exposition(const prometheus::Collectable& collectable) {
  return prometheus::TextSerializer().Serialize(collectable.Collect());
}

}  // namespace

class MetricsEndpoint::Impl {
 public:
  std::shared_ptr<NodeCollectable> node;
  std::shared_ptr<Up> up;
  std::unique_ptr<HttpEndpoint> http;  // last: stopped before what it reads
};

Result<std::unique_ptr<MetricsEndpoint>> MetricsEndpoint::Create(
    const std::string& address, NodeServer& node, const membership::Registration* registration) {
  auto impl = std::make_unique<Impl>();
  impl->node = std::make_shared<NodeCollectable>(node, registration);
  impl->up = std::make_shared<Up>(node);
  std::map<std::string, HttpEndpoint::Route> routes;
  routes["/metrics"] = [node = impl->node.get()] { return Exposition(*node); };
  routes["/healthz"] = [up = impl->up.get()] { return Exposition(*up); };
  KVSTASH_ASSIGN_OR_RETURN(impl->http, HttpEndpoint::Create(address, std::move(routes)));
  return std::unique_ptr<MetricsEndpoint>(new MetricsEndpoint(std::move(impl)));
}

MetricsEndpoint::MetricsEndpoint(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
MetricsEndpoint::~MetricsEndpoint() = default;

uint16_t MetricsEndpoint::port() const { return impl_->http->port(); }

}  // namespace kvstash::node
