#include "kvstash/common/cli.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <CLI/CLI.hpp>
#include <string>
#include <vector>

namespace kvstash::cli {
namespace {

using ::testing::HasSubstr;

// A program `prog` with a subcommand `sub` taking --count N (1..10, required).
struct Program {
  Program() : app("A test program.", "prog") {
    sub = app.add_subcommand("sub", "A subcommand.");
    sub->add_option("--count", count, "How many")->required()->check(CLI::Range(1, 10));
    app.require_subcommand(1);
  }
  // ParseCommandLine on `args` after the program's name.
  std::optional<int> Parse(std::vector<std::string> args) {
    args.insert(args.begin(), "prog");
    std::vector<const char*> argv;
    for (const std::string& a : args) argv.push_back(a.c_str());
    return ParseCommandLine(app, static_cast<int>(argv.size()), argv.data());
  }
  CLI::App app;
  CLI::App* sub = nullptr;
  int count = 0;
};

TEST(ParseCommandLineTest, GoodFlagsGoOn) {
  Program p;
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(p.Parse({"sub", "--count", "3"}), std::nullopt);
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
  EXPECT_EQ(p.count, 3);
}

TEST(ParseCommandLineTest, ABadFlagIsOneErrorLineNamingTheProgramAndTheCommandsHelp) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"sub", "--count", "3", "--bogus"},
       "prog: The following argument was not expected: --bogus (see prog sub --help)\n"},
      {{"sub", "--count", "11"},
       "prog: --count: Value 11 not in range 1 to 10 (see prog sub --help)\n"},
      {{"sub"}, "prog: --count is required (see prog sub --help)\n"},
      {{}, "prog: A subcommand is required (see prog --help)\n"},
  };
  for (const auto& [args, want] : cases) {
    Program p;
    ::testing::internal::CaptureStderr();
    EXPECT_EQ(p.Parse(args), kExitUsage) << want;
    EXPECT_EQ(::testing::internal::GetCapturedStderr(), want);
  }
}

TEST(ParseCommandLineTest, HelpIsPrintedOnStandardOutputAndExitsZero) {
  for (const std::vector<std::string>& args : {std::vector<std::string>{"--help"}, {"sub", "-h"}}) {
    Program p;
    ::testing::internal::CaptureStdout();
    ::testing::internal::CaptureStderr();
    EXPECT_EQ(p.Parse(args), kExitOk);
    EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
    EXPECT_THAT(::testing::internal::GetCapturedStdout(), HasSubstr("Usage:"));
  }
}

}  // namespace
}  // namespace kvstash::cli
