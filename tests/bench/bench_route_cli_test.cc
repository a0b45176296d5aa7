// `kvstash bench route` on a small generated trace (conversations growing turn by turn behind a
// shared system prompt): it starts its own clusters (real kvstashd, kvstash-engine and
// kvstash-router processes), runs both policies and the run without a cache, and reports every
// completion identical to it, none failed, and figures that add up; bad input exits 2 or 1
// naming what is wrong.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <string>
#include <vector>

#include "nlohmann/json.hpp"
#include "subprocess.h"
#include "temp_dir.h"

namespace kvstash {
namespace {

using ::kvstash::testing::RunProcess;
using ::kvstash::testing::TempDir;
using ::testing::HasSubstr;
using Json = nlohmann::json;

// Three conversations of six turns, each turn two blocks longer, all behind one system prompt
// of four blocks; interleaved, as concurrent users are.
std::string WriteTrace(const TempDir& dir) {
  const std::string path = dir.path() + "/trace.jsonl";
  std::ofstream out(path);
  uint64_t next = 100;
  std::vector<std::vector<uint64_t>> sessions(3, std::vector<uint64_t>{0, 1, 2, 3});
  for (int turn = 0; turn < 6; ++turn) {
    for (auto& s : sessions) {
      s.push_back(next++);
      s.push_back(next++);
      Json line = {{"timestamp", turn * 100},
                   {"input_length", s.size() * 512 - 100},
                   {"output_length", 4},
                   {"hash_ids", s}};
      out << line.dump() << "\n";
    }
  }
  return path;
}

TEST(BenchRouteCliTest, BothPoliciesGiveTheTokensOfARunWithoutACache) {
  TempDir dir;
  const std::string trace = WriteTrace(dir);
  const auto r = RunProcess({KVSTASH_CLI_PATH, "bench", "route", "--trace", trace, "--json",
                             "--quiet", "--node-bytes", "16MiB", "--max-tokens", "3"});
  ASSERT_EQ(r.exit_code, 0) << r.err << r.out;
  const Json out = Json::parse(r.out);
  EXPECT_EQ(out["requests"], 18);
  const uint64_t prompt_tokens = out["prompt_tokens"];
  ASSERT_EQ(out["runs"].size(), 2u);
  for (const Json& run : out["runs"]) {
    SCOPED_TRACE(run.dump());
    EXPECT_EQ(run["failed"], 0);
    EXPECT_EQ(run["mismatches"], 0);
    EXPECT_EQ(run["requests"], 18);
    EXPECT_EQ(run["prompt_tokens"].get<uint64_t>(), prompt_tokens);
    // Every later turn reuses the system prompt and the turns before it: fewer tokens computed
    // than the prompts hold, and some taken from the nodes or a worker's own cache.
    EXPECT_LT(run["computed_tokens"].get<uint64_t>(), prompt_tokens);
    EXPECT_GT(run["node_tokens"].get<uint64_t>() + run["local_hit_tokens"].get<uint64_t>(), 0u);
    EXPECT_GT(run["ttft_p50_ms"].get<double>(), 0);
  }
  EXPECT_EQ(out["runs"][0]["policy"], "kv");
  EXPECT_EQ(out["runs"][1]["policy"], "round-robin");
  EXPECT_EQ(out["runs"][1]["skipped_prefills"], 0);  // round-robin prefills every request
  EXPECT_TRUE(out["kv_saved_vs_round_robin"].is_number());
}

TEST(BenchRouteCliTest, BadInputIsNamed) {
  TempDir dir;
  const auto missing =
      RunProcess({KVSTASH_CLI_PATH, "bench", "route", "--trace", dir.path() + "/none.jsonl"});
  EXPECT_NE(missing.exit_code, 0);
  EXPECT_THAT(missing.err, HasSubstr("none.jsonl"));
  const std::string bad = dir.path() + "/bad.jsonl";
  std::ofstream(bad)
      << R"({"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]})"
      << "\n"
      << "not json\n";
  const auto malformed = RunProcess({KVSTASH_CLI_PATH, "bench", "route", "--trace", bad});
  EXPECT_EQ(malformed.exit_code, 2) << malformed.err;
  EXPECT_THAT(malformed.err, HasSubstr("bad.jsonl:2"));
  const auto policy =
      RunProcess({KVSTASH_CLI_PATH, "bench", "route", "--trace", bad, "--policy", "random"});
  EXPECT_EQ(policy.exit_code, 2) << policy.err;
}

}  // namespace
}  // namespace kvstash
