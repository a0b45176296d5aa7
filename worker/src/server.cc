#include "kvstash/worker/server.h"

#include <httplib.h>
#include <sys/socket.h>

#include <atomic>
#include <chrono>
#include <deque>
#include <map>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "kvstash/common/logging.h"
#include "kvstash/common/mutex.h"
#include "protocol_json.h"

namespace kvstash::worker {
namespace {

using Clock = std::chrono::steady_clock;
using engine::Engine;
using engine::Request;
using engine::RequestId;

double Millis(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

int64_t UnixSeconds() {
  return std::chrono::duration_cast<std::chrono::seconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// The HTTP status and error code that answer an engine's Status.
std::pair<int, std::string_view> HttpErrorOf(const Status& status) {
  switch (status.code()) {
    case StatusCode::kInvalidArgument:
    case StatusCode::kOutOfRange:
      return {400, "invalid_prompt"};
    case StatusCode::kUnavailable:
    case StatusCode::kResourceExhausted:
      return {503, "engine_unavailable"};
    default:
      return {500, "engine_error"};
  }
}

// The methods each endpoint answers: another method on one of these paths is a 405.
const std::map<std::string_view, std::string_view>& AllowedMethods() {
  static const auto* allowed = new std::map<std::string_view, std::string_view>{
      {"/v1/completions", "POST"}, {"/v1/models", "GET, HEAD"},     {"/health", "GET, HEAD"},
      {"/metrics", "GET, HEAD"},   {"/kvstash/stats", "GET, HEAD"},
  };
  return *allowed;
}

void SendError(httplib::Response& res, int status, std::string_view code, std::string_view message,
               std::string_view param = {}) {
  res.status = status;
  res.set_content(Dump(ErrorJson(status, code, message, param)), "application/json");
}

// One completion request on its way from the HTTP thread that parsed it to the engine thread
// that runs it, and back. Shared (shared_ptr) by the handler, its streaming content provider
// (which runs after the handler has returned) and the engine thread. Thread-safe: what more than
// one thread touches is under `mu`.
struct Call {
  Call(CompletionRequest request, Clock::time_point arrival)
      : prompt(std::move(request.prompt)),
        max_tokens(request.max_tokens),
        stream(request.stream),
        start(arrival) {}

  // Set before the call is submitted; read-only after.
  const std::vector<uint32_t> prompt;
  const size_t max_tokens;
  const bool stream;
  const Clock::time_point start;

  Mutex mu;
  CondVar changed;                       // admitted, done, or (streams) more tokens
  bool admitted GUARDED_BY(mu) = false;  // the engine took it (or refused it: done)
  bool done GUARDED_BY(mu) = false;
  Status status GUARDED_BY(mu);                 // done and failed: why
  std::vector<uint32_t> tokens GUARDED_BY(mu);  // generated so far (streams: as they come)
  CompletionUsage usage GUARDED_BY(mu);         // done

  // The engine thread's own.
  size_t published = 0;  // tokens handed to a stream
  double ttft_ms = -1;
};

// WorkerServer on cpp-httplib. Owns its httplib::Server (and through it the HTTP threads, which
// run only inside Serve); borrows the engine, which only the thread in Serve touches. The state
// the HTTP threads and the engine thread share is under mu_ (the queue, stopping, the totals)
// or each Call's own mutex; Stop is safe from any thread.
class HttpWorkerServer final : public WorkerServer {
 public:
  HttpWorkerServer(Engine* engine, const ServerOptions& options, WorkerInfo info)
      : engine_(engine),
        options_(options),
        info_(std::move(info)),
        created_(UnixSeconds()),
        id_prefix_(fmt::format("cmpl-{:x}", std::chrono::duration_cast<std::chrono::microseconds>(
                                                std::chrono::system_clock::now().time_since_epoch())
                                                .count())) {}

  Status Bind();
  uint16_t port() const override { return port_; }
  Status Serve() override;
  void Stop() override;

 private:
  void Route();
  // HTTP handler threads.
  void HandleCompletion(const httplib::Request& req, httplib::Response& res,
                        const httplib::ContentReader& reader);
  void StartStream(httplib::Response& res, std::shared_ptr<Call> call, std::string id);
  // Writes what `call` has produced since `sent` tokens; blocks until there is something.
  bool StreamMore(Call& call, const std::string& id, size_t& sent, httplib::DataSink& sink);
  httplib::Server::HandlerResponse HandleError(const httplib::Request& req, httplib::Response& res);
  // Unavailable once stopping.
  Status Submit(std::shared_ptr<Call> call);
  // Totals as of now: the engine thread takes them between two steps.
  WorkerTotals FreshTotals();

  // The engine thread.
  void EngineLoop();
  void Admit(const std::shared_ptr<Call>& call);
  // Streams get the tokens the step generated; every request its time to first token.
  void Publish(Clock::time_point now);
  void Finish(RequestId id, Clock::time_point step_end);
  void PublishTotals(bool engine_done);

  Engine* const engine_;
  const ServerOptions options_;
  const WorkerInfo info_;
  const int64_t created_;
  const std::string id_prefix_;
  std::atomic<uint64_t> next_id_{0};
  httplib::Server http_;
  uint16_t port_ = 0;

  Mutex mu_;
  CondVar work_;            // the engine thread: calls, a totals request, or stopping
  CondVar totals_changed_;  // totals_version_ moved on, or the engine thread ended
  CondVar state_changed_;   // open_streams_ fell, or the HTTP server ended
  std::deque<std::shared_ptr<Call>> inbox_ GUARDED_BY(mu_);
  bool stopping_ GUARDED_BY(mu_) = false;
  bool totals_wanted_ GUARDED_BY(mu_) = false;
  uint64_t totals_version_ GUARDED_BY(mu_) = 0;
  WorkerTotals totals_ GUARDED_BY(mu_);
  bool engine_done_ GUARDED_BY(mu_) = false;
  size_t open_streams_ GUARDED_BY(mu_) = 0;  // streaming responses not yet written out
  bool http_done_ GUARDED_BY(mu_) = false;
  bool http_stopped_ GUARDED_BY(mu_) = false;  // Serve stopped it (else it failed)

  // The engine thread's own.
  std::unordered_map<RequestId, std::shared_ptr<Call>> running_;
  WorkerTotals served_;  // the completions' figures, summed
};

Status HttpWorkerServer::Bind() {
  // SO_REUSEADDR only: httplib's default also sets SO_REUSEPORT, with which a second worker on a
  // taken port would start and share it instead of failing.
  http_.set_socket_options([](socket_t sock) {
    int yes = 1;
    ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
  });
  http_.set_tcp_nodelay(true);  // a stream's events leave as they are written
  http_.set_payload_max_length(options_.max_body_bytes);
  http_.set_keep_alive_timeout(options_.keep_alive_seconds);
  const size_t threads = options_.http_threads;
  // httplib takes ownership of the queue it is given.
  http_.new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
  Route();
  int port = -1;
  if (options_.port == 0) {
    port = http_.bind_to_any_port(options_.listen);
  } else if (http_.bind_to_port(options_.listen, options_.port)) {
    port = options_.port;
  }
  if (port <= 0) {
    return UnavailableError("cannot listen on {}:{} (the port is taken, or no such address here)",
                            options_.listen, options_.port);
  }
  port_ = static_cast<uint16_t>(port);
  return Status::OK();
}

void HttpWorkerServer::Route() {
  http_.Post("/v1/completions",
             [this](const httplib::Request& req, httplib::Response& res,
                    const httplib::ContentReader& reader) { HandleCompletion(req, res, reader); });
  http_.Get("/v1/models", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(Dump(ModelsJson(info_, created_)), "application/json");
  });
  http_.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
    MutexLock lock(&mu_);
    res.status = stopping_ ? 503 : 200;
    res.set_content(stopping_ ? R"({"status":"stopping"})" : R"({"status":"ok"})",
                    "application/json");
  });
  http_.Get("/kvstash/stats", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(Dump(TotalsJson(FreshTotals())), "application/json");
  });
  http_.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(MetricsText(FreshTotals(), info_), "text/plain; version=0.0.4; charset=utf-8");
  });
  http_.set_error_handler(httplib::Server::HandlerWithResponse(
      [this](const httplib::Request& req, httplib::Response& res) {
        return HandleError(req, res);
      }));
}

