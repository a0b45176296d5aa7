// `kvstash-engine serve` under abuse, as processes on loopback (issue 29): completions whose
// clients go away, connections that send their headers a byte a second, requests the KV pool
// can never hold, a burst of a thousand connections, the file-descriptor limit and 100 MB
// bodies. Each test failed against the worker of 0944692 (KVSTASH_TEST_ENGINE runs them against
// another build). The issue's acceptance bounds (/health within 100 ms at p99 of 50 probes,
// SIGTERM within 2 s) are asserted, the first with a margin for a busy 2-core machine; the
// measured figures are printed.

#include <arpa/inet.h>
#include <errno.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "kvstash/engine/engine.h"
#include "loopback_socket.h"
#include "programs.h"
#include "subprocess.h"

namespace kvstash::worker {
namespace {

using Clock = std::chrono::steady_clock;
using ::kvstash::testing::ConnectLoopback;
using nlohmann::json;
using std::chrono::milliseconds;
using std::chrono::seconds;

// The acceptance bound is 100 ms at p99; a 2-core CI machine running other tests beside this
// one gets five times that before the test fails (the figures measured are printed).
constexpr double kHealthBoundMs = 500;
constexpr double kSigtermBoundMs = 2000;

double MillisSince(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

// Polls `done` every 10 ms until it holds or `timeout` passes.
bool WaitFor(const std::function<bool()>& done, milliseconds timeout) {
  const Clock::time_point deadline = Clock::now() + timeout;
  for (;;) {
    if (done()) return true;
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(milliseconds(10));
  }
}

// A `kvstash-engine serve` child on a free port, its output and log kept in memory (Log()).
class Worker {
 public:
  explicit Worker(std::vector<std::string> args) {
    std::vector<std::string> argv = {testing::EnginePath(), "serve", "--port", "0"};
    argv.insert(argv.end(), args.begin(), args.end());
    ChildOptions options;
    options.output = ChildOptions::Output::kMemory;
    options.merge_stderr = true;
    Result<std::unique_ptr<ChildProcess>> child = ChildProcess::Create(argv, options);
    if (!child.ok()) {
      ADD_FAILURE() << child.status().ToString();
      return;
    }
    child_ = std::move(child).value();
    const std::string prefix = "kvstash-engine serving ";
    WaitFor(
        [&] {
          const std::string out = child_->Output();
          const size_t at = out.find(prefix);
          const size_t eol = at == std::string::npos ? at : out.find('\n', at);
          if (eol == std::string::npos) return child_->Exited();
          const std::string line = out.substr(at, eol - at);
          port_ = static_cast<uint16_t>(std::stoi(line.substr(line.rfind(':') + 1)));
          return true;
        },
        seconds(30));
    if (port_ == 0) ADD_FAILURE() << "the worker did not start: " << child_->Output();
  }
  uint16_t port() const { return port_; }
  pid_t pid() const { return child_->pid(); }
  std::string Log() const { return child_->Output(); }
  // SIGTERM, then up to `limit` for it to exit (it is killed after): how long it took, and its
  // exit status.
  std::pair<double, int> Terminate(milliseconds limit) {
    const Clock::time_point start = Clock::now();
    ::kill(child_->pid(), SIGTERM);
    const int status = child_->Wait(limit);
    return {MillisSince(start), status};
  }

 private:
  std::unique_ptr<ChildProcess> child_;
  uint16_t port_ = 0;
};

// An HTTP reply on a fresh connection: status 0 when none came in time.
struct Reply {
  int status = 0;
  std::string body;
  json parsed;
};

Reply ToReply(const httplib::Result& result) {
  Reply reply;
  if (!result) return reply;
  reply.status = result->status;
  reply.body = result->body;
  reply.parsed = json::parse(reply.body, nullptr, /*allow_exceptions=*/false);
  return reply;
}

httplib::Client Client(uint16_t port, milliseconds timeout) {
  httplib::Client client("127.0.0.1", port);
  client.set_connection_timeout(timeout);
  client.set_read_timeout(timeout);
  client.set_write_timeout(timeout);
  return client;
}

Reply Get(uint16_t port, const std::string& path, milliseconds timeout = seconds(2)) {
  return ToReply(Client(port, timeout).Get(path));
}

Reply Complete(uint16_t port, const json& request, milliseconds timeout) {
  return ToReply(Client(port, timeout).Post("/v1/completions", request.dump(), "application/json"));
}

json Stats(uint16_t port) { return Get(port, "/kvstash/stats").parsed; }

uint64_t StatOf(const json& stats, const char* name) {
  return stats.is_object() && stats.contains(name) && stats[name].is_number_unsigned()
             ? stats[name].get<uint64_t>()
             : UINT64_MAX;
}

std::vector<uint32_t> Prompt(size_t n) {
  std::vector<uint32_t> t(n);
  for (size_t i = 0; i < n; ++i) t[i] = static_cast<uint32_t>((i * 37 + 11) % 256);
  return t;
}

// --- Raw connections --------------------------------------------------------------------------

bool SendAll(int fd, std::string_view data) {
  while (!data.empty()) {
    const ssize_t n = ::send(fd, data.data(), data.size(), MSG_NOSIGNAL);
    if (n <= 0) return false;
    data.remove_prefix(static_cast<size_t>(n));
  }
  return true;
}

// What the peer sent until it closed the connection (closed) or `timeout` passed.
struct Received {
  std::string data;
  bool closed = false;
};

Received ReadAll(int fd, milliseconds timeout) {
  Received r;
  const Clock::time_point deadline = Clock::now() + timeout;
  char buffer[65536];
  for (;;) {
    const auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) return r;
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left)) <= 0) continue;
    const ssize_t n = ::recv(fd, buffer, sizeof buffer, 0);
    if (n <= 0) {
      r.closed = true;
      return r;
    }
    r.data.append(buffer, static_cast<size_t>(n));
  }
}

