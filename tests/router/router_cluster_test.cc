// kvstash-router in front of a real cluster: two kvstashd nodes, two prefill and two decode
// `kvstash-engine serve` workers, all publishing KV events, over loopback. Completions through
// the router give the tokens of a run without any cache; a later turn of a conversation goes to
// the prefill worker that holds the earlier one, with the hit the router predicted; a prompt the
// nodes hold skips the prefill; streaming, /metrics and /health answer; a worker killed mid-run
// costs no request; workers of another model or role are refused at start.

#include <gtest/gtest.h>
#include <httplib.h>
#include <signal.h>

#include <chrono>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "etcd_process.h"
#include "subprocess.h"

namespace kvstash::router {
namespace {

using ::kvstash::testing::ChildProcess;
using ::kvstash::testing::RunProcess;
using nlohmann::json;
using Clock = std::chrono::steady_clock;

// A child whose start lines were read: the rest of the line that starts with each prefix asked
// for ("" for one that did not come).
struct Started {
  std::unique_ptr<ChildProcess> child;
  std::vector<std::string> rest;
};

Started Start(const std::vector<std::string>& argv, const std::vector<std::string>& prefixes) {
  Started s;
  s.child = ::kvstash::testing::StartChild(argv);
  s.rest.assign(prefixes.size(), "");
  if (s.child == nullptr) return s;
  size_t found = 0;
  for (int i = 0; i < 60 && found < prefixes.size(); ++i) {
    std::optional<std::string> line = s.child->ReadLine(30000);
    if (!line) break;
    for (size_t p = 0; p < prefixes.size(); ++p) {
      if (s.rest[p].empty() && line->rfind(prefixes[p], 0) == 0) {
        s.rest[p] = line->substr(prefixes[p].size());
        ++found;
      }
    }
  }
  return s;
}

std::string LastWord(const std::string& text) { return text.substr(text.rfind(' ') + 1); }

// The tokens `kvstash-engine generate` prints for the prompt, with no nodes and no cache.
std::vector<uint32_t> Reference(const std::vector<uint32_t>& prompt, size_t max_new) {
  std::string text;
  for (uint32_t t : prompt) text += (text.empty() ? "" : " ") + std::to_string(t);
  const auto r =
      RunProcess({KVSTASH_ENGINE_PATH, "generate", "--model", "builtin:tiny-hybrid", "--prompt",
                  text, "--max-new-tokens", std::to_string(max_new), "--no-prefix-cache"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  std::vector<uint32_t> tokens;
  std::istringstream in(r.out);
  for (uint32_t t; in >> t;) tokens.push_back(t);
  return tokens;
}

std::vector<uint32_t> Prompt(size_t n, uint64_t seed) {
  std::vector<uint32_t> t(n);
  for (size_t i = 0; i < n; ++i) t[i] = static_cast<uint32_t>((i * 37 + seed * 11 + i * i) % 256);
  return t;
}

struct Reply {
  int status = 0;
  std::string body;
  json parsed;
};

Reply Call(uint16_t port, const std::string& method, const std::string& path,
           const std::string& body = "") {
  httplib::Client client("127.0.0.1", port);
  client.set_read_timeout(std::chrono::seconds(120));
  httplib::Result result =
      method == "GET" ? client.Get(path) : client.Post(path, body, "application/json");
  Reply reply;
  if (!result) return reply;
  reply.status = result->status;
  reply.body = result->body;
  reply.parsed = json::parse(reply.body, nullptr, /*allow_exceptions=*/false);
  return reply;
}

json Request(const std::vector<uint32_t>& prompt, size_t max_tokens, bool stream = false) {
  return {{"prompt", prompt}, {"max_tokens", max_tokens}, {"stream", stream}};
}

std::vector<uint32_t> Tokens(const json& completion) {
  if (!completion.is_object() || !completion.contains("choices")) return {};
  return completion["choices"][0]["token_ids"].get<std::vector<uint32_t>>();
}

// Waits (at most 20 s) until the router would place `prompt` as `ready` says.
bool WaitForRoute(uint16_t port, const std::vector<uint32_t>& prompt,
                  const std::function<bool(const json&)>& ready) {
  const auto deadline = Clock::now() + std::chrono::seconds(20);
  while (Clock::now() < deadline) {
    const Reply r = Call(port, "POST", "/kvstash/route", Request(prompt, 1).dump());
    if (r.status == 200 && ready(r.parsed)) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

// Waits (at most 20 s) until the router's state (GET /kvstash/router) says `ready`.
bool WaitForState(uint16_t port, const std::function<bool(const json&)>& ready) {
  const auto deadline = Clock::now() + std::chrono::seconds(20);
  while (Clock::now() < deadline) {
    const Reply r = Call(port, "GET", "/kvstash/router");
    if (r.status == 200 && ready(r.parsed)) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

// Two nodes, two prefill and two decode workers, each publishing its KV events; the router in
// front (started by the test, so that it can be given other flags).
class RouterClusterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string node_list;
    for (int i = 0; i < 2; ++i) {
      Started node = Start({KVSTASHD_PATH, "--port", "0", "--metrics-address", "off", "--log-level",
                            "warn", "--block-bytes", "4152", "--cpu-bytes", "32MiB", "--kv-events",
                            "tcp://127.0.0.1:*", "--kv-events-replay", "tcp://127.0.0.1:*"},
                           {"kvstashd listening on ", "kvstashd KV events on "});
      ASSERT_FALSE(node.rest[0].empty() || node.rest[1].empty()) << "kvstashd did not start";
      node_list += (node_list.empty() ? "" : ",") + node.rest[0];
      const std::string& events = node.rest[1];
      node_events_.push_back(events.substr(0, events.find(',')));
      node_replays_.push_back(LastWord(events));
      nodes_.push_back(std::move(node));
    }
    for (const char* role : {"prefill", "prefill", "decode", "decode"}) {
      Started w =
          Start({KVSTASH_ENGINE_PATH, "serve", "--model", "builtin:tiny-hybrid", "--role", role,
                 "--nodes", node_list, "--port", "0", "--lookup-budget-ms", "60000", "--kv-events",
                 "tcp://127.0.0.1:*", "--kv-events-replay", "tcp://127.0.0.1:*"},
                {"kvstash-engine serving ", "kvstash-engine KV events on "});
      ASSERT_FALSE(w.rest[0].empty() || w.rest[1].empty()) << "a worker did not start";
      (std::string(role) == "prefill" ? prefill_ : decode_).push_back(LastWord(w.rest[0]));
      worker_events_.push_back(w.rest[1]);
      workers_.push_back(std::move(w));
    }
    node_list_ = node_list;
  }

  // Starts worker i again (after it was killed) on its HTTP port and its event endpoints.
  bool Restart(size_t i) {
    const std::string& address = i < 2 ? prefill_[i] : decode_[i - 2];
    // Bound on the same ports ("tcp://HOST:PORT" would connect, as vLLM's publisher does).
    auto bind = [](const std::string& endpoint) {
      return "tcp://*:" + endpoint.substr(endpoint.rfind(':') + 1);
    };
    const std::string& events = worker_events_[i];
    Started w = Start(
        {KVSTASH_ENGINE_PATH, "serve", "--model", "builtin:tiny-hybrid", "--role",
         i < 2 ? "prefill" : "decode", "--nodes", node_list_, "--port",
         address.substr(address.rfind(':') + 1), "--lookup-budget-ms", "60000", "--kv-events",
         bind(events.substr(0, events.find(','))), "--kv-events-replay", bind(LastWord(events))},
        {"kvstash-engine serving "});
    if (w.rest[0].empty()) return false;
    workers_[i] = std::move(w);
    return true;
  }

  // The router over the cluster, with `extra` flags; its port, 0 when it did not start.
  uint16_t StartRouter(std::vector<std::string> extra = {}) {
    std::vector<std::string> argv = {KVSTASH_ROUTER_PATH, "--port", "0"};
    for (const std::string& p : prefill_) argv.insert(argv.end(), {"--prefill-worker", p});
    for (const std::string& d : decode_) argv.insert(argv.end(), {"--decode-worker", d});
    for (size_t i = 0; i < node_events_.size(); ++i) {
      argv.insert(argv.end(),
                  {"--node-events", node_events_[i], "--node-events-replay", node_replays_[i]});
    }
    argv.insert(argv.end(), extra.begin(), extra.end());
    router_ = Start(argv, {"kvstash-router serving on "});
    if (router_.rest[0].empty()) return 0;
    const std::string& address = router_.rest[0];
    return static_cast<uint16_t>(std::stoi(address.substr(address.rfind(':') + 1)));
  }

  static bool WaitForChoice(uint16_t port, const std::vector<uint32_t>& prompt,
                            const std::function<bool(const json&)>& ready) {
    return WaitForRoute(port, prompt, ready);
  }

  std::vector<Started> nodes_, workers_;
  std::vector<std::string> node_events_, node_replays_, prefill_, decode_, worker_events_;
  std::string node_list_;
  Started router_;
};

TEST_F(RouterClusterTest, RoutesByWhatIsHeldAndAnswersAsWithoutACache) {
  // Every prompt with something to compute is prefilled (the turns here add 100 tokens).
  const uint16_t port = StartRouter({"--local-prefill-tokens", "0"});
  ASSERT_NE(port, 0);

  // A conversation: each turn the whole history, plus 100 new tokens.
  std::vector<uint32_t> history;
  std::string first_prefill;
  for (int turn = 0; turn < 3; ++turn) {
    SCOPED_TRACE("turn " + std::to_string(turn));
    const std::vector<uint32_t> user = Prompt(100, 7 + turn);
    history.insert(history.end(), user.begin(), user.end());
    if (turn > 0) {
      // What the earlier turn cached, as the workers' events say it: the router scores the
      // prefill worker that ran it by the hit it holds.
      const size_t index = first_prefill == prefill_[0] ? 0 : 1;
      ASSERT_TRUE(WaitForChoice(port, history, [&](const json& c) {
        return c["prefill_worker"] == first_prefill &&
               c["scores"]["prefill"][index]["hit_tokens"].get<size_t>() > 0;
      })) << "the router never saw the earlier turn's blocks";
    }
    const Reply r = Call(port, "POST", "/v1/completions", Request(history, 12).dump());
    ASSERT_EQ(r.status, 200) << r.body;
    EXPECT_EQ(Tokens(r.parsed), Reference(history, 12));
    const json& kv = r.parsed["usage"]["kvstash"];
    const json& routed = kv["router"];
    ASSERT_TRUE(routed["prefill"].is_object()) << r.body;  // the prompt is new: prefilled
    const std::string prefill = routed["prefill"]["worker"];
    if (turn == 0) {
      first_prefill = prefill;
    } else {
      EXPECT_EQ(prefill, first_prefill) << r.body;
      // The router's score of that worker is the hit the worker then got from its own cache.
      const size_t index = prefill == prefill_[0] ? 0 : 1;
      const size_t predicted = routed["scores"]["prefill"][index]["hit_tokens"];
      EXPECT_GT(predicted, 0u) << r.body;
      EXPECT_EQ(predicted, routed["prefill"]["local_hit_tokens"].get<size_t>()) << r.body;
    }
    // Prefill's and decode's computed tokens, with decode pulling the prompt from the nodes.
    EXPECT_EQ(kv["computed_tokens"].get<size_t>(),
              routed["prefill"]["computed_tokens"].get<size_t>() +
                  (history.size() - kv["node_tokens"].get<size_t>() -
                   kv["local_hit_tokens"].get<size_t>()))
        << r.body;
    EXPECT_GT(kv["node_tokens"].get<size_t>(), 0u) << r.body;
    const std::vector<uint32_t> out = Tokens(r.parsed);
    history.insert(history.end(), out.begin(), out.end());
  }

  // The same prompt again: the nodes hold every block of it, so no prefill at all; the router
  // said so before it ran, and the decode worker took it from the nodes or its own cache.
  const std::vector<uint32_t> again(history.begin(), history.end() - 12);
  ASSERT_TRUE(WaitForChoice(
      port, again, [](const json& c) { return c["skipped_prefill"] == "nodes-hold-prompt"; }));
  const Reply r = Call(port, "POST", "/v1/completions", Request(again, 4).dump());
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(Tokens(r.parsed), Reference(again, 4));
  const json& kv = r.parsed["usage"]["kvstash"];
  EXPECT_TRUE(kv["router"]["prefill"].is_null()) << r.body;
  EXPECT_EQ(kv["router"]["skipped_prefill"], "nodes-hold-prompt") << r.body;
  EXPECT_LE(kv["computed_tokens"].get<size_t>(), 16u) << r.body;

  // The conversation goes on with a short turn: with the default --local-prefill-tokens (256)
  // the decode worker that holds the history computes the 20 new tokens itself.
  {
    Started router =
        Start({KVSTASH_ROUTER_PATH, "--port", "0", "--prefill-worker", prefill_[0],
               "--prefill-worker", prefill_[1], "--decode-worker", decode_[0], "--decode-worker",
               decode_[1], "--node-events", node_events_[0], "--node-events", node_events_[1]},
              {"kvstash-router serving on "});
    ASSERT_FALSE(router.rest[0].empty());
    const uint16_t short_port =
        static_cast<uint16_t>(std::stoi(router.rest[0].substr(router.rest[0].rfind(':') + 1)));
    std::vector<uint32_t> next = history;
    const std::vector<uint32_t> user = Prompt(20, 31);
    next.insert(next.end(), user.begin(), user.end());
    ASSERT_TRUE(WaitForChoice(
        short_port, next, [](const json& c) { return c["skipped_prefill"] == "short-prefill"; }));
    const Reply s = Call(short_port, "POST", "/v1/completions", Request(next, 4).dump());
    ASSERT_EQ(s.status, 200) << s.body;
    EXPECT_EQ(Tokens(s.parsed), Reference(next, 4));
    EXPECT_TRUE(s.parsed["usage"]["kvstash"]["router"]["prefill"].is_null()) << s.body;
    EXPECT_LE(s.parsed["usage"]["kvstash"]["computed_tokens"].get<size_t>(), 20u + 16u) << s.body;
  }

  // Streamed: one event per token, the last carrying the router's usage, then [DONE].
  {
    httplib::Client client("127.0.0.1", port);
    client.set_read_timeout(std::chrono::seconds(120));
    auto res =
        client.Post("/v1/completions", Request(Prompt(70, 99), 5, true).dump(), "application/json");
    ASSERT_TRUE(res);
    ASSERT_EQ(res->status, 200) << res->body;
    std::vector<std::string> events;
    std::istringstream in(res->body);
    for (std::string line; std::getline(in, line);) {
      if (line.rfind("data: ", 0) == 0) events.push_back(line.substr(6));
    }
    ASSERT_EQ(events.size(), 6u) << res->body;
    EXPECT_EQ(events.back(), "[DONE]");
    std::vector<uint32_t> streamed;
    for (size_t i = 0; i + 1 < events.size(); ++i) {
      const json chunk = json::parse(events[i]);
      streamed.push_back(chunk["choices"][0]["token_ids"][0]);
    }
    EXPECT_EQ(streamed, Reference(Prompt(70, 99), 5));
    const json last = json::parse(events[events.size() - 2]);
    EXPECT_EQ(last["usage"]["kvstash"]["router"]["policy"], "kv") << events[events.size() - 2];
  }

  // Bad requests are the caller's: a 400 naming the field, from the router or a worker.
  EXPECT_EQ(Call(port, "POST", "/v1/completions", R"({"prompt": "text"})").status, 400);
  EXPECT_EQ(Call(port, "POST", "/v1/completions", R"({"prompt": [1, 2, 999]})").status, 400);
  EXPECT_EQ(Call(port, "POST", "/v1/completions", R"({"prompt": [1], "model": "other"})").status,
            404);

  const Reply metrics = Call(port, "GET", "/metrics");
  EXPECT_NE(metrics.body.find("kvstash_router_requests_total 5"), std::string::npos)
      << metrics.body;
  EXPECT_NE(metrics.body.find("kvstash_router_skipped_prefills_total 1"), std::string::npos)
      << metrics.body;
  EXPECT_NE(metrics.body.find("kvstash_router_worker_chosen_total{worker=\"" + first_prefill +
                              "\",role=\"prefill\"}"),
            std::string::npos)
      << metrics.body;
  EXPECT_EQ(Call(port, "GET", "/health").status, 200);
  const Reply models = Call(port, "GET", "/v1/models");
  EXPECT_EQ(models.parsed["data"][0]["id"], "tiny-hybrid") << models.body;
  EXPECT_EQ(router_.child->Kill(SIGTERM), 0);
}

TEST_F(RouterClusterTest, AWorkerKilledCostsNoRequest) {
  const uint16_t port = StartRouter({"--down-ms", "60000", "--local-prefill-tokens", "0"});
  ASSERT_NE(port, 0);
  // The first decode worker and the first prefill worker die.
  EXPECT_NE(workers_[2].child->Kill(SIGKILL), 0);
  EXPECT_NE(workers_[0].child->Kill(SIGKILL), 0);
  for (int i = 0; i < 6; ++i) {
    SCOPED_TRACE("request " + std::to_string(i));
    const std::vector<uint32_t> prompt = Prompt(40 + 10 * i, 50 + i);
    const Reply r = Call(port, "POST", "/v1/completions", Request(prompt, 4).dump());
    ASSERT_EQ(r.status, 200) << r.body;
    EXPECT_EQ(Tokens(r.parsed), Reference(prompt, 4));
    EXPECT_EQ(r.parsed["usage"]["kvstash"]["router"]["decode_worker"], decode_[1]) << r.body;
  }
  const Reply state = Call(port, "GET", "/kvstash/router");
  EXPECT_EQ(state.parsed["decode_workers"][0]["up"], false) << state.body;
  EXPECT_GE(state.parsed["decode_workers"][0]["failures"].get<int>(), 1) << state.body;
  EXPECT_EQ(state.parsed["prefill_workers"][0]["up"], false) << state.body;
  EXPECT_EQ(state.parsed["totals"]["failed_requests"], 0) << state.body;
  EXPECT_EQ(Call(port, "GET", "/health").status, 200);

  // The other decode worker dies too: requests fail with 503, and /health says so.
  EXPECT_NE(workers_[3].child->Kill(SIGKILL), 0);
  const Reply r = Call(port, "POST", "/v1/completions", Request(Prompt(30, 5), 2).dump());
  EXPECT_EQ(r.status, 503) << r.body;
  EXPECT_EQ(Call(port, "GET", "/health").status, 503);
}

// A worker that failed sits out --down-ms, then is chosen again: one that came back serves.
TEST_F(RouterClusterTest, AWorkerThatComesBackIsUsedAgain) {
  const uint16_t port = StartRouter({"--down-ms", "300", "--local-prefill-tokens", "0"});
  ASSERT_NE(port, 0);
  // A prompt decode_[0] caches in its first life (equal scores take turns: a few tries).
  auto decode0_hit = [](const json& choice) {
    return choice["scores"]["decode"][0]["hit_tokens"].get<size_t>();
  };
  std::vector<uint32_t> old_prompt;
  for (int i = 0; i < 8 && old_prompt.empty(); ++i) {
    const std::vector<uint32_t> prompt = Prompt(100, 50 + i);
    const Reply r = Call(port, "POST", "/v1/completions", Request(prompt, 3).dump());
    ASSERT_EQ(r.status, 200) << r.body;
    if (r.parsed["usage"]["kvstash"]["router"]["decode_worker"] == decode_[0]) old_prompt = prompt;
  }
  ASSERT_FALSE(old_prompt.empty()) << "decode_[0] was never chosen";
  ASSERT_TRUE(WaitForChoice(port, old_prompt, [&](const json& c) { return decode0_hit(c) > 0; }));
  EXPECT_NE(workers_[2].child->Kill(SIGKILL), 0);  // decode_[0]
  for (int i = 0; i < 3; ++i) {
    const Reply r = Call(port, "POST", "/v1/completions", Request(Prompt(40, 70 + i), 3).dump());
    ASSERT_EQ(r.status, 200) << r.body;
    EXPECT_EQ(r.parsed["usage"]["kvstash"]["router"]["decode_worker"], decode_[1]) << r.body;
  }
  ASSERT_TRUE(Restart(2));
  // Past --down-ms, equal scores take turns: the worker that came back gets requests again.
  bool used = false;
  std::vector<uint32_t> new_prompt;
  const auto deadline = Clock::now() + std::chrono::seconds(20);
  for (int i = 0; !used && Clock::now() < deadline; ++i) {
    new_prompt = Prompt(100, 90 + i);
    const Reply r = Call(port, "POST", "/v1/completions", Request(new_prompt, 3).dump());
    ASSERT_EQ(r.status, 200) << r.body;
    EXPECT_EQ(Tokens(r.parsed), Reference(new_prompt, 3));
    used = r.parsed["usage"]["kvstash"]["router"]["decode_worker"] == decode_[0] &&
           r.parsed["usage"]["kvstash"]["router"]["retries"] == 0;
  }
  ASSERT_TRUE(used) << "the worker that came back was never used again";
  const Reply state = Call(port, "GET", "/kvstash/router");
  EXPECT_EQ(state.parsed["decode_workers"][0]["up"], true) << state.body;
  // The router follows the new life's events (its numbers started over, its first batches
  // likely sent before the router's connection came back): what the new life cached is scored,
  // what the old life held no longer is.
  EXPECT_TRUE(WaitForChoice(port, new_prompt, [&](const json& c) { return decode0_hit(c) > 0; }))
      << "the router never saw the new life's blocks";
  EXPECT_TRUE(WaitForChoice(port, old_prompt, [&](const json& c) { return decode0_hit(c) == 0; }))
      << "the router still scores decode_[0] by what its old life held";
  EXPECT_EQ(Call(port, "GET", "/kvstash/router").parsed["totals"]["failed_requests"], 0);
}

// A worker that holds the prompt is passed over once it runs more than --max-imbalance
// requests beyond the least loaded one: a prefix every request shares does not queue them all
// on one worker. (A stopped worker holds its request running.)
TEST_F(RouterClusterTest, AWorkerRunningTooManyMoreThanTheOthersIsPassedOver) {
  const uint16_t port = StartRouter({"--max-imbalance", "0", "--worker-timeout-ms", "60000"});
  ASSERT_NE(port, 0);
  const std::vector<uint32_t> prompt = Prompt(120, 400);
  const Reply first = Call(port, "POST", "/v1/completions", Request(prompt, 3).dump());
  ASSERT_EQ(first.status, 200) << first.body;
  const std::string holder = first.parsed["usage"]["kvstash"]["router"]["decode_worker"];
  const size_t h = holder == decode_[0] ? 0 : 1;
  // The router sees the holder's own cache hold the prompt: it would send it there again.
  ASSERT_TRUE(WaitForChoice(port, prompt, [&](const json& c) {
    return c["decode_worker"] == holder && c["scores"]["decode"][h]["hit_tokens"].get<size_t>() > 0;
  }));
  // The holder stops: the prompt sent again runs there, held.
  ASSERT_EQ(::kill(workers_[2 + h].child->pid(), SIGSTOP), 0);
  std::thread held([&] {
    const Reply r = Call(port, "POST", "/v1/completions", Request(prompt, 3).dump());
    EXPECT_EQ(r.status, 200) << r.body;
    EXPECT_EQ(r.parsed["usage"]["kvstash"]["router"]["decode_worker"], holder) << r.body;
  });
  ASSERT_TRUE(WaitForState(
      port, [&](const json& s) { return s["decode_workers"][h]["running"].get<size_t>() == 1; }));
  // One running there, none on the other: the same prompt goes to the other, as without a cache.
  const Reply other = Call(port, "POST", "/v1/completions", Request(prompt, 3).dump());
  EXPECT_EQ(other.status, 200) << other.body;
  EXPECT_EQ(other.parsed["usage"]["kvstash"]["router"]["decode_worker"], decode_[1 - h])
      << other.body;
  EXPECT_EQ(Tokens(other.parsed), Tokens(first.parsed));
  ASSERT_EQ(::kill(workers_[2 + h].child->pid(), SIGCONT), 0);
  held.join();
}

TEST_F(RouterClusterTest, WorkersOfAnotherModelOrRoleAreRefusedAtStart) {
  Started other =
      Start({KVSTASH_ENGINE_PATH, "serve", "--model", "builtin:tiny-full", "--port", "0"},
            {"kvstash-engine serving "});
  ASSERT_FALSE(other.rest[0].empty());
  const auto wrong_model =
      RunProcess({KVSTASH_ROUTER_PATH, "--prefill-worker", prefill_[0], "--decode-worker",
                  decode_[0], "--decode-worker", LastWord(other.rest[0])});
  EXPECT_EQ(wrong_model.exit_code, 2);
  EXPECT_NE(wrong_model.err.find("would never match"), std::string::npos) << wrong_model.err;
  const auto wrong_role = RunProcess(
      {KVSTASH_ROUTER_PATH, "--prefill-worker", decode_[0], "--decode-worker", decode_[1]});
  EXPECT_EQ(wrong_role.exit_code, 2);
  EXPECT_NE(wrong_role.err.find("not prefill"), std::string::npos) << wrong_role.err;
  const auto down = RunProcess({KVSTASH_ROUTER_PATH, "--decode-worker", "127.0.0.1:1"});
  EXPECT_EQ(down.exit_code, 1);
  EXPECT_NE(down.err.find("127.0.0.1:1"), std::string::npos) << down.err;
  const auto usage =
      RunProcess({KVSTASH_ROUTER_PATH, "--policy", "random", "--decode-worker", decode_[0]});
  EXPECT_EQ(usage.exit_code, 2) << usage.err;
}

// The router finding its workers and nodes in etcd: workers that `serve --register`, a node
// whose record names its KV events. Workers join and leave while it runs.
class RouterEtcdTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(etcd_.Started());
    node_ = Start({KVSTASHD_PATH,
                   "--port",
                   "0",
                   "--metrics-address",
                   "off",
                   "--log-level",
                   "warn",
                   "--block-bytes",
                   "4152",
                   "--cpu-bytes",
                   "32MiB",
                   "--kv-events",
                   "tcp://127.0.0.1:*",
                   "--kv-events-replay",
                   "tcp://127.0.0.1:*",
                   "--etcd",
                   etcd_.endpoint(),
                   "--cluster",
                   "c1",
                   "--etcd-ttl-s",
                   "2"},
                  {"kvstashd listening on "});
    ASSERT_FALSE(node_.rest[0].empty()) << "kvstashd did not start";
  }

  // A worker registered in etcd; its address ("" when it did not start).
  std::string StartWorker(const std::string& role) {
    Started w = Start({KVSTASH_ENGINE_PATH,
                       "serve",
                       "--model",
                       "builtin:tiny-hybrid",
                       "--role",
                       role,
                       "--etcd",
                       etcd_.endpoint(),
                       "--cluster",
                       "c1",
                       "--port",
                       "0",
                       "--lookup-budget-ms",
                       "60000",
                       "--kv-events",
                       "tcp://127.0.0.1:*",
                       "--kv-events-replay",
                       "tcp://127.0.0.1:*",
                       "--register",
                       "--etcd-ttl-s",
                       "2"},
                      {"kvstash-engine serving "});
    if (w.rest[0].empty()) return "";
    const std::string address = LastWord(w.rest[0]);
    workers_.push_back(std::move(w));
    return address;
  }

  // Whether `state` lists `address` among `role`'s workers as a member that is up.
  static bool Member(const json& state, const std::string& role, const std::string& address) {
    for (const json& w : state[role + "_workers"]) {
      if (w["address"] == address) return w["member"] == true && w["up"] == true;
    }
    return false;
  }

  ::kvstash::testing::EtcdProcess etcd_;
  Started node_;
  std::vector<Started> workers_;
};

TEST_F(RouterEtcdTest, WorkersAndNodesRegisteredInEtcdJoinAndLeaveTheRoutersSet) {
  // The router starts before any worker and waits for a decode worker to register.
  Started router = Start({KVSTASH_ROUTER_PATH, "--port", "0", "--etcd", etcd_.endpoint(),
                          "--cluster", "c1", "--local-prefill-tokens", "0"},
                         {});
  ASSERT_NE(router.child, nullptr);
  const std::string decode = StartWorker("decode");
  const std::string prefill = StartWorker("prefill");
  ASSERT_FALSE(decode.empty() || prefill.empty()) << "a worker did not start";
  std::optional<std::string> serving;
  for (int i = 0; i < 60 && !serving; ++i) {
    std::optional<std::string> line = router.child->ReadLine(30000);
    if (!line) break;
    if (line->rfind("kvstash-router serving on ", 0) == 0) serving = LastWord(*line);
  }
  ASSERT_TRUE(serving) << "the router did not start";
  const uint16_t port = static_cast<uint16_t>(std::stoi(serving->substr(serving->rfind(':') + 1)));
  ASSERT_TRUE(WaitForState(port, [&](const json& s) {
    return Member(s, "decode", decode) && Member(s, "prefill", prefill);
  })) << Call(port, "GET", "/kvstash/router").body;

  // A prompt runs prefill then decode, as without a cache; run again, the nodes (followed
  // through their etcd record) hold it all: no prefill.
  const std::vector<uint32_t> prompt = Prompt(120, 5);
  Reply r = Call(port, "POST", "/v1/completions", Request(prompt, 4).dump());
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(Tokens(r.parsed), Reference(prompt, 4));
  EXPECT_EQ(r.parsed["usage"]["kvstash"]["router"]["prefill"]["worker"], prefill) << r.body;
  EXPECT_TRUE(WaitForRoute(port, prompt, [](const json& c) {
    return c["skipped_prefill"] == "nodes-hold-prompt";
  })) << "the router never followed the node's events found in etcd";

  // A second decode worker registers: it is chosen in turn.
  const std::string second = StartWorker("decode");
  ASSERT_FALSE(second.empty());
  ASSERT_TRUE(WaitForState(port, [&](const json& s) { return Member(s, "decode", second); }));
  bool used = false;
  for (int i = 0; i < 6 && !used; ++i) {
    const std::vector<uint32_t> p = Prompt(40, 200 + i);
    r = Call(port, "POST", "/v1/completions", Request(p, 3).dump());
    ASSERT_EQ(r.status, 200) << r.body;
    used = r.parsed["usage"]["kvstash"]["router"]["decode_worker"] == second;
  }
  EXPECT_TRUE(used) << "the decode worker that registered later was never chosen";

  // It stops (SIGTERM: its key is deleted at once): it leaves the set, and no request fails.
  workers_[2].child->Kill(SIGTERM);
  ASSERT_TRUE(WaitForState(port, [&](const json& s) {
    for (const json& w : s["decode_workers"]) {
      if (w["address"] == second) return w["member"] == false;
    }
    return false;
  })) << Call(port, "GET", "/kvstash/router").body;
  // The first decode worker is killed outright: its lease (2 s) expires and it leaves too;
  // with no decode worker left the router is unhealthy rather than failing calls slowly.
  workers_[0].child->Kill(SIGKILL);
  ASSERT_TRUE(WaitForState(port, [&](const json& s) {
    for (const json& w : s["decode_workers"]) {
      if (w["member"] == true) return false;
    }
    return true;
  })) << Call(port, "GET", "/kvstash/router").body;
  EXPECT_EQ(Call(port, "GET", "/health").status, 503);
  // A decode worker that registers again makes it whole.
  const std::string again = StartWorker("decode");
  ASSERT_FALSE(again.empty());
  ASSERT_TRUE(WaitForState(port, [&](const json& s) { return Member(s, "decode", again); }));
  const std::vector<uint32_t> last = Prompt(60, 300);
  r = Call(port, "POST", "/v1/completions", Request(last, 3).dump());
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(Tokens(r.parsed), Reference(last, 3));
  EXPECT_EQ(r.parsed["usage"]["kvstash"]["router"]["decode_worker"], again);
  EXPECT_EQ(Call(port, "GET", "/kvstash/router").parsed["totals"]["failed_requests"], 0);
}

TEST_F(RouterEtcdTest, FlagsThatCannotWorkAreRefused) {
  const auto alone = RunProcess({KVSTASH_ROUTER_PATH, "--etcd", etcd_.endpoint()});
  EXPECT_EQ(alone.exit_code, 2) << alone.err;
  EXPECT_NE(alone.err.find("--cluster"), std::string::npos) << alone.err;
  const auto none = RunProcess({KVSTASH_ROUTER_PATH});
  EXPECT_EQ(none.exit_code, 2) << none.err;
  EXPECT_NE(none.err.find("--decode-worker"), std::string::npos) << none.err;
  // No decode worker registers within the wait: a clear failure, not a router without one.
  const auto empty = RunProcess({KVSTASH_ROUTER_PATH, "--etcd", etcd_.endpoint(), "--cluster",
                                 "nobody", "--wait-for-workers-ms", "300"});
  EXPECT_NE(empty.exit_code, 0);
  EXPECT_NE(empty.err.find("no registered decode worker"), std::string::npos) << empty.err;
  // serve --register needs etcd, and an address routers can reach.
  const auto no_etcd = RunProcess({KVSTASH_ENGINE_PATH, "serve", "--model", "builtin:tiny-hybrid",
                                   "--port", "0", "--register"});
  EXPECT_EQ(no_etcd.exit_code, 2) << no_etcd.err;
  EXPECT_NE(no_etcd.err.find("--register needs --etcd"), std::string::npos) << no_etcd.err;
  const auto wildcard = RunProcess({KVSTASH_ENGINE_PATH, "serve", "--model", "builtin:tiny-hybrid",
                                    "--port", "0", "--listen", "0.0.0.0", "--etcd",
                                    etcd_.endpoint(), "--cluster", "c1", "--register"});
  EXPECT_EQ(wildcard.exit_code, 2) << wildcard.err;
  EXPECT_NE(wildcard.err.find("--advertise"), std::string::npos) << wildcard.err;
}

}  // namespace
}  // namespace kvstash::router
