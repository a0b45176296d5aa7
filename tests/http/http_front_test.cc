// HttpFront in process, over loopback sockets: the choices its two servers make differently
// (what happens at max_connections, the lanes' threads, the I/O thread's own error answers).
// The servers' behaviour under abuse is tested on the processes: tests/worker's
// serve_hardening_test and tests/node's kvstashd_http_test.

#include "kvstash/http/http_front.h"

#include <arpa/inet.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "loopback_socket.h"

namespace kvstash::http {
namespace {

using namespace std::chrono_literals;
using ::kvstash::testing::ConnectLoopback;
using ::testing::HasSubstr;
using ::testing::StartsWith;
using Clock = std::chrono::steady_clock;

// Reads from `fd` until its peer closes it, what came ends with `until` (unless empty), or
// `limit` passes; what came.
std::string ReadUntilClosed(int fd, std::chrono::milliseconds limit,
                            const std::string& until = "") {
  const auto deadline = Clock::now() + limit;
  std::string in;
  for (;;) {
    if (!until.empty() && in.size() >= until.size() &&
        in.compare(in.size() - until.size(), until.size(), until) == 0) {
      return in;
    }
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    pollfd p{fd, POLLIN, 0};
    if (left.count() <= 0 || ::poll(&p, 1, static_cast<int>(left.count())) != 1) return in;
    char buffer[4096];
    const ssize_t n = ::recv(fd, buffer, sizeof buffer, 0);
    if (n <= 0) return in;
    in.append(buffer, static_cast<size_t>(n));
  }
}

// Whether the peer closes `fd` without a word within `limit`.
bool ClosedSilently(int fd, std::chrono::milliseconds limit) {
  pollfd p{fd, POLLIN, 0};
  if (::poll(&p, 1, static_cast<int>(limit.count())) != 1) return false;
  char byte;
  return ::recv(fd, &byte, 1, 0) == 0;
}

// A GET of `path` with Connection: close on a new connection; the answer ("" if none came).
std::string Get(uint16_t port, const std::string& path, std::chrono::milliseconds limit = 5s) {
  const int fd = ConnectLoopback(port);
  if (fd < 0) return "";
  const std::string request =
      "GET " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
  std::string answer;
  if (::send(fd, request.data(), request.size(), MSG_NOSIGNAL) ==
      static_cast<ssize_t>(request.size())) {
    answer = ReadUntilClosed(fd, limit);
  }
  ::close(fd);
  return answer;
}

FrontOptions Options() {
  FrontOptions options;
  options.name = "test server";
  options.request_threads = 1;
  options.info_threads = 1;
  options.health_threads = 1;
  options.classify = [](std::string_view method, std::string_view path) {
    return path == "/health" ? Lane::kHealth : Lane::kRequests;
  };
  return options;
}

// A started front answering GET /health "ok", and the routes `route` adds.
std::unique_ptr<HttpFront> StartFront(FrontOptions options,
                                      const std::function<void(httplib::Server&)>& route = {}) {
  Result<std::unique_ptr<HttpFront>> front = HttpFront::Create(std::move(options));
  EXPECT_TRUE(front.ok()) << front.status().ToString();
  if (!front.ok()) return nullptr;
  (*front)->router().Get("/health", [](const httplib::Request&, httplib::Response& res) {
    res.set_content("ok", "text/plain");
  });
  if (route) route((*front)->router());
  (*front)->Start();
  return std::move(*front);
}

// The node's choice: a flood of silent connections cannot keep a prober out.
TEST(HttpFrontTest, AtTheLimitTheOldestWaitingConnectionIsClosedForANewOne) {
  FrontOptions options = Options();
  options.max_connections = 4;
  options.at_limit = AtLimit::kCloseOldestWaiting;
  std::unique_ptr<HttpFront> front = StartFront(std::move(options));
  ASSERT_NE(front, nullptr);
  // The listen backlog is in order: the front takes these four before any later connection.
  std::vector<int> silent;
  for (int i = 0; i < 4; ++i) {
    silent.push_back(ConnectLoopback(front->port()));
    ASSERT_GE(silent.back(), 0);
  }
  // Each probe is taken at once, and the oldest silent connection closed for it without a
  // word. The probes keep their connections (kept alive, waiting for their next request, so
  // the newest waiting): four open again after each.
  const std::string request = "GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n";
  std::vector<int> probes;
  for (size_t probe = 0; probe < 2; ++probe) {
    probes.push_back(ConnectLoopback(front->port()));
    ASSERT_GE(probes.back(), 0);
    ASSERT_EQ(::send(probes.back(), request.data(), request.size(), MSG_NOSIGNAL),
              static_cast<ssize_t>(request.size()));
    EXPECT_THAT(ReadUntilClosed(probes.back(), 5s, "\r\n\r\nok"), HasSubstr("\r\n\r\nok")) << probe;
    EXPECT_TRUE(ClosedSilently(silent[probe], 5s)) << probe;
  }
  // The newer ones, and the probes, are open.
  for (int fd : {silent[2], silent[3], probes[0], probes[1]}) {
    pollfd p{fd, POLLIN, 0};
    EXPECT_EQ(::poll(&p, 1, 0), 0);
  }
  for (int fd : silent) ::close(fd);
  for (int fd : probes) ::close(fd);
}

// The worker's choice: at the limit new connections wait in the listen backlog until one
// closes (the connections open keep their requests).
TEST(HttpFrontTest, AtTheLimitNewConnectionsWaitUntilOneCloses) {
  FrontOptions options = Options();
  options.max_connections = 2;
  options.at_limit = AtLimit::kWait;
  std::unique_ptr<HttpFront> front = StartFront(std::move(options));
  ASSERT_NE(front, nullptr);
  const int first = ConnectLoopback(front->port());
  const int second = ConnectLoopback(front->port());
  ASSERT_GE(first, 0);
  ASSERT_GE(second, 0);
  // Connected (the kernel completes it), but not taken: no answer while both are open.
  const int third = ConnectLoopback(front->port());
  ASSERT_GE(third, 0);
  const std::string request =
      "GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
  ASSERT_EQ(::send(third, request.data(), request.size(), MSG_NOSIGNAL),
            static_cast<ssize_t>(request.size()));
  EXPECT_EQ(ReadUntilClosed(third, 300ms), "");
  ::close(first);
  EXPECT_THAT(ReadUntilClosed(third, 5s), HasSubstr("\r\n\r\nok"));
  // The connection that stayed was never closed for it.
  pollfd p{second, POLLIN, 0};
  EXPECT_EQ(::poll(&p, 1, 0), 0);
  ::close(second);
  ::close(third);
}

// The health lane's thread is its own: a request lane whose one thread is held does not delay
// a health check.
TEST(HttpFrontTest, HealthIsAnsweredWhileEveryRequestThreadIsHeld) {
  std::atomic<bool> held{false};
  std::atomic<bool> release{false};
  std::unique_ptr<HttpFront> front = StartFront(Options(), [&](httplib::Server& router) {
    router.Get("/slow", [&](const httplib::Request&, httplib::Response& res) {
      held = true;
      while (!release) std::this_thread::sleep_for(1ms);
      res.set_content("done", "text/plain");
    });
  });
  ASSERT_NE(front, nullptr);
  std::string slow;
  std::thread client([&] { slow = Get(front->port(), "/slow", 10s); });
  const auto deadline = Clock::now() + 5s;
  while (!held && Clock::now() < deadline) std::this_thread::sleep_for(1ms);
  ASSERT_TRUE(held);
  EXPECT_THAT(Get(front->port(), "/health"), HasSubstr("\r\n\r\nok"));
  release = true;
  client.join();
  EXPECT_THAT(slow, HasSubstr("\r\n\r\ndone"));
}

// A head that does not arrive in time is answered by the I/O thread, in the server's spelling.
TEST(HttpFrontTest, AHeadLateBeyondItsTimeoutIs408InTheServersSpelling) {
  FrontOptions options = Options();
  options.header_timeout = 200ms;
  options.error_body = [](int status, std::string_view code, std::string_view message) {
    return std::string("{\"code\":\"") + std::string(code) + "\"}";
  };
  options.error_content_type = "application/json";
  std::unique_ptr<HttpFront> front = StartFront(std::move(options));
  ASSERT_NE(front, nullptr);
  const int fd = ConnectLoopback(front->port());
  ASSERT_GE(fd, 0);
  const std::string part = "GET /health HTTP/1.1\r\nHost: 127.";
  ASSERT_EQ(::send(fd, part.data(), part.size(), MSG_NOSIGNAL), static_cast<ssize_t>(part.size()));
  const std::string answer = ReadUntilClosed(fd, 5s);
  ::close(fd);
  EXPECT_THAT(answer, StartsWith("HTTP/1.1 408 "));
  EXPECT_THAT(answer, HasSubstr("Content-Type: application/json\r\n"));
  EXPECT_THAT(answer, HasSubstr("\r\n\r\n{\"code\":\"request_timeout\"}"));
}

TEST(HttpFrontTest, OptionsOutOfRangeAreRefused) {
  FrontOptions no_threads = Options();
  no_threads.health_threads = 0;
  EXPECT_EQ(HttpFront::Create(no_threads).status().code(), StatusCode::kInvalidArgument);
  FrontOptions no_connections = Options();
  no_connections.max_connections = 0;
  EXPECT_EQ(HttpFront::Create(no_connections).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvstash::http
