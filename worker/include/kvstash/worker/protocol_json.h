#pragma once

// The JSON (and Prometheus text) spelling of the worker's HTTP API: what the server writes and
// the client reads, in one place. No function here throws: JSON is parsed with exceptions off,
// every type is checked before it is read, and output replaces invalid UTF-8.

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "kvstash/common/status.h"
#include "kvstash/worker/protocol.h"

namespace kvstash::worker {

using nlohmann::json;

// The serialized text of `value`; invalid UTF-8 in strings is replaced, never thrown about.
std::string Dump(const json& value);

// "5 17 3": choices[0].text of a completion.
std::string JoinTokens(std::span<const uint32_t> tokens);

// --- Requests (the server parses, the client writes) ------------------------------------------

// A POST /v1/completions body. InvalidArgument saying what is wrong; `param` (when not null)
// is set to the field at fault ("prompt", "max_tokens", "stream", "model"), empty when the
// body is not a JSON object at all. "prompt" is a list of token ids or a list holding one such
// list; max_tokens defaults to 16 and goes from 1 to kMaxCompletionTokens; fields OpenAI
// defines that a greedy engine has no use for (temperature, ...) are ignored.
Result<CompletionRequest> ParseCompletionRequest(std::string_view body, std::string* param);
std::string CompletionRequestJson(const CompletionRequest& request);

// --- Replies (the server writes, the client parses) -------------------------------------------

// OpenAI's error object: {"error": {"message", "type", "param", "code"}}; type is
// "invalid_request_error" below 500 and "server_error" from 500.
json ErrorJson(int http_status, std::string_view code, std::string_view message,
               std::string_view param = {});
// The message of an error reply (its body), or the body itself when it is not one.
std::string ErrorMessage(std::string_view body);

json UsageJson(const CompletionUsage& usage);
// OpenAI's completion object ("object": "text_completion") with one choice.
json CompletionJson(const Completion& completion, int64_t created);
// One streamed chunk: one token (choices[0].text the token id, after a space unless it is the
// first, so that the texts joined are the whole completion's text; token_ids [id]);
// finish_reason null, or set with "usage" on the last chunk. `token` unset: no token (a last
// chunk that carries only the finish).
json ChunkJson(std::string_view id, int64_t created, std::string_view model,
               std::optional<uint32_t> token, bool first, const CompletionUsage* last,
               std::string_view finish_reason);
Result<Completion> ParseCompletion(std::string_view body);

json ModelsJson(const WorkerInfo& info, int64_t created);
Result<WorkerInfo> ParseModels(std::string_view body);

// GET /kvstash/stats: every total, the offload client's counters each under its export_name.
// ParseTotals wants every one of them.
json TotalsJson(const WorkerTotals& totals);
Result<WorkerTotals> ParseTotals(std::string_view body);

// GET /metrics: the totals as Prometheus text exposition (format 0.0.4, kvstash::http's
// PrometheusWriter), every counter kvstash_worker_*_total, plus kvstash_worker_running_requests
// and kvstash_worker_info; the offload client's counters under ClientCounterMetric's names.
std::string MetricsText(const WorkerTotals& totals, const WorkerInfo& info);
// A client counter's name in /metrics: kvstash_worker_<export_name>, with _total for a counter.
std::string ClientCounterMetric(const ClientCounterDef& def);

}  // namespace kvstash::worker
