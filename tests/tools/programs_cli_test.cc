// Every kvstash program (kvstash, kvstashd, kvstash-engine) reads its command line the one way,
// kvstash::cli::ParseCommandLine over CLI11: a bad flag or value is one line on standard error,
// "NAME: message (see NAME SUBCOMMAND --help)", like every other error of the program, and exit
// status 2; --help is the help on standard output and exit status 0. KVSTASH_TEST_CLI,
// KVSTASH_TEST_KVSTASHD and KVSTASH_TEST_ENGINE run it against other binaries (tests/util/
// programs.h): against 1c9594e's, whose parse errors were CLI11's own two lines without the
// program's name, it fails.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "programs.h"
#include "subprocess.h"

namespace kvstash {
namespace {

using testing::CliPath;
using ::testing::EndsWith;
using testing::EnginePath;
using ::testing::HasSubstr;
using testing::KvstashdPath;
using testing::RunProcess;
using ::testing::StartsWith;

struct BadCommandLine {
  std::string program;            // the name it reports under
  std::vector<std::string> argv;  // argv[0] the binary
  std::string names;              // what the message must name
  std::string help;               // the command whose --help the message points to
};

std::vector<BadCommandLine> BadCommandLines() {
  const std::string cli = CliPath(), daemon = KvstashdPath(), engine = EnginePath();
  return {
      {"kvstash", {cli, "trace", "--bogus"}, "--bogus", "kvstash trace"},
      {"kvstash", {cli}, "subcommand is required", "kvstash"},
      {"kvstash",
       {cli, "lookup", "--node", "127.0.0.1:1", "--key", "1", "--timeout-ms", "soon"},
       "--timeout-ms",
       "kvstash lookup"},
      {"kvstash",
       {cli, "bench", "ssd", "--dir", "/tmp"},
       "--block-size is required",
       "kvstash bench ssd"},
      {"kvstashd", {daemon, "--bogus"}, "--bogus", "kvstashd"},
      {"kvstashd", {daemon, "--port", "x"}, "--port", "kvstashd"},
      {"kvstash-engine", {engine, "generate"}, "--prompt is required", "kvstash-engine generate"},
      {"kvstash-engine",
       {engine, "generate", "--prompt", "1", "--attn-pack", "0"},
       "--attn-pack",
       "kvstash-engine generate"},
      {"kvstash-engine", {engine, "serve", "--bogus"}, "--bogus", "kvstash-engine serve"},
  };
}

std::string Joined(const std::vector<std::string>& argv) {
  std::string s;
  for (size_t i = 1; i < argv.size(); ++i) s += " " + argv[i];
  return s;
}

TEST(ProgramsCliTest, ABadFlagIsOneLineNamingTheProgramAndExitsTwo) {
  for (const BadCommandLine& c : BadCommandLines()) {
    SCOPED_TRACE(c.program + Joined(c.argv));
    const auto r = RunProcess(c.argv);
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_EQ(r.out, "");
    EXPECT_THAT(r.err, StartsWith(c.program + ": "));
    EXPECT_THAT(r.err, HasSubstr(c.names));
    EXPECT_THAT(r.err, EndsWith("(see " + c.help + " --help)\n"));
    EXPECT_EQ(r.err.find('\n'), r.err.size() - 1) << "one line: " << r.err;
  }
}

TEST(ProgramsCliTest, HelpIsOnStandardOutputAndExitsZero) {
  const std::vector<std::vector<std::string>> helps = {
      {CliPath(), "--help"},    {CliPath(), "trace", "--help"}, {KvstashdPath(), "--help"},
      {EnginePath(), "--help"}, {EnginePath(), "serve", "-h"},
  };
  for (const auto& argv : helps) {
    SCOPED_TRACE(Joined(argv));
    const auto r = RunProcess(argv);
    EXPECT_EQ(r.exit_code, 0) << r.err;
    EXPECT_EQ(r.err, "");
    EXPECT_THAT(r.out, HasSubstr("Usage:"));
  }
}

}  // namespace
}  // namespace kvstash
