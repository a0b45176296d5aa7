// A node's KV events (node/src/kv_event_pump.h) over a real store and real ZMQ sockets: what a
// subscriber of each namespace's topic sees when blocks are stored and removed, and when the
// store drops events nobody drained (docs/semantics.md §19).
#include "kv_event_pump.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <zmq.h>

#include <chrono>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "temp_dir.h"

namespace kvstash::node {
namespace {

using events::AllBlocksCleared;
using events::BlockRemoved;
using events::BlockStored;
using events::ExternalHash;
using events::KvEvent;
using Clock = std::chrono::steady_clock;

constexpr size_t kBlock = 4096;

BlockKey Key(NamespaceId ns, uint64_t hash, uint32_t group = 0) {
  return BlockKey{BlockHash{.lo = hash, .hi = 0}, group, ns};
}

struct Message {
  std::string topic;
  int64_t seq;
  std::vector<KvEvent> events;
};

class KvEventPumpTest : public ::testing::Test {
 protected:
  void Start(size_t max_pending_event_keys = size_t{1} << 20) {
    store::TieredStoreOptions options;
    options.block_bytes = kBlock;
    options.cpu_capacity_blocks = 64;
    options.prefault = false;
    options.enable_events = true;
    options.max_pending_event_keys = max_pending_event_keys;
    auto store = store::TieredStore::Create(options);
    ASSERT_TRUE(store.ok()) << store.status().ToString();
    store_ = std::move(*store);
    KvEventOptions events;
    events.publisher.endpoint = "tcp://127.0.0.1:*";
    // Rounds only when the test says (PublishNow), so that it decides what one round holds.
    events.interval = std::chrono::hours(1);
    auto pump = KvEventPump::Create(events, store_.get(), [](NamespaceId ns) {
      static const std::map<NamespaceId, std::string> names = {{1, "a"}, {2, "b"}, {3, "probe"}};
      auto it = names.find(ns);
      return it == names.end() ? std::nullopt : std::optional<std::string>(it->second);
    });
    ASSERT_TRUE(pump.ok()) << pump.status().ToString();
    pump_ = std::move(*pump);
    ctx_ = zmq_ctx_new();
    sub_ = zmq_socket(ctx_, ZMQ_SUB);
    const int linger = 0;
    zmq_setsockopt(sub_, ZMQ_LINGER, &linger, sizeof(linger));
    zmq_setsockopt(sub_, ZMQ_SUBSCRIBE, "", 0);
    ASSERT_EQ(zmq_connect(sub_, pump_->publisher().endpoint().c_str()), 0);
    // The SUB socket joins asynchronously: stores probe blocks until one's event arrives.
    SetTimeout(50);
    const auto deadline = Clock::now() + std::chrono::seconds(10);
    for (uint64_t i = 1; Clock::now() < deadline; ++i) {
      Store({Key(3, i)});
      pump_->PublishNow();
      if (Receive()) break;
    }
    while (Receive()) {
    }
    SetTimeout(10000);
  }

  void TearDown() override {
    pump_.reset();
    if (sub_ != nullptr) zmq_close(sub_);
    if (ctx_ != nullptr) zmq_ctx_term(ctx_);
  }

  void SetTimeout(int ms) { zmq_setsockopt(sub_, ZMQ_RCVTIMEO, &ms, sizeof(ms)); }

  void Store(std::vector<BlockKey> keys) {
    store::StorePlan plan;
    ASSERT_TRUE(store_->PrepareStore(keys, &plan).ok());
    store_->CompleteStore(keys, true);
  }

  std::optional<Message> Receive() {
    std::vector<std::string> frames;
    int more = 1;
    while (more != 0) {
      zmq_msg_t msg;
      zmq_msg_init(&msg);
      if (zmq_msg_recv(&msg, sub_, 0) < 0) {
        zmq_msg_close(&msg);
        return std::nullopt;
      }
      frames.emplace_back(static_cast<const char*>(zmq_msg_data(&msg)), zmq_msg_size(&msg));
      more = zmq_msg_more(&msg);
      zmq_msg_close(&msg);
    }
    EXPECT_EQ(frames.size(), 3u);
    if (frames.size() != 3) return std::nullopt;
    auto batch = events::DecodeBatch(std::as_bytes(std::span(frames[2])));
    EXPECT_TRUE(batch.ok()) << batch.status().ToString();
    if (!batch.ok()) return std::nullopt;
    return Message{frames[0], *events::DecodeSequence(std::as_bytes(std::span(frames[1]))),
                   std::move(batch->events)};
  }

  // The next message of `topic` (the probes' are skipped).
  Message Next(const std::string& topic) {
    while (true) {
      std::optional<Message> m = Receive();
      if (!m) {
        ADD_FAILURE() << "no message on " << topic;
        return {};
      }
      if (m->topic == topic) return *m;
    }
  }

