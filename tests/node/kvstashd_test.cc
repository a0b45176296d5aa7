// `kvstashd` as operators run it: real daemon processes on loopback ports they pick (--port 0,
// read back from the start line), clients in this process. Serving and a clean SIGTERM stop,
// wrong tokens, restarts over an SSD directory (after SIGTERM and after kill -9), config files,
// and settings refused with exit status 2.

#include <arpa/inet.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include "daemon_process.h"
#include "loopback_socket.h"
#include "node_test_client.h"
#include "private_namespaces.h"
#include "subprocess.h"
#include "temp_dir.h"

namespace kvstash {
namespace {

using namespace std::chrono_literals;
using ::kvstash::testing::ChildProcess;
using ::kvstash::testing::Daemon;
using ::kvstash::testing::kKvstashd;
using ::kvstash::testing::NodeTestClient;
using ::kvstash::testing::RunProcess;
using ::kvstash::testing::TempDir;
using ::testing::HasSubstr;

constexpr size_t kBlock = 64 << 10;

TEST(KvstashdTest, ServesThenStopsCleanlyOnSigterm) {
  Daemon daemon({"--auth-token", "s3cret"});
  ASSERT_NE(daemon.port(), 0);
  {
    NodeTestClient client(daemon.port(), "tenant", "s3cret", "", kBlock);
    ASSERT_TRUE(client.ok());
    client.Store({1, 2, 3});
    EXPECT_THAT(client.PerKey({1, 2, 3, 4}),
                ::testing::ElementsAre(wire::LOOKUP_HIT, wire::LOOKUP_HIT, wire::LOOKUP_HIT,
                                       wire::LOOKUP_MISS));
    EXPECT_TRUE(client.ReadBack(2));
    // The client stays connected through the stop: SIGTERM ends its session too.
    EXPECT_EQ(daemon.process().Kill(SIGTERM), 0);
  }
}

// kvstashd --transport stream serves blocks over its own TCP framing, checks tokens as over
// UCX, and tells a UCX client that connects what to do instead.
TEST(KvstashdTest, ServesOverTheStreamTransportAndTellsAUcxClientToUseIt) {
  Daemon daemon({"--transport", "stream", "--auth-token", "s3cret"});
  ASSERT_NE(daemon.port(), 0);
  NodeTestClient client(daemon.port(), "tenant", "s3cret", "stream", kBlock);
  ASSERT_TRUE(client.ok());
  client.Store({1, 2, 3});
  EXPECT_THAT(client.PerKey({1, 2, 3, 4}),
              ::testing::ElementsAre(wire::LOOKUP_HIT, wire::LOOKUP_HIT, wire::LOOKUP_HIT,
                                     wire::LOOKUP_MISS));
  EXPECT_TRUE(client.ReadBack(1));
  EXPECT_TRUE(client.ReadBack(3));

  NodeTestClient intruder(daemon.port(), "tenant", "wrong", "stream", kBlock);
  wire::LookupRequest lookup;
  *lookup.add_keys() = ::kvstash::testing::WireKey(1);
  wire::LookupReply reply;
  EXPECT_EQ(intruder.Call(wire::METHOD_LOOKUP, lookup, &reply).code(),
            StatusCode::kUnauthenticated);

  NodeTestClient ucx(daemon.port(), "tenant", "s3cret", "tcp", kBlock);
  const Status refused = ucx.rpc().Connect();
  EXPECT_EQ(refused.code(), StatusCode::kFailedPrecondition) << refused.ToString();
  EXPECT_THAT(refused.message(), HasSubstr("stream transport"));
  EXPECT_TRUE(client.ReadBack(2));  // the node still serves
  EXPECT_EQ(daemon.process().Kill(SIGTERM), 0);
}

// GET http://127.0.0.1:port/path: the response body, or "" when the request fails.
std::string HttpGet(uint16_t port, const std::string& path) {
  const int fd = ::kvstash::testing::ConnectLoopback(port);
  if (fd < 0) return "";
  const std::string request =
      "GET " + path + " HTTP/1.0\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
  (void)!write(fd, request.data(), request.size());
  std::string response;
  char buffer[4096];
  for (ssize_t n; (n = read(fd, buffer, sizeof(buffer))) > 0;) response.append(buffer, n);
  close(fd);
  if (response.rfind("HTTP/1.1 200", 0) != 0 && response.rfind("HTTP/1.0 200", 0) != 0) return "";
  const size_t body = response.find("\r\n\r\n");
  return body == std::string::npos ? "" : response.substr(body + 4);
}

// A large tier: the node serves at once and faults its memory in behind; /healthz says it is
// up and how much is in, blocks stored meanwhile read back whole, and a SIGTERM while the pages
// still come in stops it cleanly (exit 0). Readiness, content and the stop, never the time.
TEST(KvstashdTest, ALargeTierServesCorrectBlocksWhileItsMemoryComesInAndStopsOnSigterm) {
  Daemon daemon({"--block-bytes", "64KiB", "--cpu-bytes", "4GiB"}, /*sizes=*/false);
  ASSERT_NE(daemon.port(), 0);
  ASSERT_NE(daemon.metrics_port(), 0);
  const std::string health = HttpGet(daemon.metrics_port(), "/healthz");
  EXPECT_THAT(health, HasSubstr("kvstash_up 1"));
  EXPECT_THAT(health, HasSubstr("kvstash_cpu_memory_faulted_ratio "));
  {
    NodeTestClient client(daemon.port(), "tenant", "", "", kBlock);
    ASSERT_TRUE(client.ok());
    std::vector<uint64_t> keys;
    for (uint64_t k = 1; k <= 64; ++k) keys.push_back(k);
    client.Store(keys);
    for (uint64_t k : keys) EXPECT_TRUE(client.ReadBack(k)) << k;
  }
  const std::string metrics = HttpGet(daemon.metrics_port(), "/metrics");
  EXPECT_THAT(metrics, HasSubstr("kvstash_cpu_memory_bytes{state=\"total\"} 4294967296"));
  EXPECT_THAT(metrics, HasSubstr("kvstash_cpu_memory_bytes{state=\"faulted\"} "));
  EXPECT_EQ(daemon.process().Kill(SIGTERM), 0);
}

TEST(KvstashdTest, MetricsMoveUnderLoadAndHealthAnswers) {
  Daemon daemon({});
  ASSERT_NE(daemon.port(), 0);
  ASSERT_NE(daemon.metrics_port(), 0);
  EXPECT_THAT(HttpGet(daemon.metrics_port(), "/healthz"), HasSubstr("kvstash_up 1"));
  const std::string idle = HttpGet(daemon.metrics_port(), "/metrics");
  EXPECT_THAT(idle, HasSubstr("kvstash_blocks_stored_total 0"));
  EXPECT_THAT(idle, HasSubstr("kvstash_capacity_blocks{tier=\"cpu\"} 64"));
  NodeTestClient client(daemon.port(), "tenant", "", "", kBlock);
  client.Store({1, 2, 3});
  EXPECT_TRUE(client.ReadBack(2));
  client.PerKey({1, 99});
  const std::string busy = HttpGet(daemon.metrics_port(), "/metrics");
  EXPECT_THAT(busy, HasSubstr("kvstash_blocks_stored_total 3"));
  EXPECT_THAT(busy, HasSubstr("kvstash_blocks{tier=\"cpu\"} 3"));
  EXPECT_THAT(busy, HasSubstr("kvstash_payload_bytes_total{direction=\"in\"} 196608"));
  EXPECT_THAT(busy, HasSubstr("kvstash_payload_bytes_total{direction=\"out\"} 65536"));
  EXPECT_THAT(busy, HasSubstr("kvstash_lookup_keys_total{result=\"miss\"} 1"));
  EXPECT_THAT(busy, HasSubstr("kvstash_lookup_keys_total{result=\"hit\"} 1"));
  EXPECT_THAT(busy, HasSubstr("kvstash_bytes{tier=\"cpu\"} 196608"));
  EXPECT_THAT(busy, HasSubstr("kvstash_evictions_total{tier=\"cpu\"} 0"));
  // One latency histogram per method; the puts' replies are counted before the client has them
  // (a get's only once its payload is sent, which may come after: not checked here).
  EXPECT_THAT(busy, HasSubstr("# TYPE kvstash_request_seconds histogram"));
  EXPECT_THAT(busy, HasSubstr("kvstash_request_seconds_count{method=\"put_block\"} 3"));
  EXPECT_THAT(busy,
              HasSubstr("kvstash_request_seconds_bucket{method=\"put_block\",le=\"+Inf\"} 3"));
  EXPECT_THAT(busy, HasSubstr("kvstash_request_seconds_bucket{method=\"lookup\",le=\"1\"} 1"));
  EXPECT_THAT(busy, HasSubstr("kvstash_request_seconds_count{method=\"touch\"} 0"));
  EXPECT_THAT(busy, HasSubstr("kvstash_request_seconds_sum{method=\"release\"} "));
  EXPECT_EQ(daemon.process().Kill(SIGTERM), 0);
}

// A daemon whose CPU tier overflows counts the blocks it evicted.
TEST(KvstashdTest, MetricsCountEvictions) {
  Daemon daemon({"--block-bytes", "64KiB", "--cpu-bytes", "256KiB"}, /*sizes=*/false);
  ASSERT_NE(daemon.port(), 0);
  NodeTestClient client(daemon.port(), "tenant", "", "", kBlock);
  client.Store({1, 2, 3, 4});
  client.Store({5, 6});
  const std::string metrics = HttpGet(daemon.metrics_port(), "/metrics");
  EXPECT_THAT(metrics, HasSubstr("kvstash_evictions_total{tier=\"cpu\"} 2"));
  EXPECT_THAT(metrics, HasSubstr("kvstash_evictions_total{tier=\"ssd\"} 0"));
  EXPECT_THAT(metrics, HasSubstr("kvstash_blocks{tier=\"cpu\"} 4"));
  EXPECT_EQ(daemon.process().Kill(SIGTERM), 0);
}

// Random and mutated requests to every method, with and without payloads, then raw frames:
// each gets an answer or is dropped, and the daemon keeps serving with its blocks intact.
TEST(KvstashdTest, RandomAndMutatedRequestsNeverStopTheDaemon) {
  Daemon daemon({});
  ASSERT_NE(daemon.port(), 0);
  NodeTestClient keeper(daemon.port(), "tenant", "", "", kBlock);
  keeper.Store({1, 2});
  NodeTestClient fuzzer(daemon.port(), "tenant", "", "", kBlock);
  std::mt19937_64 random(20261122);
  // Valid requests to start mutating from.
  std::vector<std::pair<wire::Method, std::string>> seeds;
  {
    wire::LookupRequest lookup;
    for (uint64_t k : {1, 2, 3}) *lookup.add_keys() = ::kvstash::testing::WireKey(k);
    seeds.emplace_back(wire::METHOD_LOOKUP, lookup.SerializeAsString());
    wire::PutBlockRequest put;
    *put.mutable_key() = ::kvstash::testing::WireKey(5);
    put.set_length(kBlock);
    seeds.emplace_back(wire::METHOD_PUT_BLOCK, put.SerializeAsString());
    wire::LoadRequest load;
    *load.add_keys() = ::kvstash::testing::WireKey(1);
    seeds.emplace_back(wire::METHOD_LOAD, load.SerializeAsString());
    wire::GetBlockRequest get;
    *get.mutable_key() = ::kvstash::testing::WireKey(1);
    seeds.emplace_back(wire::METHOD_GET_BLOCK, get.SerializeAsString());
    wire::ReleaseRequest release;
    *release.add_keys() = ::kvstash::testing::WireKey(1);
    seeds.emplace_back(wire::METHOD_RELEASE, release.SerializeAsString());
    wire::EchoRequest echo;
    echo.set_body("x");
    echo.set_payload_bytes(100);
    seeds.emplace_back(wire::METHOD_ECHO, echo.SerializeAsString());
  }
  std::vector<std::byte> payload(kBlock), reply_buffer(kBlock);
  int answered = 0;
  for (int i = 0; i < 1500; ++i) {
    std::string request;
    uint16_t method = 0;
    if (i % 2 == 0) {
      const auto& [m, bytes] = seeds[random() % seeds.size()];
      method = static_cast<uint16_t>(m);
      request = bytes;
      for (int flips = 1 + random() % 4; flips > 0 && !request.empty(); --flips) {
        request[random() % request.size()] = static_cast<char>(random());
      }
      if (random() % 4 == 0) request.resize(random() % (request.size() + 1));
    } else {
      method = static_cast<uint16_t>(random() % 14);
      request.resize(random() % 300);
      for (char& c : request) c = static_cast<char>(random());
    }
    transport::CallOptions options;
    options.deadline = transport::Clock::now() + 5s;
    if (random() % 3 == 0) options.send_payload = std::span(payload).first(random() % kBlock);
    if (random() % 3 == 0) options.recv_payload = reply_buffer;
    const Status s =
        fuzzer.rpc().CallSync(method, std::as_bytes(std::span(request)), options, nullptr);
    if (s.code() != StatusCode::kUnavailable && s.code() != StatusCode::kDeadlineExceeded) {
      ++answered;
    }
  }
  EXPECT_GT(answered, 1400);  // everything was answered, bar the odd dropped connection
  // Still serving, with the committed blocks intact.
  EXPECT_TRUE(keeper.ReadBack(1));
  EXPECT_TRUE(keeper.ReadBack(2));
  keeper.Store({3});
  EXPECT_TRUE(keeper.ReadBack(3));
  EXPECT_EQ(daemon.process().Kill(SIGTERM), 0);
}

TEST(KvstashdTest, WrongTokenIsRefused) {
  Daemon daemon({"--auth-token", "s3cret"});
  ASSERT_NE(daemon.port(), 0);
  NodeTestClient intruder(daemon.port(), "tenant", "guess", "", kBlock);
  ASSERT_TRUE(intruder.ok());
  const Status status = intruder.rpc().Connect();
  EXPECT_EQ(status.code(), StatusCode::kUnauthenticated) << status.ToString();
  EXPECT_THAT(std::string(status.message()), HasSubstr("wrong auth token"));
  // The refusal is counted; the right token still gets in.
  NodeTestClient client(daemon.port(), "tenant", "s3cret", "", kBlock);
  wire::StatsReply stats;
  ASSERT_TRUE(client.Call(wire::METHOD_STATS, wire::StatsRequest(), &stats).ok());
  EXPECT_EQ(stats.counters().at("transport.refused"), 1u);
  EXPECT_EQ(daemon.process().Kill(SIGTERM), 0);
}

// Tokens per namespace from a file: each tenant gets in with its own token only, and a
// namespace the file does not list is refused.
TEST(KvstashdTest, WrongNamespaceIsRefused) {
  const std::string path =
      std::filesystem::temp_directory_path() / ("kvstash-ns-tokens-" + std::to_string(getpid()));
  std::ofstream(path) << "# tenant tokens\ntenant-a  alpha\n\ntenant-b beta\n";
  Daemon daemon({"--namespace-token-file", path});
  ASSERT_NE(daemon.port(), 0);
  NodeTestClient a(daemon.port(), "tenant-a", "alpha", "", kBlock);
  a.Store({1, 2});
  EXPECT_TRUE(a.ReadBack(1));
  NodeTestClient swapped(daemon.port(), "tenant-b", "alpha", "", kBlock);
  EXPECT_EQ(swapped.rpc().Connect().code(), StatusCode::kUnauthenticated);
  NodeTestClient stranger(daemon.port(), "tenant-c", "alpha", "", kBlock);
  const Status refused = stranger.rpc().Connect();
  EXPECT_EQ(refused.code(), StatusCode::kPermissionDenied) << refused.ToString();
  NodeTestClient b(daemon.port(), "tenant-b", "beta", "", kBlock);
  // tenant-b sees none of tenant-a's blocks.
  EXPECT_THAT(b.PerKey({1, 2}), ::testing::ElementsAre(wire::LOOKUP_MISS, wire::LOOKUP_MISS));
  wire::StatsReply stats;
  ASSERT_TRUE(b.Call(wire::METHOD_STATS, wire::StatsRequest(), &stats).ok());
  EXPECT_EQ(stats.counters().at("transport.refused"), 2u);
  EXPECT_EQ(daemon.process().Kill(SIGTERM), 0);

  // A malformed file is a bad setting.
  std::ofstream(path) << "tenant-a\n";
  auto bad = RunProcess({kKvstashd, "--namespace-token-file", path});
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_THAT(bad.err, HasSubstr("line 1 is not `NAMESPACE TOKEN`"));
  EXPECT_THAT(bad.err, ::testing::Not(HasSubstr("alpha")));
  std::filesystem::remove(path);
}

// The blocks come back after a restart over the same SSD directory: looked up (RETRY while
// they are promoted to the CPU tier, then HIT) and read with the right bytes.
void ExpectBlocksBack(uint16_t port, const std::vector<uint64_t>& keys) {
  NodeTestClient client(port, "tenant", "", "", kBlock);
  ASSERT_TRUE(client.ok());
  std::vector<wire::LookupResult> results;
  for (int i = 0; i < 200; ++i) {
    results = client.PerKey(keys);
    if (std::all_of(results.begin(), results.end(),
                    [](wire::LookupResult r) { return r == wire::LOOKUP_HIT; })) {
      break;
    }
    std::this_thread::sleep_for(10ms);
  }
  for (size_t i = 0; i < keys.size(); ++i) {
    EXPECT_EQ(results.at(i), wire::LOOKUP_HIT) << keys[i];
    EXPECT_TRUE(client.ReadBack(keys[i])) << keys[i];
  }
}

TEST(KvstashdTest, WriteBackBlocksSurviveASigtermRestart) {
  TempDir dir;
  const std::vector<std::string> ssd = {"--ssd-dir", dir.path() + "/ssd", "--ssd-bytes",
                                        "8MiB",      "--cascade",         "write-back"};
  {
    Daemon daemon(ssd);
    ASSERT_NE(daemon.port(), 0);
    NodeTestClient client(daemon.port(), "tenant", "", "", kBlock);
    client.Store({11, 12, 13});
    // Write-back: the blocks are only in the CPU tier until the stop flushes them.
    EXPECT_EQ(daemon.process().Kill(SIGTERM), 0);
  }
  Daemon again(ssd);
  ASSERT_NE(again.port(), 0);
  ExpectBlocksBack(again.port(), {11, 12, 13});
  EXPECT_EQ(again.process().Kill(SIGTERM), 0);
}

TEST(KvstashdTest, WriteThroughBlocksSurviveKillNine) {
  TempDir dir;
  const std::vector<std::string> ssd = {"--ssd-dir", dir.path() + "/ssd", "--ssd-bytes", "8MiB"};
  {
    Daemon daemon(ssd);
    ASSERT_NE(daemon.port(), 0);
    NodeTestClient client(daemon.port(), "tenant", "", "", kBlock);
    client.Store({21, 22});
    // Write-through cascades in the background: wait until the SSD tier holds both.
    wire::StatsReply stats;
    for (int i = 0; i < 200; ++i) {
      ASSERT_TRUE(client.Call(wire::METHOD_STATS, wire::StatsRequest(), &stats).ok());
      if (stats.counters().at("store.cascades_done") == 2) break;
      std::this_thread::sleep_for(10ms);
    }
    ASSERT_EQ(stats.counters().at("store.cascades_done"), 2u);
    EXPECT_EQ(daemon.process().Kill(SIGKILL), 128 + SIGKILL);
  }
  Daemon again(ssd);
  ASSERT_NE(again.port(), 0);
  ExpectBlocksBack(again.port(), {21, 22});
  EXPECT_EQ(again.process().Kill(SIGTERM), 0);
}

TEST(KvstashdTest, ReadsSettingsFromATomlFileWithFlagsWinning) {
  TempDir dir;
  const std::string config = dir.path() + "/kvstashd.toml";
  std::ofstream(config) << "port = 1\nblock-bytes = \"128KiB\"\ncpu-bytes = \"4MiB\"\n";
  // --port 0 (from Daemon) wins over the file's port 1; the block size comes from the file.
  Daemon daemon({"--config", config}, /*sizes=*/false);
  ASSERT_NE(daemon.port(), 0);
  NodeTestClient client(daemon.port(), "tenant", "", "", 128 << 10);
  wire::StatsReply stats;
  ASSERT_TRUE(client.Call(wire::METHOD_STATS, wire::StatsRequest(), &stats).ok());
  EXPECT_EQ(stats.counters().at("cpu.block_bytes"), 128u << 10);
  EXPECT_EQ(stats.counters().at("cpu.capacity_blocks"), 32u);
  EXPECT_EQ(daemon.process().Kill(SIGTERM), 0);
}

// Namespace quotas from a TOML file: each namespace keeps at most its quota of blocks (its own
// newest), the metrics show every namespace's blocks and quota, and a store beyond the quota is
// refused and counted.
TEST(KvstashdTest, NamespaceQuotasFromATomlFile) {
  TempDir dir;
  const std::string config = dir.path() + "/kvstashd.toml";
  std::ofstream(config) << "namespace-quota = [\"tenant-a=128KiB\", \"tenant-b=192KiB\"]\n"
                        << "default-namespace-quota = \"256KiB\"\n";
  Daemon daemon({"--config", config});  // 64 KiB blocks: quotas of 2, 3 and 4 blocks
  ASSERT_NE(daemon.port(), 0);
  NodeTestClient a(daemon.port(), "tenant-a", "", "", kBlock);
  NodeTestClient c(daemon.port(), "tenant-c", "", "", kBlock);
  for (uint64_t k = 1; k <= 6; ++k) {
    a.Store({k});
    c.Store({k});
  }
  EXPECT_THAT(a.PerKey({1, 2, 3, 4, 5, 6}),
              ::testing::ElementsAre(wire::LOOKUP_MISS, wire::LOOKUP_MISS, wire::LOOKUP_MISS,
                                     wire::LOOKUP_MISS, wire::LOOKUP_HIT, wire::LOOKUP_HIT));
  EXPECT_THAT(c.PerKey({1, 2, 3, 4, 5, 6}),
              ::testing::ElementsAre(wire::LOOKUP_MISS, wire::LOOKUP_MISS, wire::LOOKUP_HIT,
                                     wire::LOOKUP_HIT, wire::LOOKUP_HIT, wire::LOOKUP_HIT));
  // Both of tenant-a's blocks pinned: a third has no room in its quota and is refused.
  wire::LoadRequest load;
  for (uint64_t k : {5, 6}) *load.add_keys() = testing::WireKey(k);
  wire::LoadReply loaded;
  ASSERT_TRUE(a.Call(wire::METHOD_LOAD, load, &loaded).ok());
  ASSERT_THAT(loaded.pinned(), ::testing::ElementsAre(true, true));
  wire::PutBlockRequest put;
  *put.mutable_key() = testing::WireKey(7);
  put.set_length(kBlock);
  std::vector<std::byte> block(kBlock);
  transport::CallOptions with_block;
  with_block.send_payload = block;
  const Status refused =
      a.Call(wire::METHOD_PUT_BLOCK, put, (wire::PutBlockReply*)nullptr, with_block);
  EXPECT_EQ(refused.code(), StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(refused.message()), HasSubstr("namespace 'tenant-a'"));
  const std::string metrics = HttpGet(daemon.metrics_port(), "/metrics");
  EXPECT_THAT(metrics,
              HasSubstr("kvstash_namespace_blocks{namespace=\"tenant-a\",tier=\"cpu\"} 2"));
  EXPECT_THAT(metrics,
              HasSubstr("kvstash_namespace_blocks{namespace=\"tenant-b\",tier=\"cpu\"} 0"));
  EXPECT_THAT(metrics,
              HasSubstr("kvstash_namespace_blocks{namespace=\"tenant-c\",tier=\"cpu\"} 4"));
  EXPECT_THAT(metrics,
              HasSubstr("kvstash_namespace_quota_blocks{namespace=\"tenant-b\",tier=\"cpu\"} 3"));
  EXPECT_THAT(metrics,
              HasSubstr("kvstash_namespace_quota_blocks{namespace=\"tenant-c\",tier=\"cpu\"} 4"));
  EXPECT_THAT(metrics, HasSubstr("kvstash_quota_refusals_total{namespace=\"tenant-a\"} 1"));
  EXPECT_THAT(metrics, HasSubstr("kvstash_quota_refusals_total{namespace=\"tenant-c\"} 0"));
  EXPECT_THAT(metrics, HasSubstr("kvstash_blocks{tier=\"cpu\"} 6"));
  EXPECT_EQ(daemon.process().Kill(SIGTERM), 0);
}

TEST(KvstashdTest, BadSettingsExitTwoNamingTheSetting) {
  TempDir dir;
  const std::string unknown = dir.path() + "/unknown.toml";
  std::ofstream(unknown) << "cpu_policy = \"lru\"\n";
  const std::string bad_quota = dir.path() + "/bad_quota.toml";
  std::ofstream(bad_quota) << "namespace-quota = [\"tenant-a\"]\n";
  struct Case {
    std::vector<std::string> args;
    std::string named;
  };
  const std::vector<Case> cases = {
      {{"--cpu-bytes", "1K"}, "cpu-bytes"},
      {{"--block-bytes", "12Q"}, "block-bytes"},
      {{"--cpu-policy", "fifo"}, "cpu-policy"},
      {{"--cascade", "sometimes"}, "cascade"},
      {{"--ssd-dir", "/tmp/x"}, "ssd-bytes"},
      {{"--ssd-bytes", "1G"}, "ssd-dir"},
      {{"--port", "70000"}, "port"},
      {{"--auth-token", "a", "--auth-token-file", "/tmp/t"}, "auth-token"},
      {{"--log-level", "loud"}, "log-level"},
      {{"--max-payload-bytes", "1K"}, "max-payload-bytes"},
      {{"--max-batch-bytes", "5MiB"}, "max-batch-bytes: 5 MiB is outside 0..4 MiB"},
      {{"--max-batch-bytes", "1MiB", "--max-payload-bytes", "512KiB"}, "max-batch-bytes"},
      {{"--max-batch-bytes", "many"}, "max-batch-bytes"},
      {{"--lease-timeout-ms", "0"}, "lease-timeout-ms"},
      {{"--spin-us", "-1"}, "spin-us"},
      {{"--progress-threads", "65"}, "progress-threads: 65 is outside 0..64"},
      {{"--progress-threads", "-1"}, "progress-threads"},
      {{"--metrics-address", "nowhere"}, "metrics-address"},
      {{"--config", unknown}, "cpu_policy"},
      {{"--namespace-quota", "tenant-a"}, "namespace-quota: 'tenant-a' is not NAME=BYTES"},
      {{"--namespace-quota", "=1GiB"}, "namespace-quota"},
      {{"--namespace-quota", "a=12Q"}, "namespace-quota: 'a'"},
      {{"--namespace-quota", "a=1MiB", "--namespace-quota", "a=2MiB"}, "'a' is given twice"},
      {{"--namespace-quota", "a=1KiB"}, "below one block"},
      {{"--namespace-quota", "a=2GiB"}, "above the CPU tier"},
      {{"--namespace-quota", "other=1MiB"}, "reserved"},
      {{"--default-namespace-quota", "12Q"}, "default-namespace-quota"},
      {{"--default-namespace-quota", "4GiB"}, "default-namespace-quota"},
      {{"--config", bad_quota}, "namespace-quota"},
      {{"--no-such-flag"}, "--no-such-flag"},
      {{"--transport", "rdma"}, "transport: 'rdma' is not ucx or stream"},
      {{"--transport", "stream", "--tls", "tcp"}, "'tcp' names UCX transports"},
      {{"--kv-events-replay", "tcp://*:5558"},
       "kv-events-replay: 'tcp://*:5558' needs --kv-events"},
  };
  for (const Case& c : cases) {
    std::vector<std::string> argv = {kKvstashd};
    argv.insert(argv.end(), c.args.begin(), c.args.end());
    const auto r = RunProcess(argv);
    const std::string what = ::testing::PrintToString(c.args);
    EXPECT_EQ(r.exit_code, 2) << what << ": " << r.err;
    EXPECT_THAT(r.err, HasSubstr(c.named)) << what;
  }
  const auto missing = RunProcess({kKvstashd, "--auth-token-file", "/nonexistent/token"});
  EXPECT_EQ(missing.exit_code, 1) << missing.err;
  EXPECT_THAT(missing.err, HasSubstr("/nonexistent/token"));
  // An events endpoint ZMQ cannot use stops the start, naming it.
  const auto events =
      RunProcess({kKvstashd, "--port", "0", "--metrics-address", "off", "--cpu-bytes", "1MiB",
                  "--block-bytes", "4KiB", "--kv-events", "tcp://*:notaport"});
  EXPECT_EQ(events.exit_code, 1) << events.err;
  EXPECT_THAT(events.err, HasSubstr("tcp://*:notaport"));
}

TEST(KvstashdTest, HelpExplainsEverySetting) {
  const auto r = RunProcess({kKvstashd, "--help"});
  EXPECT_EQ(r.exit_code, 0);
  for (const char* flag : {"--config",
                           "--listen",
                           "--port",
                           "--transport",
                           "--tls",
                           "--kv-events",
                           "--kv-events-replay",
                           "--block-bytes",
                           "--cpu-bytes",
                           "--cpu-policy",
                           "--huge-pages",
                           "--shm-dir",
                           "--ssd-dir",
                           "--ssd-bytes",
                           "--ssd-policy",
                           "--cascade",
                           "--auth-token",
                           "--auth-token-file",
                           "--max-keys-per-request",
                           "--max-batch-bytes",
                           "--lease-timeout-ms",
                           "--spin-us",
                           "--progress-threads",
                           "--metrics-address",
                           "--namespace-quota",
                           "--default-namespace-quota",
                           "--log-level",
                           "SIGTERM"}) {
    EXPECT_THAT(r.out, HasSubstr(flag));
  }
}

// The VmFlags lines (/proc/PID/smaps) of the readable mappings of `pid` of `bytes` or more.
std::vector<std::string> FlagsOfMappingsOfAtLeast(pid_t pid, size_t bytes) {
  std::ifstream smaps("/proc/" + std::to_string(pid) + "/smaps");
  std::vector<std::string> flags;
  size_t size_kib = 0;
  for (std::string line; std::getline(smaps, line);) {
    if (line.rfind("Size:", 0) == 0) size_kib = std::stoull(line.substr(5));
    if (line.rfind("VmFlags:", 0) == 0 && size_kib * 1024 >= bytes &&
        line.find(" rd ") != std::string::npos) {
      flags.push_back(line + " ");
    }
  }
  return flags;
}

// The CPU tier is in 4 KiB pages unless --huge-pages asks for huge ones, whatever allocates it:
// UCX backs memory for TCP alone with transparent huge pages, and a System V segment (the
// default transports) takes the shared-memory setting. The kernel's advice flags of the tier's
// mapping say it: `nh` (no huge pages) or `hg`.
TEST(KvstashdTest, TheCpuTierTakesHugePagesOnlyWhenAsked) {
  constexpr size_t kTier = size_t{64} << 20;
  struct Case {
    std::vector<std::string> args;
    const char* flag;
  };
  const std::vector<Case> cases = {
      {{"--tls", "tcp"}, " nh "},
      {{"--tls", "tcp", "--huge-pages"}, " hg "},
      {{}, " nh "},
  };
  for (const Case& c : cases) {
    std::vector<std::string> args = {"--block-bytes", "64KiB", "--cpu-bytes", "64MiB"};
    args.insert(args.end(), c.args.begin(), c.args.end());
    Daemon daemon(args, /*sizes=*/false);
    ASSERT_NE(daemon.port(), 0);
    const std::vector<std::string> flags = FlagsOfMappingsOfAtLeast(daemon.process().pid(), kTier);
    ASSERT_FALSE(flags.empty()) << ::testing::PrintToString(c.args);
    for (const std::string& line : flags) {
      EXPECT_THAT(line, HasSubstr(c.flag)) << ::testing::PrintToString(c.args);
    }
    EXPECT_EQ(daemon.process().Kill(SIGTERM), 0);
  }
}

// --cpu-bytes is checked against what the machine can give, but where a System V segment holds
// the tier (UCX's first choice) /dev/shm's size does not matter: a container's 64 MiB /dev/shm
// serves a larger tier. Run with a 64 MiB tmpfs on /dev/shm in private namespaces (then taken
// away again for the tests after this one in the same process).
TEST(KvstashdTest, ATierASystemVSegmentHoldsStartsWhateverTheSizeOfDevShm) {
  std::string why;
  if (!::kvstash::testing::EnterPrivateNamespaces(&why) ||
      !::kvstash::testing::MountTmpfs("/dev/shm", 64 << 20, &why)) {
    GTEST_SKIP() << why;
  }
  struct Unmount {
    ~Unmount() { umount2("/dev/shm", MNT_DETACH); }
  } unmount;
  {
    Daemon daemon({"--cpu-bytes", "128MiB"}, /*sizes=*/false);
    EXPECT_NE(daemon.port(), 0);
    EXPECT_EQ(daemon.process().Kill(SIGTERM), 0);
  }
  EXPECT_THAT(::kvstash::testing::EntriesUnder("/dev/shm"), ::testing::IsEmpty());
}

}  // namespace
}  // namespace kvstash
