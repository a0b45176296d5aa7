// The worker API's JSON: every way a completion request can be wrong is named with its field,
// and what the server writes (completions, chunks, the model list, totals) reads back as it was
// written, through the client's own parsers.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "kvstash/worker/protocol_json.h"

namespace kvstash::worker {
namespace {

struct BadRequest {
  std::string body;
  std::string param;
  std::string why;
};

TEST(ProtocolTest, ParsesCompletionRequestsInEitherPromptShape) {
  std::string param = "untouched";
  Result<CompletionRequest> r = ParseCompletionRequest(R"({"prompt": [1, 2, 3]})", &param);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->prompt, (std::vector<uint32_t>{1, 2, 3}));
  EXPECT_EQ(r->max_tokens, 16u);
  EXPECT_FALSE(r->stream);
  EXPECT_FALSE(r->model.has_value());
  EXPECT_EQ(param, "untouched");

  r = ParseCompletionRequest(
      R"({"model": "m", "prompt": [[4294967295, 0]], "max_tokens": 1048576, "stream": true,
          "temperature": 0.7, "user": "ignored"})",
      &param);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->prompt, (std::vector<uint32_t>{4294967295u, 0}));
  EXPECT_EQ(r->max_tokens, kMaxCompletionTokens);
  EXPECT_TRUE(r->stream);
  EXPECT_EQ(r->model, "m");

  // null means "not given".
  r = ParseCompletionRequest(R"({"prompt": [9], "max_tokens": null, "stream": null})", &param);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->max_tokens, 16u);
}

TEST(ProtocolTest, NamesTheFieldOfEveryBadRequest) {
  const std::vector<BadRequest> bad = {
      {"", "", "JSON object"},
      {"{\"prompt\": [1,", "", "JSON object"},
      {"[1, 2]", "", "JSON object"},
      {"\"prompt\"", "", "JSON object"},
      {"{}", "prompt", "missing"},
      {R"({"prompt": 5})", "prompt", "list of token ids"},
      {R"({"prompt": {"a": 1}})", "prompt", "list of token ids"},
      {R"({"prompt": []})", "prompt", "at least one"},
      {R"({"prompt": [[]]})", "prompt", "at least one"},
      {R"({"prompt": "1 2 3"})", "prompt", "no tokenizer"},
      {R"({"prompt": ["1"]})", "prompt", "no tokenizer"},
      {R"({"prompt": [[1], [2]]})", "prompt", "2 prompts"},
      {R"({"prompt": [1, -1]})", "prompt", "-1 at position 1"},
      {R"({"prompt": [1.5]})", "prompt", "not a token id"},
      {R"({"prompt": [4294967296]})", "prompt", "4294967296"},
      {R"({"prompt": [1, null]})", "prompt", "null at position 1"},
      {R"({"prompt": [[1, [2]]]})", "prompt", "not a token id"},
      {R"({"prompt": [1], "max_tokens": 0})", "max_tokens", "from 1 to 1048576, not 0"},
      {R"({"prompt": [1], "max_tokens": 1048577})", "max_tokens", "not 1048577"},
      {R"({"prompt": [1], "max_tokens": -3})", "max_tokens", "not -3"},
      {R"({"prompt": [1], "max_tokens": 2.0})", "max_tokens", "not 2.0"},
      {R"({"prompt": [1], "max_tokens": "4"})", "max_tokens", "not \"4\""},
      {R"({"prompt": [1], "stream": 1})", "stream", "true or false, not 1"},
      {R"({"prompt": [1], "model": 7})", "model", "must be a string"},
  };
  for (const BadRequest& b : bad) {
    std::string param = "unset";
    const Result<CompletionRequest> r = ParseCompletionRequest(b.body, &param);
    ASSERT_FALSE(r.ok()) << b.body;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << b.body;
    EXPECT_EQ(param, b.param) << b.body;
    EXPECT_NE(r.status().message().find(b.why), std::string::npos)
        << b.body << " -> " << r.status().message();
  }
}

TEST(ProtocolTest, ARequestWrittenByTheClientParsesBack) {
  CompletionRequest request;
  request.prompt = {3, 1, 4, 1, 5};
  request.max_tokens = 9;
  request.model = "tiny-hybrid";
  const Result<CompletionRequest> back =
      ParseCompletionRequest(CompletionRequestJson(request), nullptr);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->prompt, request.prompt);
  EXPECT_EQ(back->max_tokens, 9u);
  EXPECT_EQ(back->model, "tiny-hybrid");
  EXPECT_FALSE(back->stream);
}

