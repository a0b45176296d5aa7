// `kvstash-engine serve` and `kvstash-engine chat --prefill-worker/--decode-worker` with real
// processes over loopback HTTP: a worker answers OpenAI-shaped completions (to cpp-httplib's
// client and to curl) with the tokens `generate` prints, streams them one event per token, names
// bad requests without stopping, refuses oversized bodies, batches concurrent requests, reports
// its totals (/kvstash/stats, /metrics), and on SIGTERM finishes what is in flight and exits 0;
// a conversation through a prefill and a decode worker over two real kvstashd nodes gives the
// tokens of a run without any cache, each turn pulled from the nodes and each later turn
// starting from the earlier turn's blocks.

#include <gtest/gtest.h>
#include <httplib.h>
#include <signal.h>

#include <latch>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "daemon_process.h"
#include "etcd_process.h"
#include "kvstash/connector/node_client.h"
#include "kvstash/events/subscriber.h"
#include "kvstash/router/scoring.h"
#include "kvstash/worker/protocol_json.h"
#include "membership_wait.h"
#include "subprocess.h"

namespace kvstash::worker {
namespace {

using ::kvstash::testing::ChildProcess;
using ::kvstash::testing::Daemon;
using ::kvstash::testing::RunProcess;
using nlohmann::json;

constexpr const char* kNodeBlockBytes = "4152";  // the built-ins' page plus the block trailer

// A `kvstash-engine serve` child on a free port; port() is 0 when it did not start.
class Worker {
 public:
  explicit Worker(std::vector<std::string> args) {
    std::vector<std::string> argv = {KVSTASH_ENGINE_PATH, "serve", "--port", "0"};
    argv.insert(argv.end(), args.begin(), args.end());
    child_ = ::kvstash::testing::StartChild(argv);
    if (child_ == nullptr) return;
    const std::string prefix = "kvstash-engine serving ";
    for (int i = 0; i < 50; ++i) {
      std::optional<std::string> line = child_->ReadLine(20000);
      if (!line) break;
      if (line->rfind(prefix, 0) == 0) {
        address_ = line->substr(line->rfind(' ') + 1);
        port_ = static_cast<uint16_t>(std::stoi(address_.substr(address_.rfind(':') + 1)));
        break;
      }
    }
  }
  const std::string& address() const { return address_; }
  uint16_t port() const { return port_; }
  ChildProcess& process() { return *child_; }

 private:
  std::unique_ptr<ChildProcess> child_;
  std::string address_;
  uint16_t port_ = 0;
};

// An HTTP reply: status 0 when none came.
struct Reply {
  int status = 0;
  std::string body;
  httplib::Headers headers;
  json parsed;  // the body as JSON (discarded when it is not)

  std::string Header(const std::string& name) const {
    const auto it = headers.find(name);
    return it == headers.end() ? "" : it->second;
  }
};

Reply ToReply(const httplib::Result& result) {
  Reply reply;
  if (!result) return reply;
  reply.status = result->status;
  reply.body = result->body;
  reply.headers = result->headers;
  reply.parsed = json::parse(reply.body, nullptr, /*allow_exceptions=*/false);
  return reply;
}

// One client of one worker, over a kept-alive connection.
class Http {
 public:
  explicit Http(uint16_t port) : client_("127.0.0.1", port) {
    client_.set_read_timeout(std::chrono::seconds(60));
    client_.set_keep_alive(true);
  }
  Reply Get(const std::string& path) { return ToReply(client_.Get(path)); }
  Reply Post(const std::string& path, const std::string& body) {
    return ToReply(client_.Post(path, body, "application/json"));
  }
  Reply Complete(const json& request) { return Post("/v1/completions", request.dump()); }
  httplib::Client& client() { return client_; }
  // Closes the connection (the worker need not wait for it to go idle when it stops).
  void Close() { client_.stop(); }

