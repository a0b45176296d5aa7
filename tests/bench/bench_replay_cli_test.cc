// `kvstash bench replay` against a real `kvstashd`: on a generated production-like trace
// (conversations growing turn by turn behind a few shared system prompts, one-off requests,
// popular sessions coming back), the node's block hit ratio must be within 0.01 of the model of
// the node's own policy that the tool computes, and of an independent LRU model written here
// (per request: the hit is the leading run present; then every block is touched, the first key
// most recent; misses are stored; victims are chosen outside the request). Every block read back
// must be the one stored (a wrong block planted on the node is caught), and bad input exits 2
// naming the line.
//
// KVSTASH_REPLAY_TRACE=FILE replays that trace instead (a Mooncake-format trace, say), at
// KVSTASH_REPLAY_BLOCKS blocks of CPU tier (default 8192), and prints the figures.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <list>
#include <random>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include "daemon_process.h"
#include "nlohmann/json.hpp"
#include "subprocess.h"
#include "temp_dir.h"

namespace kvstash {
namespace {

using ::kvstash::testing::Daemon;
using ::kvstash::testing::RunProcess;
using ::kvstash::testing::TempDir;
using ::testing::HasSubstr;
using Json = nlohmann::json;

const std::string kKvstash = KVSTASH_CLI_PATH;
constexpr size_t kBlockBytes = 4096;

struct Request {
  uint64_t timestamp_ms = 0;
  uint64_t input_length = 0;
  std::vector<uint64_t> ids;
};

// A production-like trace: sessions open behind one of a few system prompts and grow by a few
// blocks a turn; popular sessions come back often (a Zipf-like choice), some requests are
// one-offs. Ids are a trie: a block's id names its whole prefix.
std::vector<Request> GenerateTrace(size_t requests, uint64_t seed) {
  std::mt19937_64 random(seed);
  uint64_t next_id = 0;
  std::vector<std::vector<uint64_t>> systems(4);
  for (auto& s : systems) {
    const size_t blocks = 3 + random() % 6;
    for (size_t i = 0; i < blocks; ++i) s.push_back(next_id++);
  }
  std::vector<std::vector<uint64_t>> sessions;
  std::vector<Request> trace;
  for (size_t r = 0; r < requests; ++r) {
    Request req;
    req.timestamp_ms = r * 5;
    const uint64_t kind = random() % 10;
    if (kind == 0 || sessions.empty()) {
      // A one-off request, or a new session.
      std::vector<uint64_t> ids = systems[random() % systems.size()];
      const size_t own = 1 + random() % 6;
      for (size_t i = 0; i < own; ++i) ids.push_back(next_id++);
      if (random() % 2 == 0) sessions.push_back(ids);
      req.ids = ids;
    } else {
      // A session comes back: the lower indexes far more often.
      const double u = std::uniform_real_distribution<double>(0, 1)(random);
      const size_t s =
          std::min(sessions.size() - 1, static_cast<size_t>(std::pow(u, 3) * sessions.size()));
      const size_t turn = 1 + random() % 4;
      for (size_t i = 0; i < turn && sessions[s].size() < 120; ++i) {
        sessions[s].push_back(next_id++);
      }
      req.ids = sessions[s];
    }
    req.input_length = req.ids.size() * 512 - random() % 400;
    trace.push_back(std::move(req));
  }
  return trace;
}

std::string WriteTrace(const TempDir& dir, const std::vector<Request>& trace) {
  const std::string path = dir / "trace.jsonl";
  std::ofstream out(path);
  for (const Request& r : trace) {
    out << Json{{"timestamp", r.timestamp_ms},
                {"input_length", r.input_length},
                {"output_length", 8},
                {"hash_ids", r.ids}}
               .dump()
        << "\n";
  }
  return path;
}

std::vector<Request> ReadTrace(const std::string& path) {
  std::ifstream in(path);
  std::vector<Request> trace;
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    const Json doc = Json::parse(line);
    trace.push_back({doc["timestamp"].get<uint64_t>(), doc["input_length"].get<uint64_t>(),
                     doc["hash_ids"].get<std::vector<uint64_t>>()});
  }
  return trace;
}

// The independent model: a plain LRU list of `capacity` blocks.
// LRU over the trace as the replay drives it: a request stores its full blocks (input_length /
// 512 of them), or every block with `partial` (--store-partial).
double LruHitRatio(const std::vector<Request>& trace, size_t capacity, bool partial = false) {
  std::list<uint64_t> order;  // most recent first
  std::unordered_map<uint64_t, std::list<uint64_t>::iterator> where;
  uint64_t refs = 0, hits = 0;
  for (const Request& r : trace) {
    size_t hit = 0;
    while (hit < r.ids.size() && where.contains(r.ids[hit])) ++hit;
    refs += r.ids.size();
    hits += hit;
    // Store the misses, evicting the least recent blocks outside the request.
    const std::unordered_set<uint64_t> request(r.ids.begin(), r.ids.end());
    const size_t stored =
        partial ? r.ids.size() : std::min<size_t>(r.ids.size(), r.input_length / 512);
    for (size_t i = stored; i-- > 0;) {
      const uint64_t id = r.ids[i];
      if (where.contains(id)) continue;
      if (where.size() >= capacity) {
        auto victim = order.end();
        for (auto it = std::prev(order.end());; --it) {
          if (!request.contains(*it)) {
            victim = it;
            break;
          }
          if (it == order.begin()) break;
        }
        if (victim == order.end()) continue;  // everything held is this request's
        where.erase(*victim);
        order.erase(victim);
      }
      order.push_front(id);
      where[id] = order.begin();
    }
    // Every block of the request used: the first key most recent.
    for (size_t i = r.ids.size(); i-- > 0;) {
      auto it = where.find(r.ids[i]);
      if (it != where.end()) order.splice(order.begin(), order, it->second);
    }
  }
  return refs == 0 ? 0 : static_cast<double>(hits) / static_cast<double>(refs);
}

double InfiniteHitRatio(const std::vector<Request>& trace) {
  std::unordered_set<uint64_t> seen;
  uint64_t refs = 0, hits = 0;
  for (const Request& r : trace) {
    size_t hit = 0;
    while (hit < r.ids.size() && seen.contains(r.ids[hit])) ++hit;
    refs += r.ids.size();
    hits += hit;
    seen.insert(r.ids.begin(), r.ids.end());
  }
  return static_cast<double>(hits) / static_cast<double>(refs);
}

std::unique_ptr<Daemon> Node(size_t blocks, const std::string& policy) {
  auto node = std::make_unique<Daemon>(
      std::vector<std::string>{"--block-bytes", std::to_string(kBlockBytes), "--cpu-bytes",
                               std::to_string(blocks * kBlockBytes), "--cpu-policy", policy},
      /*sizes=*/false);
  EXPECT_NE(node->port(), 0);
  return node;
}

std::string Address(const Daemon& d) { return "127.0.0.1:" + std::to_string(d.port()); }

// The JSON summary on the last line of stdout.
Json Summary(const std::string& out) {
  const size_t end = out.find_last_not_of('\n');
  const size_t start = out.rfind('\n', end);
  return Json::parse(out.substr(start == std::string::npos ? 0 : start + 1), nullptr, false);
}

class BenchReplayTest : public ::testing::TestWithParam<std::string> {};

TEST_P(BenchReplayTest, HitRatioMatchesTheModelsAndEveryBlockReadsBack) {
  TempDir dir;
  std::string path;
  size_t blocks = 256;
  if (const char* given = std::getenv("KVSTASH_REPLAY_TRACE")) {
    path = given;
    blocks = 8192;
    if (const char* b = std::getenv("KVSTASH_REPLAY_BLOCKS")) blocks = std::stoul(b);
  } else {
    path = WriteTrace(dir, GenerateTrace(1500, 7));
  }
  const std::vector<Request> trace = ReadTrace(path);
  uint64_t refs = 0;
  for (const Request& r : trace) refs += r.ids.size();
  auto node = Node(blocks, GetParam());
  const auto r = RunProcess({kKvstash, "bench", "replay", "--trace", path, "--node", Address(*node),
                             "--lookup-budget-ms", "60000", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err << r.out;
  const Json s = Summary(r.out);
  ASSERT_FALSE(s.is_discarded()) << r.out;
  std::cout << s.dump(1) << "\n";
  EXPECT_EQ(s["requests"], trace.size());
  EXPECT_EQ(s["block_refs"], refs);
  EXPECT_EQ(s["errors"], 0);
  EXPECT_EQ(s["mismatches"], 0);
  EXPECT_EQ(s["capacity_blocks"], blocks);
  EXPECT_EQ(s["policy"], GetParam());
  const double measured = s["block_hit_ratio"].get<double>();
  EXPECT_NEAR(measured, s["model_block_hit_ratio"].get<double>(), 0.01);
  EXPECT_DOUBLE_EQ(s["infinite_cache_hit_ratio"].get<double>(), InfiniteHitRatio(trace));
  const double lru = LruHitRatio(trace, blocks);
  std::cout << "independent LRU model: " << lru << "\n";
  if (GetParam() == "lru") {
    EXPECT_NEAR(measured, lru, 0.01);
  }
  EXPECT_EQ(s["stored_blocks"], "full blocks");
  // The cache was small enough to matter and large enough to work.
  EXPECT_GT(measured, 0.05);
  if (std::getenv("KVSTASH_REPLAY_TRACE") == nullptr) {
    EXPECT_LT(measured, InfiniteHitRatio(trace) - 0.02);
  }
  EXPECT_GT(s["token_hit_ratio"].get<double>(), 0.0);
  EXPECT_GT(s["bytes_stored"].get<uint64_t>(), 0u);
  EXPECT_GT(s["bytes_read"].get<uint64_t>(), 0u);
  for (const char* field :
       {"lookup_p50_us", "lookup_p99_us", "read_p50_us", "read_p99_us", "store_p50_us",
        "store_p99_us", "gbps", "requests_per_s", "copy_limit_gbps", "ratio"}) {
    EXPECT_TRUE(s[field].is_number()) << field;
  }
}

INSTANTIATE_TEST_SUITE_P(Policies, BenchReplayTest, ::testing::Values("lru", "arc", "aflru"));

// --store-partial stores a request's last block too, as the replay did before it stored full
// blocks only: each mode's hit ratio follows an independent LRU that stores the same blocks,
// and the partial mode stores more bytes.
TEST(BenchReplayCliTest, StorePartialStoresTheLastBlockToo) {
  TempDir dir;
  const std::string path = WriteTrace(dir, GenerateTrace(1500, 7));
  const std::vector<Request> trace = ReadTrace(path);
  auto replay = [&](bool partial) {
    auto node = Node(256, "lru");
    std::vector<std::string> argv = {kKvstash, "bench",  "replay",       "--trace",
                                     path,     "--node", Address(*node), "--lookup-budget-ms",
                                     "60000",  "--json"};
    if (partial) argv.push_back("--store-partial");
    const auto r = RunProcess(argv);
    EXPECT_EQ(r.exit_code, 0) << r.err << r.out;
    return Summary(r.out);
  };
  const Json full = replay(false);
  const Json partial = replay(true);
  ASSERT_FALSE(full.is_discarded());
  ASSERT_FALSE(partial.is_discarded());
  EXPECT_EQ(full["stored_blocks"], "full blocks");
  EXPECT_EQ(partial["stored_blocks"], "every block");
  EXPECT_GT(partial["bytes_stored"].get<uint64_t>(), full["bytes_stored"].get<uint64_t>());
  for (const Json* s : {&full, &partial}) {
    EXPECT_DOUBLE_EQ((*s)["block_hit_ratio"].get<double>(),
                     (*s)["model_block_hit_ratio"].get<double>());
  }
  EXPECT_NEAR(partial["block_hit_ratio"].get<double>(), LruHitRatio(trace, 256, true), 0.01);
  EXPECT_NEAR(full["block_hit_ratio"].get<double>(), LruHitRatio(trace, 256, false), 0.01);
}

// A node under --cpu-admission adaptive (docs/semantics.md §2a) equals the model, which reads
// the node's admission from its stats.
TEST(BenchReplayCliTest, AdaptiveAdmissionLiveEqualsTheModel) {
  TempDir dir;
  const std::string path = WriteTrace(dir, GenerateTrace(1500, 7));
  auto node = std::make_unique<Daemon>(
      std::vector<std::string>{"--block-bytes", std::to_string(kBlockBytes), "--cpu-bytes",
                               std::to_string(256 * kBlockBytes), "--cpu-policy", "aflru",
                               "--cpu-admission", "adaptive"},
      /*sizes=*/false);
  ASSERT_NE(node->port(), 0);
  const auto r = RunProcess({kKvstash, "bench", "replay", "--trace", path, "--node", Address(*node),
                             "--lookup-budget-ms", "60000", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err << r.out;
  const Json s = Summary(r.out);
  EXPECT_EQ(s["admission"], "adaptive");
  EXPECT_EQ(s["policy"], "aflru");
  EXPECT_DOUBLE_EQ(s["block_hit_ratio"].get<double>(), s["model_block_hit_ratio"].get<double>());
  EXPECT_GT(s["block_hit_ratio"].get<double>(), 0.05);
}

// --model-only: no node, one row per policy and capacity; LRU's follows an independent LRU.
TEST(BenchReplayCliTest, ModelOnlyTablesPoliciesByCapacity) {
  TempDir dir;
  const std::string path = WriteTrace(dir, GenerateTrace(1500, 7));
  const std::vector<Request> trace = ReadTrace(path);
  const auto r = RunProcess({kKvstash, "bench", "replay", "--trace", path, "--model-only",
                             "--policy", "lru,aflru", "--capacity-blocks", "256,512", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const Json s = Summary(r.out);
  ASSERT_FALSE(s.is_discarded()) << r.out;
  EXPECT_EQ(s["layout"], "full");
  ASSERT_EQ(s["rows"].size(), 4u);
  for (const Json& row : s["rows"]) {
    const size_t blocks = row["capacity_blocks"].get<size_t>();
    EXPECT_TRUE(blocks == 256 || blocks == 512) << row.dump();
    if (row["policy"] == "lru") {
      EXPECT_NEAR(row["block_hit_ratio"].get<double>(), LruHitRatio(trace, blocks), 0.01);
    }
    EXPECT_DOUBLE_EQ(row["token_hit_ratio"].get<double>(),
                     row["blind_token_hit_ratio"].get<double>());
  }
  const auto bad = RunProcess({kKvstash, "bench", "replay", "--trace", path, "--model-only"});
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_THAT(bad.err, HasSubstr("--capacity-blocks or --capacity-share"));
  const auto layout = RunProcess({kKvstash, "bench", "replay", "--trace", path, "--model-only",
                                  "--capacity-blocks", "64", "--layout", "llama"});
  EXPECT_EQ(layout.exit_code, 2);
  EXPECT_THAT(layout.err, HasSubstr("unknown layout 'llama'"));
}

// A hybrid layout (docs/semantics.md §4b): the live node equals the model, the usable hit is at
// most the group-blind count, and a node told what each block is for hits at least as much as
// one that stores every block alike.
TEST(BenchReplayCliTest, HybridLayoutLiveEqualsTheModelAndSpareBlocksHelp) {
  TempDir dir;
  const std::string path = WriteTrace(dir, GenerateTrace(1500, 7));
  const auto sized =
      RunProcess({kKvstash, "bench", "replay", "--trace", path, "--model-only", "--policy", "lru",
                  "--layout", "qwen3-next-like", "--capacity-share", "0.25", "--json"});
  ASSERT_EQ(sized.exit_code, 0) << sized.err;
  const size_t blocks = Summary(sized.out)["rows"][0]["capacity_blocks"].get<size_t>();
  auto replay = [&](bool blind) {
    auto node = Node(blocks, "lru");
    std::vector<std::string> argv = {
        kKvstash, "bench",        "replay",   "--trace",         path,
        "--node", Address(*node), "--layout", "qwen3-next-like", "--lookup-budget-ms",
        "60000",  "--json"};
    if (blind) argv.push_back("--group-blind");
    const auto r = RunProcess(argv);
    EXPECT_EQ(r.exit_code, 0) << r.err << r.out;
    const Json s = Summary(r.out);
    EXPECT_EQ(s["mismatches"], 0);
    EXPECT_EQ(s["errors"], 0);
    EXPECT_DOUBLE_EQ(s["block_hit_ratio"].get<double>(), s["model_block_hit_ratio"].get<double>());
    EXPECT_DOUBLE_EQ(s["token_hit_ratio"].get<double>(), s["model_token_hit_ratio"].get<double>());
    EXPECT_LE(s["token_hit_ratio"].get<double>(), s["blind_token_hit_ratio"].get<double>());
    return s["token_hit_ratio"].get<double>();
  };
  const double aware = replay(false);
  const double blind = replay(true);
  std::cout << "usable token hit ratio: told " << aware << ", group-blind " << blind << "\n";
  EXPECT_GT(blind, 0.05);
  EXPECT_GE(aware, blind);
}

TEST(BenchReplayCliTest, ConcurrentReplayLosesNothingAndFollowsTheClockWithProgress) {
  TempDir dir;
  // 300 requests 5 ms apart at --speed 1: about 1.5 s, so a progress line shows.
  const std::string path = WriteTrace(dir, GenerateTrace(300, 11));
  auto node = Node(256, "lru");
  const auto r =
      RunProcess({kKvstash, "bench", "replay", "--trace", path, "--node", Address(*node),
                  "--concurrency", "4", "--speed", "1", "--lookup-budget-ms", "60000", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const Json s = Summary(r.out);
  EXPECT_EQ(s["requests"], 300);
  EXPECT_EQ(s["errors"], 0);
  EXPECT_EQ(s["mismatches"], 0);
  EXPECT_GE(s["seconds"].get<double>(), 1.4);
  EXPECT_THAT(r.err, HasSubstr("requests  block hits"));
}

TEST(BenchReplayCliTest, AWrongBlockOnTheNodeIsAMismatchAndExitsOne) {
  TempDir dir;
  const std::string path = dir / "trace.jsonl";
  std::ofstream(path) << R"({"timestamp": 0, "input_length": 1024, "output_length": 1, )"
                      << R"("hash_ids": [5, 6]})"
                      << "\n";
  auto node = Node(64, "lru");
  // Block 5 of the replay's namespace, with bytes that are not block 5's.
  const std::string block = dir / "block";
  std::ofstream(block) << std::string(kBlockBytes, 'x');
  const auto put = RunProcess({kKvstash, "put", "--node", Address(*node), "--namespace", "replay",
                               "--key", "0x6b76737265706c790000000000000005", "--file", block});
  ASSERT_EQ(put.exit_code, 0) << put.err;
  const auto r = RunProcess({kKvstash, "bench", "replay", "--trace", path, "--node", Address(*node),
                             "--lookup-budget-ms", "60000", "--json"});
  EXPECT_EQ(r.exit_code, 1);
  const Json s = Summary(r.out);
  EXPECT_EQ(s["mismatches"], 1);
  EXPECT_EQ(s["blocks_hit"], 1);
  EXPECT_THAT(r.err, HasSubstr("block 5 read back wrong"));
}

TEST(BenchReplayCliTest, BadInputIsRefusedClearly) {
  TempDir dir;
  auto node = Node(64, "lru");
  const std::string bad = dir / "bad.jsonl";
  std::ofstream(bad)
      << R"({"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]})"
      << "\n\n"
      << R"({"timestamp": 1, "input_length": 10, "output_length": 1})"
      << "\n";
  auto r = RunProcess({kKvstash, "bench", "replay", "--trace", bad, "--node", Address(*node)});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr(bad + ":3: no \"hash_ids\""));
  std::ofstream(bad) << "not json\n";
  r = RunProcess({kKvstash, "bench", "replay", "--trace", bad, "--node", Address(*node)});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr(":1: not a JSON object"));
  r = RunProcess(
      {kKvstash, "bench", "replay", "--trace", dir / "missing", "--node", Address(*node)});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("cannot read trace"));
  r = RunProcess(
      {kKvstash, "bench", "replay", "--trace", bad, "--node", Address(*node), "--speed", "-1"});
  EXPECT_EQ(r.exit_code, 2);
  // A node that is not there is an error, not a replay of misses.
  const std::string good = WriteTrace(dir, GenerateTrace(10, 3));
  r = RunProcess({kKvstash, "bench", "replay", "--trace", good, "--node", "127.0.0.1:1",
                  "--timeout-ms", "500"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("127.0.0.1:1"));
  const auto help = RunProcess({kKvstash, "bench", "replay", "--help"});
  EXPECT_EQ(help.exit_code, 0);
  EXPECT_THAT(help.out, HasSubstr("model_block_hit_ratio"));
}

}  // namespace
}  // namespace kvstash
