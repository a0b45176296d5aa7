// `kvstash-engine serve` and `kvstash-engine chat --prefill-worker/--decode-worker` with real
// processes: a worker answers JSON-line requests over loopback TCP with the tokens `generate`
// prints, tells bad requests apart without dropping the connection, batches concurrent
// requests, and stops cleanly on SIGTERM; a conversation through a prefill and a decode worker
// over two real kvstashd nodes gives the tokens of a run without any cache, each turn pulled
// from the nodes and each later turn starting from the earlier turn's blocks.

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "daemon_process.h"
#include "subprocess.h"

namespace kvstash::engine {
namespace {

using ::kvstash::testing::ChildProcess;
using ::kvstash::testing::Daemon;
using ::kvstash::testing::RunProcess;
using nlohmann::json;

constexpr const char* kNodeBlockBytes = "4152";  // the built-ins' page plus the block trailer

// A `kvstash-engine serve` child; address() is empty when it did not start.
class Worker {
 public:
  explicit Worker(std::vector<std::string> args) {
    std::vector<std::string> argv = {KVSTASH_ENGINE_PATH, "serve", "--port", "0"};
    argv.insert(argv.end(), args.begin(), args.end());
    child_ = ::kvstash::testing::StartChild(argv);
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

// One TCP connection to a worker, a line at a time.
class Connection {
 public:
  explicit Connection(uint16_t port) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
      ::close(fd_);
      fd_ = -1;
    }
  }
  ~Connection() {
    if (fd_ >= 0) ::close(fd_);
  }
  bool ok() const { return fd_ >= 0; }
  bool Send(const std::string& text) {
    size_t done = 0;
    while (done < text.size()) {
      const ssize_t n = ::send(fd_, text.data() + done, text.size() - done, MSG_NOSIGNAL);
      if (n <= 0) return false;
      done += static_cast<size_t>(n);
    }
    return true;
  }
  // The next line, or nullopt at end of stream or after 60 s.
  std::optional<std::string> ReadLine() {
    for (;;) {
      if (const size_t nl = buffer_.find('\n'); nl != std::string::npos) {
        std::string line = buffer_.substr(0, nl);
        buffer_.erase(0, nl + 1);
        return line;
      }
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, 60000) <= 0) return std::nullopt;
      char chunk[65536];
      const ssize_t n = ::recv(fd_, chunk, sizeof chunk, 0);
      if (n <= 0) return std::nullopt;
      buffer_.append(chunk, static_cast<size_t>(n));
    }
  }
  json Call(const json& request) {
    if (!Send(request.dump() + "\n")) return json();
    std::optional<std::string> line = ReadLine();
    return line ? json::parse(*line, nullptr, false) : json();
  }

 private:
  int fd_ = -1;
  std::string buffer_;
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

std::vector<uint32_t> Output(const json& reply) {
  if (!reply.is_object() || !reply.contains("output")) return {};
  return reply["output"].get<std::vector<uint32_t>>();
}

TEST(ServeTest, AnswersLikeGenerateAndNamesBadRequestsWithoutDroppingTheConnection) {
  Worker worker({"--model", "builtin:tiny-hybrid", "--max-line-bytes", "4096"});
  ASSERT_NE(worker.port(), 0);
  Connection c(worker.port());
  ASSERT_TRUE(c.ok());

  const json info = c.Call({{"op", "info"}});
  EXPECT_EQ(info.value("model", ""), "tiny-hybrid");
  EXPECT_EQ(info.value("role", ""), "both");
  EXPECT_EQ(info.value("block_size", 0u), 16u);

  const std::vector<uint32_t> prompt = Prompt(70, 1);
  json reply = c.Call({{"id", "first"}, {"prompt", prompt}, {"max_new_tokens", 7}});
  EXPECT_EQ(reply.value("id", ""), "first");
  EXPECT_EQ(Output(reply), Reference("builtin:tiny-hybrid", prompt, 7)) << reply.dump();
  EXPECT_EQ(reply.value("prompt_tokens", 0u), 70u);
  EXPECT_EQ(reply.value("computed_tokens", 0u), 70u);
  EXPECT_EQ(reply.value("node_tokens", 1u), 0u);
  EXPECT_GT(reply.value("ttft_ms", -1.0), 0.0);
  // The same prompt again hits the worker's own prefix cache and gives the same tokens.
  reply = c.Call({{"prompt", prompt}, {"max_new_tokens", 7}});
  EXPECT_EQ(Output(reply), Reference("builtin:tiny-hybrid", prompt, 7));
  EXPECT_GE(reply.value("local_hit_tokens", 0u), 64u);

  // Each bad request gets an error naming what is wrong; the connection stays usable.
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"not json at all", "one JSON object per line"},
      {"[1, 2, 3]", "one JSON object per line"},
      {R"({"op": "reboot"})", "unknown op"},
      {R"({"prompt": []})", "non-empty array"},
      {R"({"prompt": [1, -2]})", "not a token id"},
      {R"({"prompt": [1, 300]})", "outside the vocabulary"},
      {R"({"prompt": [1, 2], "max_new_tokens": 0})", "max_new_tokens"},
  };
  for (const auto& [line, why] : bad) {
    ASSERT_TRUE(c.Send(line + "\n"));
    std::optional<std::string> answer = c.ReadLine();
    ASSERT_TRUE(answer) << line;
    const json parsed = json::parse(*answer, nullptr, false);
    ASSERT_TRUE(parsed.contains("error")) << line << " -> " << *answer;
    EXPECT_NE(parsed["error"].get<std::string>().find(why), std::string::npos)
        << line << " -> " << *answer;
  }
  EXPECT_EQ(Output(c.Call({{"prompt", prompt}, {"max_new_tokens", 7}})),
            Reference("builtin:tiny-hybrid", prompt, 7));

  // A line past --max-line-bytes: an error, then the connection ends; others are unaffected.
  ASSERT_TRUE(c.Send(std::string(5000, ' ') + "\n"));
  std::optional<std::string> answer = c.ReadLine();
  ASSERT_TRUE(answer);
  EXPECT_NE(answer->find("longer than the limit"), std::string::npos) << *answer;
  EXPECT_FALSE(c.ReadLine());
  Connection other(worker.port());
  ASSERT_TRUE(other.ok());
  EXPECT_EQ(other.Call({{"op", "info"}}).value("model", ""), "tiny-hybrid");

  EXPECT_EQ(worker.process().Kill(SIGTERM), 0);
}