httplib::Server::HandlerResponse HttpWorkerServer::HandleError(const httplib::Request& req,
                                                               httplib::Response& res) {
  // Replies our handlers wrote (an error object already) stay as they are.
  if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
  const auto& allowed = AllowedMethods();
  if (const auto it = allowed.find(req.path); it != allowed.end()) {
    const bool head_of_get = req.method == "HEAD" && it->second != "POST";
    if (it->second.find(req.method) == std::string_view::npos && !head_of_get) {
      res.set_header("Allow", std::string(it->second));
      SendError(res, 405, "method_not_allowed",
                fmt::format("{} {} is not allowed: {} only", req.method, req.path, it->second));
      return httplib::Server::HandlerResponse::Handled;
    }
  }
  switch (res.status) {
    case 404:
      SendError(res, 404, "not_found",
                fmt::format("no endpoint {} {} (POST /v1/completions; GET /v1/models, /health, "
                            "/metrics, /kvstash/stats)",
                            req.method, req.path));
      break;
    case 413:
      res.set_header("Connection", "close");
      SendError(res, 413, "request_too_large",
                fmt::format("the request body is longer than the limit of {} bytes",
                            options_.max_body_bytes));
      break;
    default:
      SendError(res, res.status, res.status >= 500 ? "server_error" : "bad_request",
                fmt::format("HTTP {} for {} {}", res.status, req.method, req.path));
      break;
  }
  return httplib::Server::HandlerResponse::Handled;
}

