// Fuzz target `worker_requests`: what an engine worker (worker/src/server.cc) makes of a client's
// HTTP request: the body of POST /v1/completions (ParseCompletionRequest) and the error replies
// that quote what the client sent (a model it named, the method and path it asked for), all
// through worker/src/protocol.cc. The same bytes are also read as a worker's replies, as
// WorkerClient reads them (a completion, the model list, the totals, an error). cpp-httplib's own
// parsing of the request line and headers is the Debian library's, which this build cannot
// instrument.
//
// Input: the body; its first line also serves as the method and path of a request for an
// endpoint that does not exist.
//
// Checked besides the sanitizers: a request that parses is within its documented bounds and
// reads back the same once written as a client writes it (CompletionRequestJson); a refused one
// names the field at fault or none; every reply is JSON (invalid UTF-8 replaced, never thrown).

#include <fmt/format.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "fuzz_check.h"
#include "kvstash/worker/protocol.h"
#include "kvstash/worker/protocol_json.h"

namespace kvstash::worker {
namespace {

bool IsJson(const std::string& text) {
  return !json::parse(text, nullptr, /*allow_exceptions=*/false).is_discarded();
}

void CompletionRequestOnServer(std::string_view body) {
  std::string param;
  Result<CompletionRequest> parsed = ParseCompletionRequest(body, &param);
  if (!parsed.ok()) {
    KVSTASH_FUZZ_CHECK(parsed.status().code() == StatusCode::kInvalidArgument);
    KVSTASH_FUZZ_CHECK(param.empty() || param == "prompt" || param == "max_tokens" ||
                       param == "stream" || param == "model");
    // The 400 reply, as HandleCompletion sends it.
    const std::string reply =
        Dump(ErrorJson(400, param.empty() ? "invalid_json" : "invalid_" + param,
                       parsed.status().message(), param));
    KVSTASH_FUZZ_CHECK(IsJson(reply));
    return;
  }
  const CompletionRequest& request = *parsed;
  KVSTASH_FUZZ_CHECK(!request.prompt.empty());
  KVSTASH_FUZZ_CHECK(request.max_tokens >= 1 && request.max_tokens <= kMaxCompletionTokens);
  if (request.model) {
    // The 404 for a model this worker does not serve quotes the client's name.
    const std::string reply =
        Dump(ErrorJson(404, "model_not_found",
                       fmt::format("the model '{}' is not served here: this worker serves '{}'",
                                   *request.model, "fuzz-model"),
                       "model"));
    KVSTASH_FUZZ_CHECK(IsJson(reply));
  }
  // Written as WorkerClient writes it, it reads back the same. (A model name that is not UTF-8
  // is written replaced, so it is left out of the comparison.)
  Result<CompletionRequest> again = ParseCompletionRequest(CompletionRequestJson(request), nullptr);
  KVSTASH_FUZZ_CHECK(again.ok());
  KVSTASH_FUZZ_CHECK(again->prompt == request.prompt);
  KVSTASH_FUZZ_CHECK(again->max_tokens == request.max_tokens);
  KVSTASH_FUZZ_CHECK(again->stream == request.stream);
  KVSTASH_FUZZ_CHECK(again->model.has_value() == request.model.has_value());
}

// HandleError's replies quote the method and path a client sent.
void UnknownEndpointOnServer(std::string_view first_line) {
  const size_t space = first_line.find(' ');
  const std::string_view method = first_line.substr(0, space);
  const std::string_view path =
      space == std::string_view::npos ? std::string_view() : first_line.substr(space + 1);
  for (const int status : {404, 405, 400, 500}) {
    const std::string reply =
        Dump(ErrorJson(status, status == 404 ? "not_found" : "bad_request",
                       fmt::format("no endpoint {} {} (POST /v1/completions)", method, path)));
    KVSTASH_FUZZ_CHECK(IsJson(reply));
  }
}

// The bytes as a worker's replies, read as WorkerClient reads them: values or errors, never a
// throw.
void RepliesOnClient(std::string_view body) {
  (void)ParseCompletion(body);
  (void)ParseModels(body);
  (void)ParseTotals(body);
  (void)ErrorMessage(body);
}

void FuzzWorker(std::span<const uint8_t> input) {
  const std::string_view body = fuzz::AsText(input);
  CompletionRequestOnServer(body);
  UnknownEndpointOnServer(body.substr(0, body.find('\n')));
  RepliesOnClient(body);
}

}  // namespace
}  // namespace kvstash::worker

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kvstash::worker::FuzzWorker(std::span<const uint8_t>(data, size));
  return 0;
}
