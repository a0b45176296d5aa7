// NodeClients that follow a cluster's members in a real etcd, over real kvstashd processes: a
// client sees the registered nodes, places keys on a node that joins without restarting, reads
// a killed node's keys as misses (never errors) once its lease expires, loses no hits with two
// replicas when a node dies, and keeps its last set while etcd itself is away.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <csignal>
#include <set>
#include <thread>

#include "block_pattern.h"
#include "daemon_process.h"
#include "etcd_process.h"
#include "kvstash/connector/node_client.h"

namespace kvstash::connector {
namespace {

using namespace std::chrono_literals;
using ::kvstash::testing::Daemon;
using ::kvstash::testing::EtcdProcess;
using ::kvstash::testing::FillPattern;
using ::kvstash::testing::MatchesPattern;
using ::testing::HasSubstr;

constexpr size_t kBlockBytes = 64 << 10;  // the test daemon's block size

BlockKey Key(uint64_t i) {
  BlockKey key;
  key.hash = {0x5eed0000 + i, i * 0x9e3779b97f4a7c15ULL};
  return key;
}

// Keys [first, first + count).
std::vector<BlockKey> Keys(uint64_t first, size_t count) {
  std::vector<BlockKey> keys;
  for (size_t i = 0; i < count; ++i) keys.push_back(Key(first + i));
  return keys;
}

std::string AddressOf(const Daemon& node) { return "127.0.0.1:" + std::to_string(node.port()); }

// Waits up to `timeout` for `client` to see `count` nodes: whether it did.
bool WaitForNodes(const NodeClient& client, size_t count, std::chrono::milliseconds timeout) {
  const auto until = std::chrono::steady_clock::now() + timeout;
  while (client.nodes().size() != count && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(20ms);
  }
  return client.nodes().size() == count;
}

class EtcdClientsTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(etcd_.Started()); }

  std::unique_ptr<Daemon> Node() {
    auto node = std::make_unique<Daemon>(std::vector<std::string>{
        "--etcd", etcd_.endpoint(), "--cluster", "t", "--etcd-ttl-s", "2"});
    EXPECT_NE(node->port(), 0);
    return node;
  }

  // Starts three nodes (nodes_) and a client of them with `replicas` that has seen all three
  // (client_); whether it did.
  ::testing::AssertionResult StartThree(size_t replicas = 1) {
    for (int i = 0; i < 3; ++i) nodes_.push_back(Node());
    client_ = Client(replicas);
    if (client_ == nullptr) return ::testing::AssertionFailure() << "no client";
    if (!WaitForNodes(*client_, 3, 5s)) {
      return ::testing::AssertionFailure() << "the client sees " << client_->nodes().size();
    }
    return ::testing::AssertionSuccess();
  }

  std::unique_ptr<NodeClient> Client(size_t replicas = 1, uint64_t block_bytes = 0) {
    NodeClientOptions options;
    options.block_bytes = block_bytes;
    options.etcd = etcd_.endpoint();
    options.cluster = "t";
    options.replicas = replicas;
    options.timeout = 2000ms;
    options.lookup_budget = options.timeout;
    options.connect_timeout = 1000ms;
    auto client = NodeClient::Create(options);
    EXPECT_TRUE(client.ok()) << client.status().ToString();
    return client.ok() ? std::move(*client) : nullptr;
  }

  // Stores keys [first, first + count) with their patterns; the store's status.
  static Status Store(NodeClient& client, uint64_t first, size_t count) {
    std::vector<std::vector<std::byte>> blocks(count, std::vector<std::byte>(kBlockBytes));
    for (size_t i = 0; i < count; ++i) FillPattern(first + i, blocks[i]);
    const std::vector<transport::Bytes> views(blocks.begin(), blocks.end());
    return client.Put(Keys(first, count), views);
  }

  static std::vector<LookupResult> Lookup(NodeClient& client, uint64_t first, size_t count) {
    return client.Lookup(Keys(first, count));
  }