void HttpWorkerServer::HandleCompletion(const httplib::Request& req, httplib::Response& res,
                                        const httplib::ContentReader& reader) {
  const Clock::time_point arrival = Clock::now();
  std::string body;
  bool too_large = false;
  const bool read = reader([&](const char* data, size_t n) {
    if (n > options_.max_body_bytes - body.size()) {
      too_large = true;
      return false;
    }
    body.append(data, n);
    return true;
  });
  // 413 from httplib: a Content-Length past the limit (it skipped the body).
  if (too_large || res.status == 413) {
    // What is left of the body is not read: the connection cannot carry another request.
    res.set_header("Connection", "close");
    return SendError(res, 413, "request_too_large",
                     fmt::format("the request body is longer than the limit of {} bytes",
                                 options_.max_body_bytes));
  }
  if (!read) {
    res.set_header("Connection", "close");
    return SendError(res, 400, "invalid_body", "the request body could not be read");
  }

  std::string param;
  Result<CompletionRequest> parsed = ParseCompletionRequest(body, &param);
  if (!parsed.ok()) {
    return SendError(res, 400, param.empty() ? "invalid_json" : "invalid_" + param,
                     parsed.status().message(), param);
  }
  if (parsed->model && *parsed->model != info_.model) {
    return SendError(res, 404, "model_not_found",
                     fmt::format("the model '{}' is not served here: this worker serves '{}'",
                                 *parsed->model, info_.model),
                     "model");
  }
  auto call = std::make_shared<Call>(std::move(parsed).value(), arrival);
  if (Status s = Submit(call); !s.ok()) {
    return SendError(res, 503, "shutting_down", s.message());
  }
  std::string id = fmt::format("{}-{}", id_prefix_, next_id_.fetch_add(1));

  if (call->stream) return StartStream(res, std::move(call), std::move(id));

  Completion completion;
  Status status;
  {
    MutexLock lock(&call->mu);
    while (!call->done) call->changed.Wait(&call->mu);
    status = call->status;
    completion.tokens = call->tokens;
    completion.usage = call->usage;
  }
  if (!status.ok()) {
    const auto [http_status, code] = HttpErrorOf(status);
    return SendError(res, http_status, code, status.message(), http_status == 400 ? "prompt" : "");
  }
  completion.id = std::move(id);
  completion.model = info_.model;
  completion.finish_reason = "length";
  res.set_content(Dump(CompletionJson(completion, created_)), "application/json");
}