std::string PostRequest(const std::string& body) {
  return "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
         "Content-Length: " +
         std::to_string(body.size()) + "\r\n\r\n" + body;
}

int StatusOf(const std::string& reply) {
  return reply.rfind("HTTP/1.1 ", 0) == 0 ? std::atoi(reply.c_str() + 9) : 0;
}

// --- /health probes ---------------------------------------------------------------------------

struct Probes {
  std::vector<double> ms;  // answered 200
  size_t failed = 0;       // no 200 within a second
  double Percentile(double q) const {
    if (ms.empty()) return INFINITY;
    std::vector<double> sorted = ms;
    std::sort(sorted.begin(), sorted.end());
    const size_t rank = static_cast<size_t>(std::ceil(q * static_cast<double>(sorted.size())));
    return sorted[std::max<size_t>(rank, 1) - 1];
  }
};

// 50 GET /health, each on a fresh connection, 20 ms apart; three failures end it early.
Probes ProbeHealth(uint16_t port, const char* under) {
  Probes probes;
  for (int i = 0; i < 50 && probes.failed < 3; ++i) {
    const Clock::time_point start = Clock::now();
    const Reply reply = Get(port, "/health", seconds(1));
    if (reply.status == 200) {
      probes.ms.push_back(MillisSince(start));
    } else {
      ++probes.failed;
    }
    std::this_thread::sleep_until(start + milliseconds(20));
  }
  std::printf("/health under %s: p50 %.2f ms, p99 %.2f ms of %zu answered, %zu failed\n", under,
              probes.Percentile(0.5), probes.Percentile(0.99), probes.ms.size(), probes.failed);
  return probes;
}

void ExpectHealthy(const Probes& probes, const char* under) {
  EXPECT_EQ(probes.failed, 0u) << under;
  EXPECT_LT(probes.Percentile(0.99), kHealthBoundMs) << under;
}