  // Reads keys [first, first + count): how many came back with their own pattern; the rest
  // must be misses (NotFound), never errors.
  static size_t ReadBack(NodeClient& client, uint64_t first, size_t count) {
    std::vector<std::vector<std::byte>> blocks(count, std::vector<std::byte>(kBlockBytes));
    const std::vector<transport::MutableBytes> outs(blocks.begin(), blocks.end());
    const std::vector<Result<size_t>> got = client.Get(Keys(first, count), outs);
    size_t good = 0;
    for (size_t i = 0; i < count; ++i) {
      if (got[i].ok()) {
        EXPECT_EQ(*got[i], kBlockBytes);
        EXPECT_TRUE(MatchesPattern(first + i, blocks[i])) << "key " << first + i;
        ++good;
      } else {
        EXPECT_EQ(got[i].status().code(), StatusCode::kNotFound) << got[i].status().ToString();
      }
    }
    return good;
  }

  EtcdProcess etcd_;
  std::vector<std::unique_ptr<Daemon>> nodes_;
  std::unique_ptr<NodeClient> client_;
};

TEST_F(EtcdClientsTest, AClientSeesTheNodesAndPlacesKeysOnOneThatJoinsWithoutRestarting) {
  ASSERT_TRUE(StartThree());
  std::vector<std::unique_ptr<Daemon>>& nodes = nodes_;
  NodeClient* client = client_.get();
  std::set<std::string> seen;
  for (const NodeAddress& node : client->nodes()) seen.insert(node.ToString());
  for (const auto& node : nodes) EXPECT_EQ(seen.count(AddressOf(*node)), 1u);
  ASSERT_TRUE(Store(*client, 0, 40).ok());
  for (LookupResult r : Lookup(*client, 0, 40)) EXPECT_EQ(r, LookupResult::kHit);

  nodes.push_back(Node());
  ASSERT_TRUE(WaitForNodes(*client, 4, 5s));
  // At least the new one (a node whose 2 s lease lapsed under load and came back counts again).
  EXPECT_GE(client->counters()[ClientCounter::kMembersJoined], 1u);
  // Keys the new node now ranks first for miss (it never had them); the rest still hit.
  const std::string fourth = AddressOf(*nodes.back());
  size_t moved = 0;
  const std::vector<LookupResult> after = Lookup(*client, 0, 40);
  for (uint64_t i = 0; i < 40; ++i) {
    const bool on_fourth = client->PlacesOf(Key(i)).front().ToString() == fourth;
    moved += on_fourth ? 1 : 0;
    EXPECT_EQ(after[i], on_fourth ? LookupResult::kMiss : LookupResult::kHit) << "key " << i;
  }
  EXPECT_GT(moved, 0u);
  EXPECT_LT(moved, 40u);
  // New stores of those keys go to the fourth node, which then holds and serves them.
  ASSERT_TRUE(Store(*client, 0, 40).ok());
  for (LookupResult r : Lookup(*client, 0, 40)) EXPECT_EQ(r, LookupResult::kHit);
  EXPECT_EQ(ReadBack(*client, 0, 40), 40u);
  auto address = connector::ParseNodeAddress(fourth);
  ASSERT_TRUE(address.ok());
  auto stats = client->Stats(*address);
  ASSERT_TRUE(stats.ok()) << stats.status().ToString();
  EXPECT_EQ((*stats)["cpu.resident_blocks"], moved);
  const BlockStoreCounters c = client->counters();
  EXPECT_EQ(c[ClientCounter::kUnreachable], 0u);
  EXPECT_EQ(c[ClientCounter::kRefused], 0u);
  EXPECT_EQ(c[ClientCounter::kUnservedKeys], 0u);
}

