#include "kvstash/worker/server.h"

#include <httplib.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <atomic>
#include <chrono>
#include <deque>
#include <map>
#include <optional>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "cache_events.h"
#include "kvstash/common/logging.h"
#include "kvstash/common/mutex.h"
#include "kvstash/http/http_front.h"
#include "kvstash/http/prometheus_text.h"
#include "kvstash/worker/protocol_json.h"

namespace kvstash::worker {
namespace {

using Clock = std::chrono::steady_clock;
using engine::Engine;
using engine::Request;
using engine::RequestId;
using http::FrontOptions;
using http::HttpFront;
using http::Lane;

// How often a thread waiting on the engine for a client looks whether the client has left.
constexpr std::chrono::milliseconds kClientCheck{20};
// Bodies from this size on are given back to the system once parsed: glibc keeps freed memory
// in the arena of the thread that used it, and a few 100 MB bodies would otherwise stay
// resident for good.
constexpr size_t kTrimAfterBytes = size_t{1} << 20;

void GiveBackMemory() {
#if defined(__GLIBC__)
  malloc_trim(0);
#endif
}

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
  bool cancelled GUARDED_BY(mu) = false;        // its client left: the engine drops it
  Status status GUARDED_BY(mu);                 // done and failed: why
  std::vector<uint32_t> tokens GUARDED_BY(mu);  // generated so far (streams: as they come)
  CompletionUsage usage GUARDED_BY(mu);         // done

  // The engine thread's own.
  RequestId engine_id = 0;  // once admitted
  size_t published = 0;     // tokens handed to a stream
  double ttft_ms = -1;
};

// WorkerServer on cpp-httplib behind an HttpFront. Owns the front (and through it the HTTP
// threads, which run only inside Serve); borrows the engine, which only the thread in Serve
// touches. The state the HTTP threads and the engine thread share is under mu_ (the queues,
// stopping, the totals) or each Call's own mutex; Stop is safe from any thread.
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

  Status Bind(const FrontOptions& front);
  // Starts publishing the engine's cache events (options' kv_events).
  Status StartEvents() {
    if (options_.kv_events.endpoint.empty()) return Status::OK();
    KVSTASH_ASSIGN_OR_RETURN(
        cache_events_, CacheEventPublisher::Create(options_.kv_events, engine_->layout().groups));
    info_.kv_events = cache_events_->publisher().endpoint();
    info_.kv_events_replay = cache_events_->publisher().replay_endpoint();
    info_.kv_events_topic = options_.kv_events.default_topic;
    return Status::OK();
  }
  const events::EventPublisher* kv_events() const override {
    return cache_events_ ? &cache_events_->publisher() : nullptr;
  }
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
  bool StreamMore(const std::shared_ptr<Call>& call, const std::string& id, size_t& sent,
                  httplib::DataSink& sink);
  httplib::Server::HandlerResponse HandleError(const httplib::Request& req, httplib::Response& res);
  // Unavailable once stopping.
  Status Submit(std::shared_ptr<Call> call);
  // The client of `call` left: the engine thread drops it. Idempotent; nothing once done.
  void Cancel(const std::shared_ptr<Call>& call);
  // Waits for `ready` (under call.mu) while the client is there; false when it left (the call
  // is cancelled then).
  template <typename Ready>
  bool WaitWhileClientStays(const std::shared_ptr<Call>& call, Ready ready);
  // Totals as of now: the engine thread takes them between two steps.
  WorkerTotals FreshTotals();

  // The engine thread.
  void EngineLoop();
  void Admit(const std::shared_ptr<Call>& call);
  // Drops a call from the engine (its client left, or the stop's grace ran out) and answers
  // it with `status`.
  void Drop(const std::shared_ptr<Call>& call, Status status);
  // Streams get the tokens the step generated; every request its time to first token.
  void Publish(Clock::time_point now);
  void Finish(RequestId id, Clock::time_point step_end);
  void PublishTotals(bool engine_done);

  Engine* const engine_;
  std::unique_ptr<CacheEventPublisher> cache_events_;  // null: no KV events
  const ServerOptions options_;
  WorkerInfo info_;  // set by Create and StartEvents, before any request is served
  const int64_t created_;
  const std::string id_prefix_;
  std::atomic<uint64_t> next_id_{0};
  std::unique_ptr<HttpFront> front_;
  uint16_t port_ = 0;