// Completions whose clients keep waiting: each one's HTTP status once it is answered.
class Waiters {
 public:
  Waiters(uint16_t port, const std::string& request, size_t n) : statuses_(n) {
    for (size_t i = 0; i < n; ++i) {
      const int fd = ConnectLoopback(port);
      if (fd < 0 || !SendAll(fd, request)) {
        ADD_FAILURE() << "cannot send completion " << i;
        if (fd >= 0) ::close(fd);
        continue;
      }
      threads_.emplace_back([this, fd, i] {
        statuses_[i] = StatusOf(ReadAll(fd, seconds(20)).data);
        ::close(fd);
      });
    }
  }
  const std::vector<int>& Join() {
    for (std::thread& t : threads_) t.join();
    threads_.clear();
    return statuses_;
  }
  ~Waiters() { Join(); }

 private:
  std::vector<int> statuses_;
  std::vector<std::thread> threads_;
};

// The issue's load: 33 long completions abandoned by their clients after 2 s. Each is
// cancelled (its KV freed, the engine idle again) within an engine step or two; /health stays
// quick meanwhile; SIGTERM with completions in flight answers them 503 and exits within 2 s.
TEST(ServeHardeningTest, AbandonedCompletionsAreCancelledWhileHealthAndSigtermStayQuick) {
  Worker worker({"--model", "builtin:tiny-hybrid"});
  ASSERT_NE(worker.port(), 0);
  const uint16_t port = worker.port();
  // 20000 tokens each: they fit the pool one at a time, and together take minutes.
  const std::string request =
      PostRequest(json{{"prompt", {1, 2, 3}}, {"max_tokens", 20000}}.dump());
  const Clock::time_point sent = Clock::now();
  std::vector<int> clients;
  for (int i = 0; i < 33; ++i) {
    const int fd = ConnectLoopback(port);
    ASSERT_GE(fd, 0);
    ASSERT_TRUE(SendAll(fd, request));
    clients.push_back(fd);
  }
  // 32 in the engine (--http-threads 32), the 33rd waiting for a thread.
  ASSERT_TRUE(WaitFor([&] { return StatOf(Stats(port), "running_requests") == 32; }, seconds(10)))
      << "the worker did not take the completions: " << Stats(port).dump();
  const Probes loaded = ProbeHealth(port, "33 long completions");
  std::this_thread::sleep_until(sent + seconds(2));  // the load the issue describes
  const Clock::time_point abandoned = Clock::now();
  for (const int fd : clients) ::close(fd);
  const bool cancelled = WaitFor(
      [&] {
        const json stats = Stats(port);
        return StatOf(stats, "running_requests") == 0 && StatOf(stats, "cancelled_requests") == 33;
      },
      seconds(5));
  std::printf("33 abandoned completions cancelled in %.1f ms\n", MillisSince(abandoned));
  ASSERT_TRUE(cancelled) << Stats(port).dump();
  const Reply small = Complete(port, {{"prompt", {1, 2, 3}}, {"max_tokens", 4}}, seconds(10));
  EXPECT_EQ(small.status, 200) << small.body;
  const Probes after = ProbeHealth(port, "33 abandoned completions");
  ExpectHealthy(loaded, "33 long completions");
  ExpectHealthy(after, "33 abandoned completions");

  // SIGTERM with 20 completions waited for: past the stop grace (1 s) they are cancelled.
  Waiters waiters(port, request, 20);
  ASSERT_TRUE(WaitFor([&] { return StatOf(Stats(port), "running_requests") == 20; }, seconds(10)));
  const auto [stop_ms, status] = worker.Terminate(seconds(15));
  std::printf("SIGTERM with 20 completions in flight: exited in %.1f ms\n", stop_ms);
  EXPECT_EQ(status, 0);
  EXPECT_LT(stop_ms, kSigtermBoundMs);
  for (const int s : waiters.Join()) EXPECT_EQ(s, 503);
}

