// Membership in the cluster client, over the loopback transport with real node services and
// an in-memory member source (no etcd): who joins and leaves moves only their own keys, members
// that stay keep their connection, a node of another block size is left out for good, and zones
// spread a key's replicas. Milliseconds each.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <string>

#include "block_pattern.h"
#include "kvstash/connector/in_memory_members.h"
#include "kvstash/connector/node_client.h"
#include "kvstash/node/node_server.h"
#include "kvstash/transport/loopback.h"

namespace kvstash::node {
namespace {

using ::kvstash::ClientCounter;
using ::kvstash::ClientCounterDef;

using connector::NodeAddress;
using connector::NodeClient;
using ::kvstash::testing::FillPattern;
using ::kvstash::testing::MatchesPattern;
using membership::NodeRecord;

constexpr size_t kBlock = 4096;

BlockKey Key(uint64_t k) { return BlockKey{Hash128{k, 0xe3e}, 0}; }

class ClusterMembersTest : public ::testing::Test {
 protected:
  // A node on the loopback network; its record names it as "loopback:PORT".
  NodeRecord StartNode(size_t block_bytes = kBlock, std::string zone = "") {
    NodeOptions options;
    options.store.block_bytes = block_bytes;
    options.store.cpu_capacity_blocks = 512;
    options.store.prefault = false;
    options.listen = [network = network_](const transport::ServerOptions& server) {
      return Result<std::unique_ptr<transport::Listener>>(network->Listen(server));
    };
    auto node = NodeServer::Create(options);
    EXPECT_TRUE(node.ok()) << node.status().ToString();
    NodeRecord record;
    record.address = "loopback:" + std::to_string((*node)->port());
    record.block_bytes = block_bytes;
    record.zone = std::move(zone);
    nodes_.push_back(std::move(*node));
    return record;
  }

  std::unique_ptr<NodeClient> Client(size_t replicas = 1) {
    connector::NodeClientOptions options;
    options.members = members_;
    options.replicas = replicas;
    options.block_bytes = kBlock;
    options.lookup_budget = options.timeout;  // every answer counts
    options.connect = [this](const transport::ClientOptions& c) {
      ++connects_[c.port];
      return Result<std::unique_ptr<transport::Channel>>(network_->Connect(c));
    };
    auto client = NodeClient::Create(options);
    EXPECT_TRUE(client.ok()) << client.status().ToString();
    return client.ok() ? std::move(*client) : nullptr;
  }

  static std::string Home(NodeClient& client, uint64_t k) {
    const std::vector<NodeAddress> places = client.PlacesOf(Key(k));
    return places.empty() ? "" : places.front().ToString();
  }

  static Status Store(NodeClient& client, uint64_t begin, uint64_t end) {
    std::vector<BlockKey> keys;
    std::vector<std::vector<std::byte>> blocks;
    for (uint64_t k = begin; k < end; ++k) {
      keys.push_back(Key(k));
      blocks.emplace_back(kBlock);
      FillPattern(k, blocks.back());
    }
    std::vector<transport::Bytes> views(blocks.begin(), blocks.end());
    return client.Put(keys, views);
  }

  static bool ReadsBack(NodeClient& client, uint64_t k) {
    std::vector<std::byte> block(kBlock);
    auto got = client.Get(Key(k), block);
    return got.ok() && MatchesPattern(k, block);
  }