  Mutex mu_;
  CondVar work_;            // the engine thread: calls, a totals request, or stopping
  CondVar totals_changed_;  // totals_version_ moved on, or the engine thread ended
  CondVar state_changed_;   // open_streams_ fell, or the HTTP server ended
  std::deque<std::shared_ptr<Call>> inbox_ GUARDED_BY(mu_);
  std::deque<std::shared_ptr<Call>> cancels_ GUARDED_BY(mu_);
  bool stopping_ GUARDED_BY(mu_) = false;
  Clock::time_point stop_time_ GUARDED_BY(mu_);
  bool totals_wanted_ GUARDED_BY(mu_) = false;
  uint64_t totals_version_ GUARDED_BY(mu_) = 0;
  WorkerTotals totals_ GUARDED_BY(mu_);
  bool engine_done_ GUARDED_BY(mu_) = false;
  size_t open_streams_ GUARDED_BY(mu_) = 0;  // streaming responses not yet written out
  Status http_failure_ GUARDED_BY(mu_);      // the front failed on its own

  // The engine thread's own.
  std::unordered_map<RequestId, std::shared_ptr<Call>> running_;
  WorkerTotals served_;  // the completions' figures, summed
};

Status HttpWorkerServer::Bind(const FrontOptions& front) {
  FrontOptions o = front;
  o.classify = [](std::string_view method, std::string_view path) {
    if (method != "GET" && method != "HEAD") return Lane::kRequests;
    if (path == "/health") return Lane::kHealth;
    if (path == "/v1/models" || path == "/metrics" || path == "/kvstash/stats") return Lane::kInfo;
    return Lane::kRequests;
  };
  o.error_body = [](int status, std::string_view code, std::string_view message) {
    return Dump(ErrorJson(status, code, message));
  };
  o.error_content_type = "application/json";
  o.on_failure = [this](const Status& failure) {
    {
      MutexLock lock(&mu_);
      http_failure_ = failure;
    }
    Stop();
  };
  KVSTASH_ASSIGN_OR_RETURN(front_, HttpFront::Create(std::move(o)));
  httplib::Server& http = front_->router();
  http.set_payload_max_length(options_.max_body_bytes);
  Route();
  port_ = front_->port();
  return Status::OK();
}

void HttpWorkerServer::Route() {
  httplib::Server& http = front_->router();
  http.Post("/v1/completions",
            [this](const httplib::Request& req, httplib::Response& res,
                   const httplib::ContentReader& reader) { HandleCompletion(req, res, reader); });
  http.Get("/v1/models", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(Dump(ModelsJson(info_, created_)), "application/json");
  });
  http.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
    MutexLock lock(&mu_);
    res.status = stopping_ ? 503 : 200;
    res.set_content(stopping_ ? R"({"status":"stopping"})" : R"({"status":"ok"})",
                    "application/json");
  });
  http.Get("/kvstash/stats", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(Dump(TotalsJson(FreshTotals())), "application/json");
  });
  http.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(MetricsText(FreshTotals(), info_), http::kPrometheusContentType);
  });
  http.set_error_handler(httplib::Server::HandlerWithResponse(
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
  // Read into its final size at once: growing by doubling would hold up to twice the body.
  body.reserve(std::min<uint64_t>(req.get_header_value<uint64_t>("Content-Length"),
                                  options_.max_body_bytes));
  // A large body's memory goes back to the system once it is parsed (or refused).
  struct Trim {
    std::string& body;
    ~Trim() {
      if (body.capacity() < kTrimAfterBytes) return;
      std::string().swap(body);
      GiveBackMemory();
    }
  } trim{body};
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
    if (HttpFront::ReadTimedOut()) {
      return SendError(
          res, 408, "request_timeout",
          fmt::format("the request body did not arrive within {} ms", options_.read_timeout_ms));
    }
    return SendError(res, 400, "invalid_body", "the request body could not be read");
  }
  // Read: from here on it waits only on the engine, and a stopping worker lets it answer.
  HttpFront::Answering();

  std::string param;
  Result<CompletionRequest> parsed = ParseCompletionRequest(body, &param);
  if (body.capacity() >= kTrimAfterBytes) {
    std::string().swap(body);
    GiveBackMemory();
  }
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
  // What the pool can never hold is refused now, not after the prompt's work.
  const size_t prompt_tokens = parsed->prompt.size();
  const size_t max_new = options_.role == Role::kPrefill ? 1 : parsed->max_tokens;
  if (Status fits = engine_->CheckFits(prompt_tokens, max_new); !fits.ok()) {
    const bool prompt_alone = !engine_->CheckFits(prompt_tokens, 1).ok();
    if (prompt_alone) {
      return SendError(res, 400, "invalid_prompt", fits.message(), "prompt");
    }
    return SendError(
        res, 400, "invalid_max_tokens",
        fmt::format("max_tokens {} is more than this worker's KV-cache pool can hold after a "
                    "prompt of {} tokens: {}",
                    parsed->max_tokens, prompt_tokens, fits.message()),
        "max_tokens");
  }
  auto call = std::make_shared<Call>(std::move(parsed).value(), arrival);
  if (Status s = Submit(call); !s.ok()) {
    return SendError(res, 503, "shutting_down", s.message());
  }
  std::string id = fmt::format("{}-{}", id_prefix_, next_id_.fetch_add(1));

  if (call->stream) return StartStream(res, std::move(call), std::move(id));

  Completion completion;
  Status status;
  if (!WaitWhileClientStays(call, [](Call& c) {
        c.mu.AssertHeld();
        return c.done;
      })) {
    // Nobody reads the answer; the connection closes after it.
    res.set_header("Connection", "close");
    return SendError(res, 503, "client_gone", "the client closed its connection");
  }
  {
    MutexLock lock(&call->mu);
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
  if (!WaitWhileClientStays(call, [](Call& c) {
        c.mu.AssertHeld();
        return c.admitted;
      })) {
    res.set_header("Connection", "close");
    return SendError(res, 503, "client_gone", "the client closed its connection");
  }
  {
    MutexLock lock(&call->mu);
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
        return StreamMore(call, id, sent, sink);
      },
      // Runs once the response is written (or abandoned): Serve waits for it before closing.
      // A stream that ended early (its client left, or stopped reading) is cancelled.
      [this, call](bool success) {
        if (!success) Cancel(call);
        MutexLock lock(&mu_);
        --open_streams_;
        state_changed_.SignalAll();
      });
}

