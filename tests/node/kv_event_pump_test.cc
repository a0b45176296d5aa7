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
  void Start(size_t max_pending_event_keys = size_t{1} << 20, size_t cpu_blocks = 64,
             size_t max_metas = 16) {
    store::TieredStoreOptions options;
    options.block_bytes = kBlock;
    options.cpu_capacity_blocks = cpu_blocks;
    options.prefault = false;
    options.enable_events = true;
    options.max_pending_event_keys = max_pending_event_keys;
    auto store = store::TieredStore::Create(options);
    ASSERT_TRUE(store.ok()) << store.status().ToString();
    store_ = std::move(*store);
    metas_ = std::make_unique<BlockMetaTable>(max_metas);
    KvEventOptions events;
    events.publisher.endpoint = "tcp://127.0.0.1:*";
    // Rounds only when the test says (PublishNow), so that it decides what one round holds.
    events.interval = std::chrono::hours(1);
    auto pump = KvEventPump::Create(
        events, store_.get(),
        [](NamespaceId ns) {
          static const std::map<NamespaceId, std::string> names = {
              {1, "a"}, {2, "b"}, {3, "probe"}};
          auto it = names.find(ns);
          return it == names.end() ? std::nullopt : std::optional<std::string>(it->second);
        },
        metas_.get());
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
  std::unique_ptr<BlockMetaTable> metas_;  // as a node's puts fill it
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

// A chain's BlockStored in the CPU tier: its parent (none: a request's first block) and size.
BlockStored Chain(std::vector<ExternalHash> hashes, std::optional<uint64_t> parent,
                  int64_t block_size, int64_t group = 0) {
  BlockStored e = Stored(std::move(hashes), "CPU", group);
  if (parent) e.parent_block_hash = *parent;
  e.block_size = block_size;
  return e;
}

BlockMeta Meta(std::optional<uint64_t> parent, uint32_t tokens) {
  BlockMeta meta;
  if (parent) meta.parent = BlockHash{.lo = *parent, .hi = 0};
  meta.tokens = tokens;
  return meta;
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

// Blocks whose puts said what they hold go in one BlockStored per chain: blocks each naming the
// one before as its parent, with the same tokens, whatever order they were committed in (the
// cluster client sends a request's blocks last first). A break (a parent not stored here,
// another size, a first block, a second block naming the same parent) starts a new event;
// blocks without metadata are published together, as before; a cycle is published once. The
// round takes what it published out of the table.
TEST_F(KvEventPumpTest, BlocksWithMetadataArePublishedInChainsWithTheirParentAndSize) {
  Start();
  const std::vector<std::pair<uint64_t, BlockMeta>> said = {
      {10, Meta(9, 16)},
      {11, Meta(10, 16)},
      {12, Meta(11, 16)},  // a chain under 9
      {20, Meta(19, 16)},
      {21, Meta(20, 16)},            // another chain
      {40, Meta(std::nullopt, 16)},  // a request's first block
      {41, Meta(40, 32)},            // another size
      {60, Meta(61, 16)},
      {61, Meta(60, 16)},  // a cycle
      {70, Meta(69, 16)},
      {71, Meta(70, 16)},
      {72, Meta(70, 16)},  // two children of 70
      {50, Meta(7, 16)},
      {51, Meta(50, 16)}};  // group 1
  for (const auto& [k, meta] : said) metas_->Record(Key(1, k, k == 50 || k == 51 ? 1 : 0), meta);
  Store({Key(1, 12), Key(1, 11), Key(1, 10), Key(1, 20), Key(1, 21), Key(1, 30), Key(1, 31),
         Key(1, 40), Key(1, 41), Key(1, 50, 1), Key(1, 51, 1), Key(1, 60), Key(1, 61), Key(1, 70),
         Key(1, 71), Key(1, 72)});
  pump_->PublishNow();
  EXPECT_THAT(Next("a").events,
              ::testing::ElementsAre(
                  KvEvent(AllBlocksCleared{}), KvEvent(Chain({10u, 11u, 12u}, 9, 16)),
                  KvEvent(Chain({20u, 21u}, 19, 16)), KvEvent(Chain({30u, 31u}, std::nullopt, 0)),
                  KvEvent(Chain({40u}, std::nullopt, 16)), KvEvent(Chain({41u}, 40, 32)),
                  KvEvent(Chain({60u, 61u}, 61, 16)), KvEvent(Chain({70u, 71u}, 69, 16)),
                  KvEvent(Chain({72u}, 70, 16)), KvEvent(Chain({50u, 51u}, 7, 16, 1))));
  EXPECT_TRUE(metas_->empty());
  // Only the put's own life carries it: stored again (a promotion), the block has none.
  const std::vector<BlockKey> ten = {Key(1, 10)};
  ASSERT_EQ(store_->cpu().Remove(ten), 1u);
  pump_->PublishNow();
  Next("a");
  Store({Key(1, 10)});
  pump_->PublishNow();
  EXPECT_THAT(Next("a").events, ::testing::ElementsAre(KvEvent(Stored({10u}, "CPU"))));
  EXPECT_EQ(pump_->stats().block_metas_dropped, 0u);
}

// A chain longer than one batch goes on in the next batch from the last block sent.
TEST_F(KvEventPumpTest, AChainSplitAcrossBatchesHangsFromTheLastBlockSent) {
  constexpr uint64_t kBlocks = 8192 + 3;  // one more batch than kMaxHashesPerBatch holds
  Start(size_t{1} << 20, /*cpu_blocks=*/kBlocks + 8, /*max_metas=*/kBlocks);
  std::vector<BlockKey> keys;
  for (uint64_t k = 1; k <= kBlocks; ++k) {
    keys.push_back(Key(1, k));
    metas_->Record(keys.back(), Meta(k - 1, 16));
  }
  Store(keys);
  pump_->PublishNow();
  const Message first = Next("a");
  const Message second = Next("a");
  ASSERT_EQ(first.events.size(), 2u);  // AllBlocksCleared, then the chain's first 8192 blocks
  ASSERT_EQ(second.events.size(), 1u);
  const auto& a = std::get<BlockStored>(first.events[1]);
  const auto& b = std::get<BlockStored>(second.events[0]);
  ASSERT_EQ(a.block_hashes.size(), 8192u);
  EXPECT_EQ(a.parent_block_hash, ExternalHash(uint64_t{0}));
  EXPECT_EQ(a.block_size, 16);
  EXPECT_EQ(b.block_hashes, (std::vector<ExternalHash>{8193u, 8194u, 8195u}));
  EXPECT_EQ(b.parent_block_hash, ExternalHash(uint64_t{8192}));
  EXPECT_EQ(b.block_size, 16);
}

// The table keeps the newest `capacity` entries: the oldest goes first, counted, and a block
// taken, erased or recorded again is not counted when its old slot comes round.
TEST(BlockMetaTableTest, KeepsTheNewestEntriesAndCountsTheOldestDropped) {
  BlockMetaTable table(3);
  EXPECT_TRUE(table.empty());
  table.Record(Key(1, 1), Meta(std::nullopt, 16));
  table.Record(Key(1, 2), Meta(1, 16));
  table.Record(Key(1, 3), Meta(2, 16));
  table.Record(Key(1, 4), Meta(3, 16));  // 1 goes
  EXPECT_EQ(table.dropped(), 1u);
  EXPECT_EQ(table.Take(Key(1, 1)), std::nullopt);
  EXPECT_EQ(table.Take(Key(1, 2)), Meta(1, 16));
  EXPECT_EQ(table.Take(Key(1, 2)), std::nullopt);  // taken once
  table.Erase(Key(1, 3));
  table.Record(Key(1, 4), Meta(3, 32));  // recorded again: its newer entry counts
  table.Record(Key(1, 5), Meta(4, 16));  // the slots of 2, 3 and 4's first entry: none dropped
  table.Record(Key(1, 6), Meta(5, 16));
  EXPECT_EQ(table.dropped(), 1u);
  EXPECT_EQ(table.Take(Key(1, 4)), Meta(3, 32));
  // Another namespace's or group's block of the same hash is another key.
  table.Record(Key(2, 5), Meta(9, 16));
  table.Record(Key(1, 5, 1), Meta(9, 16));
  EXPECT_EQ(table.dropped(), 2u);  // 5's slot came round again: it was still there
  EXPECT_EQ(table.Take(Key(1, 5)), std::nullopt);
  EXPECT_EQ(table.Take(Key(1, 6)), Meta(5, 16));
  EXPECT_EQ(table.Take(Key(2, 5)), Meta(9, 16));
  EXPECT_EQ(table.Take(Key(1, 5, 1)), Meta(9, 16));
  EXPECT_TRUE(table.empty());
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