Completion SampleCompletion() {
  Completion c;
  c.id = "cmpl-1";
  c.model = "tiny-hybrid";
  c.tokens = {17, 0, 255};
  c.finish_reason = "length";
  c.usage = {.prompt_tokens = 70,
             .completion_tokens = 3,
             .local_hit_tokens = 48,
             .node_tokens = 16,
             .computed_tokens = 6,
             .ttft_ms = 1.25,
             .latency_ms = 3.5};
  return c;
}

TEST(ProtocolTest, CompletionIsOpenAisObjectAndReadsBack) {
  const Completion c = SampleCompletion();
  const json j = CompletionJson(c, 1700000000);
  EXPECT_EQ(j["object"], "text_completion");
  EXPECT_EQ(j["created"], 1700000000);
  EXPECT_EQ(j["choices"][0]["text"], "17 0 255");
  EXPECT_EQ(j["choices"][0]["index"], 0);
  EXPECT_EQ(j["usage"]["total_tokens"], 73);
  EXPECT_EQ(j["usage"]["prompt_tokens_details"]["cached_tokens"], 48);
  EXPECT_EQ(j["usage"]["kvstash"]["local_hit_tokens"], 48);
  EXPECT_EQ(j["usage"]["kvstash"]["node_tokens"], 16);

  const Result<Completion> back = ParseCompletion(Dump(j));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->id, c.id);
  EXPECT_EQ(back->model, c.model);
  EXPECT_EQ(back->tokens, c.tokens);
  EXPECT_EQ(back->finish_reason, "length");
  EXPECT_EQ(back->usage.prompt_tokens, 70u);
  EXPECT_EQ(back->usage.completion_tokens, 3u);
  EXPECT_EQ(back->usage.local_hit_tokens, 48u);
  EXPECT_EQ(back->usage.node_tokens, 16u);
  EXPECT_EQ(back->usage.computed_tokens, 6u);
  EXPECT_DOUBLE_EQ(back->usage.ttft_ms, 1.25);
  EXPECT_DOUBLE_EQ(back->usage.latency_ms, 3.5);
}

TEST(ProtocolTest, MalformedRepliesAreInternalErrorsNotExceptions) {
  json good = CompletionJson(SampleCompletion(), 1);
  std::vector<std::string> bad = {"", "[]", "{\"id\": 1}", "not json"};
  json no_usage = good;
  no_usage.erase("usage");
  bad.push_back(Dump(no_usage));
  json negative = good;
  negative["choices"][0]["token_ids"] = {1, -2};
  bad.push_back(Dump(negative));
  json string_ttft = good;
  string_ttft["usage"]["kvstash"]["ttft_ms"] = "fast";
  bad.push_back(Dump(string_ttft));
  json no_choices = good;
  no_choices["choices"] = json::array();
  bad.push_back(Dump(no_choices));
  for (const std::string& body : bad) {
    const Result<Completion> r = ParseCompletion(body);
    ASSERT_FALSE(r.ok()) << body;
    EXPECT_EQ(r.status().code(), StatusCode::kInternal) << body;
  }
  EXPECT_FALSE(ParseModels(R"({"data": []})").ok());
  EXPECT_FALSE(ParseModels(R"({"data": [{"id": "m", "kvstash": {"fingerprint": "zz"}}]})").ok());
  EXPECT_FALSE(ParseTotals(R"({"requests": -1})").ok());
}

TEST(ProtocolTest, ChunksJoinToTheCompletionsTextAndOnlyTheLastCarriesUsage) {
  const Completion c = SampleCompletion();
  std::string text;
  for (size_t i = 0; i < c.tokens.size(); ++i) {
    const bool last = i + 1 == c.tokens.size();
    const json chunk = ChunkJson("cmpl-1", 5, "tiny-hybrid", c.tokens[i], i == 0,
                                 last ? &c.usage : nullptr, "length");
    EXPECT_EQ(chunk["object"], "text_completion");
    EXPECT_EQ(chunk["choices"][0]["token_ids"], json::array({c.tokens[i]}));
    EXPECT_EQ(chunk["choices"][0]["finish_reason"].is_null(), !last);
    EXPECT_EQ(chunk.contains("usage"), last);
    text += chunk["choices"][0]["text"].get<std::string>();
  }
  EXPECT_EQ(text, JoinTokens(c.tokens));
  const json finish_only = ChunkJson("cmpl-1", 5, "m", std::nullopt, false, &c.usage, "length");
  EXPECT_EQ(finish_only["choices"][0]["text"], "");
  EXPECT_TRUE(finish_only["choices"][0]["token_ids"].empty());
  EXPECT_EQ(finish_only["usage"]["completion_tokens"], 3);
}

