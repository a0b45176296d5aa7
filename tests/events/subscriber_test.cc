// The subscriber against the real publisher over loopback: order, gaps filled by replay (the
// index after a cut equals one built from scratch), gaps the replay cannot fill, a publisher
// that starts over, and garbage on the wire.
#include "kvstash/events/subscriber.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <zmq.h>

#include <chrono>
#include <random>
#include <thread>

#include "kvstash/events/publisher.h"

namespace kvstash::events {
namespace {

using Clock = std::chrono::steady_clock;

// Waits until `done` holds, for at most 20 s.
template <typename F>
bool Within(F done) {
  const auto deadline = Clock::now() + std::chrono::seconds(20);
  while (!done()) {
    if (Clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return true;
}

// Batch i: stores two blocks (one per medium) and removes one stored three batches earlier.
KvEventBatch Nth(uint64_t i) {
  BlockStored cpu;
  cpu.block_hashes = {i};
  cpu.medium = "CPU";
  cpu.group_idx = static_cast<int64_t>(i % 3);
  BlockStored ssd = cpu;
  ssd.medium = "SSD";
  KvEventBatch b{1.0, {cpu, ssd}, std::nullopt};
  if (i >= 3) b.events.push_back(BlockRemoved{{i - 3}, "CPU", static_cast<int64_t>((i - 3) % 3)});
  return b;
}

struct Rig {
  std::unique_ptr<EventPublisher> publisher;
  KvIndex reference;  // every batch published, applied in order
  int64_t published = 0;

  explicit Rig(size_t buffer = 10000) {
    PublisherOptions o;
    o.endpoint = "tcp://127.0.0.1:*";
    o.replay_endpoint = "tcp://127.0.0.1:*";
    o.default_topic = "t";
    o.buffer_batches = buffer;
    auto p = EventPublisher::Create(o);
    EXPECT_TRUE(p.ok()) << p.status().ToString();
    publisher = std::move(*p);
  }
  void Publish(size_t n) {
    for (size_t k = 0; k < n; ++k) {
      KvEventBatch b = Nth(static_cast<uint64_t>(published));
      reference.Apply("src", Delivery{published, b, false});
      ASSERT_TRUE(publisher->Publish("t", std::move(b)));
      ++published;
    }
    publisher->Flush();
  }
  std::unique_ptr<EventSubscriber> Follow(KvIndex* index) {
    SubscriberOptions o;
    o.endpoint = publisher->endpoint();
    o.replay_endpoint = publisher->replay_endpoint();
    o.topic = "t";
    auto s = EventSubscriber::Create(o, [index](const Delivery& d) { index->Apply("src", d); });
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    return std::move(*s);
  }
};

TEST(EventSubscriberTest, ACutOfFiveSecondsIsReplayedAndTheIndexEqualsOneBuiltFromScratch) {
  Rig rig;
  KvIndex live;
  std::unique_ptr<EventSubscriber> sub = rig.Follow(&live);
  int tick = 0;  // the waits publish a batch every 25th poll (50 ms), not every one
  // It joins asynchronously: batches published before it did come by replay.
  rig.Publish(20);
  ASSERT_TRUE(Within([&] {
    if (sub->expected() < 20 && ++tick % 25 == 0) rig.Publish(1);
    return sub->expected() == rig.published;
  }));
  const int64_t before = rig.published;

  sub->Disconnect();
  const auto cut_end = Clock::now() + std::chrono::seconds(5);
  while (Clock::now() < cut_end) {  // the publisher goes on through the cut
    rig.Publish(1);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_EQ(sub->expected(), before);  // nothing came through the cut
  sub->Reconnect();
  ASSERT_TRUE(Within([&] {
    if (++tick % 25 == 0) rig.Publish(1);  // the next batch shows the gap
    return sub->expected() == rig.published;
  }));

  KvIndex fresh;
  std::unique_ptr<EventSubscriber> late = rig.Follow(&fresh);
  ASSERT_TRUE(Within([&] {
    // A batch until it has joined (the first it sees makes it replay the rest), then none.
    if (late->expected() == -1 && ++tick % 25 == 0) rig.Publish(1);
    return late->expected() == rig.published && sub->expected() == rig.published;
  }));
  EXPECT_EQ(live.Snapshot("src"), rig.reference.Snapshot("src"));
  EXPECT_EQ(fresh.Snapshot("src"), rig.reference.Snapshot("src"));
  EXPECT_GT(live.blocks("src"), 0u);
  const SubscriberStats stats = sub->stats();
  EXPECT_GE(stats.gaps, 1u);
  EXPECT_GE(stats.replayed, 40u);  // about 50 batches went by during the cut
  EXPECT_EQ(stats.resets, 0u);
  EXPECT_EQ(stats.malformed, 0u);
}

// A subscriber that joins a quiet publisher learns its history at once when asked to, without
// waiting for a live batch to show it joined late (one that is not asked waits).
TEST(EventSubscriberTest, ReplayAtStartLearnsAQuietPublishersHistory) {
  Rig rig;
  rig.Publish(12);
  KvIndex asked, waiting;
  SubscriberOptions o;
  o.endpoint = rig.publisher->endpoint();
  o.replay_endpoint = rig.publisher->replay_endpoint();
  o.topic = "t";
  auto waits =
      EventSubscriber::Create(o, [&waiting](const Delivery& d) { waiting.Apply("src", d); });
  o.replay_at_start = true;
  auto sub = EventSubscriber::Create(o, [&asked](const Delivery& d) { asked.Apply("src", d); });
  ASSERT_TRUE(sub.ok() && waits.ok());
  ASSERT_TRUE(Within([&] { return (*sub)->expected() == rig.published; }));
  EXPECT_EQ(asked.Snapshot("src"), rig.reference.Snapshot("src"));
  EXPECT_EQ((*sub)->stats().resets, 0u);
  EXPECT_EQ((*waits)->expected(), -1);  // nothing came live
  EXPECT_EQ(waiting.blocks("src"), 0u);
  // What comes next is delivered after the history, once.
  rig.Publish(3);
  ASSERT_TRUE(Within([&] { return (*sub)->expected() == rig.published; }));
  EXPECT_EQ(asked.Snapshot("src"), rig.reference.Snapshot("src"));
}

TEST(EventSubscriberTest, AGapTheReplayNoLongerHoldsStartsTheSourceOver) {
  Rig rig(/*buffer=*/5);
  KvIndex live;
  std::unique_ptr<EventSubscriber> sub = rig.Follow(&live);
  int tick = 0;  // the waits publish a batch every 25th poll (50 ms), not every one
  ASSERT_TRUE(Within([&] {
    if (++tick % 25 == 0) rig.Publish(1);
    return sub->expected() > 0 && sub->expected() == rig.published;
  }));
  // Block k (on SSD, never removed) arrives; however the subscriber joined (a slow join may
  // itself have been a reset), it holds it now.
  const uint64_t k = static_cast<uint64_t>(rig.published);
  rig.Publish(1);
  ASSERT_TRUE(Within([&] { return sub->expected() == rig.published; }));
  ASSERT_TRUE(live.Holds("src", "SSD", static_cast<int64_t>(k % 3), ExternalHash(k)));
  const uint64_t resets = sub->stats().resets;
  sub->Disconnect();
  rig.Publish(20);  // more than the replay keeps
  sub->Reconnect();
  ASSERT_TRUE(Within([&] {
    if (++tick % 25 == 0) rig.Publish(1);  // the next batch shows the gap
    return sub->expected() == rig.published;
  }));
  EXPECT_GE(sub->stats().resets, resets + 1);
  // Block k was never removed, but what followed it is lost: the index no longer claims it.
  EXPECT_FALSE(live.Holds("src", "SSD", static_cast<int64_t>(k % 3), ExternalHash(k)));
  EXPECT_TRUE(rig.reference.Holds("src", "SSD", static_cast<int64_t>(k % 3), ExternalHash(k)));
  // What it holds is true of the source.
  for (const KvIndex::Entry& e : live.Snapshot("src")) {
    EXPECT_TRUE(rig.reference.Holds("src", std::get<0>(e), std::get<1>(e), std::get<2>(e)));
  }
}

// A publisher killed and started again on its ports numbers from 0 again, and its first
// batches (its AllBlocksCleared among them) are published before the subscriber's connection
// comes back. Whether the new life has sent fewer batches than the old one had (its numbers
// look like duplicates) or more (they look like a gap), the subscriber starts the source over
// from the new life's history: it ends holding exactly what the new life published.
class SubscriberRestartTest : public ::testing::TestWithParam<int> {};

TEST_P(SubscriberRestartTest, APublisherStartedAgainOnItsPortsIsFollowedFromItsNewLife) {
  const int new_batches = GetParam();
  auto rig = std::make_unique<Rig>();
  KvIndex live;
  std::unique_ptr<EventSubscriber> sub = rig->Follow(&live);
  int tick = 0;
  rig->Publish(30);
  ASSERT_TRUE(Within([&] {
    if (sub->expected() < 30 && ++tick % 25 == 0) rig->Publish(1);
    return sub->expected() == rig->published;
  }));
  const std::string endpoint = rig->publisher->endpoint();
  const std::string replay = rig->publisher->replay_endpoint();
  const uint64_t restarts = sub->stats().restarts;

  rig.reset();  // killed: the old life's blocks are gone with it
  // On the same ports (a wildcard host: an address with a host would be connected to).
  auto port_of = [](const std::string& e) { return e.substr(e.rfind(':')); };
  PublisherOptions o;
  o.endpoint = "tcp://*" + port_of(endpoint);
  o.replay_endpoint = "tcp://*" + port_of(replay);
  o.default_topic = "t";
  auto again = EventPublisher::Create(o);
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  KvIndex reference;
  int64_t published = 0;
  auto publish = [&](uint64_t first_block) {
    KvEventBatch b = Nth(first_block + static_cast<uint64_t>(published));
    if (published == 0) b.events.insert(b.events.begin(), AllBlocksCleared{});
    reference.Apply("src", Delivery{published, b, false});
    ASSERT_TRUE((*again)->Publish("t", std::move(b)));
    ++published;
    (*again)->Flush();
  };
  // Other blocks than the old life's (1000 on), published at once: before the reconnect.
  for (int i = 0; i < new_batches; ++i) publish(1000);
  ASSERT_TRUE(Within([&] {
    // One more every 50 ms until the subscriber follows: the live batch that shows it.
    if (++tick % 25 == 0) publish(1000);
    return sub->expected() == published && live.Snapshot("src") == reference.Snapshot("src");
  })) << "expected "
      << sub->expected() << " of " << published << ", holds " << live.blocks("src")
      << " blocks, the new life " << reference.blocks("src") << "; restarts "
      << sub->stats().restarts << " duplicates " << sub->stats().duplicates << " delivered "
      << sub->stats().delivered;
  EXPECT_GE(sub->stats().restarts, restarts + 1);
  EXPECT_FALSE(live.Holds("src", "SSD", 0, ExternalHash(uint64_t{3})));  // the old life's
}

INSTANTIATE_TEST_SUITE_P(FewerOrMoreBatchesThanBefore, SubscriberRestartTest,
                         ::testing::Values(5, 45));

TEST(EventSubscriberTest, GarbageOnTheWireIsCountedAndWhatFollowsIsDelivered) {
  void* ctx = zmq_ctx_new();
  void* pub = zmq_socket(ctx, ZMQ_PUB);
  ASSERT_EQ(zmq_bind(pub, "tcp://127.0.0.1:*"), 0);
  char endpoint[256];
  size_t size = sizeof(endpoint);
  zmq_getsockopt(pub, ZMQ_LAST_ENDPOINT, endpoint, &size);
  KvIndex index;
  std::vector<Delivery> got;
  Mutex mu;
  SubscriberOptions o;
  o.endpoint = endpoint;
  o.topic = "t";
  auto sub = EventSubscriber::Create(o, [&](const Delivery& d) {
    MutexLock lock(&mu);
    got.push_back(d);
  });
  ASSERT_TRUE(sub.ok());
  auto send = [&](const std::vector<std::string>& frames) {
    for (size_t i = 0; i < frames.size(); ++i) {
      zmq_send(pub, frames[i].data(), frames[i].size(), i + 1 < frames.size() ? ZMQ_SNDMORE : 0);
    }
  };
  const std::string good = EncodeBatch(Nth(7));
  // Until it has joined: good batches at sequence 0 (those after the first are duplicates).
  ASSERT_TRUE(Within([&] {
    send({"t", EncodeSequence(0), good});
    MutexLock lock(&mu);
    return !got.empty();
  }));
  send({"t", EncodeSequence(1)});                      // two frames
  send({"t", "short", good});                          // a sequence of 5 bytes
  send({"t", EncodeSequence(1), "\xc1 not msgpack"});  // an unreadable batch
  send({"t", EncodeSequence(2), good});                // fine again
  send({"tt", EncodeSequence(9), good});               // another topic: not ours
  ASSERT_TRUE(Within([&] { return (*sub)->expected() == 3; }));
  EXPECT_EQ((*sub)->stats().malformed, 3u);
  {
    MutexLock lock(&mu);
    ASSERT_GE(got.size(), 2u);
    EXPECT_EQ(got.back().sequence, 2);
    EXPECT_TRUE(got.back().reset);  // batch 1 is lost for good: no replay here
  }
  sub->reset();
  zmq_close(pub);
  zmq_ctx_term(ctx);
}

}  // namespace
}  // namespace kvstash::events