TEST_F(EtcdClientsTest, AKilledNodesKeysMissNeverErrorOnceItsLeaseExpires) {
  ASSERT_TRUE(StartThree());
  std::vector<std::unique_ptr<Daemon>>& nodes = nodes_;
  NodeClient* client = client_.get();
  ASSERT_TRUE(Store(*client, 0, 40).ok());
  const std::string dead = AddressOf(*nodes[1]);
  std::vector<bool> was_dead(40);
  for (uint64_t i = 0; i < 40; ++i) {
    was_dead[i] = client->PlacesOf(Key(i)).front().ToString() == dead;
  }

  nodes[1]->process().Kill(SIGKILL);
  // Until its lease expires the node is a member that does not answer: its keys miss, and
  // the client counts them as keys no node served.
  const std::vector<LookupResult> meanwhile = Lookup(*client, 0, 40);
  for (uint64_t i = 0; i < 40; ++i) {
    EXPECT_EQ(meanwhile[i], was_dead[i] ? LookupResult::kMiss : LookupResult::kHit) << i;
  }
  EXPECT_GT(client->counters()[ClientCounter::kUnservedKeys], 0u);

  ASSERT_TRUE(WaitForNodes(*client, 2, 8s));
  EXPECT_EQ(client->counters()[ClientCounter::kMembersLeft], 1u);
  const BlockStoreCounters before = client->counters();
  const std::vector<LookupResult> after = Lookup(*client, 0, 40);
  for (uint64_t i = 0; i < 40; ++i) {
    EXPECT_EQ(after[i], was_dead[i] ? LookupResult::kMiss : LookupResult::kHit) << i;
  }
  EXPECT_EQ(ReadBack(*client, 0, 40),
            static_cast<size_t>(std::count(was_dead.begin(), was_dead.end(), false)));
  // Stores of its keys go to the others.
  ASSERT_TRUE(Store(*client, 0, 40).ok());
  for (LookupResult r : Lookup(*client, 0, 40)) EXPECT_EQ(r, LookupResult::kHit);
  const BlockStoreCounters c = client->counters();
  EXPECT_EQ(c[ClientCounter::kUnreachable], before[ClientCounter::kUnreachable]);
  EXPECT_EQ(c[ClientCounter::kUnservedKeys], before[ClientCounter::kUnservedKeys]);
  EXPECT_EQ(c[ClientCounter::kRefused], 0u);
}

TEST_F(EtcdClientsTest, WithTwoReplicasAKilledNodeCostsNoHitsAndReadsRestoreTheSecondCopy) {
  ASSERT_TRUE(StartThree(2));
  std::vector<std::unique_ptr<Daemon>>& nodes = nodes_;
  NodeClient* client = client_.get();
  ASSERT_TRUE(Store(*client, 0, 30).ok());
  for (uint64_t i = 0; i < 30; ++i) ASSERT_EQ(client->PlacesOf(Key(i)).size(), 2u);
  uint64_t resident = 0;
  for (size_t n = 0; n < 3; ++n) {
    resident += (*client->Stats(client->nodes()[n]))["cpu.resident_blocks"];
  }
  EXPECT_EQ(resident, 60u);  // every block twice

  nodes[0]->process().Kill(SIGKILL);
  // Before its lease expires: the other replica answers, and reads fall back to it.
  for (LookupResult r : Lookup(*client, 0, 30)) EXPECT_EQ(r, LookupResult::kHit);
  EXPECT_EQ(ReadBack(*client, 0, 30), 30u);
  ASSERT_TRUE(Store(*client, 100, 10).ok());  // one replica left is enough for a store
  EXPECT_GT(client->counters()[ClientCounter::kUnreachable], 0u);
  EXPECT_EQ(client->counters()[ClientCounter::kUnservedKeys], 0u);

  // After it: the survivors hold every block still.
  ASSERT_TRUE(WaitForNodes(*client, 2, 8s));
  for (LookupResult r : Lookup(*client, 0, 30)) EXPECT_EQ(r, LookupResult::kHit);
  for (LookupResult r : Lookup(*client, 100, 10)) EXPECT_EQ(r, LookupResult::kHit);
  EXPECT_EQ(ReadBack(*client, 0, 30), 30u);
  const BlockStoreCounters c = client->counters();
  EXPECT_EQ(c[ClientCounter::kUnservedKeys], 0u);
  EXPECT_EQ(c[ClientCounter::kRefused], 0u);
  // The blocks whose second replica is now the other survivor were copied there by that read
  // (the lookup found them missing), so a second node lost costs no hits either.
  EXPECT_GT(c[ClientCounter::kRepairedBlocks], 0u);
  nodes[1]->process().Kill(SIGKILL);
  for (LookupResult r : Lookup(*client, 0, 30)) EXPECT_EQ(r, LookupResult::kHit);
  EXPECT_EQ(ReadBack(*client, 0, 30), 30u);
}

