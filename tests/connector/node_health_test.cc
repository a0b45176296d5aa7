// NodeHealth alone: when a node becomes suspect, how probes are admitted (one at a time, at
// most every probe interval), and what brings it back. No clock but the one passed in.

#include "cluster/node_health.h"

#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

namespace kvstash::connector {
namespace {

using namespace std::chrono_literals;
using Clock = NodeHealth::Clock;
constexpr auto kGo = NodeHealth::Admission::kGo;
constexpr auto kSkip = NodeHealth::Admission::kSkip;
constexpr auto kProbe = NodeHealth::Admission::kProbe;

TEST(NodeHealthTest, FailuresInARowWithNoAnswerMakeItSuspect) {
  NodeHealth health("n:1", {2, 100ms});
  const Clock::time_point t0 = Clock::now();
  EXPECT_EQ(health.Admit(t0), kGo);
  EXPECT_FALSE(health.Record(DeadlineExceededError("late")));
  EXPECT_FALSE(health.suspect());
  EXPECT_EQ(health.Admit(t0), kGo);
  health.Late();
  EXPECT_TRUE(health.suspect());
  EXPECT_EQ(health.Admit(t0), kSkip);
  EXPECT_EQ(health.Admit(t0 + 50ms), kSkip);
}

TEST(NodeHealthTest, AnAnswerInBetweenStartsTheCountAgain) {
  NodeHealth health("n:1", {2, 100ms});
  for (int i = 0; i < 10; ++i) {
    health.Late();
    EXPECT_FALSE(health.Record(Status::OK()));  // the late call's answer came
  }
  EXPECT_FALSE(health.suspect());
  // NotFound and Aborted are answers; a refusal is an answer too, and says it is one.
  health.Late();
  EXPECT_FALSE(health.Record(NotFoundError("no block")));
  health.Late();
  EXPECT_TRUE(health.Record(PermissionDeniedError("token")));
  health.Late();
  EXPECT_FALSE(health.suspect());
}

TEST(NodeHealthTest, ASuspectNodeGetsOneProbeAtATimeEveryInterval) {
  NodeHealth health("n:1", {1, 100ms});
  health.Record(UnavailableError("gone"));
  ASSERT_TRUE(health.suspect());
  const Clock::time_point t0 = Clock::now();
  EXPECT_EQ(health.Admit(t0), kSkip);                           // within the interval
  EXPECT_EQ(health.Admit(t0 + 150ms), kProbe);                  // the probe
  EXPECT_EQ(health.Admit(t0 + 300ms), kSkip);                   // one at a time, while it is out
  EXPECT_FALSE(health.Record(UnavailableError("still gone")));  // the probe failed
  EXPECT_TRUE(health.suspect());
  EXPECT_EQ(health.Admit(t0 + 200ms), kSkip);   // the interval since the last probe
  EXPECT_EQ(health.Admit(t0 + 300ms), kProbe);  // the next probe
  EXPECT_FALSE(health.Record(Status::OK()));    // answered: up
  EXPECT_FALSE(health.suspect());
  EXPECT_EQ(health.Admit(t0 + 300ms), kGo);
  EXPECT_EQ(health.Admit(t0 + 300ms), kGo);
}

TEST(NodeHealthTest, OfManyThreadsAskingOneTakesTheProbe) {
  NodeHealth health("n:1", {1, 10ms});
  health.Record(UnavailableError("gone"));
  const Clock::time_point later = Clock::now() + 1s;
  std::atomic<int> admitted{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < 8; ++i) {
    threads.emplace_back([&] {
      for (int j = 0; j < 1000; ++j) admitted += health.Admit(later) == kProbe ? 1 : 0;
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(admitted.load(), 1);
}

}  // namespace
}  // namespace kvstash::connector
