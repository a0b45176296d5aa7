// The node service through the loopback transport, with a client (NodeClient) behind a
// FaultChannel: fast, in one process, and deterministic about what the network does. Dropped,
// delayed and corrupted frames, a connection cut in the middle of a store, and leases expiring
// on the transport's timer: each leaves the node consistent (nothing half-written readable, no
// slot or pin leaked) and the client with an error, never a wrong block. Each test runs with
// blocks one to a call (PutBlock, GetBlock) and many to a call (PutBlocks, GetBlocks).

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <thread>

#include "block_pattern.h"
#include "kvstash/connector/node_client.h"
#include "kvstash/node/node_server.h"
#include "kvstash/proto/wire.pb.h"
#include "kvstash/transport/fault_channel.h"
#include "kvstash/transport/loopback.h"

namespace kvstash::node {
namespace {

using namespace std::chrono_literals;
using connector::NodeClient;
using ::kvstash::testing::FillPattern;
using ::kvstash::testing::MatchesPattern;
using ::testing::HasSubstr;
using transport::Fault;

constexpr size_t kBlock = 4096;
constexpr size_t kCapacity = 16;

BlockKey Key(uint64_t k) { return BlockKey{Hash128{k, 0x10ca1}, 0}; }
std::vector<BlockKey> Keys(std::initializer_list<BlockKey> keys) { return keys; }

// The parameter: whether the node serves batched calls (the client then sends them).
class NodeLoopbackTest : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override { StartNode(30000ms); }

  void StartNode(std::chrono::milliseconds lease) {
    node_.reset();
    NodeOptions options;
    options.max_keys_per_request = 64;
    options.max_batch_bytes = GetParam() ? uint64_t{1} << 20 : 0;
    options.store.block_bytes = kBlock;
    options.store.cpu_capacity_blocks = kCapacity;
    options.store.prefault = false;
    options.lease_timeout = lease;
    options.listen = [network = network_](const transport::ServerOptions& server) {
      return Result<std::unique_ptr<transport::Listener>>(network->Listen(server));
    };
    auto node = NodeServer::Create(options);
    ASSERT_TRUE(node.ok()) << node.status().ToString();
    node_ = std::move(*node);
  }

  // A client whose calls go through a FaultChannel following `plan` (by method, the index of
  // the call of that method).
  std::unique_ptr<NodeClient> Client(std::map<std::pair<uint16_t, uint64_t>, Fault> plan = {},
                                     std::chrono::milliseconds timeout = 500ms) {
    connector::NodeClientOptions options;
    options.nodes = {{"loopback", node_->port()}};
    options.timeout = timeout;
    // Single faults, each to its outcome: a lookup waits for its calls, and no run of faults
    // makes the node suspect (ManyNodesTest and NodeHealthTest test that).
    options.lookup_budget = timeout;
    options.suspect_after = 1000;
    options.connect =
        [this, plan](
            const transport::ClientOptions& client) -> Result<std::unique_ptr<transport::Channel>> {
      auto inner = network_->Connect(client);
      transport::Channel* raw = inner.get();
      auto channel = std::make_unique<transport::FaultChannel>(
          std::move(inner),
          [plan](uint16_t method, uint64_t index) {
            auto it = plan.find({method, index});
            return it == plan.end() ? Fault{} : it->second;
          },
          [raw] { transport::LoopbackNetwork::CutAfterNextRequest(*raw); });
      faults_ = channel.get();
      return std::unique_ptr<transport::Channel>(std::move(channel));
    };
    auto client = NodeClient::Create(options);
    EXPECT_TRUE(client.ok()) << client.status().ToString();
    return client.ok() ? std::move(*client) : nullptr;
  }

  static Status Put(NodeClient& client, uint64_t k) {
    std::vector<std::byte> block(kBlock);
    FillPattern(k, block);
    const BlockKey key = Key(k);
    const transport::Bytes bytes = block;
    return client.Put(std::span(&key, 1), std::span(&bytes, 1));
  }
  static bool ReadsBack(NodeClient& client, uint64_t k) {
    std::vector<std::byte> block(kBlock);
    auto got = client.Get(Key(k), block);
    return got.ok() && *got == kBlock && MatchesPattern(k, block);
  }
  // The method a store of blocks goes by.
  uint16_t PutMethod() const {
    return GetParam() ? wire::METHOD_PUT_BLOCKS : wire::METHOD_PUT_BLOCK;
  }
  uint64_t Counter(const std::string& name) { return node_->Counters().at(name); }
  // Everything the network still has to run (late replies, cut connections) has run.
  void Settle() {
    network_->Flush();
    std::this_thread::sleep_for(5ms);
    network_->Flush();
  }

