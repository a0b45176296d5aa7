// The `kvstash` binary as users run it: `kvstash trace` on the reference example, on standard
// input, and on bad input; exit codes 0, 1 (cannot open) and 2 (malformed or bad usage).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

#include "subprocess.h"

namespace kvstash {
namespace {

using ::testing::HasSubstr;
using testing::RunProcess;

const std::string kKvstash = KVSTASH_CLI_PATH;
const std::string kData = KVSTASH_TEST_DATA_DIR;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

TEST(KvstashCliTest, TraceReproducesTheReferenceTranscript) {
  auto r = RunProcess({kKvstash, "trace", kData + "/policy/example.trace"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, ReadFile(kData + "/policy/example.expected"));
  EXPECT_EQ(r.err, "");
}

TEST(KvstashCliTest, TraceReadsStandardInput) {
  const std::string trace = ReadFile(kData + "/policy/example.trace");
  auto r = RunProcess({kKvstash, "trace"}, trace);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, ReadFile(kData + "/policy/example.expected"));
  auto dash = RunProcess({kKvstash, "trace", "-"}, trace);
  EXPECT_EQ(dash.out, r.out);
}

TEST(KvstashCliTest, MalformedTraceExitsTwoNamingTheLine) {
  auto r = RunProcess({kKvstash, "trace"}, "policy lru\ncapacity 2\nstore 1\nsotre 2\n");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(r.out, "store=1 evict=\n");
  EXPECT_THAT(r.err, HasSubstr("<stdin>: line 4: unknown operation 'sotre'"));
}

TEST(KvstashCliTest, MissingFileExitsOne) {
  auto r = RunProcess({kKvstash, "trace", "/nonexistent/x.trace"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("cannot open '/nonexistent/x.trace'"));
}

TEST(KvstashCliTest, HelpAndUsageErrors) {
  auto help = RunProcess({kKvstash, "--help"});
  EXPECT_EQ(help.exit_code, 0);
  EXPECT_THAT(help.out, HasSubstr("trace"));
  auto trace_help = RunProcess({kKvstash, "trace", "--help"});
  EXPECT_EQ(trace_help.exit_code, 0);
  EXPECT_THAT(trace_help.out, HasSubstr("policy lru|arc"));
  EXPECT_EQ(RunProcess({kKvstash}).exit_code, 2);
  EXPECT_EQ(RunProcess({kKvstash, "frobnicate"}).exit_code, 2);
  EXPECT_EQ(RunProcess({kKvstash, "trace", "a", "b"}).exit_code, 2);
}

}  // namespace
}  // namespace kvstash