TEST(ProtocolTest, ModelListCarriesTheFingerprintExactly) {
  WorkerInfo info;
  info.model = "tiny-state-hybrid";
  info.fingerprint = 0xfedcba9876543210ull;  // past 2^53: a JSON number would lose bits
  info.block_size = 16;
  info.attn_pack = 4;
  info.role = Role::kDecode;
  info.nodes = 2;
  const json j = ModelsJson(info, 42);
  EXPECT_EQ(j["object"], "list");
  EXPECT_EQ(j["data"][0]["object"], "model");
  EXPECT_EQ(j["data"][0]["kvstash"]["fingerprint"], "0xfedcba9876543210");
  const Result<WorkerInfo> back = ParseModels(Dump(j));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->model, info.model);
  EXPECT_EQ(back->fingerprint, info.fingerprint);
  EXPECT_EQ(back->block_size, 16u);
  EXPECT_EQ(back->attn_pack, 4u);
  EXPECT_EQ(back->role, Role::kDecode);
  EXPECT_EQ(back->nodes, 2u);
  EXPECT_TRUE(back->groups.empty());  // a worker that states no layout
}

TEST(ProtocolTest, ModelListCarriesTheCacheLayoutAndEventEndpoints) {
  using Kind = engine::AttentionSpec::Kind;
  WorkerInfo info;
  info.model = "m";
  info.groups = {{Kind::kFull, 16},
                 {Kind::kSlidingWindow, 16, 128},
                 {Kind::kState, 16},
                 {Kind::kChunkedLocal, 32, 0, 64}};
  info.hash_block_size = 16;
  info.cache_salt = "00000000000000001234567890abcdef";
  info.kv_events = "tcp://0.0.0.0:5557";
  info.kv_events_replay = "tcp://0.0.0.0:5558";
  const Result<WorkerInfo> back = ParseModels(Dump(ModelsJson(info, 1)));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->groups, info.groups);
  EXPECT_EQ(back->hash_block_size, 16u);
  EXPECT_EQ(back->cache_salt, info.cache_salt);
  EXPECT_EQ(back->kv_events, info.kv_events);
  EXPECT_EQ(back->kv_events_replay, info.kv_events_replay);
  EXPECT_EQ(back->kv_events_topic, "");
  // A layout that cannot be right is refused, naming what is wrong.
  for (
      const auto& [bad, why] : std::vector<std::pair<std::string, std::string>>{
          {R"("groups": [{"kind": "warp", "block_size": 16}], "hash_block_size": 16, "cache_salt": "")",
           "unknown kind"},
          {R"("groups": [{"kind": "full_attention", "block_size": 0}], "hash_block_size": 16, "cache_salt": "")",
           "block size"},
          {R"("groups": [{"kind": "full_attention", "block_size": 24}], "hash_block_size": 16, "cache_salt": "")",
           "does not divide"},
          {R"("groups": [{"kind": "sliding_window", "block_size": 16}], "hash_block_size": 16, "cache_salt": "")",
           "window"},
          {R"("groups": 7, "hash_block_size": 16, "cache_salt": "")", "not an array"}}) {
    const std::string body = R"({"data": [{"id": "m", "kvstash": {"fingerprint": "0x01", )"
                             R"("block_size": 16, "attn_pack": 1, "nodes": 0, "role": "both", )" +
                             bad + "}}]}";
    const Result<WorkerInfo> r = ParseModels(body);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_THAT(std::string(r.status().message()), ::testing::HasSubstr(why)) << bad;
  }
}

