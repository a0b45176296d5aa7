#include "kvstash/router/router_server.h"

#include <fmt/format.h>

#include <ctime>
#include <deque>
#include <thread>
#include <utility>

#include "kvstash/common/logging.h"
#include "kvstash/common/mutex.h"
#include "kvstash/http/http_front.h"
#include "kvstash/http/prometheus_text.h"
#include "kvstash/worker/protocol_json.h"

namespace kvstash::router {
namespace {

using nlohmann::json;

// The HTTP status and error code of a failed completion.
std::pair<int, const char*> HttpErrorOf(const Status& status) {
  switch (status.code()) {
    case StatusCode::kInvalidArgument:
      return {400, "invalid_request"};
    case StatusCode::kNotFound:
      return {404, "model_not_found"};
    case StatusCode::kUnavailable:
      return {503, "no_worker_available"};
    case StatusCode::kDeadlineExceeded:
      return {504, "worker_timeout"};
    default:
      return {500, "internal_error"};
  }
}

void SendError(httplib::Response& res, int status, std::string_view code, std::string_view message,
               std::string_view param = {}) {
  res.status = status;
  res.set_content(worker::Dump(worker::ErrorJson(status, code, message, param)),
                  "application/json");
}

json WorkersJson(const std::vector<WorkerView>& workers) {
  json list = json::array();
  for (const WorkerView& w : workers) {
    list.push_back({{"address", w.address},
                    {"role", worker::RoleName(w.role)},
                    {"up", w.up},
                    {"member", w.member},
                    {"events", w.events},
                    {"running", w.running},
                    {"blocks", w.blocks},
                    {"chosen", w.chosen},
                    {"failures", w.failures},
                    {"hit_tokens", w.hit_tokens}});
  }
  return list;
}

class HttpRouterServer final : public RouterServer {
 public:
  HttpRouterServer(const RouterServerOptions& options, Router* router)
      : options_(options), router_(router), created_(static_cast<int64_t>(std::time(nullptr))) {}

