// The trace language of `kvstash trace`: transcripts for both policies and every operation,
// and a clear error naming the line for malformed input.
#include "kvstash/store/trace_replay.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <string>

namespace kvstash::store {
namespace {

using ::testing::HasSubstr;

struct Replay {
  Status status;
  std::string out;
};

Replay ReplayString(const std::string& trace) {
  std::istringstream in(trace);
  std::ostringstream out;
  Status status = ReplayTrace(in, out);
  return {status, out.str()};
}

TEST(TraceReplayTest, ReferenceExampleMatchesByteForByte) {
  std::ifstream trace(KVSTASH_TEST_DATA_DIR "/policy/example.trace");
  std::ifstream expected(KVSTASH_TEST_DATA_DIR "/policy/example.expected");
  ASSERT_TRUE(trace && expected);
  std::ostringstream out;
  ASSERT_TRUE(ReplayTrace(trace, out).ok());
  std::stringstream want;
  want << expected.rdbuf();
  EXPECT_EQ(out.str(), want.str());
}

TEST(TraceReplayTest, ArcStateAndLoadErrors) {
  Replay r = ReplayString(
      "policy arc   # ARC\n"
      "capacity 2\n"
      "\n"
      "state\n"
      "store 1 2\n"
      "commit 1 2\n"
      "touch 2\n"
      "load 2\n"
      "store 3\n"
      "state\n"
      "load 3\n"
      "unload 1\n"
      "unload 2\n"
      "touch 1\n"
      "state\n"
      "events\n"
      "events\n"
      "reset\n"
      "state\n");
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  EXPECT_EQ(r.out,
            "arc p=0.000000 t1= t2= b1= b2=\n"
            "store=1,2 evict=\n"
            "ok\n"
            "ok\n"
            "ok\n"
            "store=3 evict=1\n"  // kvstash's T2->T1 fallback does not apply: p=0, T1 first
            "arc p=0.000000 t1=3:-1 t2=2:1 b1=1 b2=\n"
            "error cannot load key 0x3 (1 of 1): it is still being written\n"
            "error cannot unload key 0x1 (1 of 1): it is not stored\n"
            "ok\n"
            "ok\n"
            "arc p=1.000000 t1=3:-1 t2=2:0 b1=1 b2=\n"
            "stored:1,2 removed:1\n"
            "-\n"
            "ok\n"
            "arc p=0.000000 t1= t2= b1= b2=\n");
}

TEST(TraceReplayTest, LruLookupsScansAndReuseFilter) {
  Replay r = ReplayString(
      "policy lru\ncapacity 3\nthreshold 2\ntracker 8\n"
      "store 1 2\n"  // never looked up: filtered out
      "lookup 1 2 1\n"
      "store 1 2\n"  // 1 seen twice
      "lookup 1 2 3\n"
      "prefix 2 1\n"  // 2 missing: stops after one lookup
      "window 1 3 1\n"
      "state\n"
      "store\n"
      "lookup\n");
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  EXPECT_EQ(r.out,
            "store= evict=\n"
            "0 0 0\n"
            "store=1 evict=\n"
            "? 0 0\n"
            "0\n"
            "?\n"
            "lru 1:-1\n"
            "store= evict=\n"
            "\n");
}

TEST(TraceReplayTest, MalformedLinesAreNamed) {
  const std::pair<const char*, const char*> cases[] = {
      {"policy lru\ncapacity 2\nfrobnicate 1\n", "line 3: unknown operation 'frobnicate'"},
      {"policy lru\ncapacity 2\nlookup 1 x\n", "line 3: 'x' is not a key"},
      {"policy lru\ncapacity 2\nlookup -1\n", "line 3: '-1' is not a key"},
      {"policy lru\ncapacity 2\nlookup 18446744073709551616\n", "is not a key"},
      {"policy lru\ncapacity 2\nwindow 0 1 2\n", "line 3: 'window' needs a window size"},
      {"policy lru\ncapacity 2\nwindow\n", "line 3: 'window' needs a window size"},
      {"policy lru\ncapacity 2\nstate 1\n", "line 3: 'state' takes no arguments"},
      {"policy lru\nlookup 1\n", "line 2: 'capacity N' must come before the first operation"},
      {"capacity 2\nlookup 1\n", "line 2: 'policy lru|arc' must come before"},
      {"policy fifo\n", "line 1: unknown eviction policy 'fifo'"},
      {"policy lru\ncapacity 0\nlookup 1\n", "line 3: capacity of 0 blocks"},
      {"policy lru\ncapacity two\n", "line 2: 'capacity' needs an unsigned integer"},
      {"policy lru\ncapacity 2 3\n", "line 2: 'capacity' takes exactly one value"},
      {"policy lru\ncapacity 2\nlookup 1\ncapacity 3\n", "line 4: 'capacity' must come before"},
  };
  for (const auto& [trace, message] : cases) {
    SCOPED_TRACE(trace);
    Replay r = ReplayString(trace);
    EXPECT_EQ(r.status.code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(r.status.message()), HasSubstr(message));
  }
}

TEST(TraceReplayTest, TranscriptUpToTheErrorIsWritten) {
  Replay r = ReplayString("policy lru\ncapacity 1\nstore 1\nlookup 1\nbogus\nlookup 1\n");
  EXPECT_FALSE(r.status.ok());
  EXPECT_EQ(r.out, "store=1 evict=\n?\n");
}

}  // namespace
}  // namespace kvstash::store
