#include "serve_command.h"

#include <algorithm>
#include <asio.hpp>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <iostream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>
#include <unordered_map>
#include <utility>

#include "kvstash/common/logging.h"
#include "kvstash/connector/node_client.h"

namespace kvstash::engine::cli {
namespace {

using asio::ip::tcp;
using nlohmann::json;
using Clock = std::chrono::steady_clock;

double Millis(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

std::string HexFingerprint(uint64_t f) { return fmt::format("0x{:016x}", f); }

// ---------------------------------------------------------------------------------------------
// The server. One I/O thread accepts connections and reads lines; the engine runs on the
// calling thread, batching every request in flight (continuous batching), and posts each reply
// back to the I/O thread.

class Server;

class Connection : public std::enable_shared_from_this<Connection> {
 public:
  Connection(tcp::socket socket, Server* server, size_t max_line)
      : socket_(std::move(socket)), server_(server), buf_(max_line) {}
  void Start() { ReadNext(); }
  // On the I/O thread. `close_after`: the connection ends once this line is out.
  void Send(std::string line, bool close_after = false);

 private:
  void ReadNext();
  void WriteNext();

  tcp::socket socket_;
  Server* server_;
  asio::streambuf buf_;
  std::deque<std::pair<std::string, bool>> out_;
  bool writing_ = false;
};

struct Job {
  std::shared_ptr<Connection> conn;
  json request;
};

class Server {
 public:
  Server(Engine* engine, const ServeFlags& flags, size_t num_nodes)
      : engine_(engine), flags_(flags), num_nodes_(num_nodes), acceptor_(io_), signals_(io_) {}

  Status Listen() {
    std::error_code ec;
    const asio::ip::address address = asio::ip::make_address(flags_.listen, ec);
    if (ec) return InvalidArgumentError("--listen '{}' is not an IP address", flags_.listen);
    const tcp::endpoint endpoint(address, flags_.port);
    acceptor_.open(endpoint.protocol(), ec);
    if (!ec) acceptor_.set_option(tcp::acceptor::reuse_address(true), ec);
    if (!ec) acceptor_.bind(endpoint, ec);
    if (!ec) acceptor_.listen(asio::socket_base::max_listen_connections, ec);
    if (ec) {
      return UnavailableError("cannot listen on {}:{}: {}", flags_.listen, flags_.port,
                              ec.message());
    }
    return Status::OK();
  }
  uint16_t port() const { return acceptor_.local_endpoint().port(); }

  int Serve() {
    signals_.add(SIGINT);
    signals_.add(SIGTERM);
    signals_.async_wait([this](const std::error_code& ec, int) {
      if (ec) return;
      KVSTASH_LOG_INFO("kvstash-engine serve: stopping (answering what is queued first)");
      std::error_code ignored;
      acceptor_.close(ignored);
      std::lock_guard lock(mu_);
      stopping_ = true;
      cv_.notify_all();
    });
    Accept();
    std::thread io_thread([this] { io_.run(); });
    EngineLoop();
    engine_->DrainOffload();
    // Replies still being written get a moment to leave.
    asio::post(io_, [this] { io_.stop(); });
    io_thread.join();
    return kExitOk;
  }

  // From the I/O thread.
  void Submit(Job job) {
    std::lock_guard lock(mu_);
    inbox_.push_back(std::move(job));
    cv_.notify_all();
  }
  void Reply(const std::shared_ptr<Connection>& conn, const json& reply) {
    asio::post(io_, [conn, line = reply.dump() + "\n"]() mutable { conn->Send(std::move(line)); });
  }

 private:
  struct Pending {
    std::shared_ptr<Connection> conn;
    json id;
    Clock::time_point start;
    double ttft_ms = -1;
  };

  void Accept() {
    acceptor_.async_accept([this](const std::error_code& ec, tcp::socket socket) {
      if (ec) {
        if (ec != asio::error::operation_aborted) {
          KVSTASH_LOG_WARN("kvstash-engine serve: accept failed: {}", ec.message());
        }
        if (!acceptor_.is_open()) return;
      } else {
        std::make_shared<Connection>(std::move(socket), this, flags_.max_line_bytes)->Start();
      }
      Accept();
    });
  }

  void EngineLoop() {
    Engine& e = *engine_;
    for (;;) {
      std::deque<Job> jobs;
      {
        std::unique_lock lock(mu_);
        if (inbox_.empty() && !e.HasUnfinished()) {
          if (stopping_) return;
          cv_.wait_for(lock, std::chrono::milliseconds(200));
        }
        jobs.swap(inbox_);
      }
      for (Job& job : jobs) Handle(std::move(job));
      if (!e.HasUnfinished()) continue;
      const std::vector<RequestId> done = e.Step();
      const auto now = Clock::now();
      for (auto& [id, p] : pending_) {
        if (p.ttft_ms >= 0) continue;
        const Request* r = e.Find(id);
        if (r != nullptr && r->num_output_tokens() > 0) p.ttft_ms = Millis(p.start, now);
      }
      if (done.empty()) continue;
      // A reply means the request's blocks are on the nodes: the decode worker (or the next
      // turn) asked next finds them.
      e.DrainOffload();
      for (RequestId id : done) Finish(id, now);
    }
  }

  void Handle(Job job) {
    const json& req = job.request;
    json id = req.contains("id") ? req["id"] : json();
    auto error = [&](const std::string& message) {
      json reply = {{"error", message}};
      if (!id.is_null()) reply["id"] = id;
      Reply(job.conn, reply);
    };
    if (req.contains("op")) {
      const json& op = req["op"];
      if (op == "info") {
        json reply = {{"model", engine_->config().name},
                      {"fingerprint", HexFingerprint(engine_->fingerprint())},
                      {"block_size", engine_->layout().block_size},
                      {"attn_pack", engine_->layout().attn_pack},
                      {"role", flags_.role},
                      {"nodes", num_nodes_}};
        if (!id.is_null()) reply["id"] = id;
        Reply(job.conn, reply);
      } else if (op == "stats") {
        json reply = Totals();
        if (!id.is_null()) reply["id"] = id;
        Reply(job.conn, reply);
      } else {
        error("unknown op " + op.dump() + " (info, stats, or none for a generate request)");
      }
      return;
    }
    {
      std::lock_guard lock(mu_);
      if (stopping_) return error("the worker is shutting down");
    }
    if (!req.contains("prompt") || !req["prompt"].is_array() || req["prompt"].empty()) {
      return error("a generate request needs \"prompt\": a non-empty array of token ids");
    }
    std::vector<uint32_t> prompt;
    prompt.reserve(req["prompt"].size());
    for (const json& t : req["prompt"]) {
      if (!t.is_number_unsigned() || t.get<uint64_t>() > UINT32_MAX) {
        return error("\"prompt\" holds " + t.dump() + ", not a token id");
      }
      prompt.push_back(t.get<uint32_t>());
    }
    size_t max_new = 16;
    if (req.contains("max_new_tokens")) {
      const json& m = req["max_new_tokens"];
      if (!m.is_number_unsigned() || m.get<uint64_t>() < 1 || m.get<uint64_t>() > (1u << 20)) {
        return error("\"max_new_tokens\" must be an integer from 1 to 1048576");
      }
      max_new = m.get<size_t>();
    }
    const bool prefill = flags_.role == "prefill";
    const auto start = Clock::now();
    auto rid = engine_->AddRequest(std::move(prompt), prefill ? 1 : max_new, prefill);
    if (!rid.ok()) return error(rid.status().ToString());
    pending_[*rid] = Pending{std::move(job.conn), std::move(id), start};
  }

  void Finish(RequestId rid, Clock::time_point now) {
    auto it = pending_.find(rid);
    std::unique_ptr<Request> r = engine_->TakeResult(rid);
    if (it == pending_.end() || r == nullptr) return;
    Pending p = std::move(it->second);
    pending_.erase(it);
    json reply;
    if (!p.id.is_null()) reply["id"] = p.id;
    if (r->state == Request::State::kFailed) {
      reply["error"] = r->error.ToString();
    } else {
      reply["output"] = std::vector<uint32_t>(r->output().begin(), r->output().end());
      reply["prompt_tokens"] = r->num_prompt_tokens;
      reply["local_hit_tokens"] = r->num_cached_tokens;
      reply["node_tokens"] = r->num_external_tokens;
      reply["computed_tokens"] = r->num_computed_prompt_tokens;
      reply["ttft_ms"] = p.ttft_ms >= 0 ? p.ttft_ms : Millis(p.start, now);
      reply["latency_ms"] = Millis(p.start, Clock::now());
      reply["worker"] = Totals();
    }
    Reply(p.conn, reply);
  }

  // The worker's running totals.
  json Totals() const {
    json t = {{"steps", engine_->counters().steps},
              {"prefill_tokens", engine_->counters().prefill_tokens},
              {"decode_tokens", engine_->counters().decode_tokens},
              {"load_failures", engine_->counters().load_failures}};
    if (const KvOffload* offload = engine_->offload()) {
      const OffloadStats s = offload->stats();
      t["loaded_bytes"] = s.bytes_loaded;
      t["stored_bytes"] = s.bytes_stored;
      t["blocks_loaded"] = s.blocks_loaded;
      t["blocks_stored"] = s.blocks_stored;
      t["node_unreachable"] = s.node_unreachable;
      t["node_refusals"] = s.node_refusals;
      t["touched_keys"] = s.touched_keys;
    } else {
      t["loaded_bytes"] = 0;
      t["stored_bytes"] = 0;
    }
    return t;
  }

  Engine* engine_;
  ServeFlags flags_;
  size_t num_nodes_;
  asio::io_context io_;
  tcp::acceptor acceptor_;
  asio::signal_set signals_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> inbox_;
  bool stopping_ = false;
  std::unordered_map<RequestId, Pending> pending_;  // engine thread only
};

void Connection::ReadNext() {
  asio::async_read_until(
      socket_, buf_, '\n', [self = shared_from_this()](const std::error_code& ec, size_t n) {
        if (ec == asio::error::not_found) {
          self->Send(json{{"error", "request line longer than the limit of " +
                                        std::to_string(self->buf_.max_size()) + " bytes"}}
                             .dump() +
                         "\n",
                     /*close_after=*/true);
          return;
        }
        if (ec) return;  // closed by the client
        std::string line(asio::buffers_begin(self->buf_.data()),
                         asio::buffers_begin(self->buf_.data()) + static_cast<ptrdiff_t>(n));
        self->buf_.consume(n);
        while (!line.empty() && (line.back() == '\n' || line.back() == '\r')) line.pop_back();
        if (!line.empty()) {
          json request = json::parse(line, nullptr, /*allow_exceptions=*/false);
          if (request.is_discarded() || !request.is_object()) {
            self->Send(json{{"error",
                             "a request is one JSON object per line, e.g. "
                             "{\"prompt\": [1, 2, 3], \"max_new_tokens\": 8}"}}
                           .dump() +
                       "\n");
          } else {
            self->server_->Submit(Job{self, std::move(request)});
          }
        }
        self->ReadNext();
      });
}

void Connection::Send(std::string line, bool close_after) {
  out_.emplace_back(std::move(line), close_after);
  if (!writing_) WriteNext();
}

void Connection::WriteNext() {
  if (out_.empty()) {
    writing_ = false;
    return;
  }
  writing_ = true;
  asio::async_write(socket_, asio::buffer(out_.front().first),
                    [self = shared_from_this()](const std::error_code& ec, size_t) {
                      const bool close = self->out_.front().second;
                      self->out_.pop_front();
                      if (ec || close) {
                        std::error_code ignored;
                        self->socket_.shutdown(tcp::socket::shutdown_both, ignored);
                        self->socket_.close(ignored);
                        self->out_.clear();
                        self->writing_ = false;
                        return;
                      }
                      self->WriteNext();
                    });
}

// ---------------------------------------------------------------------------------------------
// A blocking client of one worker: one request line out, one reply line back, with a deadline.

class WorkerClient {
 public:
  static Result<std::unique_ptr<WorkerClient>> Connect(const std::string& address,
                                                       std::chrono::milliseconds timeout) {
    KVSTASH_ASSIGN_OR_RETURN(connector::NodeAddress a, connector::ParseNodeAddress(address));
    auto c = std::unique_ptr<WorkerClient>(new WorkerClient(address, timeout));
    tcp::resolver resolver(c->io_);
    std::error_code ec;
    auto endpoints = resolver.resolve(a.host, std::to_string(a.port), ec);
    if (!ec) asio::connect(c->socket_, endpoints, ec);
    if (ec) return UnavailableError("worker {}: cannot connect: {}", address, ec.message());
    return c;
  }

  Result<json> Call(const json& request) {
    const std::string line = request.dump() + "\n";
    std::error_code ec;
    bool done = false;
    size_t n = 0;
    asio::async_write(socket_, asio::buffer(line), [&](const std::error_code& e, size_t) {
      if (e) {
        ec = e;
        done = true;
        return;
      }
      asio::async_read_until(socket_, buf_, '\n', [&](const std::error_code& e2, size_t got) {
        ec = e2;
        n = got;
        done = true;
      });
    });
    io_.restart();
    io_.run_for(timeout_);
    if (!done) {
      socket_.close(ec);
      return DeadlineExceededError("worker {}: no answer within {} ms", address_, timeout_.count());
    }
    if (ec) return UnavailableError("worker {}: {}", address_, ec.message());
    std::string reply(asio::buffers_begin(buf_.data()),
                      asio::buffers_begin(buf_.data()) + static_cast<ptrdiff_t>(n));
    buf_.consume(n);
    json parsed = json::parse(reply, nullptr, false);
    if (parsed.is_discarded() || !parsed.is_object()) {
      return InternalError("worker {}: unparseable reply", address_);
    }
    if (parsed.contains("error")) {
      return InternalError("worker {}: {}", address_, parsed["error"].get<std::string>());
    }
    return parsed;
  }

  const std::string& address() const { return address_; }

 private:
  WorkerClient(std::string address, std::chrono::milliseconds timeout)
      : address_(std::move(address)), timeout_(timeout), socket_(io_) {}
  std::string address_;
  std::chrono::milliseconds timeout_;
  asio::io_context io_;
  tcp::socket socket_;
  asio::streambuf buf_;
};

struct LocalRun {
  std::vector<uint32_t> output;
  double ttft_ms = 0;
};

// The prompt on a local engine without any cache: the time to first token to compare with.
Result<LocalRun> RunWithoutCache(Engine& e, const std::vector<uint32_t>& prompt, size_t max_new) {
  const auto start = Clock::now();
  KVSTASH_ASSIGN_OR_RETURN(RequestId id, e.AddRequest(prompt, max_new));
  LocalRun run;
  run.ttft_ms = -1;
  std::unique_ptr<Request> r;
  while (e.HasUnfinished()) {
    for (RequestId done : e.Step()) r = e.TakeResult(done);
    const Request* live = r ? r.get() : e.Find(id);
    if (run.ttft_ms < 0 && live != nullptr && live->num_output_tokens() > 0) {
      run.ttft_ms = Millis(start, Clock::now());
    }
  }
  if (r == nullptr) return InternalError("the local request did not finish");
  if (r->state == Request::State::kFailed) return r->error;
  run.output.assign(r->output().begin(), r->output().end());
  return run;
}

uint64_t Total(const json& reply, const char* field) {
  return reply.contains("worker") ? reply["worker"].value(field, uint64_t{0}) : 0;
}

int RemoteChat(const ModelFlags& model, const RemoteChatFlags& flags, size_t turns,
               size_t user_tokens, size_t max_new, uint64_t seed) {
  const auto timeout = std::chrono::milliseconds(flags.timeout_ms);
  std::unique_ptr<WorkerClient> prefill;
  if (!flags.prefill_worker.empty()) {
    auto c = WorkerClient::Connect(flags.prefill_worker, timeout);
    if (!c.ok()) return kErrors.Fail(c.status());
    prefill = std::move(*c);
  }
  auto decode_or = WorkerClient::Connect(flags.decode_worker, timeout);
  if (!decode_or.ok()) return kErrors.Fail(decode_or.status());
  std::unique_ptr<WorkerClient> decode = std::move(*decode_or);

  auto decode_info = decode->Call(json{{"op", "info"}});
  if (!decode_info.ok()) return kErrors.Fail(decode_info.status());
  const std::string fingerprint = (*decode_info)["fingerprint"];
  if (prefill) {
    auto info = prefill->Call(json{{"op", "info"}});
    if (!info.ok()) return kErrors.Fail(info.status());
    if ((*info)["fingerprint"] != fingerprint) {
      return kErrors.Fail(InvalidArgumentError(
          "the prefill worker {} runs {} (fingerprint {}) but the decode worker {} runs {} ({}): "
          "their blocks would never match",
          prefill->address(), (*info)["model"].get<std::string>(),
          (*info)["fingerprint"].get<std::string>(), decode->address(),
          (*decode_info)["model"].get<std::string>(), fingerprint));
    }
    if ((*info)["role"] != "prefill") {
      KVSTASH_LOG_WARN("the prefill worker {} runs with --role {}", prefill->address(),
                       (*info)["role"].get<std::string>());
    }
  }

  // The comparison: the same model here, without prefix caching or nodes.
  std::unique_ptr<Engine> local;
  ModelFlags local_flags = model;
  local_flags.nodes.clear();
  local_flags.no_prefix_cache = true;
  auto local_or = MakeEngine(local_flags);
  if (!local_or.ok()) return kErrors.Fail(local_or.status());
  local = std::move(*local_or);
  if (flags.compare && HexFingerprint(local->fingerprint()) != fingerprint) {
    return kErrors.Fail(InvalidArgumentError(
        "the decode worker runs {} (fingerprint {}), not this --model {} ({}); give chat the "
        "workers' model flags",
        (*decode_info)["model"].get<std::string>(), fingerprint, model.model,
        HexFingerprint(local->fingerprint())));
  }
  const uint32_t vocab = local->config().vocab_size;

  std::printf("model=%s workers: prefill=%s decode=%s\n",
              (*decode_info)["model"].get<std::string>().c_str(),
              prefill ? prefill->address().c_str() : "-", decode->address().c_str());
  std::vector<uint32_t> history;
  uint64_t last_loaded = 0, last_stored = 0, last_p_loaded = 0, last_p_stored = 0;
  double sum_ttft = 0, sum_nocache = 0;
  size_t sum_prompt = 0, sum_node = 0, sum_local = 0, mismatches = 0;
  uint64_t sum_bytes = 0;
  for (size_t turn = 1; turn <= turns; ++turn) {
    std::vector<uint32_t> user = RandomTokens(user_tokens, vocab, seed + turn);
    history.insert(history.end(), user.begin(), user.end());
    const json request = {{"id", turn}, {"prompt", history}, {"max_new_tokens", max_new}};
    json p;
    if (prefill) {
      auto reply = prefill->Call(request);
      if (!reply.ok()) return kErrors.Fail(reply.status());
      p = std::move(*reply);
    }
    auto d_or = decode->Call(request);
    if (!d_or.ok()) return kErrors.Fail(d_or.status());
    const json& d = *d_or;
    const std::vector<uint32_t> output = d["output"];
    // Bytes moved this turn: what either worker pushed to or pulled from the nodes.
    const uint64_t p_stored = prefill ? Total(p, "stored_bytes") - last_p_stored : 0;
    const uint64_t p_loaded = prefill ? Total(p, "loaded_bytes") - last_p_loaded : 0;
    const uint64_t d_stored = Total(d, "stored_bytes") - last_stored;
    const uint64_t d_loaded = Total(d, "loaded_bytes") - last_loaded;
    if (prefill) {
      last_p_stored = Total(p, "stored_bytes");
      last_p_loaded = Total(p, "loaded_bytes");
    }
    last_stored = Total(d, "stored_bytes");
    last_loaded = Total(d, "loaded_bytes");
    std::printf("turn=%zu prompt_tokens=%zu", turn, history.size());
    if (prefill) {
      std::printf(
          " prefill_node_tokens=%zu prefill_local_hit_tokens=%zu prefill_computed_tokens=%zu",
          p["node_tokens"].get<size_t>(), p["local_hit_tokens"].get<size_t>(),
          p["computed_tokens"].get<size_t>());
    }
    const double ttft = d["ttft_ms"];
    std::printf(
        " decode_node_tokens=%zu decode_local_hit_tokens=%zu decode_computed_tokens=%zu "
        "ttft_ms=%.2f",
        d["node_tokens"].get<size_t>(), d["local_hit_tokens"].get<size_t>(),
        d["computed_tokens"].get<size_t>(), ttft);
    if (flags.compare) {
      auto base = RunWithoutCache(*local, history, max_new);
      if (!base.ok()) return kErrors.Fail(base.status());
      const bool match = base->output == output;
      mismatches += match ? 0 : 1;
      std::printf(" nocache_ttft_ms=%.2f speedup=%.1fx", base->ttft_ms,
                  ttft > 0 ? base->ttft_ms / ttft : 0.0);
      std::printf(" pushed_bytes=%llu pulled_bytes=%llu tokens=%s\n",
                  static_cast<unsigned long long>(p_stored + d_stored),
                  static_cast<unsigned long long>(p_loaded + d_loaded),
                  match ? "same-as-nocache" : "DIFFERENT");
      sum_nocache += base->ttft_ms;
    } else {
      std::printf(" pushed_bytes=%llu pulled_bytes=%llu\n",
                  static_cast<unsigned long long>(p_stored + d_stored),
                  static_cast<unsigned long long>(p_loaded + d_loaded));
    }
    std::fflush(stdout);
    sum_ttft += ttft;
    sum_prompt += history.size();
    sum_node += d["node_tokens"].get<size_t>();
    sum_local += d["local_hit_tokens"].get<size_t>();
    sum_bytes += p_stored + d_stored + p_loaded + d_loaded;
    history.insert(history.end(), output.begin(), output.end());
  }
  std::printf(
      "total turns=%zu prompt_tokens=%zu decode_node_tokens=%zu decode_local_hit_tokens=%zu "
      "ttft_ms=%.2f",
      turns, sum_prompt, sum_node, sum_local, sum_ttft);
  if (flags.compare) {
    std::printf(" nocache_ttft_ms=%.2f speedup=%.1fx mismatches=%zu", sum_nocache,
                sum_ttft > 0 ? sum_nocache / sum_ttft : 0.0, mismatches);
  }
  std::printf(" bytes_moved=%llu\n", static_cast<unsigned long long>(sum_bytes));
  if (mismatches > 0) {
    return kErrors.Fail(
        InternalError("{} turn(s) generated other tokens than without the cache", mismatches));
  }
  return kExitOk;
}

}  // namespace

int RunServe(const ModelFlags& model, const ServeFlags& serve) {
  if (serve.role != "both" && model.nodes.empty()) {
    return kErrors.Fail(InvalidArgumentError("--role {} needs --nodes", serve.role));
  }
  auto engine = MakeEngine(model);
  if (!engine.ok()) return kErrors.Fail(engine.status());
  size_t num_nodes = 0;
  if (!model.nodes.empty()) num_nodes = std::count(model.nodes.begin(), model.nodes.end(), ',') + 1;
  Server server(engine->get(), serve, num_nodes);
  if (Status s = server.Listen(); !s.ok()) return kErrors.Fail(s);
  std::printf("kvstash-engine serving %s (role %s) on %s:%u\n", (*engine)->config().name.c_str(),
              serve.role.c_str(), serve.listen.c_str(), server.port());
  std::fflush(stdout);
  return server.Serve();
}

int RunRemoteChat(const ModelFlags& model, const RemoteChatFlags& remote, size_t turns,
                  size_t user_tokens, size_t max_new, uint64_t seed) {
  return RemoteChat(model, remote, turns, user_tokens, max_new, seed);
}

}  // namespace kvstash::engine::cli