TEST(ProtocolTest, TotalsReadBackAndEveryOneIsAMetric) {
  WorkerTotals t;
  uint64_t v = 1;
  // Distinct values, so a field read from another's name shows.
  for (uint64_t* field :
       {&t.requests, &t.failed_requests, &t.cancelled_requests, &t.prompt_tokens,
        &t.generation_tokens, &t.local_hit_tokens, &t.node_tokens, &t.computed_tokens,
        &t.running_requests, &t.steps, &t.prefill_tokens, &t.decode_tokens, &t.preemptions,
        &t.load_failures, &t.loaded_bytes, &t.stored_bytes, &t.blocks_loaded, &t.blocks_stored}) {
    *field = 1000 + v++;
  }
  for (const ClientCounterDef& def : kClientCounterDefs) t.client[def.id] = 1000 + v++;
  const Result<WorkerTotals> back = ParseTotals(Dump(TotalsJson(t)));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(Dump(TotalsJson(*back)), Dump(TotalsJson(t)));
  EXPECT_EQ(back->requests, t.requests);
  EXPECT_EQ(back->client, t.client);

  WorkerInfo info;
  info.model = "odd \"name\"\\";
  info.role = Role::kPrefill;
  const std::string text = MetricsText(t, info);
  EXPECT_NE(text.find("kvstash_worker_info{model=\"odd \\\"name\\\"\\\\\",role=\"prefill\"} 1\n"),
            std::string::npos)
      << text;
  std::vector<std::pair<std::string, uint64_t>> metrics = {
      {"kvstash_worker_requests_total", t.requests},
      {"kvstash_worker_prompt_tokens_total", t.prompt_tokens},
      {"kvstash_worker_generation_tokens_total", t.generation_tokens},
      {"kvstash_worker_node_tokens_total", t.node_tokens},
      {"kvstash_worker_load_failures_total", t.load_failures},
      {"kvstash_worker_loaded_bytes_total", t.loaded_bytes},
      {"kvstash_worker_stored_bytes_total", t.stored_bytes},
      // The client's counters that predate its registry keep their names.
      {"kvstash_worker_node_unreachable_total", t.client[ClientCounter::kUnreachable]},
      {"kvstash_worker_node_refusals_total", t.client[ClientCounter::kRefused]},
      {"kvstash_worker_touched_keys_total", t.client[ClientCounter::kTouchedKeys]},
      {"kvstash_worker_node_unserved_keys_total", t.client[ClientCounter::kUnservedKeys]},
      {"kvstash_worker_members_joined_total", t.client[ClientCounter::kMembersJoined]},
      {"kvstash_worker_members_left_total", t.client[ClientCounter::kMembersLeft]},
      {"kvstash_worker_running_requests", t.running_requests}};
  // And every row of the registry is one.
  for (const ClientCounterDef& def : kClientCounterDefs) {
    metrics.emplace_back(ClientCounterMetric(def), t.client[def.id]);
  }
  for (const auto& [name, value] : metrics) {
    EXPECT_NE(text.find("\n" + name + " " + std::to_string(value) + "\n"), std::string::npos)
        << name << " in\n"
        << text;
    EXPECT_NE(text.find("# TYPE " + name + " "), std::string::npos) << name;
  }
  // No two totals share a name: one family per JSON field, and kvstash_worker_info.
  size_t families = 0;
  for (size_t at = text.find("# TYPE "); at != std::string::npos;
       at = text.find("# TYPE ", at + 1)) {
    ++families;
  }
  EXPECT_EQ(families, TotalsJson(t).size() + 1) << text;
}

TEST(ProtocolTest, ClientCountersKeepTheirNamesAndParseWantsEveryOne) {
  EXPECT_EQ(ClientCounterMetric(kClientCounterDefs[static_cast<size_t>(ClientCounter::kRefused)]),
            "kvstash_worker_node_refusals_total");
  EXPECT_EQ(ClientCounterMetric(kClientCounterDefs[static_cast<size_t>(ClientCounter::kProbes)]),
            "kvstash_worker_node_probes_total");
  // A stats reply without one of the client's counters is an error that names it.
  json reply = TotalsJson(WorkerTotals{});
  reply.erase("node_abandoned_calls");
  const Result<WorkerTotals> parsed = ParseTotals(Dump(reply));
  ASSERT_FALSE(parsed.ok());
  EXPECT_NE(parsed.status().message().find("node_abandoned_calls"), std::string::npos)
      << parsed.status().ToString();
}

TEST(ProtocolTest, ErrorsAreOpenAisShapeAndInvalidUtf8NeverThrows) {
  const json e = ErrorJson(400, "invalid_prompt", "bad", "prompt");
  EXPECT_EQ(e["error"]["type"], "invalid_request_error");
  EXPECT_EQ(e["error"]["code"], "invalid_prompt");
  EXPECT_EQ(e["error"]["param"], "prompt");
  EXPECT_EQ(e["error"]["message"], "bad");
  EXPECT_EQ(ErrorJson(503, "x", "y")["error"]["type"], "server_error");
  EXPECT_TRUE(ErrorJson(404, "x", "y")["error"]["param"].is_null());
  EXPECT_EQ(ErrorMessage(Dump(e)), "bad");
  EXPECT_EQ(ErrorMessage("plain text"), "plain text");
  // A message holding bytes that are not UTF-8 is written with replacements.
  const std::string dumped = Dump(ErrorJson(500, "x", std::string("\xff\xfe tail")));
  EXPECT_NE(dumped.find("tail"), std::string::npos);
}

TEST(ProtocolTest, RolesByName) {
  for (const Role role : {Role::kBoth, Role::kPrefill, Role::kDecode}) {
    const Result<Role> back = ParseRole(RoleName(role));
    ASSERT_TRUE(back.ok());
    EXPECT_EQ(*back, role);
  }
  EXPECT_EQ(ParseRole("decoder").status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvstash::worker
