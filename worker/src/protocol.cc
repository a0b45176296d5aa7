#include "kvstash/worker/protocol.h"

#include <cinttypes>
#include <cstdio>
#include <limits>
#include <utility>

#include "kvstash/http/prometheus_text.h"
#include "kvstash/worker/protocol_json.h"

namespace kvstash::worker {
namespace {

// Every running total of the worker's own: its /kvstash/stats field, its Prometheus name and
// help, and whether it is a gauge (else a counter). The offload client's counters follow them,
// from their own registry (WorkerTotals::client, kvstash/common/client_counters.h).
struct TotalField {
  const char* json;
  const char* metric;
  const char* help;
  uint64_t WorkerTotals::*member;
  bool gauge = false;
};

constexpr TotalField kTotals[] = {
    {"requests", "kvstash_worker_requests_total", "Completions answered", &WorkerTotals::requests},
    {"failed_requests", "kvstash_worker_failed_requests_total",
     "Completions the engine failed (answered 500 or 503)", &WorkerTotals::failed_requests},
    {"cancelled_requests", "kvstash_worker_cancelled_requests_total",
     "Completions dropped before their end (their client left, or the worker stopped)",
     &WorkerTotals::cancelled_requests},
    {"prompt_tokens", "kvstash_worker_prompt_tokens_total", "Prompt tokens of answered completions",
     &WorkerTotals::prompt_tokens},
    {"generation_tokens", "kvstash_worker_generation_tokens_total",
     "Tokens generated for answered completions", &WorkerTotals::generation_tokens},
    {"local_hit_tokens", "kvstash_worker_local_hit_tokens_total",
     "Prompt tokens the worker's own prefix cache held", &WorkerTotals::local_hit_tokens},
    {"node_tokens", "kvstash_worker_node_tokens_total",
     "Prompt tokens loaded from the offload nodes", &WorkerTotals::node_tokens},
    {"computed_tokens", "kvstash_worker_computed_tokens_total",
     "Prompt tokens run through the model (recomputations included)",
     &WorkerTotals::computed_tokens},
    {"running_requests", "kvstash_worker_running_requests",
     "Completions in the engine now (queued, loading or running)", &WorkerTotals::running_requests,
     /*gauge=*/true},
    {"steps", "kvstash_worker_engine_steps_total", "Engine steps", &WorkerTotals::steps},
    {"prefill_tokens", "kvstash_worker_prefill_tokens_total",
     "Tokens the engine ran before a request's first sampled token", &WorkerTotals::prefill_tokens},
    {"decode_tokens", "kvstash_worker_decode_tokens_total", "Tokens the engine decoded",
     &WorkerTotals::decode_tokens},
    {"preemptions", "kvstash_worker_preemptions_total", "Requests preempted for KV-cache room",
     &WorkerTotals::preemptions},
    {"load_failures", "kvstash_worker_load_failures_total",
     "Loads from the offload nodes that fell back to recomputing", &WorkerTotals::load_failures},
    {"loaded_bytes", "kvstash_worker_loaded_bytes_total", "Bytes loaded from the offload nodes",
     &WorkerTotals::loaded_bytes},
    {"stored_bytes", "kvstash_worker_stored_bytes_total", "Bytes stored on the offload nodes",
     &WorkerTotals::stored_bytes},
    {"blocks_loaded", "kvstash_worker_loaded_blocks_total", "Blocks loaded from the offload nodes",
     &WorkerTotals::blocks_loaded},
    {"blocks_stored", "kvstash_worker_stored_blocks_total", "Blocks stored on the offload nodes",
     &WorkerTotals::blocks_stored},
};

// The member `key` of object `o`, or null.
const json* Field(const json& o, const char* key) {
  if (!o.is_object()) return nullptr;
  const auto it = o.find(key);
  return it == o.end() ? nullptr : &*it;
}

// The unsigned integer `key` of `o`; `where` names `o` in the error.
Result<uint64_t> UintField(const json& o, const char* key, std::string_view where) {
  const json* v = Field(o, key);
  if (v == nullptr || !v->is_number_unsigned()) {
    return InternalError("{} has no unsigned integer \"{}\"", where, key);
  }
  return v->get<uint64_t>();
}

Result<double> NumberField(const json& o, const char* key, std::string_view where) {
  const json* v = Field(o, key);
  if (v == nullptr || !v->is_number()) {
    return InternalError("{} has no number \"{}\"", where, key);
  }
  return v->get<double>();
}

Result<std::string> StringField(const json& o, const char* key, std::string_view where) {
  const json* v = Field(o, key);
  if (v == nullptr || !v->is_string()) {
    return InternalError("{} has no string \"{}\"", where, key);
  }
  return v->get<std::string>();
}

// A token id (an unsigned integer that fits 32 bits), or nullopt.
std::optional<uint32_t> TokenId(const json& v) {
  if (!v.is_number_unsigned()) return std::nullopt;
  const uint64_t id = v.get<uint64_t>();
  if (id > std::numeric_limits<uint32_t>::max()) return std::nullopt;
  return static_cast<uint32_t>(id);
}

Result<json> ParseObject(std::string_view body, std::string_view what) {
  json parsed = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (parsed.is_discarded() || !parsed.is_object()) {
    return InternalError("{} is not a JSON object: {:.200}", what, body);
  }
  return parsed;
}

}  // namespace

std::string_view RoleName(Role role) {
  switch (role) {
    case Role::kBoth:
      return "both";
    case Role::kPrefill:
      return "prefill";
    case Role::kDecode:
      return "decode";
  }
  return "both";
}

Result<Role> ParseRole(std::string_view name) {
  for (const Role role : {Role::kBoth, Role::kPrefill, Role::kDecode}) {
    if (RoleName(role) == name) return role;
  }
  return InvalidArgumentError("role '{}' is not both, prefill or decode", name);
}

std::string Dump(const json& value) {
  return value.dump(-1, ' ', /*ensure_ascii=*/false, json::error_handler_t::replace);
}

std::string JoinTokens(std::span<const uint32_t> tokens) {
  std::string s;
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (i > 0) s += ' ';
    s += std::to_string(tokens[i]);
  }
  return s;
}