  std::shared_ptr<transport::LoopbackNetwork> network_ = transport::LoopbackNetwork::Create();
  std::unique_ptr<NodeServer> node_;
  transport::FaultChannel* faults_ = nullptr;
};

constexpr uint16_t kLookup = wire::METHOD_LOOKUP;

INSTANTIATE_TEST_SUITE_P(Calls, NodeLoopbackTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "Batched" : "OneBlockPerCall";
                         });

TEST_P(NodeLoopbackTest, StoresLooksUpAndReadsBackOverTheLoopback) {
  auto client = Client();
  ASSERT_NE(client, nullptr);
  for (uint64_t k = 0; k < 4; ++k) ASSERT_TRUE(Put(*client, k).ok());
  EXPECT_EQ(
      client->Lookup(Keys({Key(0), Key(3), Key(9)})),
      (std::vector<LookupResult>{LookupResult::kHit, LookupResult::kHit, LookupResult::kMiss}));
  EXPECT_TRUE(ReadsBack(*client, 2));
  EXPECT_FALSE(node_->shares_cpu_memory());  // the loopback shares no memory: payloads copied
  EXPECT_EQ(Counter("node.blocks_stored"), 4u);
}

TEST_P(NodeLoopbackTest, ADroppedFrameIsADeadlineAndChangesNothing) {
  auto client = Client(
      {{{PutMethod(), 0}, {Fault::Kind::kDrop}}, {{kLookup, 0}, {Fault::Kind::kDrop}}}, 100ms);
  ASSERT_NE(client, nullptr);
  EXPECT_EQ(Put(*client, 1).code(), StatusCode::kDeadlineExceeded);
  // The dropped lookup reads as misses, counted as an unreachable node, not as a refusal.
  EXPECT_EQ(client->Lookup(Keys({Key(1)})), std::vector<LookupResult>{LookupResult::kMiss});
  EXPECT_EQ(client->counters()[ClientCounter::kUnreachable], 2u);
  EXPECT_EQ(client->counters()[ClientCounter::kRefused], 0u);
  EXPECT_EQ(Counter("cpu.resident_blocks"), 0u);
  // The next frames arrive.
  ASSERT_TRUE(Put(*client, 1).ok());
  EXPECT_TRUE(ReadsBack(*client, 1));
  EXPECT_EQ(faults_->counts().dropped, 2u);
}

TEST_P(NodeLoopbackTest, AStoreDelayedPastItsDeadlineIsWholeOrAbsentNeverHalfWritten) {
  auto client = Client({{{PutMethod(), 0}, {Fault::Kind::kDelay, 250ms}},
                        {{PutMethod(), 1}, {Fault::Kind::kDelay, 20ms}}},
                       100ms);
  ASSERT_NE(client, nullptr);
  EXPECT_EQ(Put(*client, 1).code(), StatusCode::kDeadlineExceeded);
  // The request arrives after the client gave up, whole: the node stores it, and its reply goes
  // nowhere. What a lookup then finds reads back exactly.
  std::this_thread::sleep_for(250ms);
  Settle();
  EXPECT_EQ(Counter("node.blocks_stored"), 1u);
  EXPECT_EQ(client->Lookup(Keys({Key(1)})), std::vector<LookupResult>{LookupResult::kHit});
  EXPECT_TRUE(ReadsBack(*client, 1));
  // A delay within the deadline is only slower.
  ASSERT_TRUE(Put(*client, 2).ok());
  EXPECT_TRUE(ReadsBack(*client, 2));
  // Nothing leaked: the whole tier still takes new blocks (the first two are evicted).
  for (uint64_t k = 100; k < 100 + kCapacity; ++k) ASSERT_TRUE(Put(*client, k).ok()) << k;
  EXPECT_EQ(Counter("cpu.resident_blocks"), kCapacity);
}

TEST_P(NodeLoopbackTest, ACorruptedFrameIsRefusedAndACorruptPayloadNeverStored) {
  auto client = Client({{{kLookup, 0}, {Fault::Kind::kCorruptRequest}},
                        {{PutMethod(), 0}, {Fault::Kind::kCorruptPayload}}});
  ASSERT_NE(client, nullptr);
  auto refused = client->LookupStrict(Keys({Key(1)}));
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("unparseable"));
  EXPECT_EQ(client->counters()[ClientCounter::kRefused], 1u);
  // The checksum the client sent catches the flipped byte: DataLoss, nothing stored.
  EXPECT_EQ(Put(*client, 1).code(), StatusCode::kDataLoss);
  EXPECT_EQ(Counter("node.checksum_failures"), 1u);
  EXPECT_EQ(Counter("cpu.resident_blocks"), 0u);
  EXPECT_EQ(client->Lookup(Keys({Key(1)})), std::vector<LookupResult>{LookupResult::kMiss});
  // The session goes on.
  ASSERT_TRUE(Put(*client, 1).ok());
  EXPECT_TRUE(ReadsBack(*client, 1));
}