  std::shared_ptr<transport::LoopbackNetwork> network_ = transport::LoopbackNetwork::Create();
  std::vector<std::unique_ptr<NodeServer>> nodes_;
  std::shared_ptr<connector::InMemoryMembers> members_ =
      std::make_shared<connector::InMemoryMembers>();
  std::map<uint16_t, int> connects_;  // channels made, by port
};

TEST_F(ClusterMembersTest, AJoinOrALeaveMovesOnlyThatNodesKeysAndKeepsTheOthersConnections) {
  const NodeRecord a = StartNode(), b = StartNode(), c = StartNode();
  members_->Set({a, b});
  std::unique_ptr<NodeClient> client = Client();
  ASSERT_NE(client, nullptr);
  constexpr uint64_t kKeys = 300;
  ASSERT_TRUE(Store(*client, 0, kKeys).ok());
  std::map<uint64_t, std::string> before;
  for (uint64_t k = 0; k < kKeys; ++k) before[k] = Home(*client, k);

  members_->Set({a, b, c});  // c joins
  ASSERT_EQ(client->nodes().size(), 3u);
  size_t moved = 0;
  for (uint64_t k = 0; k < kKeys; ++k) {
    const std::string now = Home(*client, k);
    if (now != before[k]) {
      EXPECT_EQ(now, c.address) << "key " << k << " moved between two nodes that stayed";
      ++moved;
      continue;
    }
    EXPECT_TRUE(ReadsBack(*client, k)) << k;  // the others' keys still read right
  }
  EXPECT_GT(moved, kKeys / 3 / 2);
  EXPECT_LT(moved, kKeys / 3 * 2);

  std::map<uint64_t, std::string> with_c;
  for (uint64_t k = 0; k < kKeys; ++k) with_c[k] = Home(*client, k);
  nodes_[0].reset();      // a stops,
  members_->Set({b, c});  // and leaves: its keys go to the others, b's and c's stay
  for (uint64_t k = 0; k < kKeys; ++k) {
    if (with_c[k] != a.address) EXPECT_EQ(Home(*client, k), with_c[k]) << k;
    EXPECT_NE(Home(*client, k), a.address);
  }
  // b was connected once for all of this: a member that stays keeps its channel.
  const uint16_t b_port = static_cast<uint16_t>(std::stoi(b.address.substr(9)));
  EXPECT_EQ(connects_[b_port], 1);
  EXPECT_EQ(client->counters()[ClientCounter::kMembersJoined], 1u);
  EXPECT_EQ(client->counters()[ClientCounter::kMembersLeft], 1u);
}

// etcd drops a node whose lease lapsed while it was cut off from etcd, not from the client: it
// still serves, so the client keeps it (its keys stay where they are) until it fails a call.
TEST_F(ClusterMembersTest, ANodeItsSourceDropsButThatAnswersStaysUntilItFails) {
  const NodeRecord a = StartNode(), b = StartNode();
  members_->Set({a, b});
  std::unique_ptr<NodeClient> client = Client();
  ASSERT_NE(client, nullptr);
  constexpr uint64_t kKeys = 100;
  ASSERT_TRUE(Store(*client, 0, kKeys).ok());
  members_->Set({b});  // a dropped, still serving
  EXPECT_EQ(client->nodes().size(), 2u);
  uint64_t on_a = 0;
  while (Home(*client, on_a) != a.address) ++on_a;
  EXPECT_TRUE(ReadsBack(*client, on_a));
  EXPECT_EQ(client->counters()[ClientCounter::kMembersLeft], 0u);
  members_->Set({a, b});  // listed again: a member as before
  members_->Set({b});
  EXPECT_EQ(client->nodes().size(), 2u);
  // a stops: the first call that finds it gone drops it, and its keys go to b.
  nodes_[0].reset();
  std::vector<BlockKey> keys;
  for (uint64_t k = 0; k < kKeys; ++k) keys.push_back(Key(k));
  (void)client->Lookup(keys);
  ASSERT_EQ(client->nodes().size(), 1u);
  EXPECT_EQ(client->nodes()[0].ToString(), b.address);
  EXPECT_EQ(client->counters()[ClientCounter::kMembersLeft], 1u);
  ASSERT_TRUE(Store(*client, on_a, on_a + 1).ok());
  EXPECT_TRUE(ReadsBack(*client, on_a));
}

TEST_F(ClusterMembersTest, ANodeOfAnotherBlockSizeIsLeftOutForGood) {
  const NodeRecord a = StartNode(), odd = StartNode(2 * kBlock);
  members_->Set({a, odd});
  std::unique_ptr<NodeClient> client = Client();
  ASSERT_NE(client, nullptr);
  // The first call that reaches the odd node is refused naming both sizes, and it is out.
  uint64_t on_odd = 0;
  while (Home(*client, on_odd) != odd.address) ++on_odd;
  const Status put = Store(*client, on_odd, on_odd + 1);
  EXPECT_EQ(put.code(), StatusCode::kFailedPrecondition) << put.ToString();
  EXPECT_THAT(std::string(put.message()), ::testing::HasSubstr(std::to_string(2 * kBlock)));
  ASSERT_EQ(client->nodes().size(), 1u);
  EXPECT_EQ(client->nodes()[0].ToString(), a.address);
  // A later set that lists it again still leaves it out; its keys go to a.
  members_->Set({a, odd});
  EXPECT_EQ(client->nodes().size(), 1u);
  ASSERT_TRUE(Store(*client, on_odd, on_odd + 1).ok());
  EXPECT_TRUE(ReadsBack(*client, on_odd));
}

TEST_F(ClusterMembersTest, ReplicasGoToDistinctZones) {
  // Four nodes in two zones: every key's two replicas are in different zones.
  std::vector<NodeRecord> records = {StartNode(kBlock, "rack-a"), StartNode(kBlock, "rack-a"),
                                     StartNode(kBlock, "rack-b"), StartNode(kBlock, "rack-b")};
  std::map<std::string, std::string> zone_of;
  for (const NodeRecord& r : records) zone_of[r.address] = r.zone;
  members_->Set(records);
  std::unique_ptr<NodeClient> client = Client(2);
  ASSERT_NE(client, nullptr);
  for (uint64_t k = 0; k < 200; ++k) {
    const std::vector<NodeAddress> places = client->PlacesOf(Key(k));
    ASSERT_EQ(places.size(), 2u);
    EXPECT_NE(zone_of[places[0].ToString()], zone_of[places[1].ToString()]) << "key " << k;
  }
  ASSERT_TRUE(Store(*client, 0, 50).ok());
  for (uint64_t k = 0; k < 50; ++k) EXPECT_TRUE(ReadsBack(*client, k)) << k;
}

}  // namespace
}  // namespace kvstash::node