Result<CompletionRequest> ParseCompletionRequest(std::string_view body, std::string* param) {
  auto fail = [param](const char* field, Status status) {
    if (param != nullptr) *param = field;
    return status;
  };
  const json req = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (req.is_discarded() || !req.is_object()) {
    return fail(
        "", InvalidArgumentError("the body must be a JSON object, e.g. {{\"prompt\": [1, 2, 3], "
                                 "\"max_tokens\": 8}}"));
  }
  CompletionRequest out;
  if (const json* model = Field(req, "model"); model != nullptr && !model->is_null()) {
    if (!model->is_string()) {
      return fail("model", InvalidArgumentError("\"model\" must be a string"));
    }
    out.model = model->get<std::string>();
  }

  const json* prompt = Field(req, "prompt");
  if (prompt == nullptr) {
    return fail("prompt", InvalidArgumentError("\"prompt\" is missing: a list of token ids"));
  }
  if (prompt->is_string() || (prompt->is_array() && !prompt->empty() && (*prompt)[0].is_string())) {
    return fail("prompt",
                InvalidArgumentError("\"prompt\" must be token ids: this worker has no tokenizer"));
  }
  if (!prompt->is_array()) {
    return fail("prompt", InvalidArgumentError("\"prompt\" must be a list of token ids"));
  }
  // [[1, 2, 3]]: OpenAI's list of prompts, here of exactly one.
  const json* tokens = prompt;
  if (!prompt->empty() && (*prompt)[0].is_array()) {
    if (prompt->size() != 1) {
      return fail("prompt",
                  InvalidArgumentError("\"prompt\" holds {} prompts: send one prompt per request",
                                       prompt->size()));
    }
    tokens = &(*prompt)[0];
  }
  if (tokens->empty()) {
    return fail("prompt", InvalidArgumentError("\"prompt\" must hold at least one token id"));
  }
  out.prompt.reserve(tokens->size());
  for (size_t i = 0; i < tokens->size(); ++i) {
    const std::optional<uint32_t> id = TokenId((*tokens)[i]);
    if (!id) {
      return fail("prompt",
                  InvalidArgumentError("\"prompt\" holds {} at position {}, not a token id",
                                       Dump((*tokens)[i]), i));
    }
    out.prompt.push_back(*id);
  }

  if (const json* m = Field(req, "max_tokens"); m != nullptr && !m->is_null()) {
    if (!m->is_number_unsigned() || m->get<uint64_t>() < 1 ||
        m->get<uint64_t>() > kMaxCompletionTokens) {
      return fail("max_tokens",
                  InvalidArgumentError("\"max_tokens\" must be an integer from 1 to {}, not {}",
                                       kMaxCompletionTokens, Dump(*m)));
    }
    out.max_tokens = static_cast<size_t>(m->get<uint64_t>());
  }

  if (const json* s = Field(req, "stream"); s != nullptr && !s->is_null()) {
    if (!s->is_boolean()) {
      return fail("stream",
                  InvalidArgumentError("\"stream\" must be true or false, not {}", Dump(*s)));
    }
    out.stream = s->get<bool>();
  }
  return out;
}