  Status Bind() {
    http::FrontOptions o;
    o.name = "kvstash router";
    o.listen = options_.listen;
    o.port = options_.port;
    o.request_threads = options_.request_threads;
    o.classify = [](std::string_view method, std::string_view path) {
      if (method != "GET" && method != "HEAD") return http::Lane::kRequests;
      if (path == "/health") return http::Lane::kHealth;
      if (path == "/v1/models" || path == "/metrics" || path == "/kvstash/router") {
        return http::Lane::kInfo;
      }
      return http::Lane::kRequests;
    };
    o.error_body = [](int status, std::string_view code, std::string_view message) {
      return worker::Dump(worker::ErrorJson(status, code, message));
    };
    o.error_content_type = "application/json";
    o.on_failure = [this](const Status& failure) {
      {
        MutexLock lock(&mu_);
        failure_ = failure;
      }
      Stop(std::chrono::milliseconds(0));
    };
    KVSTASH_ASSIGN_OR_RETURN(front_, http::HttpFront::Create(std::move(o)));
    httplib::Server& http = front_->router();
    http.set_payload_max_length(options_.max_body_bytes);
    // A handler that throws (a bug: nothing here should) answers a 500 that says so, logged
    // once per occurrence, rather than httplib's empty one.
    http.set_exception_handler(
        [](const httplib::Request& req, httplib::Response& res, std::exception_ptr error) {
          std::string what = "unknown exception";
          try {
            std::rethrow_exception(error);
          } catch (const std::exception& e) {
            what = e.what();
          } catch (...) {
          }
          KVSTASH_LOG_ERROR("kvstash router: {} {} failed: {}", req.method, req.path, what);
          SendError(res, 500, "internal_error", fmt::format("the router failed: {}", what));
        });
    http.Post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res) {
      HandleCompletion(req, res);
    });
    // Where a completion would go, without running it (an operator's question, a test's wait).
    http.Post("/kvstash/route", [this](const httplib::Request& req, httplib::Response& res) {
      std::string param;
      Result<worker::CompletionRequest> parsed = worker::ParseCompletionRequest(req.body, &param);
      if (!parsed.ok()) {
        return SendError(res, 400, param.empty() ? "invalid_json" : "invalid_" + param,
                         parsed.status().message(), param);
      }
      res.set_content(ChoiceJson(*router_, router_->Choose(parsed->prompt)), "application/json");
    });
    http.Get("/v1/models", [this](const httplib::Request&, httplib::Response& res) {
      worker::WorkerInfo info = router_->model();
      info.kv_events.clear();
      info.kv_events_replay.clear();
      info.kv_events_topic.clear();
      res.set_content(worker::Dump(worker::ModelsJson(info, created_)), "application/json");
    });
    http.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
      bool any = false;
      for (const WorkerView& w : router_->decode_workers()) any = any || w.up;
      res.status = any ? 200 : 503;
      res.set_content(any ? R"({"status":"ok"})" : R"({"status":"no decode worker is up"})",
                      "application/json");
    });
    http.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
      res.set_content(RouterMetricsText(*router_), http::kPrometheusContentType);
    });
    http.Get("/kvstash/router", [this](const httplib::Request&, httplib::Response& res) {
      res.set_content(RouterStateJson(*router_), "application/json");
    });
    return Status::OK();
  }

  uint16_t port() const override { return front_->port(); }

  Status Serve() override {
    front_->Start();
    std::chrono::milliseconds drain;
    Status failure;
    {
      MutexLock lock(&mu_);
      while (!stopping_) stopped_.Wait(&mu_);
      drain = drain_;
      failure = failure_;
    }
    // Here, not in Stop: Stop may run on the front's own I/O thread (on_failure), which
    // Shutdown joins.
    front_->Closing();
    front_->Shutdown(std::chrono::steady_clock::now() + drain);
    // Every stream thread uses the router: none outlives Serve. Their responses are gone, so
    // each stops at its next event (or its worker call's timeout).
    MutexLock lock(&mu_);
    while (streams_ > 0) stopped_.Wait(&mu_);
    return failure;
  }

  void Stop(std::chrono::milliseconds drain) override {
    MutexLock lock(&mu_);
    if (stopping_) return;
    stopping_ = true;
    drain_ = drain;
    stopped_.SignalAll();
  }

 private:
  void HandleCompletion(const httplib::Request& req, httplib::Response& res) {
    http::HttpFront::Answering();
    std::string param;
    Result<worker::CompletionRequest> parsed = worker::ParseCompletionRequest(req.body, &param);
    if (!parsed.ok()) {
      return SendError(res, 400, param.empty() ? "invalid_json" : "invalid_" + param,
                       parsed.status().message(), param);
    }
    if (parsed->model && *parsed->model != router_->model().model) {
      return SendError(res, 404, "model_not_found",
                       fmt::format("the model '{}' is not served here: the workers serve '{}'",
                                   *parsed->model, router_->model().model));
    }
    if (!parsed->stream) {
      Result<RoutedCompletion> routed = router_->Complete(*parsed);
      if (!routed.ok()) {
        const auto [status, code] = HttpErrorOf(routed.status());
        return SendError(res, status, code, routed.status().message());
      }
      res.set_content(RoutedCompletionBody(*routed, router_->options().policy, created_),
                      "application/json");
      return;
    }
    // The stream runs on a thread of its own, its events queued for the response: the handler
    // waits for the first, so that a request that fails before it (a bad prompt, no worker up)
    // gets its HTTP error status rather than a 200 with an error event.
    auto stream = std::make_shared<StreamState>();
    {
      MutexLock lock(&mu_);
      if (stopping_) return SendError(res, 503, "stopping", "the router is stopping");
      ++streams_;
    }
    std::thread([this, stream, request = std::move(*parsed)] {
      const Status status = router_->Stream(request, [&stream](std::string_view event) {
        MutexLock lock(&stream->mu);
        if (stream->client_gone) return false;
        stream->events.emplace_back(event);
        stream->changed.SignalAll();
        return true;
      });
      {
        MutexLock lock(&stream->mu);
        stream->status = status;
        stream->finished = true;
        stream->changed.SignalAll();
      }
      MutexLock lock(&mu_);
      --streams_;
      stopped_.SignalAll();
    }).detach();
    {
      MutexLock lock(&stream->mu);
      while (stream->events.empty() && !stream->finished) stream->changed.Wait(&stream->mu);
      if (stream->events.empty() && !stream->status.ok()) {
        const auto [status, code] = HttpErrorOf(stream->status);
        return SendError(res, status, code, stream->status.message());
      }
    }
    res.set_header("Cache-Control", "no-cache");
    res.set_chunked_content_provider(
        "text/event-stream",
        [stream](size_t, httplib::DataSink& sink) {
          std::string out;
          bool finished;
          Status status;
          bool done_sent = false;
          {
            MutexLock lock(&stream->mu);
            while (stream->events.empty() && !stream->finished) {
              stream->changed.Wait(&stream->mu);
            }
            for (const std::string& event : stream->events) {
              out += fmt::format("data: {}\n\n", event);
              stream->done_sent = stream->done_sent || event == "[DONE]";
            }
            stream->events.clear();
            finished = stream->finished;
            status = stream->status;
            done_sent = stream->done_sent;
          }
          if (finished && !status.ok() && status.code() != StatusCode::kCancelled) {
            const auto [http_status, code] = HttpErrorOf(status);
            out +=
                fmt::format("data: {}\n\n",
                            worker::Dump(worker::ErrorJson(http_status, code, status.message())));
            if (!done_sent) out += "data: [DONE]\n\n";
          }
          if (!out.empty() && !sink.write(out.data(), out.size())) return false;
          if (finished) sink.done();
          return true;
        },
        [stream](bool) {
          // The response is written or abandoned: a stream still running stops at its next
          // event.
          MutexLock lock(&stream->mu);
          stream->client_gone = true;
        });
  }

  // One streamed completion: the events its thread queued and not yet written, and its end.
  struct StreamState {
    Mutex mu;
    CondVar changed;
    std::deque<std::string> events GUARDED_BY(mu);
    bool finished GUARDED_BY(mu) = false;
    bool done_sent GUARDED_BY(mu) = false;
    bool client_gone GUARDED_BY(mu) = false;
    Status status GUARDED_BY(mu);
  };

  const RouterServerOptions options_;
  Router* const router_;
  const int64_t created_;
  std::unique_ptr<http::HttpFront> front_;
  Mutex mu_;
  CondVar stopped_;
  bool stopping_ GUARDED_BY(mu_) = false;
  size_t streams_ GUARDED_BY(mu_) = 0;  // stream threads still running
  std::chrono::milliseconds drain_ GUARDED_BY(mu_){0};
  Status failure_ GUARDED_BY(mu_);
};

}  // namespace

