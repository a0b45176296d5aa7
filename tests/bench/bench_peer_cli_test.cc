// `kvstash bench peer` as users run it, on one small cell: a short run against every store it
// starts (kvstashd, memcached, redis-server) carries every figure, ratio and per-system outcome
// in its JSON, consistent with one another, and exits 0 when no load had an error; a peer that
// returns other bytes than were stored (the --tamper-every hook stores them behind the bench's
// back) is counted as content mismatches and exits 1; bad arguments exit 2 naming the value; a
// store that cannot start exits 1 naming it; SIGINT stops the stores it started. Timings and ratios
// are never asserted: only that they are there.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "nlohmann/json.hpp"
#include "programs.h"
#include "subprocess.h"

namespace kvstash {
namespace {

using ::testing::HasSubstr;
using testing::RunProcess;
using Json = nlohmann::json;
using namespace std::chrono_literals;

const std::string kKvstash = testing::CliPath();
const std::string kKvstashd = testing::KvstashdPath();
const std::vector<std::string> kSystems = {"kvstash_tcp", "kvstash_stream", "memcached_tcp",
                                           "redis_tcp",   "kvstash_shm",    "redis_unix"};

// One small cell (blocks of 64 KiB from 2 clients), one round of half a second, small stores.
std::vector<std::string> ShortRun(std::vector<std::string> extra,
                                  const std::string& seconds = "0.5") {
  std::vector<std::string> argv = {
      kKvstash,   "bench",      "peer",      "--sizes", "64KiB",       "--clients", "2",
      "--rounds", "1",          "--seconds", seconds,   "--cpu-bytes", "64MiB",     "--delay-s",
      "0.05",     "--kvstashd", kKvstashd,   "--json",  "--quiet"};
  argv.insert(argv.end(), extra.begin(), extra.end());
  return argv;
}

Json ParseJson(const ProcessOutput& r) {
  // Exactly one JSON object on stdout: parse rejects anything around it.
  Json doc = Json::parse(r.out, nullptr, false);
  EXPECT_TRUE(doc.is_object()) << r.out << r.err;
  return doc.is_object() ? doc : Json::object();
}

double Number(const Json& doc, const std::string& name) {
  EXPECT_TRUE(doc.contains(name) && doc[name].is_number()) << name << " in " << doc.dump();
  if (!doc.contains(name) || !doc[name].is_number()) return -1;
  const double v = doc[name].get<double>();
  EXPECT_TRUE(std::isfinite(v) && v >= 0) << name << " = " << v;
  return v;
}

// A ratio of two figures: their quotient when both are positive, else null (harness.h).
void ExpectRatio(const Json& doc, const std::string& ratio, const std::string& of,
                 const std::string& to) {
  SCOPED_TRACE(ratio);
  ASSERT_TRUE(doc.contains(ratio));
  const double a = Number(doc, of), b = Number(doc, to);
  if (a > 0 && b > 0) {
    ASSERT_TRUE(doc[ratio].is_number()) << doc[ratio].dump();
    EXPECT_NEAR(doc[ratio].get<double>(), a / b, 1e-9 * (a / b));
  } else {
    EXPECT_TRUE(doc[ratio].is_null()) << doc[ratio].dump();
  }
}

// How fast each store goes, and whether a kvstash node starved of CPU misses a deadline, is the
// stores' business and never decides this test; the bench's is asserted: every figure there
// and equal to what its outcome says, every ratio the quotient of its figures, the peers'
// loads without errors and every load without a mismatch, and the exit status 0 exactly when no
// load had an error (on an idle machine there is none).
TEST(BenchPeerCliTest, ShortRunCarriesEveryFigure) {
  const ProcessOutput r = RunProcess(ShortRun({}));
  const Json doc = ParseJson(r);
  ASSERT_TRUE(doc.contains("errors")) << r.out << r.err;
  EXPECT_EQ(r.exit_code, doc.at("errors") == 0 ? 0 : 1) << r.err;
  EXPECT_EQ(doc.at("bench"), "peer");
  EXPECT_EQ(doc.at("rounds"), 1);
  EXPECT_EQ(doc.at("block_sizes"), Json::array({65536}));
  EXPECT_EQ(doc.at("clients"), Json::array({2}));
  EXPECT_EQ(doc.at("systems"), Json(kSystems));
  uint64_t errors = 0;
  for (const std::string& system : kSystems) {
    SCOPED_TRACE(system);
    const Json& outcome = doc.at("outcomes").at(system);
    // One round: the figure is the outcome's blocks over its seconds.
    const double seconds = outcome.at("seconds").get<double>();
    ASSERT_GT(seconds, 0.0);
    const double blocks = outcome.at("puts").get<double>() + outcome.at("gets").get<double>();
    EXPECT_NEAR(Number(doc, system + "_64KiB_x2"), blocks * 65536 / seconds / 1e9, 1e-9);
    EXPECT_EQ(outcome.at("mismatches"), 0);
    errors += outcome.at("errors").get<uint64_t>();
    if (system.starts_with("kvstash")) {
      if (outcome.at("errors") != 0) {
        std::cout << system
                  << " had errors (kvstash's, not the bench's): " << outcome.at("first_error")
                  << "\n";
      }
    } else {
      EXPECT_EQ(outcome.at("errors"), 0) << outcome.at("first_error");
      EXPECT_GT(blocks, 0);
    }
  }
  EXPECT_EQ(doc.at("errors"), errors);
  EXPECT_EQ(doc.at("mismatches"), 0);
  EXPECT_GT(Number(doc, "copy_limit_64KiB_x2"), 0);
  // The best TCP peer is the faster of the two in the round.
  EXPECT_DOUBLE_EQ(
      Number(doc, "best_tcp_peer_64KiB_x2"),
      std::max(Number(doc, "memcached_tcp_64KiB_x2"), Number(doc, "redis_tcp_64KiB_x2")));
  ExpectRatio(doc, "tcp_ratio_64KiB_x2", "kvstash_tcp_64KiB_x2", "best_tcp_peer_64KiB_x2");
  ExpectRatio(doc, "stream_ratio_64KiB_x2", "kvstash_stream_64KiB_x2", "best_tcp_peer_64KiB_x2");
  ExpectRatio(doc, "shm_ratio_64KiB_x2", "kvstash_shm_64KiB_x2", "redis_unix_64KiB_x2");
  ExpectRatio(doc, "shm_copy_ratio_64KiB_x2", "kvstash_shm_64KiB_x2", "copy_limit_64KiB_x2");
  // The round's order: every system and the copy limit once.
  ASSERT_EQ(doc.at("orders").size(), 1u);
  EXPECT_EQ(doc.at("orders")[0].size(), kSystems.size() + 1);
}

TEST(BenchPeerCliTest, PeerReturningOtherBytesIsCountedAsMismatches) {
  // Every other block a peer stores is stored again with a byte changed inside a page (where
  // only the word-for-word check looks, made on every read here).
  const ProcessOutput r = RunProcess(ShortRun({"--systems", "memcached-tcp,redis-tcp,redis-unix",
                                               "--tamper-every", "2", "--check-every", "1"}));
  EXPECT_EQ(r.exit_code, 1) << r.out << r.err;
  const Json doc = ParseJson(r);
  ASSERT_TRUE(doc.contains("outcomes")) << r.out << r.err;
  for (const char* peer : {"memcached_tcp", "redis_tcp", "redis_unix"}) {
    SCOPED_TRACE(peer);
    const Json& outcome = doc.at("outcomes").at(peer);
    EXPECT_GT(outcome.at("mismatches").get<uint64_t>(), 0u);
    EXPECT_EQ(outcome.at("errors"), 0);
  }
  EXPECT_GT(doc.at("mismatches").get<uint64_t>(), 0u);
}

TEST(BenchPeerCliTest, ClientsThatCrashCostTheirMeasurementNotTheRun) {
  // Each measurement's clients run in a process of their own; here every one aborts before it
  // reports: each measurement is an error with no figure, and the run goes on to the end.
  const ProcessOutput r =
      RunProcess(ShortRun({"--systems", "memcached-tcp,redis-tcp", "--abort-clients"}));
  EXPECT_EQ(r.exit_code, 1) << r.out << r.err;
  const Json doc = ParseJson(r);
  ASSERT_TRUE(doc.contains("outcomes")) << r.out << r.err;
  for (const char* peer : {"memcached_tcp", "redis_tcp"}) {
    SCOPED_TRACE(peer);
    const Json& outcome = doc.at("outcomes").at(peer);
    EXPECT_EQ(outcome.at("errors"), 1);
    EXPECT_THAT(outcome.at("first_error").get<std::string>(), HasSubstr("signal 6"));
    EXPECT_TRUE(doc.at(std::string(peer) + "_64KiB_x2").is_null());
  }
  EXPECT_EQ(doc.at("errors"), 2);
  EXPECT_GT(doc.at("copy_limit_64KiB_x2").get<double>(), 0.0);
}

TEST(BenchPeerCliTest, BadArgumentsExit2NamingTheValue) {
  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  for (const Case& c : std::vector<Case>{
           {{"--systems", "kvstash-tcp,mysql"}, "'mysql'"},
           {{"--sizes", "3000"}, "3000"},
           {{"--clients", "0"}, "--clients: 0"},
           {{"--sizes", "2MiB", "--cpu-bytes", "4MiB"}, "--cpu-bytes: 4MiB"},
       }) {
    std::vector<std::string> argv = {kKvstash, "bench", "peer"};
    argv.insert(argv.end(), c.args.begin(), c.args.end());
    const ProcessOutput r = RunProcess(argv);
    EXPECT_EQ(r.exit_code, 2) << c.message << ": " << r.err;
    EXPECT_THAT(r.err, HasSubstr(c.message));
  }
}

TEST(BenchPeerCliTest, StoreThatCannotStartExits1NamingIt) {
  const ProcessOutput r = RunProcess(
      ShortRun({"--systems", "redis-tcp", "--redis-server", "/nonexistent/redis-server"}));
  EXPECT_EQ(r.exit_code, 1) << r.out << r.err;
  EXPECT_THAT(r.err, HasSubstr("/nonexistent/redis-server"));
}

// The children of `parent` now, from /proc.
std::vector<pid_t> ChildrenOf(pid_t parent) {
  std::vector<pid_t> children;
  std::ifstream list("/proc/" + std::to_string(parent) + "/task/" + std::to_string(parent) +
                     "/children");
  for (pid_t pid = 0; list >> pid;) children.push_back(pid);
  return children;
}

bool Alive(pid_t pid) { return kill(pid, 0) == 0; }

// The target of /proc/PID/NAME (exe, cwd), or empty.
std::string ProcLink(pid_t pid, const char* name) {
  std::error_code error;
  const auto target =
      std::filesystem::read_symlink("/proc/" + std::to_string(pid) + "/" + name, error);
  return error ? std::string() : target.string();
}

TEST(BenchPeerCliTest, SigintStopsTheStoresItStarted) {
  std::vector<std::string> argv = ShortRun({"--systems", "redis-tcp"}, "60");
  ChildOptions options;
  options.output = ChildOptions::Output::kMemory;
  options.merge_stderr = true;
  auto bench = ChildProcess::Create(argv, options);
  ASSERT_TRUE(bench.ok()) << bench.status().ToString();
  // Wait (bounded) for the bench's redis-server to be in the bench's scratch directory (its
  // --dir, where it changes directory as it starts; the bench's other child is its clients'
  // process).
  std::optional<pid_t> store;
  std::string dir;
  for (const auto deadline = std::chrono::steady_clock::now() + 20s;
       !store && !(*bench)->Exited() && std::chrono::steady_clock::now() < deadline;) {
    for (const pid_t child : ChildrenOf((*bench)->pid())) {
      const std::string cwd = ProcLink(child, "cwd");
      if (ProcLink(child, "exe").find("redis") != std::string::npos &&
          cwd.find("kvstash-bench-peer-") != std::string::npos) {
        store = child;
        dir = cwd;
      }
    }
    if (!store) std::this_thread::sleep_for(10ms);
  }
  ASSERT_TRUE(store.has_value()) << (*bench)->Output();
  ASSERT_EQ(access(dir.c_str(), F_OK), 0) << dir;
  ASSERT_EQ(kill((*bench)->pid(), SIGINT), 0);
  const int status = (*bench)->Wait(20000ms);
  EXPECT_EQ(status, 1) << (*bench)->Output();
  EXPECT_THAT((*bench)->Output(), HasSubstr("interrupted"));
  // The bench cleaned up before it exited (not killed by the signal): the store is gone and so
  // is the scratch directory.
  EXPECT_FALSE(Alive(*store)) << "store " << *store << " outlived the bench";
  EXPECT_NE(access(dir.c_str(), F_OK), 0) << dir << " is left behind";
}

}  // namespace
}  // namespace kvstash