void HttpWorkerServer::StartStream(httplib::Response& res, std::shared_ptr<Call> call,
                                   std::string id) {
  // A request the engine refuses (a token past the vocabulary) is still an ordinary error
  // reply: the events start once the engine has taken it.
  {
    MutexLock lock(&call->mu);
    while (!call->admitted) call->changed.Wait(&call->mu);
    if (call->done && !call->status.ok()) {
      const auto [http_status, code] = HttpErrorOf(call->status);
      return SendError(res, http_status, code, call->status.message(),
                       http_status == 400 ? "prompt" : "");
    }
  }
  {
    MutexLock lock(&mu_);
    ++open_streams_;
  }
  res.set_header("Cache-Control", "no-cache");
  res.set_chunked_content_provider(
      "text/event-stream",
      [this, call, id = std::move(id), sent = size_t{0}](size_t, httplib::DataSink& sink) mutable {
        return StreamMore(*call, id, sent, sink);
      },
      // Runs once the response is written (or abandoned): Serve waits for it before closing.
      [this](bool) {
        MutexLock lock(&mu_);
        --open_streams_;
        state_changed_.SignalAll();
      });
}

bool HttpWorkerServer::StreamMore(Call& call, const std::string& id, size_t& sent,
                                  httplib::DataSink& sink) {
  std::vector<uint32_t> fresh;
  bool done = false;
  Status status;
  CompletionUsage usage;
  {
    MutexLock lock(&call.mu);
    while (call.tokens.size() <= sent && !call.done) call.changed.Wait(&call.mu);
    if (call.tokens.size() > sent) fresh.assign(call.tokens.begin() + sent, call.tokens.end());
    done = call.done;
    status = call.status;
    usage = call.usage;
  }
  std::string out;
  auto event = [&out](const json& data) { out += "data: " + Dump(data) + "\n\n"; };
  for (size_t i = 0; i < fresh.size(); ++i) {
    const bool last = done && status.ok() && i + 1 == fresh.size();
    event(ChunkJson(id, created_, info_.model, fresh[i], sent + i == 0, last ? &usage : nullptr,
                    "length"));
  }
  sent += fresh.size();
  if (done) {
    if (!status.ok()) {
      const auto [http_status, code] = HttpErrorOf(status);
      event(ErrorJson(http_status, code, status.message()));
    } else if (fresh.empty()) {
      event(ChunkJson(id, created_, info_.model, std::nullopt, sent == 0, &usage, "length"));
    }
    out += "data: [DONE]\n\n";
  }
  if (!out.empty() && !sink.write(out.data(), out.size())) return false;  // the client left
  if (done) sink.done();
  return true;
}

Status HttpWorkerServer::Submit(std::shared_ptr<Call> call) {
  MutexLock lock(&mu_);
  if (stopping_) return UnavailableError("the worker is shutting down");
  inbox_.push_back(std::move(call));
  work_.Signal();
  return Status::OK();
}

WorkerTotals HttpWorkerServer::FreshTotals() {
  MutexLock lock(&mu_);
  const uint64_t seen = totals_version_;
  if (!engine_done_) {
    totals_wanted_ = true;
    work_.Signal();
    while (totals_version_ == seen && !engine_done_) totals_changed_.Wait(&mu_);
  }
  return totals_;
}