std::string CompletionRequestJson(const CompletionRequest& request) {
  json body = {{"prompt", request.prompt}, {"max_tokens", request.max_tokens}};
  if (request.model) body["model"] = *request.model;
  if (request.stream) body["stream"] = true;
  return Dump(body);
}

json ErrorJson(int http_status, std::string_view code, std::string_view message,
               std::string_view param) {
  return {{"error",
           {{"message", message},
            {"type", http_status >= 500 ? "server_error" : "invalid_request_error"},
            {"param", param.empty() ? json() : json(param)},
            {"code", code}}}};
}

std::string ErrorMessage(std::string_view body) {
  const json parsed = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (const json* error = Field(parsed, "error")) {
    if (const json* message = Field(*error, "message"); message && message->is_string()) {
      return message->get<std::string>();
    }
  }
  return std::string(body.substr(0, 200));
}

json UsageJson(const CompletionUsage& u) {
  return {{"prompt_tokens", u.prompt_tokens},
          {"completion_tokens", u.completion_tokens},
          {"total_tokens", u.prompt_tokens + u.completion_tokens},
          {"prompt_tokens_details", {{"cached_tokens", u.local_hit_tokens}}},
          {"kvstash",
           {{"node_tokens", u.node_tokens},
            {"local_hit_tokens", u.local_hit_tokens},
            {"computed_tokens", u.computed_tokens},
            {"ttft_ms", u.ttft_ms},
            {"latency_ms", u.latency_ms}}}};
}

json CompletionJson(const Completion& c, int64_t created) {
  return {{"id", c.id},
          {"object", "text_completion"},
          {"created", created},
          {"model", c.model},
          {"choices", json::array({{{"index", 0},
                                    {"text", JoinTokens(c.tokens)},
                                    {"token_ids", c.tokens},
                                    {"logprobs", nullptr},
                                    {"finish_reason", c.finish_reason}}})},
          {"usage", UsageJson(c.usage)}};
}

json ChunkJson(std::string_view id, int64_t created, std::string_view model,
               std::optional<uint32_t> token, bool first, const CompletionUsage* last,
               std::string_view finish_reason) {
  json choice = {{"index", 0}, {"logprobs", nullptr}};
  if (token) {
    choice["text"] = (first ? "" : " ") + std::to_string(*token);
    choice["token_ids"] = json::array({*token});
  } else {
    choice["text"] = "";
    choice["token_ids"] = json::array();
  }
  choice["finish_reason"] = last != nullptr ? json(finish_reason) : json();
  json chunk = {{"id", id},
                {"object", "text_completion"},
                {"created", created},
                {"model", model},
                {"choices", json::array({std::move(choice)})}};
  if (last != nullptr) chunk["usage"] = UsageJson(*last);
  return chunk;
}

