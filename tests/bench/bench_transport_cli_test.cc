// `kvstash bench transport` as users run it: tiny put, get and rpc runs over shared memory and
// TCP whose JSON carries every figure, --no-perftest, and the usage errors that must name the
// flag. Timings and ratios are never asserted: only that they are there and make sense.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "nlohmann/json.hpp"
#include "subprocess.h"

namespace kvstash {
namespace {

using ::testing::HasSubstr;
using testing::RunProcess;

const std::string kKvstash = KVSTASH_CLI_PATH;

void ExpectPositiveFinite(const nlohmann::json& v, const std::string& name) {
  ASSERT_TRUE(v.is_number()) << name << " is " << v.dump();
  EXPECT_TRUE(std::isfinite(v.get<double>())) << name;
  EXPECT_GT(v.get<double>(), 0.0) << name;
}

// Runs `kvstash bench transport ARGS --json` and returns its one JSON object.
nlohmann::json RunJson(const std::vector<std::string>& args) {
  std::vector<std::string> argv = {kKvstash, "bench", "transport"};
  argv.insert(argv.end(), args.begin(), args.end());
  argv.push_back("--json");
  auto r = RunProcess(argv);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  // Exactly one JSON object on stdout: parse rejects anything around it.
  nlohmann::json doc = nlohmann::json::parse(r.out, nullptr, false);
  EXPECT_FALSE(doc.is_discarded()) << r.out << r.err;
  EXPECT_TRUE(doc.is_object()) << r.out;
  return doc.is_object() ? doc : nlohmann::json::object();
}

class BenchTransportCliTest : public ::testing::TestWithParam<std::string> {};

TEST_P(BenchTransportCliTest, PutAndGetJsonCarryEveryFigure) {
  for (const char* op : {"put", "get"}) {
    SCOPED_TRACE(op);
    const nlohmann::json doc = RunJson(
        {"--op", op, "--size", "64K", "--tls", GetParam(), "--iters", "50", "--rounds", "1"});
    ASSERT_FALSE(doc.empty());
    EXPECT_EQ(doc.at("op"), op);
    EXPECT_EQ(doc.at("size"), 65536);
    EXPECT_EQ(doc.at("tls"), GetParam());
    EXPECT_EQ(doc.at("window"), 8);
    EXPECT_EQ(doc.at("iters"), 50);
    EXPECT_EQ(doc.at("warmup"), 5);
    EXPECT_EQ(doc.at("rounds"), 1);
    EXPECT_EQ(doc.at("perftest_test"), "ucp_am_bw");
    for (const char* name : {"gbps", "perftest_gbps", "ratio", "p50_us", "p99_us"}) {
      ASSERT_TRUE(doc.contains(name)) << name;
      ExpectPositiveFinite(doc[name], name);
    }
    EXPECT_GE(doc["p99_us"].get<double>(), doc["p50_us"].get<double>());
    EXPECT_NEAR(doc["ratio"].get<double>(),
                doc["gbps"].get<double>() / doc["perftest_gbps"].get<double>(), 1e-9);
    for (const char* name : {"rounds_gbps", "rounds_perftest_gbps", "rounds_p50_us"}) {
      ASSERT_TRUE(doc.contains(name)) << name;
      ASSERT_EQ(doc[name].size(), 1u) << name;
    }
    // With one round the median is that round.
    EXPECT_EQ(doc["rounds_gbps"][0], doc["gbps"]);
    EXPECT_EQ(doc["rounds_perftest_gbps"][0], doc["perftest_gbps"]);
  }
}

TEST_P(BenchTransportCliTest, RpcReportsLatency) {
  const nlohmann::json doc =
      RunJson({"--op", "rpc", "--tls", GetParam(), "--iters", "100", "--rounds", "1"});
  ASSERT_FALSE(doc.empty());
  EXPECT_EQ(doc.at("op"), "rpc");
  EXPECT_EQ(doc.at("size"), 32);
  EXPECT_EQ(doc.at("window"), 1);
  EXPECT_EQ(doc.at("perftest_test"), "ucp_am_lat");
  ExpectPositiveFinite(doc.at("p50_us"), "p50_us");
  ExpectPositiveFinite(doc.at("p99_us"), "p99_us");
  EXPECT_GE(doc["p99_us"].get<double>(), doc["p50_us"].get<double>());
  ExpectPositiveFinite(doc.at("calls_per_s"), "calls_per_s");
  ExpectPositiveFinite(doc.at("perftest_round_trip_us"), "perftest_round_trip_us");
  ExpectPositiveFinite(doc.at("ratio"), "ratio");
  EXPECT_TRUE(doc.at("perftest_gbps").is_null());
}

TEST_P(BenchTransportCliTest, SyncRpcCallsFromTheMainThread) {
  const nlohmann::json doc = RunJson({"--op", "rpc", "--sync", "--tls", GetParam(), "--iters",
                                      "200", "--rounds", "2", "--no-perftest"});
  ASSERT_FALSE(doc.empty());
  EXPECT_EQ(doc.at("sync"), true);
  ExpectPositiveFinite(doc.at("p50_us"), "p50_us");
  EXPECT_GE(doc["p99_us"].get<double>(), doc["p50_us"].get<double>());
  ExpectPositiveFinite(doc.at("calls_per_s"), "calls_per_s");
  ASSERT_EQ(doc.at("rounds_p50_us").size(), 2u);
}

INSTANTIATE_TEST_SUITE_P(Transports, BenchTransportCliTest, ::testing::Values("shm", "tcp"),
                         [](const auto& param_info) { return param_info.param; });

TEST(BenchTransportCliStandaloneTest, NoPerftestLeavesPerftestFiguresNull) {
  const nlohmann::json doc = RunJson({"--op", "put", "--size", "4K", "--iters", "20", "--warmup",
                                      "0", "--window", "2", "--rounds", "2", "--no-perftest"});
  ASSERT_FALSE(doc.empty());
  ExpectPositiveFinite(doc.at("gbps"), "gbps");
  EXPECT_EQ(doc.at("window"), 2);
  EXPECT_EQ(doc.at("warmup"), 0);
  EXPECT_TRUE(doc.at("perftest_gbps").is_null());
  EXPECT_TRUE(doc.at("ratio").is_null());
  EXPECT_TRUE(doc.at("perftest_test").is_null());
  ASSERT_EQ(doc.at("rounds_perftest_gbps").size(), 2u);
  EXPECT_TRUE(doc["rounds_perftest_gbps"][0].is_null());
  EXPECT_EQ(doc.at("rounds_gbps").size(), 2u);
}

TEST(BenchTransportCliStandaloneTest, DistinctBuffersGiveEachCallInTheWindowItsOwn) {
  for (const char* op : {"put", "get"}) {
    const nlohmann::json doc =
        RunJson({"--op", op, "--size", "64K", "--iters", "40", "--window", "4", "--rounds", "1",
                 "--distinct-buffers", "--no-perftest"});
    ASSERT_FALSE(doc.empty()) << op;
    EXPECT_EQ(doc.at("distinct_buffers"), true) << op;
    ExpectPositiveFinite(doc.at("gbps"), "gbps");
  }
  const nlohmann::json shared =
      RunJson({"--op", "put", "--size", "64K", "--iters", "20", "--rounds", "1", "--no-perftest"});
  EXPECT_EQ(shared.at("distinct_buffers"), false);
}

TEST(BenchTransportCliStandaloneTest, TableShowsMediansAndEveryRound) {
  auto r = RunProcess({kKvstash, "bench", "transport", "--op", "get", "--size", "1M", "--iters",
                       "10", "--rounds", "2", "--no-perftest"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("GB/s"));
  EXPECT_THAT(r.out, HasSubstr("round 1 (kvstash first)"));
  EXPECT_THAT(r.out, HasSubstr("round 2 (perftest first)"));
}

TEST(BenchTransportCliStandaloneTest, BadUsageExitsTwoNamingTheFlag) {
  struct Case {
    std::vector<std::string> args;
    std::string flag;
  };
  const std::vector<Case> cases = {
      {{"--op", "foo", "--size", "64K"}, "--op"},
      {{"--op", "put", "--size", "0"}, "--size"},
      {{"--op", "put", "--size", "1T"}, "--size"},
      {{"--op", "put", "--size", "65M"}, "--size"},
      {{"--op", "get", "--size", "abc"}, "--size"},
      {{"--op", "put"}, "--size"},
      {{"--op", "put", "--size", "64K", "--tls", "ib"}, "--tls"},
      {{"--op", "put", "--size", "64K", "--window", "0"}, "--window"},
      {{"--op", "rpc", "--window", "4"}, "--window"},
      {{"--op", "put", "--size", "64K", "--rounds", "0"}, "--rounds"},
      {{"--op", "put", "--size", "64K", "--iters", "-3"}, "--iters"},
      {{"--op", "put", "--size", "64K", "--iters", "0"}, "--iters"},
      {{"--op", "put", "--size", "64K", "--warmup", "-1"}, "--warmup"},
      {{"--op", "put", "--size", "64K", "--iters", "many"}, "--iters"},
      {{"--size", "64K"}, "--op"},
      {{"--op", "put", "--size", "64K", "--sync"}, "--sync"},
      {{"--op", "rpc", "--distinct-buffers"}, "--distinct-buffers"},
      {{"--op", "put", "--size", "64M", "--window", "64", "--distinct-buffers"}, "--window"},
  };
  for (const Case& c : cases) {
    std::vector<std::string> argv = {kKvstash, "bench", "transport"};
    argv.insert(argv.end(), c.args.begin(), c.args.end());
    argv.push_back("--no-perftest");
    auto r = RunProcess(argv);
    const std::string what = ::testing::PrintToString(c.args);
    EXPECT_EQ(r.exit_code, 2) << what << ": " << r.err;
    EXPECT_THAT(r.err, HasSubstr(c.flag)) << what;
    EXPECT_EQ(r.out, "") << what;
  }
}

TEST(BenchTransportCliStandaloneTest, HelpExplainsTheComparison) {
  auto r = RunProcess({kKvstash, "bench", "transport", "--help"});
  EXPECT_EQ(r.exit_code, 0);
  for (const char* text : {"--op", "--size", "--tls", "--iters", "--warmup", "--window", "--rounds",
                           "--json", "--no-perftest", "--sync", "--distinct-buffers", "ucp_am_bw",
                           "ucp_am_lat", "UCX_TLS", "ratio"}) {
    EXPECT_THAT(r.out, HasSubstr(text));
  }
}

}  // namespace
}  // namespace kvstash