  std::unique_ptr<store::TieredStore> store_;
  std::unique_ptr<KvEventPump> pump_;
  void* ctx_ = nullptr;
  void* sub_ = nullptr;
};

BlockStored Stored(std::vector<ExternalHash> hashes, std::string medium, int64_t group = 0) {
  BlockStored e;
  e.block_hashes = std::move(hashes);
  e.medium = std::move(medium);
  e.group_idx = group;
  return e;
}

TEST_F(KvEventPumpTest, EachNamespaceIsATopicStartingWithAllBlocksCleared) {
  Start();
  Store({Key(1, 10), Key(1, 11), Key(2, 20), Key(1, 12, 3)});
  pump_->PublishNow();
  Message a = Next("a");
  EXPECT_EQ(a.seq, 0);
  EXPECT_THAT(a.events, ::testing::ElementsAre(KvEvent(AllBlocksCleared{}),
                                               KvEvent(Stored({10u, 11u}, "CPU")),
                                               KvEvent(Stored({12u}, "CPU", 3))));
  Message b = Next("b");
  EXPECT_EQ(b.seq, 0);
  EXPECT_THAT(b.events,
              ::testing::ElementsAre(KvEvent(AllBlocksCleared{}), KvEvent(Stored({20u}, "CPU"))));

  // Removed blocks, and wide hashes as 16 bytes big-endian; the topic's numbers go on.
  std::vector<BlockKey> gone = {Key(1, 11)};
  ASSERT_EQ(store_->cpu().Remove(gone), 1u);
  const BlockKey wide{BlockHash{.lo = 0x090a0b0c0d0e0f10, .hi = 0x0102030405060708}, 0, 1};
  Store({wide});
  pump_->PublishNow();
  a = Next("a");
  EXPECT_EQ(a.seq, 1);
  const std::string bytes = "\x01\x02\x03\x04\x05\x06\x07\x08\x09\x0a\x0b\x0c\x0d\x0e\x0f\x10";
  EXPECT_THAT(a.events, ::testing::ElementsAre(KvEvent(BlockRemoved{{11u}, "CPU", 0}),
                                               KvEvent(Stored({bytes}, "CPU"))));
  EXPECT_EQ(pump_->stats().rounds_lost, 0u);
}

TEST_F(KvEventPumpTest, ARoundPublishesEachKeysLastEventOnly) {
  Start();
  Store({Key(1, 1), Key(1, 2)});
  pump_->PublishNow();
  EXPECT_EQ(Next("a").seq, 0);
  // Within one round: 1 removed then stored again (held: stored), 3 stored then removed
  // (gone: removed), 2 removed.
  const std::vector<BlockKey> one = {Key(1, 1)};
  ASSERT_EQ(store_->cpu().Remove(one), 1u);
  Store({Key(1, 3), Key(1, 1)});
  const std::vector<BlockKey> three_two = {Key(1, 3), Key(1, 2)};
  ASSERT_EQ(store_->cpu().Remove(three_two), 2u);
  pump_->PublishNow();
  Message a = Next("a");
  EXPECT_EQ(a.seq, 1);
  EXPECT_THAT(a.events, ::testing::ElementsAre(KvEvent(BlockRemoved{{3u, 2u}, "CPU", 0}),
                                               KvEvent(Stored({1u}, "CPU"))));
}

TEST_F(KvEventPumpTest, EventsTheStoreDroppedRestartEveryTopic) {
  Start(/*max_pending_event_keys=*/4);
  Store({Key(1, 1)});
  pump_->PublishNow();
  EXPECT_EQ(Next("a").seq, 0);
  // More undrained keys than the store keeps: it drops them for a lost mark.
  Store({Key(2, 1), Key(2, 2), Key(2, 3), Key(2, 4), Key(2, 5)});
  Store({Key(1, 2)});
  pump_->PublishNow();
  // "a" forgets all (its key 1 and b's keys are held, but unknown now), then hears of key 2;
  // "b" had no topic yet and gets none until its next event.
  Message a = Next("a");
  EXPECT_EQ(a.seq, 1);
  EXPECT_THAT(a.events,
              ::testing::ElementsAre(KvEvent(AllBlocksCleared{}), KvEvent(Stored({2u}, "CPU"))));
  EXPECT_EQ(pump_->stats().rounds_lost, 1u);
  Store({Key(2, 9)});
  pump_->PublishNow();
  Message b = Next("b");
  EXPECT_EQ(b.seq, 0);
  EXPECT_THAT(b.events,
              ::testing::ElementsAre(KvEvent(AllBlocksCleared{}), KvEvent(Stored({9u}, "CPU"))));
}

// A topic's batches from sequence 0, through the replay socket (the topic frame names it).
std::vector<std::vector<KvEvent>> ReplayTopic(const std::string& endpoint,
                                              const std::string& topic) {
  void* ctx = zmq_ctx_new();
  void* s = zmq_socket(ctx, ZMQ_DEALER);
  const int linger = 0, timeout = 10000;
  zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof(linger));
  zmq_setsockopt(s, ZMQ_RCVTIMEO, &timeout, sizeof(timeout));
  EXPECT_EQ(zmq_connect(s, endpoint.c_str()), 0);
  const std::string start = events::EncodeSequence(0);
  zmq_send(s, "", 0, ZMQ_SNDMORE);
  zmq_send(s, start.data(), start.size(), ZMQ_SNDMORE);
  zmq_send(s, topic.data(), topic.size(), 0);
  std::vector<std::vector<KvEvent>> out;
  while (true) {
    std::vector<std::string> frames;
    for (int more = 1; more != 0;) {
      zmq_msg_t m;
      zmq_msg_init(&m);
      if (zmq_msg_recv(&m, s, 0) < 0) {
        zmq_msg_close(&m);
        ADD_FAILURE() << "no replay reply";
        more = 0;
        frames.clear();
        break;
      }
      frames.emplace_back(static_cast<const char*>(zmq_msg_data(&m)), zmq_msg_size(&m));
      more = zmq_msg_more(&m);
      zmq_msg_close(&m);
    }
    if (frames.size() != 3) break;
    if (*events::DecodeSequence(std::as_bytes(std::span(frames[1]))) == -1) break;
    auto batch = events::DecodeBatch(std::as_bytes(std::span(frames[2])));
    EXPECT_TRUE(batch.ok());
    out.push_back(batch.ok() ? batch->events : std::vector<KvEvent>{});
  }
  zmq_close(s);
  zmq_ctx_term(ctx);
  return out;
}

// A node restarted on its SSD tier starts each namespace's topic with what the tier kept.
TEST(KvEventPumpSsdTest, EachTopicStartsWithTheBlocksTheSsdTierKeptAcrossARestart) {
  ::kvstash::testing::TempDir dir;
  auto options = [&dir] {
    store::TieredStoreOptions o;
    o.block_bytes = kBlock;
    o.cpu_capacity_blocks = 16;
    o.prefault = false;
    o.enable_events = true;
    store::SsdTierOptions ssd;
    ssd.dir = dir.path();
    ssd.capacity_bytes = 64 * kBlock;
    ssd.direct_io = false;
    o.ssd = ssd;
    return o;
  };
  {
    auto first = store::TieredStore::Create(options());
    ASSERT_TRUE(first.ok()) << first.status().ToString();
    const std::vector<BlockKey> keys = {Key(1, 5), Key(1, 6), Key(2, 7, 1)};
    store::StorePlan plan;
    ASSERT_TRUE((*first)->PrepareStore(keys, &plan).ok());
    (*first)->CompleteStore(keys, true);  // write-through: on SSD once the cascade is done
    (*first)->WaitIdle();
    ASSERT_EQ((*first)->ssd()->resident_blocks(), 3u);
  }
  auto store = store::TieredStore::Create(options());
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  KvEventOptions events;
  events.publisher.endpoint = "tcp://127.0.0.1:*";
  events.publisher.replay_endpoint = "tcp://127.0.0.1:*";
  events.interval = std::chrono::hours(1);
  auto pump = KvEventPump::Create(events, store->get(), [](NamespaceId ns) {
    return ns == 1 ? std::optional<std::string>("a") : std::optional<std::string>("b");
  });
  ASSERT_TRUE(pump.ok());
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  while ((*pump)->publisher().next_sequence("b") == 0 && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  (*pump)->PublishNow();  // and waits for what was published to be sent
  const auto a = ReplayTopic((*pump)->publisher().replay_endpoint(), "a");
  ASSERT_EQ(a.size(), 1u);
  EXPECT_THAT(a[0], ::testing::UnorderedElementsAre(KvEvent(AllBlocksCleared{}),
                                                    KvEvent(Stored({5u, 6u}, "SSD"))));
  EXPECT_EQ(a[0][0], KvEvent(AllBlocksCleared{}));
  const auto b = ReplayTopic((*pump)->publisher().replay_endpoint(), "b");
  ASSERT_EQ(b.size(), 1u);
  EXPECT_THAT(b[0],
              ::testing::ElementsAre(KvEvent(AllBlocksCleared{}), KvEvent(Stored({7u}, "SSD", 1))));
}

}  // namespace
}  // namespace kvstash::node