TEST_P(NodeLoopbackTest, AConnectionCutMidStoreAbortsTheStoreAndTheClientReconnects) {
  auto client = Client({{{PutMethod(), 1}, {Fault::Kind::kDisconnectAfterRequest}}});
  ASSERT_NE(client, nullptr);
  ASSERT_TRUE(Put(*client, 1).ok());
  // The request of block 2 reaches the node, which reserves a slot (a batch reserves none
  // before its bytes are in); its bytes never come.
  EXPECT_EQ(Put(*client, 2).code(), StatusCode::kUnavailable);
  Settle();
  EXPECT_EQ(Counter("node.sessions_closed"), 1u);
  EXPECT_EQ(Counter("node.blocks_aborted"), GetParam() ? 0u : 1u);
  EXPECT_EQ(Counter("cpu.resident_blocks"), 1u);  // block 1 only: the slot of 2 came back
  // The client connects again; what was committed before the cut is still there.
  EXPECT_EQ(client->Lookup(Keys({Key(1), Key(2)})),
            (std::vector<LookupResult>{LookupResult::kHit, LookupResult::kMiss}));
  EXPECT_TRUE(ReadsBack(*client, 1));
  ASSERT_TRUE(Put(*client, 2).ok());
  EXPECT_EQ(faults_->counts().disconnects, 1u);
}

// NodeClient::Pin (what the connector's prepare_load sends) keeps blocks through another
// client's churn until Unpin; then the next churn evicts them.
TEST_P(NodeLoopbackTest, PinnedBlocksOutliveChurnUntilUnpinned) {
  auto reader = Client();
  auto writer = Client();
  ASSERT_TRUE(reader && writer);
  ASSERT_TRUE(Put(*writer, 1).ok());
  ASSERT_TRUE(Put(*writer, 2).ok());
  const std::vector<BlockKey> pinned = {Key(1)};
  reader->Pin(pinned);  // asynchronous
  for (int i = 0; i < 200 && Counter("node.pinned_keys") == 0; ++i) {
    std::this_thread::sleep_for(1ms);
  }
  ASSERT_EQ(Counter("node.pinned_keys"), 1u);
  for (uint64_t k = 100; k < 100 + 2 * kCapacity; ++k) ASSERT_TRUE(Put(*writer, k).ok()) << k;
  EXPECT_EQ(writer->Lookup(Keys({Key(1), Key(2)})),
            (std::vector<LookupResult>{LookupResult::kHit, LookupResult::kMiss}));
  EXPECT_TRUE(ReadsBack(*reader, 1));
  reader->Unpin(pinned);
  Settle();
  for (uint64_t k = 200; k < 200 + 2 * kCapacity; ++k) ASSERT_TRUE(Put(*writer, k).ok()) << k;
  EXPECT_EQ(writer->Lookup(Keys({Key(1)})), (std::vector<LookupResult>{LookupResult::kMiss}));
}

TEST_P(NodeLoopbackTest, PinsOfASilentSessionExpireOnTheTransportsTimer) {
  StartNode(60ms);
  auto client = Client();
  ASSERT_NE(client, nullptr);
  ASSERT_TRUE(Put(*client, 1).ok());
  // Pin block 1 with a Load and go silent.
  auto channel = network_->Connect([&] {
    transport::ClientOptions options;
    options.port = node_->port();
    return options;
  }());
  wire::LoadRequest load;
  *load.add_keys() = [] {
    wire::Key key;
    key.set_hash_lo(1);
    key.set_hash_hi(0x10ca1);
    return key;
  }();
  const std::string bytes = load.SerializeAsString();
  std::promise<Status> loaded;
  channel->Call(wire::METHOD_LOAD, std::as_bytes(std::span(bytes)), {},
                [&](const transport::Response& r) { loaded.set_value(r.status); });
  ASSERT_TRUE(loaded.get_future().get().ok());
  // The lease sweeps run every 15 ms; within a few leases the pin is released.
  for (int i = 0; i < 100 && Counter("node.leases_expired") == 0; ++i) {
    std::this_thread::sleep_for(10ms);
  }
  EXPECT_EQ(Counter("node.leases_expired"), 1u);
  EXPECT_EQ(Counter("node.pins_released_on_expiry"), 1u);
}

}  // namespace
}  // namespace kvstash::node