void HttpWorkerServer::Stop() {
  MutexLock lock(&mu_);
  if (!stopping_) {
    KVSTASH_LOG_INFO("kvstash worker: stopping (finishing the requests in flight first)");
  }
  stopping_ = true;
  work_.Signal();
}

Status HttpWorkerServer::Serve() {
  std::thread http([this] {
    const bool ok = http_.listen_after_bind();
    MutexLock lock(&mu_);
    if (!http_stopped_) {
      KVSTASH_LOG_ERROR("kvstash worker: the HTTP server stopped on its own ({})",
                        ok ? "no error" : "accept failed");
    }
    http_done_ = true;
    stopping_ = true;
    work_.Signal();
    state_changed_.SignalAll();
  });
  EngineLoop();
  bool failed = false;
  {
    MutexLock lock(&mu_);
    // Every call has its answer; streams may still be writing theirs.
    while (open_streams_ > 0 && !http_done_) state_changed_.Wait(&mu_);
    failed = http_done_ && !http_stopped_;
    http_stopped_ = true;
    // stop() does nothing until the server runs: asked again until the thread says it ended.
    while (!http_done_) {
      http_.stop();
      state_changed_.WaitFor(&mu_, std::chrono::milliseconds(20));
    }
  }
  http.join();
  if (failed) return UnavailableError("the HTTP server on port {} stopped on its own", port_);
  return Status::OK();
}

void HttpWorkerServer::EngineLoop() {
  for (;;) {
    std::deque<std::shared_ptr<Call>> calls;
    const bool busy = engine_->HasUnfinished();
    {
      MutexLock lock(&mu_);
      while (!busy && inbox_.empty() && !totals_wanted_ && !stopping_) work_.Wait(&mu_);
      if (!busy && inbox_.empty() && stopping_) break;
      calls.swap(inbox_);
      totals_wanted_ = false;
    }
    for (const std::shared_ptr<Call>& call : calls) Admit(call);
    if (engine_->HasUnfinished()) {
      const std::vector<RequestId> done = engine_->Step();
      const Clock::time_point now = Clock::now();
      Publish(now);
      if (!done.empty()) {
        // An answer means the request's blocks are on the nodes: the decode worker (or the
        // next turn) that asks next finds them.
        engine_->DrainOffload();
        for (const RequestId id : done) Finish(id, now);
      }
    }
    PublishTotals(/*engine_done=*/false);
  }
  engine_->DrainOffload();
  PublishTotals(/*engine_done=*/true);
}

void HttpWorkerServer::Admit(const std::shared_ptr<Call>& call) {
  // A prefill worker computes the prompt and its first token, and pushes every full block for
  // the decode worker that continues it.
  const bool prefill = options_.role == Role::kPrefill;
  Result<RequestId> id = engine_->AddRequest(call->prompt, prefill ? 1 : call->max_tokens,
                                             /*do_remote_decode=*/prefill);
  if (id.ok()) running_[*id] = call;
  MutexLock lock(&call->mu);
  call->admitted = true;
  if (!id.ok()) {
    call->done = true;
    call->status = id.status();
  }
  call->changed.SignalAll();
}

void HttpWorkerServer::Publish(Clock::time_point now) {
  for (auto& [id, call] : running_) {
    const Request* r = engine_->Find(id);
    if (r == nullptr) continue;
    const size_t n = r->num_output_tokens();
    if (n > 0 && call->ttft_ms < 0) call->ttft_ms = Millis(call->start, now);
    // A finished request's last tokens go out with its usage, once its blocks have landed.
    if (!call->stream || n <= call->published || r->state == Request::State::kFinished ||
        r->state == Request::State::kFailed) {
      continue;
    }
    const std::span<const uint32_t> output = r->output();
    MutexLock lock(&call->mu);
    call->tokens.insert(call->tokens.end(), output.begin() + call->published, output.end());
    call->published = n;
    call->changed.SignalAll();
  }
}