// A streamed completion whose client leaves after its first event is cancelled too.
TEST(ServeHardeningTest, AStreamWhoseClientLeavesIsCancelled) {
  Worker worker({"--model", "builtin:tiny-hybrid"});
  ASSERT_NE(worker.port(), 0);
  const int fd = ConnectLoopback(worker.port());
  ASSERT_GE(fd, 0);
  ASSERT_TRUE(SendAll(
      fd,
      PostRequest(json{{"prompt", {1, 2, 3}}, {"max_tokens", 20000}, {"stream", true}}.dump())));
  std::string got;
  ASSERT_TRUE(WaitFor(
      [&] {
        char buffer[4096];
        const ssize_t n = ::recv(fd, buffer, sizeof buffer, MSG_DONTWAIT);
        if (n > 0) got.append(buffer, static_cast<size_t>(n));
        return got.find("data: ") != std::string::npos;
      },
      seconds(10)));
  ::close(fd);
  EXPECT_TRUE(WaitFor(
      [&] {
        const json stats = Stats(worker.port());
        return StatOf(stats, "running_requests") == 0 && StatOf(stats, "cancelled_requests") == 1;
      },
      seconds(5)))
      << Stats(worker.port()).dump();
  EXPECT_EQ(worker.Terminate(seconds(15)).second, 0);
}

// A stream still running when the stop's grace (--stop-grace-ms) runs out ends with an error
// event and [DONE], and the worker exits 0.
TEST(ServeHardeningTest, SigtermEndsAStreamPastTheGraceWithAnErrorEvent) {
  Worker worker({"--model", "builtin:tiny-hybrid", "--stop-grace-ms", "200"});
  ASSERT_NE(worker.port(), 0);
  const int fd = ConnectLoopback(worker.port());
  ASSERT_GE(fd, 0);
  ASSERT_TRUE(SendAll(
      fd,
      PostRequest(json{{"prompt", {1, 2, 3}}, {"max_tokens", 20000}, {"stream", true}}.dump())));
  ASSERT_TRUE(
      WaitFor([&] { return StatOf(Stats(worker.port()), "running_requests") == 1; }, seconds(10)));
  const Clock::time_point start = Clock::now();
  ::kill(worker.pid(), SIGTERM);
  const Received stream = ReadAll(fd, seconds(10));
  const double ended_ms = MillisSince(start);
  ::close(fd);
  EXPECT_TRUE(stream.closed);
  EXPECT_LT(ended_ms, kSigtermBoundMs);
  EXPECT_EQ(StatusOf(stream.data), 200);
  const std::string tail =
      stream.data.substr(stream.data.size() - std::min<size_t>(600, stream.data.size()));
  EXPECT_NE(tail.find("the worker stopped before the request finished"), std::string::npos) << tail;
  EXPECT_NE(tail.find("data: [DONE]"), std::string::npos) << tail;
  EXPECT_EQ(worker.Terminate(seconds(15)).second, 0);
}

// 64 connections sending their headers a byte a second hold no thread: /health stays quick
// and SIGTERM ends the worker at once.
TEST(ServeHardeningTest, SlowlorisConnectionsLeaveHealthAndSigtermQuick) {
  Worker worker({"--model", "builtin:tiny-hybrid"});
  ASSERT_NE(worker.port(), 0);
  const std::string head =
      "GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + std::string(100, 'a') + "\r\n\r\n";
  // Each starts its request at once, then sends a byte a second; the head never completes
  // while the test runs.
  std::vector<int> slow;
  for (int i = 0; i < 64; ++i) {
    const int fd = ConnectLoopback(worker.port());
    ASSERT_GE(fd, 0);
    ASSERT_TRUE(SendAll(fd, head.substr(0, 1)));
    slow.push_back(fd);
  }
  std::atomic<bool> stop{false};
  std::thread sender([&] {
    for (size_t at = 1; !stop && at + 2 < head.size(); ++at) {
      const Clock::time_point next = Clock::now() + seconds(1);
      while (!stop && Clock::now() < next) std::this_thread::sleep_for(milliseconds(10));
      for (const int fd : slow) ::send(fd, &head[at], 1, MSG_NOSIGNAL);
    }
  });
  std::this_thread::sleep_for(milliseconds(1200));  // two bytes in on every connection
  const Probes probes = ProbeHealth(worker.port(), "64 slowloris connections");
  const auto [stop_ms, status] = worker.Terminate(seconds(10));
  std::printf("SIGTERM under 64 slowloris connections: exited in %.1f ms\n", stop_ms);
  stop = true;
  sender.join();
  for (const int fd : slow) ::close(fd);
  ExpectHealthy(probes, "64 slowloris connections");
  EXPECT_EQ(status, 0);
  EXPECT_LT(stop_ms, kSigtermBoundMs);
}