Result<Completion> ParseCompletion(std::string_view body) {
  KVSTASH_ASSIGN_OR_RETURN(const json reply, ParseObject(body, "the completion"));
  Completion c;
  KVSTASH_ASSIGN_OR_RETURN(c.id, StringField(reply, "id", "the completion"));
  KVSTASH_ASSIGN_OR_RETURN(c.model, StringField(reply, "model", "the completion"));
  const json* choices = Field(reply, "choices");
  if (choices == nullptr || !choices->is_array() || choices->empty()) {
    return InternalError("the completion has no choices");
  }
  const json& choice = (*choices)[0];
  const json* ids = Field(choice, "token_ids");
  if (ids == nullptr || !ids->is_array()) {
    return InternalError("the completion's choice has no \"token_ids\"");
  }
  for (const json& t : *ids) {
    const std::optional<uint32_t> id = TokenId(t);
    if (!id) return InternalError("the completion's token_ids hold {}", Dump(t));
    c.tokens.push_back(*id);
  }
  KVSTASH_ASSIGN_OR_RETURN(c.finish_reason, StringField(choice, "finish_reason", "the choice"));
  const json* usage = Field(reply, "usage");
  if (usage == nullptr) return InternalError("the completion has no \"usage\"");
  const json* kv = Field(*usage, "kvstash");
  if (kv == nullptr) return InternalError("the completion's usage has no \"kvstash\"");
  CompletionUsage& u = c.usage;
  KVSTASH_ASSIGN_OR_RETURN(u.prompt_tokens, UintField(*usage, "prompt_tokens", "usage"));
  KVSTASH_ASSIGN_OR_RETURN(u.completion_tokens, UintField(*usage, "completion_tokens", "usage"));
  KVSTASH_ASSIGN_OR_RETURN(u.node_tokens, UintField(*kv, "node_tokens", "usage.kvstash"));
  KVSTASH_ASSIGN_OR_RETURN(u.local_hit_tokens, UintField(*kv, "local_hit_tokens", "usage.kvstash"));
  KVSTASH_ASSIGN_OR_RETURN(u.computed_tokens, UintField(*kv, "computed_tokens", "usage.kvstash"));
  KVSTASH_ASSIGN_OR_RETURN(u.ttft_ms, NumberField(*kv, "ttft_ms", "usage.kvstash"));
  KVSTASH_ASSIGN_OR_RETURN(u.latency_ms, NumberField(*kv, "latency_ms", "usage.kvstash"));
  if (const json* router = Field(*kv, "router"); router != nullptr && router->is_object()) {
    c.router = Dump(*router);
  }
  return c;
}

namespace {

json GroupsJson(const std::vector<engine::AttentionSpec>& groups) {
  json out = json::array();
  for (const engine::AttentionSpec& g : groups) {
    json j = {{"kind", SpecKindName(g.kind)}, {"block_size", g.block_size}};
    if (g.kind == engine::AttentionSpec::Kind::kSlidingWindow) j["window"] = g.window;
    if (g.kind == engine::AttentionSpec::Kind::kChunkedLocal) j["chunk"] = g.chunk;
    out.push_back(std::move(j));
  }
  return out;
}

Result<std::vector<engine::AttentionSpec>> ParseGroups(const json& groups) {
  if (!groups.is_array() || groups.size() > kMaxCacheGroups) {
    return InternalError("the model's groups are not an array of at most {}", kMaxCacheGroups);
  }
  std::vector<engine::AttentionSpec> out;
  for (const json& g : groups) {
    if (!g.is_object()) return InternalError("a group of the model is not an object");
    KVSTASH_ASSIGN_OR_RETURN(const std::string kind, StringField(g, "kind", "a group"));
    KVSTASH_ASSIGN_OR_RETURN(const uint64_t block_size, UintField(g, "block_size", "a group"));
    if (block_size == 0 || block_size > (uint64_t{1} << 20)) {
      return InternalError("a group's block size {} is outside 1..2^20", block_size);
    }
    engine::AttentionSpec spec;
    spec.block_size = static_cast<uint32_t>(block_size);
    using Kind = engine::AttentionSpec::Kind;
    if (kind == "full_attention") {
      spec.kind = Kind::kFull;
    } else if (kind == "sliding_window") {
      spec.kind = Kind::kSlidingWindow;
      KVSTASH_ASSIGN_OR_RETURN(const uint64_t window, UintField(g, "window", "a group"));
      if (window == 0 || window > UINT32_MAX) return InternalError("a window of {}", window);
      spec.window = static_cast<uint32_t>(window);
    } else if (kind == "chunked_local_attention") {
      spec.kind = Kind::kChunkedLocal;
      KVSTASH_ASSIGN_OR_RETURN(const uint64_t chunk, UintField(g, "chunk", "a group"));
      if (chunk == 0 || chunk > UINT32_MAX) return InternalError("a chunk of {}", chunk);
      spec.chunk = static_cast<uint32_t>(chunk);
    } else if (kind == "mamba") {
      spec.kind = Kind::kState;
    } else {
      return InternalError("a group of unknown kind '{:.64}'", kind);
    }
    out.push_back(spec);
  }
  return out;
}

}  // namespace

