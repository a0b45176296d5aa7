// `kvstash put|get|lookup|stats` against a real `kvstashd`: a block round trip through files,
// lookups with the prefix, and the messages for an unreachable node, a wrong token, a missing
// key and a file of the wrong size.

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <fstream>

#include "block_pattern.h"
#include "daemon_process.h"
#include "nlohmann/json.hpp"
#include "subprocess.h"
#include "temp_dir.h"

namespace kvstash {
namespace {

using ::kvstash::testing::Daemon;
using ::kvstash::testing::FillPattern;
using ::kvstash::testing::RunProcess;
using ::kvstash::testing::TempDir;
using ::testing::HasSubstr;

const std::string kKvstash = KVSTASH_CLI_PATH;

class NodeCliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    daemon_ = std::make_unique<Daemon>(std::vector<std::string>{"--auth-token", "tk"});
    ASSERT_NE(daemon_->port(), 0);
    node_ = "127.0.0.1:" + std::to_string(daemon_->port());
  }
  void TearDown() override { EXPECT_EQ(daemon_->process().Kill(SIGTERM), 0); }

  ::kvstash::testing::ProcessResult Run(std::vector<std::string> args) {
    args.insert(args.begin(), kKvstash);
    return RunProcess(args);
  }

  std::unique_ptr<Daemon> daemon_;
  std::string node_;
  TempDir dir_;
};

TEST_F(NodeCliTest, PutGetLookupAndStatsRoundTrip) {
  const std::string in = dir_.path() + "/block.bin";
  const std::string out = dir_.path() + "/back.bin";
  std::vector<std::byte> block(64 << 10);
  FillPattern(9, block);
  std::ofstream(in, std::ios::binary)
      .write(reinterpret_cast<const char*>(block.data()),
             static_cast<std::streamsize>(block.size()));

  auto put = Run({"put", "--node", node_, "--token", "tk", "--key", "0x2a/g1", "--file", in});
  ASSERT_EQ(put.exit_code, 0) << put.err;
  EXPECT_THAT(put.out, HasSubstr("stored 0x2a/g1 (65536 bytes"));

  auto get = Run({"get", "--node", node_, "--token", "tk", "--key", "0x2a/g1", "--out", out});
  ASSERT_EQ(get.exit_code, 0) << get.err;
  std::ifstream back(out, std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(back)), std::istreambuf_iterator<char>());
  ASSERT_EQ(bytes.size(), block.size());
  EXPECT_EQ(std::memcmp(bytes.data(), block.data(), block.size()), 0);

  auto lookup = Run({"lookup", "--node", node_, "--token", "tk", "--key", "0x2a/g1", "--key",
                     "0x2b", "--prefix", "--json"});
  ASSERT_EQ(lookup.exit_code, 0) << lookup.err;
  const auto doc = nlohmann::json::parse(lookup.out);
  EXPECT_EQ(doc["keys"][0]["state"], "hit");
  EXPECT_EQ(doc["keys"][1]["state"], "miss");
  EXPECT_EQ(doc["prefix"], 1);

  auto stats = Run({"stats", "--node", node_, "--token", "tk", "--json"});
  ASSERT_EQ(stats.exit_code, 0) << stats.err;
  const auto counters = nlohmann::json::parse(stats.out)[node_];
  EXPECT_EQ(counters["node.blocks_stored"], 1);
  EXPECT_EQ(counters["node.blocks_loaded"], 1);
}

TEST_F(NodeCliTest, BenchNodeStoresAndVerifiesUnderConcurrentClients) {
  auto r = Run({"bench", "node", "--node", node_, "--token", "tk", "--clients", "3", "--seconds",
                "1", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto doc = nlohmann::json::parse(r.out);
  EXPECT_EQ(doc["clients"], 3);
  EXPECT_GT(doc["puts"].get<uint64_t>(), 0u);
  EXPECT_GT(doc["gets"].get<uint64_t>(), 0u);
  EXPECT_EQ(doc["errors"], 0);
  EXPECT_EQ(doc["mismatches"], 0);
  EXPECT_GT(doc["gbps"].get<double>(), 0.0);
  EXPECT_THAT(r.err, HasSubstr("GB/s"));  // the progress line
  // Batches of 4 blocks, each client on its own worker.
  auto batched = Run({"bench", "node", "--node", node_, "--token", "tk", "--clients", "2",
                      "--workers", "0", "--batch", "4", "--seconds", "1", "--json"});
  ASSERT_EQ(batched.exit_code, 0) << batched.err;
  const auto b = nlohmann::json::parse(batched.out);
  EXPECT_EQ(b["puts"].get<uint64_t>() % 4, 0u);
  EXPECT_GT(b["gets"].get<uint64_t>(), 0u);
  EXPECT_EQ(b["mismatches"], 0);
  auto bad = Run({"bench", "node", "--node", node_, "--clients", "0"});
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_THAT(bad.err, HasSubstr("--clients"));
}

TEST_F(NodeCliTest, ClearMessagesForWhatGoesWrong) {
  auto missing = Run({"get", "--node", node_, "--token", "tk", "--key", "0x99"});
  EXPECT_EQ(missing.exit_code, 1);
  EXPECT_THAT(missing.err, HasSubstr("does not hold block 0x99"));

  auto token = Run({"stats", "--node", node_, "--token", "wrong"});
  EXPECT_EQ(token.exit_code, 1);
  EXPECT_THAT(token.err, HasSubstr("wrong auth token"));

  auto unreachable = Run({"stats", "--node", "127.0.0.1:1", "--timeout-ms", "2000"});
  EXPECT_EQ(unreachable.exit_code, 1);
  EXPECT_THAT(unreachable.err, HasSubstr("127.0.0.1:1"));
  EXPECT_THAT(unreachable.err, HasSubstr("refused"));

  const std::string small = dir_.path() + "/small.bin";
  std::ofstream(small) << "abc";
  auto size = Run({"put", "--node", node_, "--token", "tk", "--key", "1", "--file", small});
  EXPECT_EQ(size.exit_code, 2);
  EXPECT_THAT(size.err, HasSubstr("holds 3 bytes"));
  EXPECT_THAT(size.err, HasSubstr("exactly 65536"));

  auto bad_key = Run({"lookup", "--node", node_, "--key", "0xzz"});
  EXPECT_EQ(bad_key.exit_code, 2);
  EXPECT_THAT(bad_key.err, HasSubstr("0xzz"));

  auto bad_node = Run({"lookup", "--node", "nohostport", "--key", "1"});
  EXPECT_EQ(bad_node.exit_code, 2);
  EXPECT_THAT(bad_node.err, HasSubstr("nohostport"));

  // A node that is down is a miss for its keys, with a warning, not a failure.
  auto partial = Run({"lookup", "--node", "127.0.0.1:1", "--key", "1", "--timeout-ms", "2000"});
  EXPECT_EQ(partial.exit_code, 0) << partial.err;
  EXPECT_THAT(partial.out, HasSubstr("0x1 miss"));
  EXPECT_THAT(partial.err, HasSubstr("could not be reached"));
}

}  // namespace
}  // namespace kvstash