// Headers that do not arrive within --header-timeout-ms and a body that does not arrive within
// --read-timeout-ms are answered 408 and their connections closed; a connection that sends
// nothing is closed.
TEST(ServeHardeningTest, SlowHeadersAndBodiesAreAnswered408) {
  Worker worker(
      {"--model", "builtin:tiny-hybrid", "--header-timeout-ms", "300", "--read-timeout-ms", "300"});
  ASSERT_NE(worker.port(), 0);
  const int head = ConnectLoopback(worker.port());
  const int body = ConnectLoopback(worker.port());
  const int silent = ConnectLoopback(worker.port());
  ASSERT_TRUE(head >= 0 && body >= 0 && silent >= 0);
  ASSERT_TRUE(SendAll(head, "GET /health HTTP/1.1\r\nHo"));
  const std::string post = PostRequest(json{{"prompt", {1, 2, 3}}}.dump());
  ASSERT_TRUE(SendAll(body, post.substr(0, post.size() - 5)));
  const Received late_head = ReadAll(head, seconds(5));
  const Received late_body = ReadAll(body, seconds(5));
  const Received nothing = ReadAll(silent, seconds(5));
  EXPECT_TRUE(late_head.closed);
  EXPECT_EQ(StatusOf(late_head.data), 408) << late_head.data;
  EXPECT_NE(late_head.data.find("did not arrive within 300 ms"), std::string::npos);
  EXPECT_TRUE(late_body.closed);
  EXPECT_EQ(StatusOf(late_body.data), 408) << late_body.data;
  EXPECT_NE(late_body.data.find("the request body did not arrive within 300 ms"),
            std::string::npos);
  EXPECT_TRUE(nothing.closed);
  EXPECT_EQ(nothing.data, "");
  for (const int fd : {head, body, silent}) ::close(fd);
  EXPECT_EQ(Get(worker.port(), "/health").status, 200);
  EXPECT_EQ(worker.Terminate(seconds(15)).second, 0);
}