TEST_F(EtcdClientsTest, ClientsKeepTheirLastSetWhileEtcdIsAway) {
  ASSERT_TRUE(StartThree());
  std::vector<std::unique_ptr<Daemon>>& nodes = nodes_;
  NodeClient* client = client_.get();
  ASSERT_TRUE(Store(*client, 0, 20).ok());

  etcd_.Stop();
  std::this_thread::sleep_for(3s);  // past the nodes' 2 s leases, had etcd been there
  EXPECT_EQ(client->nodes().size(), 3u);
  for (LookupResult r : Lookup(*client, 0, 20)) EXPECT_EQ(r, LookupResult::kHit);
  ASSERT_TRUE(Store(*client, 20, 20).ok());
  EXPECT_EQ(ReadBack(*client, 0, 40), 40u);

  // etcd back: the nodes register again and the client still has all three.
  ASSERT_TRUE(etcd_.Start()) << etcd_.log();
  std::this_thread::sleep_for(3s);
  EXPECT_TRUE(WaitForNodes(*client, 3, 5s));
  for (LookupResult r : Lookup(*client, 0, 40)) EXPECT_EQ(r, LookupResult::kHit);
  EXPECT_EQ(client->counters()[ClientCounter::kUnservedKeys], 0u);

  // A client that starts while etcd is down says so, naming the endpoint.
  etcd_.Stop();
  NodeClientOptions options;
  options.etcd = etcd_.endpoint();
  options.cluster = "t";
  options.etcd_first_read_timeout = 500ms;
  auto late = NodeClient::Create(options);
  ASSERT_FALSE(late.ok());
  EXPECT_EQ(late.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(late.status().message().find(etcd_.endpoint()), std::string::npos)
      << late.status().ToString();
}

// A node that joins with another block size is refused at membership: the call that finds it
// says so (FailedPrecondition naming both sizes), it is logged once and left out, and every key
// then lives on the nodes of the client's size (before, its stores failed and its lookups could
// hit blocks no load could use, for as long as it stayed).
TEST_F(EtcdClientsTest, ANodeThatJoinsWithAnotherBlockSizeIsLeftOut) {
  nodes_.push_back(Node());
  client_ = Client(1, kBlockBytes);
  ASSERT_NE(client_, nullptr);
  ASSERT_TRUE(WaitForNodes(*client_, 1, 5s));
  auto other = std::make_unique<Daemon>(
      std::vector<std::string>{"--etcd", etcd_.endpoint(), "--cluster", "t", "--etcd-ttl-s", "2",
                               "--block-bytes", "32KiB", "--cpu-bytes", "4MiB"},
      /*sizes=*/false);
  ASSERT_NE(other->port(), 0);
  ASSERT_TRUE(WaitForNodes(*client_, 2, 5s));
  ::testing::internal::CaptureStderr();
  // Some of 64 keys go to the new node: that store finds it and fails, naming both sizes.
  const Status first = Store(*client_, 0, 64);
  EXPECT_EQ(first.code(), StatusCode::kFailedPrecondition) << first.ToString();
  EXPECT_THAT(std::string(first.message()), HasSubstr("32768"));
  // Left out: one node now, every store and lookup on it, and so it stays.
  EXPECT_EQ(client_->nodes().size(), 1u);
  ASSERT_TRUE(Store(*client_, 0, 64).ok());
  const std::vector<LookupResult> r = Lookup(*client_, 0, 64);
  EXPECT_EQ(std::count(r.begin(), r.end(), LookupResult::kHit), 64);
  ASSERT_TRUE(Store(*client_, 64, 16).ok());
  const std::string log = ::testing::internal::GetCapturedStderr();
  size_t said = 0;
  for (size_t at = log.find("stores blocks of 32768"); at != std::string::npos;
       at = log.find("stores blocks of 32768", at + 1)) {
    ++said;
  }
  EXPECT_EQ(said, 1u) << log;
  EXPECT_EQ(client_->nodes().size(), 1u);
}

}  // namespace
}  // namespace kvstash::connector