void HttpWorkerServer::Finish(RequestId id, Clock::time_point step_end) {
  const auto it = running_.find(id);
  std::unique_ptr<Request> r = engine_->TakeResult(id);
  if (it == running_.end() || r == nullptr) return;
  const std::shared_ptr<Call> call = std::move(it->second);
  running_.erase(it);
  MutexLock lock(&call->mu);
  call->done = true;
  if (r->state == Request::State::kFailed) {
    call->status = r->error.ok() ? InternalError("the engine failed the request") : r->error;
    ++served_.failed_requests;
  } else {
    CompletionUsage& u = call->usage;
    u.prompt_tokens = r->num_prompt_tokens;
    u.completion_tokens = r->num_output_tokens();
    u.local_hit_tokens = r->num_cached_tokens;
    u.node_tokens = r->num_external_tokens;
    u.computed_tokens = r->num_computed_prompt_tokens;
    u.ttft_ms = call->ttft_ms >= 0 ? call->ttft_ms : Millis(call->start, step_end);
    u.latency_ms = Millis(call->start, Clock::now());
    call->tokens.assign(r->output().begin(), r->output().end());
    ++served_.requests;
    served_.prompt_tokens += u.prompt_tokens;
    served_.generation_tokens += u.completion_tokens;
    served_.local_hit_tokens += u.local_hit_tokens;
    served_.node_tokens += u.node_tokens;
    served_.computed_tokens += u.computed_tokens;
  }
  call->changed.SignalAll();
}

void HttpWorkerServer::PublishTotals(bool engine_done) {
  WorkerTotals t = served_;
  t.running_requests = running_.size();
  const engine::EngineCounters& c = engine_->counters();
  t.steps = c.steps;
  t.prefill_tokens = c.prefill_tokens;
  t.decode_tokens = c.decode_tokens;
  t.preemptions = c.preemptions;
  t.load_failures = c.load_failures;
  if (const engine::KvOffload* offload = engine_->offload()) {
    const engine::OffloadStats s = offload->stats();
    t.loaded_bytes = s.bytes_loaded;
    t.stored_bytes = s.bytes_stored;
    t.blocks_loaded = s.blocks_loaded;
    t.blocks_stored = s.blocks_stored;
    t.node_unreachable = s.node_unreachable;
    t.node_refusals = s.node_refusals;
    t.touched_keys = s.touched_keys;
    t.node_unserved_keys = s.node_unserved_keys;
    t.members_joined = s.members_joined;
    t.members_left = s.members_left;
  }
  MutexLock lock(&mu_);
  totals_ = t;
  ++totals_version_;
  if (engine_done) engine_done_ = true;
  totals_changed_.SignalAll();
}

}  // namespace

Result<std::unique_ptr<WorkerServer>> WorkerServer::Create(Engine* engine,
                                                           const ServerOptions& options) {
  if (engine == nullptr) return InvalidArgumentError("a worker server needs an engine");
  if (options.http_threads == 0) return InvalidArgumentError("a worker needs HTTP threads");
  if (options.max_body_bytes == 0) return InvalidArgumentError("a body limit of 0 bytes");
  if (options.keep_alive_seconds < 1) {
    return InvalidArgumentError("keep-alive of {} s: at least 1", options.keep_alive_seconds);
  }
  WorkerInfo info;
  info.model = engine->config().name;
  info.fingerprint = engine->fingerprint();
  info.block_size = engine->layout().block_size;
  info.attn_pack = engine->layout().attn_pack;
  info.role = options.role;
  info.nodes = options.num_nodes;
  auto server = std::make_unique<HttpWorkerServer>(engine, options, std::move(info));
  KVSTASH_RETURN_IF_ERROR(server->Bind());
  return std::unique_ptr<WorkerServer>(std::move(server));
}

}  // namespace kvstash::worker