// A prompt or max_tokens the KV pool can never hold is a 400 before any work, naming what it
// needs and what the pool has; the largest request that fits is still served in full. The
// boundary is the engine's own (Engine::CheckFits on the same model and pool here).
TEST(ServeHardeningTest, WhatThePoolCanNeverHoldIsRefused400UpFront) {
  auto config = engine::ModelConfig::Load("builtin:tiny-hybrid");
  ASSERT_TRUE(config.ok());
  engine::EngineOptions options;
  options.num_blocks = 64;
  auto engine = engine::Engine::Create(*config, options);
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  constexpr size_t kPrompt = 300;
  size_t most = 0;
  while ((*engine)->CheckFits(kPrompt, most + 1).ok()) ++most;
  ASSERT_GT(most, 10u);

  Worker small({"--model", "builtin:tiny-hybrid", "--num-blocks", "64"});
  ASSERT_NE(small.port(), 0);
  const Reply fits =
      Complete(small.port(), {{"prompt", Prompt(kPrompt)}, {"max_tokens", most}}, seconds(60));
  ASSERT_EQ(fits.status, 200) << fits.body;
  EXPECT_EQ(fits.parsed["usage"].value("completion_tokens", size_t{0}), most);
  const Reply over =
      Complete(small.port(), {{"prompt", Prompt(kPrompt)}, {"max_tokens", most + 1}}, seconds(10));
  EXPECT_EQ(over.status, 400) << over.body;
  const json& error = over.parsed["error"];
  EXPECT_EQ(error.value("code", ""), "invalid_max_tokens") << over.body;
  EXPECT_EQ(error.value("param", ""), "max_tokens");
  EXPECT_NE(error.value("message", "").find("max_tokens " + std::to_string(most + 1)),
            std::string::npos)
      << over.body;
  EXPECT_NE(error.value("message", "").find("more than the pool's 63"), std::string::npos)
      << over.body;
  const Reply prompt =
      Complete(small.port(), {{"prompt", Prompt(2000)}, {"max_tokens", 1}}, seconds(10));
  EXPECT_EQ(prompt.status, 400) << prompt.body;
  EXPECT_EQ(prompt.parsed["error"].value("code", ""), "invalid_prompt") << prompt.body;
  EXPECT_NE(prompt.body.find("a prompt of 2000 tokens needs"), std::string::npos) << prompt.body;
  EXPECT_NE(prompt.body.find("more than the pool's 63"), std::string::npos) << prompt.body;

  // The default pool holds about 32k tokens: the issue's 10^6-token prompt (here 10^5) and
  // its largest max_tokens are refused at once.
  Worker standard({"--model", "builtin:tiny-hybrid"});
  ASSERT_NE(standard.port(), 0);
  Clock::time_point start = Clock::now();
  const Reply long_prompt =
      Complete(standard.port(), {{"prompt", Prompt(100000)}, {"max_tokens", 1}}, seconds(10));
  std::printf("a 100000-token prompt answered %d in %.1f ms\n", long_prompt.status,
              MillisSince(start));
  EXPECT_EQ(long_prompt.status, 400) << long_prompt.body.substr(0, 300);
  start = Clock::now();
  const Reply most_tokens =
      Complete(standard.port(), {{"prompt", {1, 2, 3}}, {"max_tokens", 1048576}}, seconds(10));
  std::printf("max_tokens 1048576 answered %d in %.1f ms\n", most_tokens.status,
              MillisSince(start));
  EXPECT_EQ(most_tokens.status, 400) << most_tokens.body;
  EXPECT_NE(most_tokens.body.find("more than the pool's 4095"), std::string::npos)
      << most_tokens.body;
}