TEST(ServeTest, ConcurrentRequestsAreBatchedAndEachAnsweredWithItsId) {
  Worker worker({"--model", "builtin:tiny-state-hybrid"});
  ASSERT_NE(worker.port(), 0);
  Connection a(worker.port()), b(worker.port());
  ASSERT_TRUE(a.ok() && b.ok());
  // Four requests on two connections, all sent before any answer is read.
  std::map<int, std::vector<uint32_t>> prompts;
  for (int id = 0; id < 4; ++id) {
    prompts[id] = Prompt(40 + 13 * id, id + 3);
    ASSERT_TRUE(
        (id % 2 ? b : a)
            .Send(json{{"id", id}, {"prompt", prompts[id]}, {"max_new_tokens", 9}}.dump() + "\n"));
  }
  std::map<int, std::vector<uint32_t>> got;
  for (int n = 0; n < 4; ++n) {
    std::optional<std::string> line = (n % 2 ? b : a).ReadLine();
    ASSERT_TRUE(line);
    const json reply = json::parse(*line, nullptr, false);
    ASSERT_TRUE(reply.contains("id")) << *line;
    got[reply["id"].get<int>()] = Output(reply);
  }
  for (const auto& [id, prompt] : prompts) {
    EXPECT_EQ(got[id], Reference("builtin:tiny-state-hybrid", prompt, 9)) << "request " << id;
  }
  // The worker ran them together: fewer steps than run one after the other (the sum of each
  // request's own step count is at least its 9 generated tokens).
  const json stats = a.Call({{"op", "stats"}});
  EXPECT_LT(stats.value("steps", 1000u), 4u * 9u) << stats.dump();
  EXPECT_EQ(worker.process().Kill(SIGTERM), 0);
}

TEST(ServeTest, RolesOtherThanBothNeedNodes) {
  const auto r = RunProcess({KVSTASH_ENGINE_PATH, "serve", "--port", "0", "--role", "decode"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("--role decode needs --nodes"), std::string::npos) << r.err;
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
  Worker prefill({"--model", "builtin:tiny-hybrid", "--role", "prefill", "--nodes", nodes});
  Worker decode({"--model", "builtin:tiny-hybrid", "--role", "decode", "--nodes", nodes});
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

  // A worker pointed at a different model is refused before the first turn.
  const auto wrong = RunProcess({KVSTASH_ENGINE_PATH, "chat", "--model", "builtin:tiny-full",
                                 "--decode-worker", decode.address(), "--turns", "1"});
  EXPECT_EQ(wrong.exit_code, 2);
  EXPECT_NE(wrong.err.find("not this --model"), std::string::npos) << wrong.err;
  EXPECT_EQ(prefill.process().Kill(SIGTERM), 0);
  EXPECT_EQ(decode.process().Kill(SIGTERM), 0);
}

}  // namespace
}  // namespace kvstash::engine
