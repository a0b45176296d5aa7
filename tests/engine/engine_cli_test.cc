// `kvstash-engine` as a user runs it: the generated ids on the last line, the --stats line,
// the same tokens as the library, the multi-turn chat's cache hits, clear refusals.

#include <gtest/gtest.h>

#include <algorithm>
#include <sstream>
#include <string>
#include <vector>

#include "kvstash/engine/engine.h"
#include "nlohmann/json.hpp"
#include "subprocess.h"

namespace kvstash::engine {
namespace {

using kvstash::testing::RunProcess;

std::vector<std::string> Lines(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

std::string Join(std::span<const uint32_t> t) {
  std::string s;
  for (size_t i = 0; i < t.size(); ++i) s += (i ? " " : "") + std::to_string(t[i]);
  return s;
}

TEST(EngineCliTest, GeneratePrintsTheLibrarysTokensOnTheLastLine) {
  std::vector<uint32_t> prompt;
  for (uint32_t i = 0; i < 41; ++i) prompt.push_back((i * 37 + 11) % 256);
  for (const std::string& model : ModelConfig::BuiltinNames()) {
    auto config = ModelConfig::Load("builtin:" + model);
    ASSERT_TRUE(config.ok());
    auto engine = Engine::Create(*config, {});
    ASSERT_TRUE(engine.ok());
    auto want = (*engine)->Generate({prompt}, 7);
    ASSERT_TRUE(want.ok());
    const auto r = RunProcess({KVSTASH_ENGINE_PATH, "generate", "--model", "builtin:" + model,
                               "--prompt", Join(prompt), "--max-new-tokens", "7", "--stats",
                               "--max-batched-tokens", "10"});
    ASSERT_EQ(r.exit_code, 0) << r.err;
    const auto lines = Lines(r.out);
    ASSERT_GE(lines.size(), 2u);
    EXPECT_EQ(lines.back(), Join((*want)[0]->output())) << model;
    EXPECT_EQ(lines[lines.size() - 2], "prompt_tokens=41 cached_tokens=0 computed_tokens=41");
  }
}

TEST(EngineCliTest, ChatHitsEarlierTurnsAndPackingHitsMore) {
  size_t totals[2] = {0, 0};
  for (int pack : {1, 4}) {
    const auto r = RunProcess({KVSTASH_ENGINE_PATH, "chat", "--model", "builtin:tiny-state-hybrid",
                               "--turns", "4", "--user-tokens", "11", "--max-new-tokens", "5",
                               "--attn-pack", std::to_string(pack)});
    ASSERT_EQ(r.exit_code, 0) << r.err;
    const auto lines = Lines(r.out);
    ASSERT_EQ(lines.size(), 6u) << r.out;
    EXPECT_NE(lines[1].find("turn=1 prompt_tokens=11 cached_tokens=0"), std::string::npos);
    size_t cached = 0;
    ASSERT_EQ(std::sscanf(lines[5].c_str(), "total prompt_tokens=%*u cached_tokens=%zu", &cached),
              1)
        << lines[5];
    totals[pack == 4] = cached;
  }
  EXPECT_GT(totals[0], 0u);
  EXPECT_GT(totals[1], totals[0]);
}

TEST(EngineCliTest, BadArgumentsExitTwoWithAReason) {
  auto r = RunProcess({KVSTASH_ENGINE_PATH, "generate", "--prompt", "1 2 oops"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("'oops' is not a token id"), std::string::npos) << r.err;
  r = RunProcess({KVSTASH_ENGINE_PATH, "generate", "--prompt", "1 999"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("outside the vocabulary"), std::string::npos) << r.err;
  r = RunProcess({KVSTASH_ENGINE_PATH, "generate", "--model", "builtin:nope", "--prompt", "1"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("no built-in model 'nope'"), std::string::npos) << r.err;
  r = RunProcess({KVSTASH_ENGINE_PATH, "generate", "--model", "builtin:tiny-state-hybrid",
                  "--block-size", "8", "--prompt", "1"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("at least 16"), std::string::npos) << r.err;
  r = RunProcess({KVSTASH_ENGINE_PATH, "generate"});
  EXPECT_EQ(r.exit_code, 2);
  r = RunProcess({KVSTASH_ENGINE_PATH, "--help"});
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_NE(r.out.find("generate"), std::string::npos);
  EXPECT_NE(r.out.find("bench"), std::string::npos);
}

TEST(EngineCliTest, DeviceFlagRunsTheSameTokensOrSaysWhyNot) {
  std::vector<uint32_t> prompt;
  for (uint32_t i = 0; i < 50; ++i) prompt.push_back((i * 29 + 3) % 256);
  auto config = ModelConfig::Load("builtin:tiny-hybrid");
  ASSERT_TRUE(config.ok());
  auto engine = Engine::Create(*config, {});
  ASSERT_TRUE(engine.ok());
  auto want = (*engine)->Generate({prompt}, 6);
  ASSERT_TRUE(want.ok());
  for (const std::string device : {"cpu", "cpu-staged", "cuda"}) {
    const auto r =
        RunProcess({KVSTASH_ENGINE_PATH, "generate", "--model", "builtin:tiny-hybrid", "--prompt",
                    Join(prompt), "--max-new-tokens", "6", "--device", device});
    if (device == "cuda" && r.exit_code != 0) {
      // No GPU here (or no CUDA in this build): a reason, not a crash.
      EXPECT_EQ(r.exit_code, 1) << r.err;
      EXPECT_NE(r.err.find("CUDA"), std::string::npos) << r.err;
      continue;
    }
    ASSERT_EQ(r.exit_code, 0) << device << ": " << r.err;
    const auto lines = Lines(r.out);
    ASSERT_FALSE(lines.empty());
    EXPECT_EQ(lines.back(), Join((*want)[0]->output())) << device;
  }
  const auto r = RunProcess({KVSTASH_ENGINE_PATH, "generate", "--prompt", "1", "--device", "tpu"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("--device"), std::string::npos) << r.err;
}

TEST(EngineCliTest, BenchPrintsRatesAndTheModelSize) {
  const auto r = RunProcess({KVSTASH_ENGINE_PATH, "bench", "--model", "builtin:tiny-hybrid",
                             "--batch", "2", "--prompt-len", "40", "--decode-tokens", "4"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("params="), std::string::npos);
  EXPECT_NE(r.out.find("prefill: 2 x 40 tokens"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("decode:  2 streams x 4 tokens"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("MatMul"), std::string::npos);
}

// --json: one object of the harness's shape, paired rounds against the MatMul limit, every ratio
// the median of the rounds' own (with one figure per round, checked against them).
TEST(EngineCliTest, BenchJsonCarriesEveryFigureAndRoundAndNoProgressOnStdout) {
  const auto r =
      RunProcess({KVSTASH_ENGINE_PATH, "bench", "--model", "builtin:tiny-hybrid", "--batch", "2",
                  "--prompt-len", "40", "--decode-tokens", "4", "--rounds", "3", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  ASSERT_EQ(Lines(r.out).size(), 1u) << r.out;
  const nlohmann::json doc = nlohmann::json::parse(r.out, nullptr, false);
  ASSERT_TRUE(doc.is_object()) << r.out;
  EXPECT_EQ(doc.at("bench"), "engine");
  EXPECT_EQ(doc.at("model"), "tiny-hybrid");
  EXPECT_EQ(doc.at("batch"), 2);
  EXPECT_EQ(doc.at("prompt_len"), 40);
  EXPECT_EQ(doc.at("decode_tokens"), 4);
  EXPECT_EQ(doc.at("rounds"), 3);
  EXPECT_EQ(doc.at("per_round").at("order"),
            nlohmann::json::array({"engine,MatMul", "MatMul,engine", "engine,MatMul"}));
  for (const char* name : {"prefill_tokens_per_s", "decode_tokens_per_s", "prefill_gflops",
                           "decode_gflops", "matmul_gflops", "prefill_ratio", "decode_ratio"}) {
    ASSERT_TRUE(doc.at(name).is_number()) << name << ": " << doc.dump();
    EXPECT_GT(doc[name].get<double>(), 0.0) << name;
    ASSERT_EQ(doc.at("per_round").at(name).size(), 3u) << name;
  }
  for (const char* ratio : {"prefill_ratio", "decode_ratio"}) {
    std::vector<double> rounds;
    for (const auto& v : doc["per_round"][ratio]) rounds.push_back(v.get<double>());
    std::sort(rounds.begin(), rounds.end());
    EXPECT_DOUBLE_EQ(doc[ratio].get<double>(), rounds[1]) << ratio;
  }
  EXPECT_EQ(doc.at("figures").at("prefill_ratio").at("to"), "matmul_gflops");
}

// --swa-ring: the same tokens as the library's pool layout, chat still hits earlier turns as
// much as without it, and the flag is in the help of each subcommand.
TEST(EngineCliTest, SwaRingGivesTheSameTokensAndHits) {
  std::vector<uint32_t> prompt;
  for (uint32_t i = 0; i < 75; ++i) prompt.push_back((i * 53 + 7) % 256);
  for (const std::string model : {"tiny-swa", "tiny-hybrid"}) {
    auto config = ModelConfig::Load("builtin:" + model);
    ASSERT_TRUE(config.ok());
    auto engine = Engine::Create(*config, {});
    ASSERT_TRUE(engine.ok());
    auto want = (*engine)->Generate({prompt}, 9);
    ASSERT_TRUE(want.ok());
    const auto r = RunProcess({KVSTASH_ENGINE_PATH, "generate", "--model", "builtin:" + model,
                               "--prompt", Join(prompt), "--max-new-tokens", "9", "--swa-ring",
                               "--max-batched-tokens", "20"});
    ASSERT_EQ(r.exit_code, 0) << r.err;
    const auto lines = Lines(r.out);
    ASSERT_FALSE(lines.empty());
    EXPECT_EQ(lines.back(), Join((*want)[0]->output())) << model;

    std::string totals[2];
    for (bool ring : {false, true}) {
      std::vector<std::string> args = {
          KVSTASH_ENGINE_PATH, "chat", "--model",       "builtin:" + model,
          "--turns",           "4",    "--user-tokens", "23",
          "--max-new-tokens",  "5"};
      if (ring) args.push_back("--swa-ring");
      const auto c = RunProcess(args);
      ASSERT_EQ(c.exit_code, 0) << c.err;
      const auto chat = Lines(c.out);
      ASSERT_EQ(chat.size(), 6u) << c.out;
      totals[ring] = chat[5];
    }
    EXPECT_EQ(totals[1], totals[0]) << model;
    EXPECT_EQ(totals[1].find("cached_tokens=0 "), std::string::npos) << totals[1];
  }
  for (const char* sub : {"generate", "chat", "bench"}) {
    const auto h = RunProcess({KVSTASH_ENGINE_PATH, sub, "--help"});
    EXPECT_EQ(h.exit_code, 0);
    EXPECT_NE(h.out.find("--swa-ring"), std::string::npos) << sub;
  }
}

}  // namespace
}  // namespace kvstash::engine