Result<std::unique_ptr<RouterServer>> RouterServer::Create(const RouterServerOptions& options,
                                                           Router* router) {
  auto server = std::make_unique<HttpRouterServer>(options, router);
  KVSTASH_RETURN_IF_ERROR(server->Bind());
  return std::unique_ptr<RouterServer>(std::move(server));
}

std::string RouterMetricsText(const Router& router) {
  const RouterTotals t = router.totals();
  http::PrometheusWriter w;
  using prometheus::MetricType;
  auto counter = [&w](std::string_view name, std::string_view help, uint64_t value) {
    w.Add(name, MetricType::Counter, help, static_cast<double>(value));
  };
  counter("kvstash_router_requests_total", "Completions answered.", t.requests);
  counter("kvstash_router_failed_requests_total", "Completions no decode worker could answer.",
          t.failed_requests);
  counter("kvstash_router_prefills_total", "Completions prefilled on a prefill worker.",
          t.prefills);
  counter("kvstash_router_skipped_prefills_total",
          "Completions sent to a decode worker alone (the nodes or its cache held the prompt, or "
          "no prefill worker could answer).",
          t.skipped_prefills);
  counter("kvstash_router_retries_total", "Calls that failed and went to another worker.",
          t.retries);
  counter("kvstash_router_prompt_tokens_total", "Prompt tokens of the completions answered.",
          t.prompt_tokens);
  counter("kvstash_router_computed_tokens_total",
          "Prompt tokens the workers ran through the model (prefill and decode).",
          t.computed_tokens);
  counter("kvstash_router_node_tokens_total", "Prompt tokens decode workers loaded from nodes.",
          t.node_tokens);
  counter("kvstash_router_local_hit_tokens_total",
          "Prompt tokens decode workers found in their own cache.", t.local_hit_tokens);
  counter("kvstash_router_event_batches_total", "KV event batches applied to the index.",
          t.event_batches);
  counter("kvstash_router_event_gaps_total", "Gaps seen in the event sequence numbers.",
          t.event_gaps);
  counter("kvstash_router_event_replayed_total", "Event batches a replay filled in.",
          t.event_replayed);
  counter("kvstash_router_event_resets_total",
          "Event subscriptions that lost batches for good and started over.", t.event_resets);
  for (const auto& workers : {router.prefill_workers(), router.decode_workers()}) {
    for (const WorkerView& v : workers) {
      const http::MetricLabels labels = {{"worker", v.address},
                                         {"role", std::string(worker::RoleName(v.role))}};
      w.Add("kvstash_router_worker_up", MetricType::Gauge,
            "1 while the worker is in use, 0 while it sits out after a failure.", v.up ? 1 : 0,
            labels);
      w.Add("kvstash_router_worker_running", MetricType::Gauge,
            "Requests the router has on the worker now.", static_cast<double>(v.running), labels);
      w.Add("kvstash_router_worker_blocks", MetricType::Gauge,
            "Blocks the worker's KV events say it holds.", static_cast<double>(v.blocks), labels);
      w.Add("kvstash_router_worker_chosen_total", MetricType::Counter,
            "Requests placed on the worker.", static_cast<double>(v.chosen), labels);
      w.Add("kvstash_router_worker_failures_total", MetricType::Counter,
            "Calls to the worker that failed.", static_cast<double>(v.failures), labels);
      w.Add("kvstash_router_worker_hit_tokens_total", MetricType::Counter,
            "Hit tokens the worker was scored with when chosen.", static_cast<double>(v.hit_tokens),
            labels);
    }
  }
  return w.Text();
}

std::string RouterStateJson(const Router& router) {
  const RouterTotals t = router.totals();
  json totals = {{"requests", t.requests},
                 {"failed_requests", t.failed_requests},
                 {"prefills", t.prefills},
                 {"skipped_prefills", t.skipped_prefills},
                 {"retries", t.retries},
                 {"prompt_tokens", t.prompt_tokens},
                 {"computed_tokens", t.computed_tokens},
                 {"node_tokens", t.node_tokens},
                 {"local_hit_tokens", t.local_hit_tokens},
                 {"event_batches", t.event_batches},
                 {"event_gaps", t.event_gaps},
                 {"event_replayed", t.event_replayed},
                 {"event_resets", t.event_resets}};
  return worker::Dump({{"policy", PolicyName(router.options().policy)},
                       {"model", router.model().model},
                       {"totals", std::move(totals)},
                       {"nodes", router.nodes()},
                       {"prefill_workers", WorkersJson(router.prefill_workers())},
                       {"decode_workers", WorkersJson(router.decode_workers())}});
}

}  // namespace kvstash::router
