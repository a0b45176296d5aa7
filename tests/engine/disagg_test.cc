// Prefill/decode disaggregation with real processes: two `kvstashd` nodes, a prefill worker
// (`kvstash-engine generate --role prefill`) and a decode worker (`--role decode`), each its own
// process. The decode worker prints the same tokens as one worker with no nodes, computing at
// most one block of the prompt; a node killed or frozen between the two costs recomputation,
// never a wrong token or a hang; a later turn of a conversation starts from the earlier turn's
// blocks; a sliding-window model pulls its window, whatever the prompt's length.

#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "daemon_process.h"
#include "generate_process.h"
#include "kvstash/engine/model.h"
#include "process_state.h"
#include "subprocess.h"

namespace kvstash::engine {
namespace {

using ::kvstash::testing::Daemon;
using ::kvstash::testing::RunProcess;

class DisaggTest : public ::testing::Test {
 protected:
  void StartNodes() {
    for (int i = 0; i < 2; ++i) {
      daemons_.push_back(std::make_unique<Daemon>(
          std::vector<std::string>{"--block-bytes", kNodeBlockBytes, "--cpu-bytes", "32MiB"},
          /*sizes=*/false));
      ASSERT_NE(daemons_.back()->port(), 0);
    }
    nodes_ = "127.0.0.1:" + std::to_string(daemons_[0]->port()) +
             ",127.0.0.1:" + std::to_string(daemons_[1]->port());
  }
  std::vector<std::unique_ptr<Daemon>> daemons_;
  std::string nodes_;
};

TEST_F(DisaggTest, PrefillThenDecodeGivesOneWorkersTokensForEveryModel) {
  StartNodes();
  for (const std::string& model : ModelConfig::BuiltinNames()) {
    SCOPED_TRACE(model);
    const std::string prompt = Prompt(150, 1);
    WorkerRun alone = Generate(model, prompt, "both", "");
    ASSERT_EQ(alone.exit_code, 0) << alone.err;
    ASSERT_EQ(alone.tokens.size(), 8u);
    WorkerRun prefill = Generate(model, prompt, "prefill", nodes_);
    ASSERT_EQ(prefill.exit_code, 0) << prefill.err;
    EXPECT_EQ(prefill.tokens, std::vector<uint32_t>{alone.tokens[0]});
    EXPECT_EQ(prefill.stats["computed_tokens"], 150u);
    EXPECT_GT(prefill.stats["stored_bytes"], 0u);
    WorkerRun decode = Generate(model, prompt, "decode", nodes_);
    ASSERT_EQ(decode.exit_code, 0) << decode.err;
    EXPECT_EQ(decode.tokens, alone.tokens);
    EXPECT_LE(decode.stats["computed_tokens"], 16u);  // at most one block of the prompt
    EXPECT_EQ(decode.stats["node_tokens"] + decode.stats["computed_tokens"], 150u);
    EXPECT_EQ(decode.stats["load_failures"], 0u);
  }
}

TEST_F(DisaggTest, NodeKilledOrFrozenBetweenPrefillAndDecodeOnlyCostsRecomputation) {
  for (const std::string& model : ModelConfig::BuiltinNames()) {
    SCOPED_TRACE(model);
    for (const int signal : {SIGKILL, SIGSTOP}) {
      daemons_.clear();
      StartNodes();
      const std::string prompt = Prompt(200, 2);
      WorkerRun alone = Generate(model, prompt, "both", "");
      ASSERT_EQ(alone.exit_code, 0) << alone.err;
      ASSERT_EQ(Generate(model, prompt, "prefill", nodes_).exit_code, 0);
      ::kill(daemons_[1]->process().pid(), signal);
      // Taken before the decode starts (kill returns before the node takes it, and a node
      // still running answers the decode's calls).
      if (signal == SIGKILL) {
        daemons_[1]->process().Wait();
      } else {
        ASSERT_TRUE(::kvstash::testing::WaitUntilStopped(daemons_[1]->process().pid(),
                                                         std::chrono::seconds(5)));
      }
      const auto start = std::chrono::steady_clock::now();
      WorkerRun decode = Generate(model, prompt, "decode", nodes_, {"--node-timeout-ms", "300"});
      EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(60));
      ASSERT_EQ(decode.exit_code, 0) << decode.err;
      EXPECT_EQ(decode.tokens, alone.tokens) << "signal " << signal;
      // Blocks are spread over both nodes: the prefix breaks at the first one on the lost node.
      EXPECT_GT(decode.stats["computed_tokens"], 16u) << "signal " << signal;
      if (signal == SIGSTOP) ::kill(daemons_[1]->process().pid(), SIGCONT);
    }
  }
}

const std::vector<std::string> kWaitForNodes = {"--lookup-budget-ms", "10000"};

TEST_F(DisaggTest, NextTurnStartsFromThePreviousTurnsBlocks) {
  StartNodes();
  // Turn 1 on one worker; turn 2 (history + reply + new user tokens) on a fresh worker.
  std::string history = Prompt(70, 3);
  size_t history_len = 70;
  for (int turn = 1; turn <= 3; ++turn) {
    SCOPED_TRACE(turn);
    WorkerRun alone = Generate("tiny-hybrid", history, "both", "");
    // A lookup waits for every node, however busy the machine (the default 50 ms budget reads
    // a node not scheduled in time as misses, by design).
    WorkerRun run = Generate("tiny-hybrid", history, "both", nodes_, kWaitForNodes);
    ASSERT_EQ(run.exit_code, 0) << run.err;
    EXPECT_EQ(run.tokens, alone.tokens);
    if (turn > 1) {
      // Everything before the previous reply's last token was computed and pushed, so the hit
      // reaches the last full block of it.
      EXPECT_GE(run.stats["node_tokens"], history_len - 16 - 33) << "of " << history_len;
      EXPECT_GT(run.stats["node_tokens"], 0u);
    }
    history += " " + Join(run.tokens) + " " + Prompt(25, 10 + turn);
    history_len += run.tokens.size() + 25;
  }
}

TEST_F(DisaggTest, SlidingWindowPullIsBoundedByTheWindowNotThePrompt) {
  StartNodes();
  uint64_t loaded[2] = {0, 0};
  size_t i = 0;
  for (size_t length : {200, 800}) {
    const std::string prompt = Prompt(length, 4);
    ASSERT_EQ(Generate("tiny-swa", prompt, "prefill", nodes_).exit_code, 0);
    WorkerRun decode = Generate("tiny-swa", prompt, "decode", nodes_, kWaitForNodes);
    ASSERT_EQ(decode.exit_code, 0) << decode.err;
    EXPECT_GE(decode.stats["node_tokens"], length - 16);
    loaded[i++] = decode.stats["loaded_bytes"];
  }
  // 4 sliding-window layers, a window of 32 tokens = 2 blocks of 4096 bytes each.
  EXPECT_EQ(loaded[0], 4u * 2 * 4096);
  EXPECT_EQ(loaded[1], loaded[0]);
}

TEST_F(DisaggTest, RolesNeedNodesAndNodesNeedTheRightBlockSize) {
  auto r = RunProcess({KVSTASH_ENGINE_PATH, "generate", "--prompt", "1 2 3", "--role", "decode"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("--role decode needs --nodes"), std::string::npos) << r.err;
  Daemon wrong({"--block-bytes", "64KiB", "--cpu-bytes", "4MiB"}, /*sizes=*/false);
  ASSERT_NE(wrong.port(), 0);
  r = RunProcess({KVSTASH_ENGINE_PATH, "generate", "--prompt", "1 2 3", "--nodes",
                  "127.0.0.1:" + std::to_string(wrong.port())});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("--block-bytes 4152"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace kvstash::engine