bool HttpWorkerServer::StreamMore(const std::shared_ptr<Call>& call, const std::string& id,
                                  size_t& sent, httplib::DataSink& sink) {
  std::vector<uint32_t> fresh;
  bool done = false;
  Status status;
  CompletionUsage usage;
  if (!WaitWhileClientStays(call, [sent](Call& c) {
        c.mu.AssertHeld();
        return c.tokens.size() > sent || c.done;
      })) {
    return false;  // the client left: the response ends, and the call was cancelled
  }
  {
    MutexLock lock(&call->mu);
    if (call->tokens.size() > sent) fresh.assign(call->tokens.begin() + sent, call->tokens.end());
    done = call->done;
    status = call->status;
    usage = call->usage;
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

void HttpWorkerServer::Cancel(const std::shared_ptr<Call>& call) {
  {
    MutexLock lock(&call->mu);
    if (call->done || call->cancelled) return;
    call->cancelled = true;
  }
  MutexLock lock(&mu_);
  cancels_.push_back(call);
  work_.Signal();
}

template <typename Ready>
bool HttpWorkerServer::WaitWhileClientStays(const std::shared_ptr<Call>& call, Ready ready) {
  {
    MutexLock lock(&call->mu);
    // The engine wakes this at once when it is ready; the client is looked at in between.
    Clock::time_point next_check = Clock::now() + kClientCheck;
    while (!ready(*call)) {
      call->changed.WaitFor(&call->mu, kClientCheck);
      if (ready(*call) || Clock::now() < next_check) continue;
      if (HttpFront::ClientGone()) break;
      next_check = Clock::now() + kClientCheck;
    }
    if (ready(*call)) return true;
  }
  Cancel(call);
  return false;
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
    KVSTASH_LOG_INFO(
        "kvstash worker: stopping (the requests in flight get {} ms to finish, then are "
        "cancelled)",
        options_.stop_grace_ms);
    stop_time_ = Clock::now();
    if (front_) front_->Closing();
  }
  stopping_ = true;
  work_.Signal();
}

Status HttpWorkerServer::Serve() {
  front_->Start();
  EngineLoop();
  Status failure;
  Clock::time_point flushed;
  {
    MutexLock lock(&mu_);
    // Every call has its answer; streams and others may still be writing theirs (a client
    // slow to read them is cut off half a second past the stop's grace).
    flushed = std::max(stop_time_ + std::chrono::milliseconds(options_.stop_grace_ms + 500),
                       Clock::now() + std::chrono::milliseconds(100));
    while (open_streams_ > 0 && Clock::now() < flushed) {
      state_changed_.WaitFor(&mu_, std::chrono::milliseconds(10));
    }
    failure = http_failure_;
  }
  front_->Shutdown(flushed);
  if (!failure.ok()) {
    return UnavailableError("the HTTP server on port {} stopped on its own: {}", port_,
                            failure.ToString());
  }
  return Status::OK();
}

void HttpWorkerServer::EngineLoop() {
  std::optional<Clock::time_point> grace_end;
  for (;;) {
    std::deque<std::shared_ptr<Call>> calls;
    std::deque<std::shared_ptr<Call>> cancels;
    const bool busy = engine_->HasUnfinished();
    {
      MutexLock lock(&mu_);
      while (!busy && inbox_.empty() && cancels_.empty() && !totals_wanted_ && !stopping_) {
        work_.Wait(&mu_);
      }
      if (!busy && inbox_.empty() && stopping_) break;
      if (stopping_ && !grace_end) {
        grace_end = stop_time_ + std::chrono::milliseconds(options_.stop_grace_ms);
      }
      calls.swap(inbox_);
      cancels.swap(cancels_);
      totals_wanted_ = false;
    }
    for (const std::shared_ptr<Call>& call : cancels) {
      Drop(call, CancelledError("the client closed its connection"));
    }
    for (const std::shared_ptr<Call>& call : calls) Admit(call);
    if (grace_end && Clock::now() >= *grace_end && !running_.empty()) {
      // Stopping, and the grace is over: what is still running is cancelled.
      std::vector<std::shared_ptr<Call>> left;
      for (const auto& [id, call] : running_) left.push_back(call);
      for (const std::shared_ptr<Call>& call : left) {
        Drop(call, UnavailableError("the worker stopped before the request finished (it gives "
                                    "the requests in flight {} ms)",
                                    options_.stop_grace_ms));
      }
    }
    if (engine_->HasUnfinished()) {
      const std::vector<RequestId> done = engine_->Step();
      if (cache_events_) cache_events_->Publish(engine_->TakeCacheEvents());
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
  {
    MutexLock lock(&call->mu);
    if (call->cancelled) return;  // its client left before the engine saw it
  }
  // A prefill worker computes the prompt and its first token, and pushes every full block for
  // the decode worker that continues it.
  const bool prefill = options_.role == Role::kPrefill;
  Result<RequestId> id = engine_->AddRequest(call->prompt, prefill ? 1 : call->max_tokens,
                                             /*do_remote_decode=*/prefill);
  if (id.ok()) {
    running_[*id] = call;
    call->engine_id = *id;
  }
  MutexLock lock(&call->mu);
  call->admitted = true;
  if (!id.ok()) {
    call->done = true;
    call->status = id.status();
  }
  call->changed.SignalAll();
}

void HttpWorkerServer::Drop(const std::shared_ptr<Call>& call, Status status) {
  if (call->engine_id != 0 && running_.erase(call->engine_id) > 0) {
    if (Status aborted = engine_->Abort(call->engine_id); !aborted.ok()) {
      KVSTASH_LOG_WARN("kvstash worker: {}", aborted.ToString());
    }
  }
  MutexLock lock(&call->mu);
  if (call->done) return;
  ++served_.cancelled_requests;
  call->admitted = true;
  call->done = true;
  call->status = std::move(status);
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
    t.client = s.client;
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
  if (options.stop_grace_ms < 0) {
    return InvalidArgumentError("a stop grace of {} ms: at least 0", options.stop_grace_ms);
  }
  WorkerInfo info;
  info.model = engine->config().name;
  info.fingerprint = engine->fingerprint();
  info.block_size = engine->layout().block_size;
  info.attn_pack = engine->layout().attn_pack;
  info.role = options.role;
  info.nodes = options.num_nodes;
  info.groups = engine->layout().groups;
  info.hash_block_size = engine->kv_cache().hash_block_size();
  info.cache_salt = engine->cache_salt();
  FrontOptions front;
  front.name = "kvstash worker";
  front.listen = options.listen;
  front.port = options.port;
  front.backlog = options.listen_backlog;
  front.request_threads = options.http_threads;
  front.max_connections = options.max_connections;
  front.header_timeout = std::chrono::milliseconds(options.header_timeout_ms);
  front.read_timeout = std::chrono::milliseconds(options.read_timeout_ms);
  front.write_timeout = std::chrono::milliseconds(options.write_timeout_ms);
  front.keep_alive = std::chrono::seconds(options.keep_alive_seconds);
  auto server = std::make_unique<HttpWorkerServer>(engine, options, std::move(info));
  KVSTASH_RETURN_IF_ERROR(server->StartEvents());
  KVSTASH_RETURN_IF_ERROR(server->Bind(front));
  return std::unique_ptr<WorkerServer>(std::move(server));
}

}  // namespace kvstash::worker
