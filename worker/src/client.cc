#include "kvstash/worker/client.h"

#include <httplib.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <utility>

#include "kvstash/worker/protocol_json.h"

namespace kvstash::worker {
namespace {

class HttpWorkerClient final : public WorkerClient {
 public:
  HttpWorkerClient(std::string address, const std::string& host, int port,
                   std::chrono::milliseconds timeout)
      : address_(std::move(address)), timeout_(timeout), http_(host, port) {
    http_.set_keep_alive(true);
    http_.set_tcp_nodelay(true);
    http_.set_connection_timeout(std::min(timeout, std::chrono::milliseconds(10000)));
    // A completion is answered when it is done: the whole generation may pass in silence.
    http_.set_read_timeout(timeout);
    http_.set_write_timeout(timeout);
  }

  Result<WorkerInfo> Info() override {
    KVSTASH_ASSIGN_OR_RETURN(std::string body, Call("GET", "/v1/models", ""));
    Result<WorkerInfo> info = ParseModels(body);
    if (!info.ok()) return InternalError("worker {}: {}", address_, info.status().message());
    return info;
  }

  Result<Completion> Complete(const CompletionRequest& request) override {
    CompletionRequest plain = request;
    plain.stream = false;
    KVSTASH_ASSIGN_OR_RETURN(std::string body,
                             Call("POST", "/v1/completions", CompletionRequestJson(plain)));
    Result<Completion> completion = ParseCompletion(body);
    if (!completion.ok()) {
      return InternalError("worker {}: {}", address_, completion.status().message());
    }
    return completion;
  }

  Status Stream(const CompletionRequest& request,
                const std::function<bool(std::string_view event)>& on_event,
                bool* started) override {
    if (started != nullptr) *started = false;
    CompletionRequest streamed = request;
    streamed.stream = true;
    httplib::Request req;
    req.method = "POST";
    req.path = "/v1/completions";
    req.body = CompletionRequestJson(streamed);
    req.set_header("Content-Type", "application/json");
    httplib::Response res;
    std::string pending;     // bytes of an event not complete yet
    std::string error_body;  // the body of an error reply
    bool done = false, stopped = false;
    req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
      if (res.status != 200) {
        if (error_body.size() < 4096) error_body.append(data, std::min<size_t>(n, 4096));
        return true;
      }
      pending.append(data, n);
      for (size_t end; (end = pending.find("\n\n")) != std::string::npos;) {
        const std::string_view event(pending.data(), end);
        if (event.rfind("data: ", 0) == 0) {
          const std::string_view payload = event.substr(6);
          if (started != nullptr) *started = true;
          if (payload == "[DONE]") done = true;
          if (!on_event(payload)) {
            stopped = true;
            return false;
          }
        }
        pending.erase(0, end + 2);
      }
      return true;
    };
    const auto start = std::chrono::steady_clock::now();
    httplib::Error error = httplib::Error::Success;
    const bool sent = http_.send(req, res, error);
    if (stopped) return CancelledError("worker {}: the stream's reader stopped", address_);
    if (!sent && res.status != 200) {
      if (std::chrono::steady_clock::now() - start >= timeout_) {
        return DeadlineExceededError("worker {}: no answer to the streamed completion within {} ms",
                                     address_, timeout_.count());
      }
      return UnavailableError("worker {}: POST /v1/completions failed: {}", address_,
                              httplib::to_string(error));
    }
    if (res.status != 200) return ErrorOf(res.status, error_body);
    if (!done) {
      return UnavailableError("worker {}: the stream ended before its last event{}", address_,
                              sent ? "" : ": " + httplib::to_string(error));
    }
    return Status::OK();
  }

  Result<WorkerTotals> Totals() override {
    KVSTASH_ASSIGN_OR_RETURN(std::string body, Call("GET", "/kvstash/stats", ""));
    Result<WorkerTotals> totals = ParseTotals(body);
    if (!totals.ok()) return InternalError("worker {}: {}", address_, totals.status().message());
    return totals;
  }

  const std::string& address() const override { return address_; }

 private:
  // The body of a 200 reply; the errors the class comment lists.
  Result<std::string> Call(const char* method, const char* path, const std::string& body) {
    const auto start = std::chrono::steady_clock::now();
    httplib::Result result = std::string_view(method) == "POST"
                                 ? http_.Post(path, body, "application/json")
                                 : http_.Get(path);
    if (!result) {
      // httplib says Read both for a timeout and for a connection that broke: the clock tells.
      if (std::chrono::steady_clock::now() - start >= timeout_) {
        return DeadlineExceededError("worker {}: no answer to {} {} within {} ms", address_, method,
                                     path, timeout_.count());
      }
      return UnavailableError("worker {}: {} {} failed: {}", address_, method, path,
                              httplib::to_string(result.error()));
    }
    if (result->status == 200) return std::move(result->body);
    return ErrorOf(result->status, result->body);
  }

  // The error of a reply with `status` other than 200 and `body`.
  Status ErrorOf(int status, std::string_view body) const {
    const std::string message = ErrorMessage(body);
    switch (status) {
      case 400:
      case 413:
        return InvalidArgumentError("worker {}: {}", address_, message);
      case 404:
        return NotFoundError("worker {}: {}", address_, message);
      case 503:
        return UnavailableError("worker {}: {}", address_, message);
      default:
        return InternalError("worker {}: HTTP {}: {}", address_, status, message);
    }
  }

  const std::string address_;
  const std::chrono::milliseconds timeout_;
  httplib::Client http_;
};

}  // namespace

Result<std::unique_ptr<WorkerClient>> WorkerClient::Create(std::string_view address,
                                                           std::chrono::milliseconds timeout) {
  const size_t colon = address.rfind(':');
  if (colon == std::string_view::npos || colon == 0 || colon + 1 == address.size()) {
    return InvalidArgumentError("worker address '{}' is not HOST:PORT", address);
  }
  std::string host(address.substr(0, colon));
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);  // [::1]:7390
  }
  const std::string port_text(address.substr(colon + 1));
  char* end = nullptr;
  errno = 0;
  const unsigned long port = std::strtoul(port_text.c_str(), &end, 10);
  if (*end != '\0' || errno != 0 || port == 0 || port > 65535 || port_text[0] == '-' ||
      port_text[0] == '+') {
    return InvalidArgumentError("worker address '{}' has no port from 1 to 65535", address);
  }
  if (timeout.count() <= 0) return InvalidArgumentError("a worker timeout must be positive");
  return std::unique_ptr<WorkerClient>(std::make_unique<HttpWorkerClient>(
      std::string(address), host, static_cast<int>(port), timeout));
}

}  // namespace kvstash::worker