// A burst of 1,000 connections at once is taken from a real listen backlog: every one is
// answered, none reset or left waiting for SYN retransmits.
TEST(ServeHardeningTest, ABurstOfAThousandConnectionsIsAllServed) {
  constexpr size_t kBurst = 1000;
  rlimit files{};
  ::getrlimit(RLIMIT_NOFILE, &files);
  if (files.rlim_max < kBurst + 100) GTEST_SKIP() << "RLIMIT_NOFILE " << files.rlim_max;
  files.rlim_cur = std::max<rlim_t>(files.rlim_cur, std::min<rlim_t>(files.rlim_max, 4096));
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &files), 0);
  Worker worker({"--model", "builtin:tiny-hybrid"});
  ASSERT_NE(worker.port(), 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(worker.port());
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const std::string request =
      "GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
  struct Pending {
    int fd = -1;
    bool sent = false;
    std::string reply;
  };
  std::vector<Pending> pending(kBurst);
  const Clock::time_point start = Clock::now();
  for (Pending& p : pending) {
    p.fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    ASSERT_GE(p.fd, 0);
    const int r = ::connect(p.fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
    ASSERT_TRUE(r == 0 || errno == EINPROGRESS) << std::strerror(errno);
  }
  size_t answered = 0, failed = 0;
  while (answered + failed < kBurst && MillisSince(start) < 10000) {
    std::vector<pollfd> polls;
    std::vector<Pending*> of;
    for (Pending& p : pending) {
      if (p.fd < 0) continue;
      polls.push_back({p.fd, static_cast<short>(p.sent ? POLLIN : POLLOUT), 0});
      of.push_back(&p);
    }
    if (::poll(polls.data(), polls.size(), 100) <= 0) continue;
    for (size_t i = 0; i < polls.size(); ++i) {
      Pending& p = *of[i];
      if (polls[i].revents == 0) continue;
      bool done = false;
      if (!p.sent) {
        int error = 0;
        socklen_t len = sizeof error;
        ::getsockopt(p.fd, SOL_SOCKET, SO_ERROR, &error, &len);
        p.sent = error == 0 && SendAll(p.fd, request);
        done = !p.sent;
      } else {
        char buffer[4096];
        const ssize_t n = ::recv(p.fd, buffer, sizeof buffer, 0);
        if (n > 0) p.reply.append(buffer, static_cast<size_t>(n));
        done = n <= 0;
      }
      if (!done) continue;
      (StatusOf(p.reply) == 200 ? answered : failed) += 1;
      ::close(p.fd);
      p.fd = -1;
    }
  }
  const double elapsed = MillisSince(start);
  for (Pending& p : pending) {
    if (p.fd >= 0) ::close(p.fd);
  }
  std::printf(
      "a burst of %zu connections: %zu answered 200, %zu reset or refused, %zu "
      "unanswered, in %.1f ms\n",
      kBurst, answered, failed, kBurst - answered - failed, elapsed);
  EXPECT_EQ(answered, kBurst);
  EXPECT_EQ(worker.Terminate(seconds(15)).second, 0);
}

// At the file-descriptor limit the worker stops accepting instead of spinning: it says so once
// per episode, serves the connections it has, and takes the ones waiting in the backlog once
// descriptors are free again.
TEST(ServeHardeningTest, AtTheDescriptorLimitAcceptBacksOffLogsOnceAndServes) {
  Worker worker({"--model", "builtin:tiny-hybrid"});
  ASSERT_NE(worker.port(), 0);
  const uint16_t port = worker.port();
  // The worker's limit: what it has open now and 10 more.
  const std::string fd_dir = "/proc/" + std::to_string(worker.pid()) + "/fd";
  size_t open_fds = 0;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator(fd_dir)) {
    ++open_fds;
  }
  const rlimit limit{open_fds + 10, open_fds + 10};
  ASSERT_EQ(::prlimit(worker.pid(), RLIMIT_NOFILE, &limit, nullptr), 0) << std::strerror(errno);
  // The kernel completes every connection; the worker takes the first ones (about 10), and
  // the others wait in the backlog.
  std::vector<int> flood;
  for (int i = 0; i < 40; ++i) {
    const int fd = ConnectLoopback(port);
    ASSERT_GE(fd, 0);
    flood.push_back(fd);
  }
  const std::string episode = "cannot accept connections";
  ASSERT_TRUE(WaitFor([&] { return worker.Log().find(episode) != std::string::npos; }, seconds(5)))
      << "no word of the limit in the log: " << worker.Log();
  // It backs off: little CPU while the backlog waits.
  const auto cpu_ticks = [&] {
    std::ifstream stat("/proc/" + std::to_string(worker.pid()) + "/stat");
    const std::string text((std::istreambuf_iterator<char>(stat)),
                           std::istreambuf_iterator<char>());
    std::istringstream fields(text.substr(text.rfind(')') + 2));
    std::string skip;
    for (int i = 0; i < 11; ++i) fields >> skip;  // state .. cmajflt
    uint64_t utime = 0, stime = 0;
    fields >> utime >> stime;
    return utime + stime;
  };
  const uint64_t ticks = cpu_ticks();
  const Clock::time_point window = Clock::now();
  std::this_thread::sleep_for(seconds(1));
  const double cpu_share = static_cast<double>(cpu_ticks() - ticks) /
                           static_cast<double>(::sysconf(_SC_CLK_TCK)) /
                           (MillisSince(window) / 1000.0);
  std::printf("at the descriptor limit: %.1f%% of a core\n", 100 * cpu_share);
  EXPECT_LT(cpu_share, 0.2);
  // A connection it took is served (its answer closes it, freeing a descriptor).
  const std::string health = "GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
  ASSERT_TRUE(SendAll(flood[0], health));
  const Received first = ReadAll(flood[0], seconds(5));
  EXPECT_EQ(StatusOf(first.data), 200) << first.data;
  // Freed descriptors: the connections left in the backlog are taken and answered.
  for (size_t i = 1; i + 5 < flood.size(); ++i) ::close(flood[i]);
  for (size_t i = flood.size() - 5; i < flood.size(); ++i) {
    ASSERT_TRUE(SendAll(flood[i], health));
  }
  for (size_t i = flood.size() - 5; i < flood.size(); ++i) {
    const Received r = ReadAll(flood[i], seconds(5));
    EXPECT_EQ(StatusOf(r.data), 200) << "connection " << i << ": " << r.data;
  }
  for (size_t i : {size_t{0}, flood.size() - 5, flood.size() - 4, flood.size() - 3,
                   flood.size() - 2, flood.size() - 1}) {
    ::close(flood[i]);
  }
  // The episode ends when the backlog is empty: after the last answer, the worker may still be
  // taking (and closing) connections whose clients left.
  EXPECT_TRUE(
      WaitFor([&] { return worker.Log().find("accepting connections again") != std::string::npos; },
              seconds(10)))
      << worker.Log();
  const std::string log = worker.Log();
  size_t episodes = 0;
  for (size_t at = log.find(episode); at != std::string::npos; at = log.find(episode, at + 1)) {
    ++episodes;
  }
  EXPECT_EQ(episodes, 1u) << log;
  EXPECT_LT(log.size(), 8192u) << log;
  EXPECT_EQ(worker.Terminate(seconds(15)).second, 0);
}