std::string_view SpecKindName(engine::AttentionSpec::Kind kind) {
  using Kind = engine::AttentionSpec::Kind;
  switch (kind) {
    case Kind::kFull:
      return "full_attention";
    case Kind::kSlidingWindow:
      return "sliding_window";
    case Kind::kChunkedLocal:
      return "chunked_local_attention";
    case Kind::kState:
      return "mamba";
  }
  return "unknown";
}

json ModelsJson(const WorkerInfo& info, int64_t created) {
  char fingerprint[32];
  std::snprintf(fingerprint, sizeof fingerprint, "0x%016" PRIx64, info.fingerprint);
  json details = {{"fingerprint", fingerprint},
                  {"block_size", info.block_size},
                  {"attn_pack", info.attn_pack},
                  {"role", RoleName(info.role)},
                  {"nodes", info.nodes}};
  if (!info.groups.empty()) {
    details["groups"] = GroupsJson(info.groups);
    details["hash_block_size"] = info.hash_block_size;
    details["cache_salt"] = info.cache_salt;
  }
  if (!info.kv_events.empty()) {
    details["kv_events"] = {{"endpoint", info.kv_events},
                            {"replay", info.kv_events_replay},
                            {"topic", info.kv_events_topic}};
  }
  return {{"object", "list"},
          {"data", json::array({{{"id", info.model},
                                 {"object", "model"},
                                 {"created", created},
                                 {"owned_by", "kvstash"},
                                 {"kvstash", std::move(details)}}})}};
}