 private:
  httplib::Client client_;
};

std::vector<uint32_t> Prompt(size_t n, uint64_t seed) {
  std::vector<uint32_t> t(n);
  for (size_t i = 0; i < n; ++i) t[i] = static_cast<uint32_t>((i * 37 + seed * 11) % 256);
  return t;
}

// The tokens `kvstash-engine generate` prints for the prompt, with no nodes and no cache.
std::vector<uint32_t> Reference(const std::string& model, const std::vector<uint32_t>& prompt,
                                size_t max_new) {
  std::string text;
  for (uint32_t t : prompt) text += (text.empty() ? "" : " ") + std::to_string(t);
  const auto r = RunProcess({KVSTASH_ENGINE_PATH, "generate", "--model", model, "--prompt", text,
                             "--max-new-tokens", std::to_string(max_new), "--no-prefix-cache"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  std::vector<uint32_t> tokens;
  std::istringstream in(r.out);
  for (uint32_t t; in >> t;) tokens.push_back(t);
  return tokens;
}

// choices[0].token_ids of a completion, or nothing.
std::vector<uint32_t> Tokens(const json& completion) {
  if (!completion.is_object() || !completion.contains("choices")) return {};
  const json& choices = completion["choices"];
  if (!choices.is_array() || choices.empty() || !choices[0].contains("token_ids")) return {};
  return choices[0]["token_ids"].get<std::vector<uint32_t>>();
}

std::string Join(const std::vector<uint32_t>& tokens) {
  std::string s;
  for (uint32_t t : tokens) s += (s.empty() ? "" : " ") + std::to_string(t);
  return s;
}

// The `data:` payloads of a Server-Sent Events body, in order.
std::vector<std::string> Events(const std::string& body) {
  std::vector<std::string> events;
  std::istringstream in(body);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("data: ", 0) == 0) events.push_back(line.substr(6));
  }
  return events;
}

TEST(ServeTest, AnswersLikeGenerateAndNamesBadRequestsWhileServing) {
  Worker worker({"--model", "builtin:tiny-hybrid", "--max-body-bytes", "4096"});
  ASSERT_NE(worker.port(), 0);
  Http http(worker.port());

  const Reply models = http.Get("/v1/models");
  ASSERT_EQ(models.status, 200) << models.body;
  EXPECT_EQ(models.parsed.value("object", ""), "list");
  ASSERT_EQ(models.parsed["data"].size(), 1u) << models.body;
  const json& model = models.parsed["data"][0];
  EXPECT_EQ(model.value("id", ""), "tiny-hybrid");
  EXPECT_EQ(model.value("object", ""), "model");
  EXPECT_EQ(model["kvstash"].value("role", ""), "both");
  EXPECT_EQ(model["kvstash"].value("block_size", 0u), 16u);
  EXPECT_EQ(model["kvstash"].value("fingerprint", "").rfind("0x", 0), 0u) << models.body;

  const std::vector<uint32_t> prompt = Prompt(70, 1);
  const std::vector<uint32_t> reference = Reference("builtin:tiny-hybrid", prompt, 7);
  ASSERT_EQ(reference.size(), 7u);
  Reply reply = http.Complete({{"model", "tiny-hybrid"}, {"prompt", prompt}, {"max_tokens", 7}});
  ASSERT_EQ(reply.status, 200) << reply.body;
  const json& c = reply.parsed;
  EXPECT_EQ(c.value("object", ""), "text_completion");
  EXPECT_EQ(c.value("id", "").rfind("cmpl-", 0), 0u) << reply.body;
  EXPECT_EQ(c.value("model", ""), "tiny-hybrid");
  EXPECT_GT(c.value("created", int64_t{0}), int64_t{1600000000});
  EXPECT_EQ(Tokens(c), reference) << reply.body;
  EXPECT_EQ(c["choices"][0].value("text", ""), Join(reference));
  EXPECT_EQ(c["choices"][0].value("finish_reason", ""), "length");
  const json& usage = c["usage"];
  EXPECT_EQ(usage.value("prompt_tokens", 0u), 70u);
  EXPECT_EQ(usage.value("completion_tokens", 0u), 7u);
  EXPECT_EQ(usage.value("total_tokens", 0u), 77u);
  EXPECT_EQ(usage["prompt_tokens_details"].value("cached_tokens", 1u), 0u);
  EXPECT_EQ(usage["kvstash"].value("computed_tokens", 0u), 70u);
  EXPECT_EQ(usage["kvstash"].value("node_tokens", 1u), 0u);
  EXPECT_EQ(usage["kvstash"].value("local_hit_tokens", 1u), 0u);
  EXPECT_GT(usage["kvstash"].value("ttft_ms", -1.0), 0.0);
  EXPECT_GE(usage["kvstash"].value("latency_ms", -1.0), usage["kvstash"].value("ttft_ms", 0.0));

  // The same prompt again, as OpenAI's list of one prompt, hits the worker's own prefix cache
  // and gives the same tokens.
  reply = http.Complete({{"prompt", json::array({prompt})}, {"max_tokens", 7}});
  ASSERT_EQ(reply.status, 200) << reply.body;
  EXPECT_EQ(Tokens(reply.parsed), reference);
  const json& again = reply.parsed["usage"];
  EXPECT_GE(again["prompt_tokens_details"].value("cached_tokens", 0u), 64u) << reply.body;
  EXPECT_EQ(again["kvstash"].value("local_hit_tokens", 0u),
            again["prompt_tokens_details"].value("cached_tokens", 1u));

  // Each bad request gets an OpenAI error object naming what is wrong; the worker (and the
  // connection) go on serving.
  struct Bad {
    std::string body;
    int status;
    std::string code;
    std::string why;
  };
  const std::vector<Bad> bad = {
      {"not json at all", 400, "invalid_json", "must be a JSON object"},
      {"[1, 2, 3]", 400, "invalid_json", "must be a JSON object"},
      {"{}", 400, "invalid_prompt", "\"prompt\" is missing"},
      {R"({"prompt": []})", 400, "invalid_prompt", "at least one token id"},
      {R"({"prompt": [1, -2]})", 400, "invalid_prompt", "not a token id"},
      {R"({"prompt": [1, 2.5]})", 400, "invalid_prompt", "not a token id"},
      {R"({"prompt": "hello"})", 400, "invalid_prompt", "no tokenizer"},
      {R"({"prompt": [[1], [2]]})", 400, "invalid_prompt", "one prompt per request"},
      {R"({"prompt": [1, 300]})", 400, "invalid_prompt", "outside the vocabulary"},
      {R"({"prompt": [1, 2], "max_tokens": 0})", 400, "invalid_max_tokens", "max_tokens"},
      {R"({"prompt": [1, 2], "max_tokens": 2000000})", 400, "invalid_max_tokens", "max_tokens"},
      {R"({"prompt": [1, 2], "max_tokens": "8"})", 400, "invalid_max_tokens", "max_tokens"},
      {R"({"prompt": [1, 2], "stream": "yes"})", 400, "invalid_stream", "\"stream\""},
      {R"({"prompt": [1, 2], "stream": true, "max_tokens": -1})", 400, "invalid_max_tokens",
       "max_tokens"},
      {R"({"prompt": [1, 300], "stream": true})", 400, "invalid_prompt", "outside the vocabulary"},
      {R"({"model": "tiny-full", "prompt": [1, 2]})", 404, "model_not_found", "serves"},
  };
  for (const Bad& b : bad) {
    const Reply answer = http.Post("/v1/completions", b.body);
    EXPECT_EQ(answer.status, b.status) << b.body << " -> " << answer.body;
    ASSERT_TRUE(answer.parsed.contains("error")) << b.body << " -> " << answer.body;
    const json& error = answer.parsed["error"];
    EXPECT_EQ(error.value("type", ""), "invalid_request_error") << answer.body;
    EXPECT_EQ(error.value("code", ""), b.code) << b.body << " -> " << answer.body;
    EXPECT_NE(error.value("message", "").find(b.why), std::string::npos)
        << b.body << " -> " << answer.body;
  }
  EXPECT_EQ(Tokens(http.Complete({{"prompt", prompt}, {"max_tokens", 7}}).parsed), reference);

  // A body past --max-body-bytes, with a length or chunked: 413 naming the limit; the worker
  // serves the next connection. The client may still be sending the body when the answer
  // comes: a write after the worker closed must fail, not end this process (httplib's client
  // writes without MSG_NOSIGNAL).
  signal(SIGPIPE, SIG_IGN);
  const std::string big = json{{"prompt", std::vector<uint32_t>(3000, 7)}}.dump();
  ASSERT_GT(big.size(), 4096u);
  for (const bool chunked : {false, true}) {
    Http fresh(worker.port());
    httplib::Result result =
        chunked
            ? fresh.client().Post(
                  "/v1/completions",
                  [&big](size_t offset, httplib::DataSink& sink) {
                    if (offset < big.size()) {
                      sink.write(big.data() + offset, std::min<size_t>(1000, big.size() - offset));
                    } else {
                      sink.done();
                    }
                    return true;
                  },
                  "application/json")
            : fresh.client().Post("/v1/completions", big, "application/json");
    const Reply answer = ToReply(result);
    EXPECT_EQ(answer.status, 413) << "chunked=" << chunked << " " << answer.body;
    EXPECT_NE(answer.parsed["error"].value("message", "").find("limit of 4096 bytes"),
              std::string::npos)
        << answer.body;
    EXPECT_EQ(answer.parsed["error"].value("code", ""), "request_too_large") << answer.body;
  }
  Http other(worker.port());
  EXPECT_EQ(Tokens(other.Complete({{"prompt", prompt}, {"max_tokens", 7}}).parsed), reference);

  other.Close();
  http.Close();
  EXPECT_EQ(worker.process().Kill(SIGTERM), 0);
}

// What the README shows, run as it is written: curl's default form body and all.
// A worker with --kv-events states its layout and event endpoints in /v1/models; a subscriber
// that joins after a completion reads its events by replay, and the hit a router computes from
// them for the same prompt is the hit the worker then really gives it.
TEST(ServeTest, KvEventsPredictTheWorkersOwnHit) {
  Worker worker({"--model", "builtin:tiny-hybrid", "--kv-events", "tcp://127.0.0.1:*",
                 "--kv-events-replay", "tcp://127.0.0.1:*"});
  ASSERT_NE(worker.port(), 0);
  Http http(worker.port());
  const Reply models = http.Get("/v1/models");
  ASSERT_EQ(models.status, 200);
  Result<worker::WorkerInfo> info = worker::ParseModels(models.body);
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  ASSERT_FALSE(info->groups.empty()) << models.body;
  ASSERT_FALSE(info->kv_events.empty()) << models.body;
  ASSERT_FALSE(info->kv_events_replay.empty()) << models.body;

  const std::vector<uint32_t> prompt = Prompt(150, 3);
  Reply first = http.Complete({{"prompt", prompt}, {"max_tokens", 2}});
  ASSERT_EQ(first.status, 200) << first.body;

  events::KvIndex index;
  events::SubscriberOptions options;
  options.endpoint = info->kv_events;
  options.replay_endpoint = info->kv_events_replay;
  options.topic = info->kv_events_topic;
  auto sub = events::EventSubscriber::Create(
      options, [&index](const events::Delivery& d) { index.Apply("w", d); });
  ASSERT_TRUE(sub.ok()) << sub.status().ToString();
  // It joins late: the next engine step's batch shows it what it missed, which it replays.
  const router::CacheLayout layout{info->groups, info->hash_block_size, info->cache_salt};
  const std::vector<BlockHash> hashes = router::PromptHashes(layout, prompt);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  size_t predicted = 0;
  for (uint64_t seed = 100; predicted == 0 && std::chrono::steady_clock::now() < deadline; ++seed) {
    // Another prompt makes a step, so a batch goes out.
    ASSERT_EQ(http.Complete({{"prompt", Prompt(20, seed)}, {"max_tokens", 1}}).status, 200);
    predicted = router::HybridHitTokens(index, "w", "GPU", layout, hashes, prompt.size());
  }
  EXPECT_GT(predicted, 100u);
  EXPECT_EQ((*sub)->stats().resets, 0u);

  Reply again = http.Complete({{"prompt", prompt}, {"max_tokens", 2}});
  ASSERT_EQ(again.status, 200) << again.body;
  EXPECT_EQ(again.parsed["usage"]["kvstash"].value("local_hit_tokens", 0u), predicted)
      << again.body;
  EXPECT_EQ(worker.process().Kill(SIGTERM), 0);
}

TEST(ServeTest, CurlGetsAnOpenAiCompletionWithGeneratesTokens) {
  Worker worker({"--model", "builtin:tiny-hybrid"});
  ASSERT_NE(worker.port(), 0);
  const auto r =
      RunProcess({"curl", "-s", "localhost:" + std::to_string(worker.port()) + "/v1/completions",
                  "-d", R"({"prompt":[1,2,3],"max_tokens":4})"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const json c = json::parse(r.out, nullptr, /*allow_exceptions=*/false);
  ASSERT_TRUE(c.is_object()) << r.out;
  const std::vector<uint32_t> reference = Reference("builtin:tiny-hybrid", {1, 2, 3}, 4);
  ASSERT_EQ(reference.size(), 4u);
  EXPECT_EQ(c.value("object", ""), "text_completion") << r.out;
  EXPECT_EQ(c.value("model", ""), "tiny-hybrid");
  EXPECT_TRUE(c.contains("id") && c.contains("created")) << r.out;
  EXPECT_EQ(Tokens(c), reference) << r.out;
  EXPECT_EQ(c["choices"][0].value("text", ""), Join(reference));
  EXPECT_EQ(c["choices"][0].value("index", -1), 0);
  EXPECT_EQ(c["usage"].value("prompt_tokens", 0u), 3u);
  EXPECT_EQ(c["usage"].value("completion_tokens", 0u), 4u);
  EXPECT_EQ(c["usage"].value("total_tokens", 0u), 7u);
  EXPECT_EQ(worker.process().Kill(SIGTERM), 0);
}

TEST(ServeTest, StreamsOneEventPerTokenThenDone) {
  Worker worker({"--model", "builtin:tiny-state-hybrid"});
  ASSERT_NE(worker.port(), 0);
  const std::vector<uint32_t> prompt = Prompt(50, 4);
  const std::vector<uint32_t> reference = Reference("builtin:tiny-state-hybrid", prompt, 6);
  ASSERT_EQ(reference.size(), 6u);
  Http http(worker.port());
  const Reply reply = http.Complete({{"prompt", prompt}, {"max_tokens", 6}, {"stream", true}});
  ASSERT_EQ(reply.status, 200) << reply.body;
  EXPECT_EQ(reply.Header("Content-Type"), "text/event-stream");
  const std::vector<std::string> events = Events(reply.body);
  ASSERT_EQ(events.size(), 7u) << reply.body;
  EXPECT_EQ(events.back(), "[DONE]");
  std::vector<uint32_t> streamed;
  std::string text;
  std::string id;
  for (size_t i = 0; i < 6; ++i) {
    const json chunk = json::parse(events[i], nullptr, /*allow_exceptions=*/false);
    ASSERT_TRUE(chunk.is_object()) << events[i];
    EXPECT_EQ(chunk.value("object", ""), "text_completion");
    if (i == 0) id = chunk.value("id", "");
    EXPECT_EQ(chunk.value("id", ""), id) << "every chunk carries the completion's id";
    const std::vector<uint32_t> ids = Tokens(chunk);
    ASSERT_EQ(ids.size(), 1u) << events[i];
    streamed.push_back(ids[0]);
    text += chunk["choices"][0].value("text", "");
    const bool last = i == 5;
    EXPECT_EQ(chunk["choices"][0]["finish_reason"].is_null(), !last) << events[i];
    EXPECT_EQ(chunk.contains("usage"), last) << events[i];
    if (last) {
      EXPECT_EQ(chunk["choices"][0].value("finish_reason", ""), "length");
      EXPECT_EQ(chunk["usage"].value("completion_tokens", 0u), 6u);
      EXPECT_EQ(chunk["usage"].value("prompt_tokens", 0u), 50u);
      EXPECT_EQ(chunk["usage"]["kvstash"].value("computed_tokens", 0u), 50u);
    }
  }
  EXPECT_EQ(streamed, reference);
  EXPECT_EQ(text, Join(reference)) << "the chunks' texts joined are the completion's text";
  http.Close();
  EXPECT_EQ(worker.process().Kill(SIGTERM), 0);
}

TEST(ServeTest, HealthMetricsStatsAndUnknownPathsOrMethods) {
  Worker worker({"--model", "builtin:tiny-hybrid"});
  ASSERT_NE(worker.port(), 0);
  Http http(worker.port());
  const Reply health = http.Get("/health");
  EXPECT_EQ(health.status, 200);
  EXPECT_EQ(health.parsed, json({{"status", "ok"}})) << health.body;

  ASSERT_EQ(http.Complete({{"prompt", Prompt(40, 2)}, {"max_tokens", 5}}).status, 200);
  ASSERT_EQ(http.Complete({{"prompt", Prompt(40, 2)}, {"max_tokens", 5}}).status, 200);

  const Reply stats = http.Get("/kvstash/stats");
  ASSERT_EQ(stats.status, 200) << stats.body;
  EXPECT_EQ(stats.parsed.value("requests", 0u), 2u) << stats.body;
  EXPECT_EQ(stats.parsed.value("prompt_tokens", 0u), 80u);
  EXPECT_EQ(stats.parsed.value("generation_tokens", 0u), 10u);
  EXPECT_GE(stats.parsed.value("local_hit_tokens", 0u), 32u) << "the second hit the first";
  EXPECT_GT(stats.parsed.value("steps", 0u), 0u);
  EXPECT_EQ(stats.parsed.value("running_requests", 1u), 0u);
  for (const char* field :
       {"loaded_bytes", "stored_bytes", "load_failures", "node_unreachable", "node_refusals",
        "touched_keys", "node_tokens", "node_unserved_keys", "members_joined", "members_left"}) {
    EXPECT_TRUE(stats.parsed.contains(field)) << field << " in " << stats.body;
  }

  const Reply metrics = http.Get("/metrics");
  ASSERT_EQ(metrics.status, 200);
  EXPECT_EQ(metrics.Header("Content-Type").rfind("text/plain; version=0.0.4", 0), 0u);
  for (const std::string line :
       {"# TYPE kvstash_worker_requests_total counter", "kvstash_worker_requests_total 2",
        "kvstash_worker_prompt_tokens_total 80", "kvstash_worker_generation_tokens_total 10",
        "kvstash_worker_node_tokens_total 0", "kvstash_worker_load_failures_total 0",
        "kvstash_worker_loaded_bytes_total 0", "kvstash_worker_stored_bytes_total 0",
        "kvstash_worker_node_unreachable_total 0", "kvstash_worker_node_refusals_total 0",
        "kvstash_worker_touched_keys_total 0", "# TYPE kvstash_worker_running_requests gauge",
        "kvstash_worker_info{model=\"tiny-hybrid\",role=\"both\"} 1"}) {
    EXPECT_NE(metrics.body.find("\n" + line + "\n"), std::string::npos) << line << " in\n"
                                                                        << metrics.body;
  }

  const Reply missing = http.Get("/v1/chat/nothing");
  EXPECT_EQ(missing.status, 404);
  EXPECT_EQ(missing.parsed["error"].value("code", ""), "not_found") << missing.body;
  const Reply get_completions = http.Get("/v1/completions");
  EXPECT_EQ(get_completions.status, 405);
  EXPECT_EQ(get_completions.Header("Allow"), "POST");
  EXPECT_EQ(get_completions.parsed["error"].value("code", ""), "method_not_allowed");
  const Reply post_health = http.Post("/health", "{}");
  EXPECT_EQ(post_health.status, 405) << post_health.body;
  EXPECT_EQ(post_health.Header("Allow"), "GET, HEAD");
  EXPECT_EQ(ToReply(http.client().Delete("/v1/models")).status, 405);
  // Still serving.
  EXPECT_EQ(http.Get("/health").status, 200);
  http.Close();
  EXPECT_EQ(worker.process().Kill(SIGTERM), 0);
}

TEST(ServeTest, ConcurrentRequestsAreBatchedAndEachAnsweredWithItsOwnResult) {
  Worker worker({"--model", "builtin:tiny-state-hybrid"});
  ASSERT_NE(worker.port(), 0);
  constexpr int kRequests = 4;
  constexpr size_t kTokens = 200;
  std::vector<std::vector<uint32_t>> prompts;
  std::vector<std::unique_ptr<Http>> clients;
  for (int i = 0; i < kRequests; ++i) {
    prompts.push_back(Prompt(40 + 13 * i, i + 3));
    clients.push_back(std::make_unique<Http>(worker.port()));
    ASSERT_EQ(clients.back()->Get("/health").status, 200);  // connected before the race
  }
  // All sent at once, each on its own connection.
  std::vector<Reply> replies(kRequests);
  std::latch start(kRequests);
  std::vector<std::thread> threads;
  for (int i = 0; i < kRequests; ++i) {
    threads.emplace_back([&, i] {
      start.arrive_and_wait();
      replies[i] = clients[i]->Complete({{"prompt", prompts[i]}, {"max_tokens", kTokens}});
    });
  }
  for (std::thread& t : threads) t.join();
  for (int i = 0; i < kRequests; ++i) {
    ASSERT_EQ(replies[i].status, 200) << replies[i].body;
    EXPECT_EQ(Tokens(replies[i].parsed),
              Reference("builtin:tiny-state-hybrid", prompts[i], kTokens))
        << "request " << i;
  }
  // The worker ran them together: fewer steps than one after the other (each request alone
  // takes at least one step per generated token).
  const Reply stats = clients[0]->Get("/kvstash/stats");
  EXPECT_LT(stats.parsed.value("steps", uint64_t{1} << 40), kRequests * kTokens) << stats.body;
  EXPECT_EQ(stats.parsed.value("requests", 0u), 4u);
  for (auto& client : clients) client->Close();
  EXPECT_EQ(worker.process().Kill(SIGTERM), 0);
}

// SIGTERM mid-stream (after the first event, with most tokens still to generate): the stream
// runs to its end within --stop-grace-ms (here more than a busy machine needs), then the worker
// exits 0.
TEST(ServeTest, SigtermFinishesTheStreamInFlightThenExitsZero) {
  Worker worker({"--model", "builtin:tiny-hybrid", "--stop-grace-ms", "60000"});
  ASSERT_NE(worker.port(), 0);
  constexpr size_t kTokens = 2000;  // about 150 ms of decoding here
  httplib::Client client("127.0.0.1", worker.port());
  client.set_read_timeout(std::chrono::seconds(60));
  httplib::Request request;
  request.method = "POST";
  request.path = "/v1/completions";
  request.set_header("Content-Type", "application/json");
  request.body = json{{"prompt", {5, 6, 7}}, {"max_tokens", kTokens}, {"stream", true}}.dump();
  std::string body;
  bool signalled = false;
  request.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
    body.append(data, n);
    if (!signalled && body.find("\n\n") != std::string::npos) {
      signalled = ::kill(worker.process().pid(), SIGTERM) == 0;  // after the first event
    }
    return true;
  };
  const httplib::Result result = client.send(request);
  ASSERT_TRUE(result) << httplib::to_string(result.error()) << " after " << body.size() << " bytes";
  EXPECT_TRUE(signalled);
  EXPECT_EQ(result->status, 200);
  const std::vector<std::string> events = Events(body);
  ASSERT_EQ(events.size(), kTokens + 1)
      << body.substr(body.size() - std::min<size_t>(500, body.size()));
  EXPECT_EQ(events.back(), "[DONE]");
  const json last = json::parse(events[kTokens - 1], nullptr, /*allow_exceptions=*/false);
  EXPECT_EQ(last["choices"][0].value("finish_reason", ""), "length") << events[kTokens - 1];
  EXPECT_EQ(last["usage"].value("completion_tokens", 0u), kTokens);
  client.stop();
  EXPECT_EQ(worker.process().Wait(std::chrono::milliseconds(30000)), 0);
}

TEST(ServeTest, RolesOtherThanBothNeedNodes) {
  const auto r = RunProcess({KVSTASH_ENGINE_PATH, "serve", "--port", "0", "--role", "decode"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("--role decode needs --nodes"), std::string::npos) << r.err;
}

// A taken port is an error at start, not a second worker sharing it.
TEST(ServeTest, ATakenPortFailsToStart) {
  Worker first({"--model", "builtin:tiny-hybrid"});
  ASSERT_NE(first.port(), 0);
  const auto r = RunProcess({KVSTASH_ENGINE_PATH, "serve", "--listen", "127.0.0.1", "--port",
                             std::to_string(first.port())});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("cannot listen on 127.0.0.1:" + std::to_string(first.port())),
            std::string::npos)
      << r.err;
  EXPECT_EQ(first.process().Kill(SIGTERM), 0);
}

// chat names a worker it cannot reach, and one that does not answer within --worker-timeout-ms.
TEST(ServeTest, ChatNamesAWorkerThatIsDownOrTooSlow) {
  Worker worker({"--model", "builtin:tiny-hybrid"});
  ASSERT_NE(worker.port(), 0);
  const auto slow = RunProcess({KVSTASH_ENGINE_PATH, "chat", "--model", "builtin:tiny-hybrid",
                                "--decode-worker", worker.address(), "--turns", "1",
                                "--max-new-tokens", "4000", "--worker-timeout-ms", "100"});
  EXPECT_EQ(slow.exit_code, 1);
  EXPECT_NE(slow.err.find("worker " + worker.address() +
                          ": no answer to POST /v1/completions within 100 ms"),
            std::string::npos)
      << slow.err;
  EXPECT_EQ(worker.process().Kill(SIGTERM), 0);

  const auto down = RunProcess({KVSTASH_ENGINE_PATH, "chat", "--model", "builtin:tiny-hybrid",
                                "--decode-worker", worker.address(), "--turns", "1"});
  EXPECT_EQ(down.exit_code, 1);
  EXPECT_NE(down.err.find("worker " + worker.address() + ": GET /v1/models failed: Connection"),
            std::string::npos)
      << down.err;
}

std::map<std::string, std::string> Fields(const std::string& line) {
  std::map<std::string, std::string> f;
  std::istringstream in(line);
  for (std::string kv; in >> kv;) {
    const size_t eq = kv.find('=');
    if (eq != std::string::npos) f[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  return f;
}

// The demo's job at test size: two nodes, a prefill and a decode worker, a chat through them.
TEST(ServeTest, ChatThroughPrefillAndDecodeWorkersMatchesNoCacheAndHitsEarlierTurns) {
  std::vector<std::unique_ptr<Daemon>> daemons;
  for (int i = 0; i < 2; ++i) {
    daemons.push_back(std::make_unique<Daemon>(
        std::vector<std::string>{"--block-bytes", kNodeBlockBytes, "--cpu-bytes", "32MiB"},
        /*sizes=*/false));
    ASSERT_NE(daemons.back()->port(), 0);
  }
  const std::string nodes = "127.0.0.1:" + std::to_string(daemons[0]->port()) +
                            ",127.0.0.1:" + std::to_string(daemons[1]->port());
  Worker prefill({"--model", "builtin:tiny-hybrid", "--role", "prefill", "--nodes", nodes,
                  "--lookup-budget-ms", "60000"});
  Worker decode({"--model", "builtin:tiny-hybrid", "--role", "decode", "--nodes", nodes,
                 "--lookup-budget-ms", "60000"});
  ASSERT_NE(prefill.port(), 0);
  ASSERT_NE(decode.port(), 0);

  const auto r =
      RunProcess({KVSTASH_ENGINE_PATH, "chat", "--model", "builtin:tiny-hybrid", "--prefill-worker",
                  prefill.address(), "--decode-worker", decode.address(), "--turns", "3",
                  "--user-tokens", "100", "--max-new-tokens", "20"});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  std::vector<std::map<std::string, std::string>> turns;
  std::map<std::string, std::string> total;
  std::istringstream in(r.out);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("turn=", 0) == 0) turns.push_back(Fields(line));
    if (line.rfind("total ", 0) == 0) total = Fields(line);
  }
  ASSERT_EQ(turns.size(), 3u) << r.out;
  for (size_t k = 0; k < turns.size(); ++k) {
    auto& t = turns[k];
    SCOPED_TRACE(r.out);
    EXPECT_EQ(t["tokens"], "same-as-nocache");
    // The decode worker takes the prompt from the nodes and its own cache, computing at most
    // one block of it.
    EXPECT_LE(std::stoul(t["decode_computed_tokens"]), 16u);
    EXPECT_GT(std::stoul(t["decode_node_tokens"]), 0u);
    EXPECT_GT(std::stoull(t["pulled_bytes"]), 0u);
    EXPECT_GT(std::stoull(t["pushed_bytes"]), 0u);
    if (k > 0) {
      // Turn k+1 starts from turn k: the prefill worker holds its earlier prompt, and takes
      // the decode worker's blocks (the generated tokens) from the nodes.
      EXPECT_GE(std::stoul(t["prefill_local_hit_tokens"]), 16u * (100u * k / 16u));
      EXPECT_GT(std::stoul(t["prefill_node_tokens"]), 0u);
      EXPECT_LT(std::stoul(t["prefill_computed_tokens"]), std::stoul(t["prompt_tokens"]) - 100);
    }
  }
  EXPECT_EQ(total["mismatches"], "0");

  // The workers' totals as a Prometheus scrape sees them: the prefill worker pushed, the
  // decode worker pulled.
  const Reply prefill_metrics = Http(prefill.port()).Get("/metrics");
  EXPECT_EQ(prefill_metrics.body.find("kvstash_worker_stored_bytes_total 0\n"), std::string::npos)
      << prefill_metrics.body;
  EXPECT_NE(prefill_metrics.body.find("role=\"prefill\""), std::string::npos);
  const Reply decode_stats = Http(decode.port()).Get("/kvstash/stats");
  EXPECT_GT(decode_stats.parsed.value("loaded_bytes", 0u), 0u) << decode_stats.body;
  EXPECT_GT(decode_stats.parsed.value("node_tokens", 0u), 0u) << decode_stats.body;

  // A worker pointed at a different model is refused before the first turn.
  const auto wrong = RunProcess({KVSTASH_ENGINE_PATH, "chat", "--model", "builtin:tiny-full",
                                 "--decode-worker", decode.address(), "--turns", "1"});
  EXPECT_EQ(wrong.exit_code, 2);
  EXPECT_NE(wrong.err.find("not this --model"), std::string::npos) << wrong.err;
  EXPECT_EQ(prefill.process().Kill(SIGTERM), 0);
  EXPECT_EQ(decode.process().Kill(SIGTERM), 0);
}

// A worker that follows a cluster in etcd says how many nodes it started with and counts a
// node that joins on /metrics; a node of another block size that joins is never used.
TEST(ServeTest, AWorkerFollowsAClusterInEtcd) {
  ::kvstash::testing::EtcdProcess etcd;
  ASSERT_TRUE(etcd.Started());
  auto node = [&] {
    return std::make_unique<Daemon>(
        std::vector<std::string>{"--block-bytes", kNodeBlockBytes, "--cpu-bytes", "32MiB", "--etcd",
                                 etcd.endpoint(), "--cluster", "w"},
        /*sizes=*/false);
  };
  std::vector<std::unique_ptr<Daemon>> daemons;
  daemons.push_back(node());
  daemons.push_back(node());
  // A node registers in etcd only after it listens (its start line): the worker must start once
  // both are there, or it counts the ones registered so far (this raced on a busy machine).
  {
    membership::WatcherOptions options;
    options.etcd.endpoints = {etcd.endpoint()};
    options.cluster = "w";
    auto watcher = membership::MembershipWatcher::Create(options, nullptr);
    ASSERT_TRUE(watcher.ok()) << watcher.status().ToString();
    ASSERT_TRUE(::kvstash::testing::WaitForMembers(**watcher, 2, std::chrono::seconds(20)));
  }
  Worker worker({"--model", "builtin:tiny-hybrid", "--role", "prefill", "--etcd", etcd.endpoint(),
                 "--cluster", "w", "--replicas", "2", "--lookup-budget-ms", "60000"});
  ASSERT_NE(worker.port(), 0);
  Http http(worker.port());
  const Reply models = http.Get("/v1/models");
  ASSERT_EQ(models.status, 200) << models.body;
  EXPECT_EQ(models.parsed["data"][0]["kvstash"].value("nodes", 0u), 2u) << models.body;

  daemons.push_back(node());
  std::string metrics;
  for (int i = 0; i < 100; ++i) {
    metrics = http.Get("/metrics").body;
    if (metrics.find("kvstash_worker_members_joined_total 1\n") != std::string::npos) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_NE(metrics.find("kvstash_worker_members_joined_total 1\n"), std::string::npos) << metrics;
  EXPECT_NE(metrics.find("kvstash_worker_node_unserved_keys_total 0\n"), std::string::npos);

  // A node of another block size joins: the worker refuses it at membership (its first call
  // there) and serves on with the others; no block is ever stored on it.
  auto odd = std::make_unique<Daemon>(
      std::vector<std::string>{"--block-bytes", "8KiB", "--cpu-bytes", "32MiB", "--etcd",
                               etcd.endpoint(), "--cluster", "w"},
      /*sizes=*/false);
  ASSERT_NE(odd->port(), 0);
  for (int i = 0; i < 100; ++i) {
    metrics = http.Get("/metrics").body;
    if (metrics.find("kvstash_worker_members_joined_total 2\n") != std::string::npos) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_NE(metrics.find("kvstash_worker_members_joined_total 2\n"), std::string::npos) << metrics;
  for (uint64_t seed = 0; seed < 4; ++seed) {
    const Reply reply = http.Complete(
        {{"model", "tiny-hybrid"}, {"prompt", Prompt(200, 40 + seed)}, {"max_tokens", 2}});
    ASSERT_EQ(reply.status, 200) << reply.body;
  }
  // One refusal (the call that found it), not one per block meant for it.
  metrics = http.Get("/metrics").body;
  EXPECT_NE(metrics.find("kvstash_worker_node_refusals_total 1\n"), std::string::npos) << metrics;
  connector::NodeClientOptions options;
  options.nodes = {{"127.0.0.1", odd->port()}};
  auto client = connector::NodeClient::Create(options);
  ASSERT_TRUE(client.ok()) << client.status().ToString();
  auto stats = (*client)->Stats(options.nodes[0]);
  ASSERT_TRUE(stats.ok()) << stats.status().ToString();
  EXPECT_EQ((*stats)["node.blocks_stored"], 0u);
  EXPECT_EQ(worker.process().Kill(SIGTERM), 0);
}

}  // namespace
}  // namespace kvstash::worker