// The memory of 100 MB bodies goes back to the system once they are parsed.
TEST(ServeHardeningTest, LargeBodiesLeaveNoResidentMemoryBehind) {
  Worker worker({"--model", "builtin:tiny-hybrid", "--max-body-bytes", "268435456"});
  ASSERT_NE(worker.port(), 0);
  const auto resident_mb = [&] {
    std::ifstream status("/proc/" + std::to_string(worker.pid()) + "/status");
    for (std::string line; std::getline(status, line);) {
      if (line.rfind("VmRSS:", 0) == 0) return std::stod(line.substr(6)) / 1024;
    }
    return -1.0;
  };
  ASSERT_EQ(Complete(worker.port(), {{"prompt", {1, 2, 3}}, {"max_tokens", 2}}, seconds(10)).status,
            200);
  const double before = resident_mb();
  // A valid JSON body of 100 MB (a long string field) with max_tokens 0: parsed whole, then
  // refused.
  const std::string body =
      R"({"prompt":[1,2,3],"max_tokens":0,"pad":")" + std::string(size_t{100} << 20, 'a') + R"("})";
  const std::string request = PostRequest(body);
  std::vector<std::thread> senders;
  std::vector<int> statuses(2);
  for (int& status : statuses) {
    senders.emplace_back([&] {
      const int fd = ConnectLoopback(worker.port());
      if (fd < 0) return;
      if (SendAll(fd, request)) status = StatusOf(ReadAll(fd, seconds(60)).data);
      ::close(fd);
    });
  }
  for (std::thread& t : senders) t.join();
  for (const int status : statuses) EXPECT_EQ(status, 400);
  const double after = resident_mb();
  std::printf("resident: %.0f MB before, %.0f MB after two 100 MB bodies at once\n", before, after);
  EXPECT_LT(after, before + 32);
  EXPECT_EQ(worker.Terminate(seconds(15)).second, 0);
}

}  // namespace
}  // namespace kvstash::worker