Result<WorkerInfo> ParseModels(std::string_view body) {
  KVSTASH_ASSIGN_OR_RETURN(const json reply, ParseObject(body, "the model list"));
  const json* data = Field(reply, "data");
  if (data == nullptr || !data->is_array() || data->size() != 1) {
    return InternalError("the model list does not hold exactly one model: {:.200}", body);
  }
  const json& model = (*data)[0];
  const json* kv = Field(model, "kvstash");
  if (kv == nullptr) return InternalError("the model has no \"kvstash\" details");
  WorkerInfo info;
  KVSTASH_ASSIGN_OR_RETURN(info.model, StringField(model, "id", "the model"));
  KVSTASH_ASSIGN_OR_RETURN(const std::string fingerprint,
                           StringField(*kv, "fingerprint", "the model"));
  char* end = nullptr;
  info.fingerprint = std::strtoull(fingerprint.c_str(), &end, 16);
  if (fingerprint.size() < 3 || fingerprint.compare(0, 2, "0x") != 0 || *end != '\0') {
    return InternalError("the model's fingerprint '{}' is not hexadecimal", fingerprint);
  }
  KVSTASH_ASSIGN_OR_RETURN(const uint64_t block_size, UintField(*kv, "block_size", "the model"));
  KVSTASH_ASSIGN_OR_RETURN(const uint64_t attn_pack, UintField(*kv, "attn_pack", "the model"));
  KVSTASH_ASSIGN_OR_RETURN(info.nodes, UintField(*kv, "nodes", "the model"));
  KVSTASH_ASSIGN_OR_RETURN(const std::string role, StringField(*kv, "role", "the model"));
  Result<Role> parsed_role = ParseRole(role);
  if (!parsed_role.ok()) return InternalError("the model's {}", parsed_role.status().message());
  info.block_size = static_cast<uint32_t>(block_size);
  info.attn_pack = static_cast<uint32_t>(attn_pack);
  info.role = *parsed_role;
  if (const json* groups = Field(*kv, "groups")) {
    KVSTASH_ASSIGN_OR_RETURN(info.groups, ParseGroups(*groups));
    KVSTASH_ASSIGN_OR_RETURN(const uint64_t hash_block,
                             UintField(*kv, "hash_block_size", "the model"));
    for (const engine::AttentionSpec& g : info.groups) {
      if (hash_block == 0 || g.block_size % hash_block != 0) {
        return InternalError("the model's hash block size {} does not divide its groups'",
                             hash_block);
      }
    }
    info.hash_block_size = static_cast<uint32_t>(hash_block);
    KVSTASH_ASSIGN_OR_RETURN(info.cache_salt, StringField(*kv, "cache_salt", "the model"));
  }
  if (const json* events = Field(*kv, "kv_events")) {
    KVSTASH_ASSIGN_OR_RETURN(info.kv_events, StringField(*events, "endpoint", "kv_events"));
    KVSTASH_ASSIGN_OR_RETURN(info.kv_events_replay, StringField(*events, "replay", "kv_events"));
    KVSTASH_ASSIGN_OR_RETURN(info.kv_events_topic, StringField(*events, "topic", "kv_events"));
  }
  return info;
}

json TotalsJson(const WorkerTotals& totals) {
  json out = json::object();
  for (const TotalField& f : kTotals) out[f.json] = totals.*f.member;
  totals.client.ForEach(
      [&out](const ClientCounterDef& def, uint64_t value) { out[def.export_name] = value; });
  return out;
}

Result<WorkerTotals> ParseTotals(std::string_view body) {
  KVSTASH_ASSIGN_OR_RETURN(const json reply, ParseObject(body, "the worker's stats"));
  WorkerTotals totals;
  for (const TotalField& f : kTotals) {
    KVSTASH_ASSIGN_OR_RETURN(totals.*f.member, UintField(reply, f.json, "the worker's stats"));
  }
  for (const ClientCounterDef& def : kClientCounterDefs) {
    KVSTASH_ASSIGN_OR_RETURN(totals.client[def.id],
                             UintField(reply, def.export_name, "the worker's stats"));
  }
  return totals;
}

std::string ClientCounterMetric(const ClientCounterDef& def) {
  return fmt::format("kvstash_worker_{}{}", def.export_name,
                     def.kind == CounterKind::kCounter ? "_total" : "");
}

std::string MetricsText(const WorkerTotals& totals, const WorkerInfo& info) {
  using prometheus::MetricType;
  http::PrometheusWriter out;
  out.Add("kvstash_worker_info", MetricType::Gauge,
          "The model this worker serves and its role (always 1)", 1,
          {{"model", info.model}, {"role", std::string(RoleName(info.role))}});
  for (const TotalField& f : kTotals) {
    out.Add(f.metric, f.gauge ? MetricType::Gauge : MetricType::Counter, f.help,
            static_cast<double>(totals.*f.member));
  }
  totals.client.ForEach([&out](const ClientCounterDef& def, uint64_t value) {
    out.Add(ClientCounterMetric(def),
            def.kind == CounterKind::kCounter ? MetricType::Counter : MetricType::Gauge, def.help,
            static_cast<double>(value));
  });
  return out.Text();
}

}  // namespace kvstash::worker
