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

// AF-LRU (docs/semantics.md §4a): a block used by two requests outlives an older one used by
// one; one kept young by refreshes outlives an older one used twice; a block stored again
// starts a class above the one its ghost remembers.
TEST(TraceReplayTest, AfLruClassesAgesAndGhosts) {
  Replay r = ReplayString(
      "policy aflru\ncapacity 2\n"
      "store 1 2\ncommit 1 2\n"  // 1 at clock 1, 2 at clock 2, both class 1
      "touch 1\n"                // clock 3: 1 used by a second request, class 2
      "store 3\n"                // 2: age 1 x 6 = 6 against 1: age 0 x 3 = 0
      "commit 3\nrefresh 3\n"    // clock 5: 3 refreshed, still class 1
      "store 4\n"                // 3: age 0 x 6 = 0 against 1: age 2 x 3 = 6
      "commit 4\nstate\n"
      "store 1\n"  // 3 (age 1 x 6) goes; 1 comes back in class 3
      "state\n");
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  EXPECT_EQ(r.out,
            "store=1,2 evict=\n"
            "ok\n"
            "ok\n"
            "store=3 evict=2\n"
            "ok\n"
            "ok\n"
            "store=4 evict=1\n"
            "ok\n"
            "aflru clock=6 c1=3:0@5,4:0@6 c2= c3= ghosts=2\n"
            "store=1 evict=3\n"
            "aflru clock=7 c1=4:0@6 c2= c3=1:-1@7 ghosts=2\n");
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
      {"capacity 2\nlookup 1\n", "line 2: 'policy lru|arc|aflru' must come before"},
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
