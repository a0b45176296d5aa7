// Isolation in the cluster client, over the loopback transport with real node services: a node
// that stops answering (every call to it dropped, as a SIGSTOPped or cut-off node) costs a
// store, a read and a lookup at most their budget, never the call deadline, once a healthy
// replica has answered; it is then skipped, probed apart from the engine's calls, and taken
// back once a probe is answered. Each wait asserted is a bound well under the 10 s deadline
// that the old code waited for; no timing decides anything else.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "block_pattern.h"
#include "kvstash/connector/node_client.h"
#include "kvstash/node/node_server.h"
#include "kvstash/proto/wire.pb.h"
#include "kvstash/transport/fault_channel.h"
#include "kvstash/transport/loopback.h"

namespace kvstash::node {
namespace {

using ::kvstash::ClientCounter;
using ::kvstash::ClientCounterDef;

using namespace std::chrono_literals;
using connector::NodeAddress;
using connector::NodeClient;
using ::kvstash::testing::FillPattern;
using ::kvstash::testing::MatchesPattern;
using transport::Fault;

constexpr size_t kBlock = 4096;
constexpr std::chrono::milliseconds kDeadline = 10000ms;
// What a bounded wait must stay under: far below the deadline, far above a budget.
constexpr auto kBound = 4s;

bool Unreachable(const Status& s) {
  return s.code() == StatusCode::kUnavailable || s.code() == StatusCode::kDeadlineExceeded ||
         s.code() == StatusCode::kCancelled;
}

BlockKey Key(uint64_t k) { return BlockKey{Hash128{k, 0x150}, 0}; }

class ClusterIsolationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (int i = 0; i < 2; ++i) {
      NodeOptions options;
      options.store.block_bytes = kBlock;
      options.store.cpu_capacity_blocks = 256;
      options.store.prefault = false;
      options.listen = [network = network_](const transport::ServerOptions& server) {
        return Result<std::unique_ptr<transport::Listener>>(network->Listen(server));
      };
      auto node = NodeServer::Create(options);
      ASSERT_TRUE(node.ok()) << node.status().ToString();
      nodes_.push_back(std::move(*node));
    }
  }

  // A client of both nodes with `replicas`; every call to a node whose `stopped_` flag is set
  // is dropped (it ends at its deadline, or when cancelled).
  std::unique_ptr<NodeClient> Client(size_t replicas) {
    connector::NodeClientOptions options;
    for (const auto& node : nodes_) options.nodes.push_back({"loopback", node->port()});
    options.replicas = replicas;
    options.timeout = kDeadline;
    options.lookup_budget = 50ms;
    options.suspect_after = 2;
    options.probe_interval = 20ms;
    options.probe_timeout = 200ms;
    options.connect =
        [this](
            const transport::ClientOptions& client) -> Result<std::unique_ptr<transport::Channel>> {
      std::atomic<bool>* stopped = &stopped_[client.port == nodes_[0]->port() ? 0 : 1];
      return std::unique_ptr<transport::Channel>(std::make_unique<transport::FaultChannel>(
          network_->Connect(client), [this, stopped](uint16_t method, uint64_t) {
            if (stopped->load()) return Fault{Fault::Kind::kDrop};
            // Slow: blocks move late, but the node answers anything else (its probes) at once.
            const bool block =
                method == wire::METHOD_PUT_BLOCK || method == wire::METHOD_GET_BLOCK ||
                method == wire::METHOD_PUT_BLOCKS || method == wire::METHOD_GET_BLOCKS;
            if (slow_.load() && block) return Fault{Fault::Kind::kDelay, 300ms};
            return Fault{};
          }));
    };
    auto client = NodeClient::Create(options);
    EXPECT_TRUE(client.ok()) << client.status().ToString();
    return client.ok() ? std::move(*client) : nullptr;
  }

  // Keys whose first-ranked node is node `n` (of the client's places).
  std::vector<BlockKey> KeysFirstOn(NodeClient& client, size_t n, size_t count) {
    std::vector<BlockKey> keys;
    const NodeAddress want = client.nodes()[n];
    for (uint64_t k = 0; keys.size() < count; ++k) {
      if (client.PlacesOf(Key(k))[0].port == want.port) keys.push_back(Key(k));
    }
    return keys;
  }

  static std::vector<std::vector<std::byte>> Blocks(std::span<const BlockKey> keys) {
    std::vector<std::vector<std::byte>> blocks;
    for (const BlockKey& key : keys) {
      blocks.emplace_back(kBlock);
      FillPattern(key.hash.lo, blocks.back());
    }
    return blocks;
  }

  static Status Put(NodeClient& client, std::span<const BlockKey> keys,
                    const std::vector<std::vector<std::byte>>& blocks) {
    std::vector<transport::Bytes> views(blocks.begin(), blocks.end());
    return client.Put(keys, views);
  }

  template <typename Fn>
  static std::chrono::steady_clock::duration Took(Fn fn) {
    const auto start = std::chrono::steady_clock::now();
    fn();
    return std::chrono::steady_clock::now() - start;
  }

  std::shared_ptr<transport::LoopbackNetwork> network_ = transport::LoopbackNetwork::Create();
  std::vector<std::unique_ptr<NodeServer>> nodes_;
  std::atomic<bool> stopped_[2] = {false, false};
  std::atomic<bool> slow_{false};  // every node's block transfers take 300 ms
};

TEST_F(ClusterIsolationTest, AStoreWaitsForOneReplicaNotForAStoppedOne) {
  std::unique_ptr<NodeClient> client = Client(2);
  ASSERT_NE(client, nullptr);
  const std::vector<BlockKey> warm = KeysFirstOn(*client, 0, 1);
  ASSERT_TRUE(Put(*client, warm, Blocks(warm)).ok());  // both connected
  stopped_[1] = true;
  std::vector<BlockKey> keys = KeysFirstOn(*client, 1, 8);
  const std::vector<std::vector<std::byte>> blocks = Blocks(keys);
  Status put;
  EXPECT_LT(Took([&] { put = Put(*client, keys, blocks); }), kBound);
  EXPECT_TRUE(put.ok()) << put.ToString();  // node 0 holds every block
  EXPECT_GT(client->counters()[ClientCounter::kAbandonedCalls], 0u);
  // Read back from node 0 alone: every block whole.
  connector::NodeClientOptions alone;
  alone.nodes = {client->nodes()[0]};
  alone.connect = [this](const transport::ClientOptions& c) {
    return Result<std::unique_ptr<transport::Channel>>(network_->Connect(c));
  };
  auto reader = NodeClient::Create(alone);
  ASSERT_TRUE(reader.ok());
  for (const BlockKey& key : keys) {
    std::vector<std::byte> out(kBlock);
    auto got = (*reader)->Get(key, out);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_TRUE(MatchesPattern(key.hash.lo, out));
  }
}

TEST_F(ClusterIsolationTest, AReadOfAStoppedReplicaIsHedgedToTheOther) {
  std::unique_ptr<NodeClient> client = Client(2);
  ASSERT_NE(client, nullptr);
  const std::vector<BlockKey> keys = KeysFirstOn(*client, 1, 8);
  const std::vector<std::vector<std::byte>> blocks = Blocks(keys);
  ASSERT_TRUE(Put(*client, keys, blocks).ok());
  stopped_[1] = true;  // the first-ranked replica of every key
  std::vector<std::vector<std::byte>> read(keys.size(), std::vector<std::byte>(kBlock));
  std::vector<transport::MutableBytes> outs(read.begin(), read.end());
  std::vector<Result<size_t>> got;
  EXPECT_LT(Took([&] { got = client->Get(keys, outs); }), kBound);
  for (size_t k = 0; k < keys.size(); ++k) {
    ASSERT_TRUE(got[k].ok()) << k << ": " << got[k].status().ToString();
    EXPECT_TRUE(MatchesPattern(keys[k].hash.lo, read[k])) << k;
  }
  // The stopped replica's read (the 8 small blocks go in one call) was abandoned.
  EXPECT_GE(client->counters()[ClientCounter::kAbandonedCalls], 1u);
}

TEST_F(ClusterIsolationTest, WithOneReplicaAStoppedNodeCostsAProbeNotTheDeadline) {
  std::unique_ptr<NodeClient> client = Client(1);
  ASSERT_NE(client, nullptr);
  const std::vector<BlockKey> keys = KeysFirstOn(*client, 1, 4);
  const std::vector<std::vector<std::byte>> blocks = Blocks(keys);
  ASSERT_TRUE(Put(*client, keys, blocks).ok());
  stopped_[1] = true;
  // Its probe goes unanswered: the store and the read end, each an error naming the node.
  Status put;
  EXPECT_LT(Took([&] { put = Put(*client, keys, blocks); }), kBound);
  EXPECT_TRUE(Unreachable(put)) << put.ToString();
  std::vector<std::byte> out(kBlock);
  Result<size_t> got = size_t{0};
  EXPECT_LT(Took([&] { got = client->Get(keys[0], out); }), kBound);
  EXPECT_TRUE(Unreachable(got.status())) << got.status().ToString();
  EXPECT_GT(client->counters()[ClientCounter::kProbes], 0u);
  EXPECT_GT(client->counters()[ClientCounter::kAbandonedCalls], 0u);
}

TEST_F(ClusterIsolationTest, ASlowNodeThatAnswersItsProbeIsWaitedFor) {
  std::unique_ptr<NodeClient> client = Client(1);
  ASSERT_NE(client, nullptr);
  const std::vector<BlockKey> keys = KeysFirstOn(*client, 1, 4);
  const std::vector<std::vector<std::byte>> blocks = Blocks(keys);
  slow_ = true;  // past the 50 ms budget, well within the deadline
  ASSERT_TRUE(Put(*client, keys, blocks).ok());
  for (size_t k = 0; k < keys.size(); ++k) {
    std::vector<std::byte> out(kBlock);
    auto got = client->Get(keys[k], out);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_TRUE(MatchesPattern(keys[k].hash.lo, out));
  }
  EXPECT_EQ(client->counters()[ClientCounter::kAbandonedCalls], 0u);
}

TEST_F(ClusterIsolationTest, ASuspectNodeIsProbedApartAndComesBackWhenItAnswers) {
  std::unique_ptr<NodeClient> client = Client(1);
  ASSERT_NE(client, nullptr);
  const std::vector<BlockKey> keys = KeysFirstOn(*client, 1, 4);
  ASSERT_TRUE(Put(*client, keys, Blocks(keys)).ok());
  stopped_[1] = true;
  // Two lookups past their budget make it suspect; no lookup waits for it.
  for (int i = 0; i < 2; ++i) {
    std::vector<LookupResult> r;
    EXPECT_LT(Took([&] { r = client->Lookup(keys); }), kBound);
    for (LookupResult x : r) EXPECT_EQ(x, LookupResult::kMiss);
  }
  // Skipped now, and probed (echoes no call waits for) while the calls go on.
  const auto until = std::chrono::steady_clock::now() + 30s;
  while (client->counters()[ClientCounter::kProbes] < 3 &&
         std::chrono::steady_clock::now() < until) {
    EXPECT_LT(Took([&] { (void)client->Lookup(keys); }), kBound);
    std::this_thread::sleep_for(5ms);
  }
  EXPECT_GE(client->counters()[ClientCounter::kProbes], 3u);
  EXPECT_GT(client->counters()[ClientCounter::kSkippedCalls], 0u);
  // It answers again: a probe brings it back and its keys hit.
  stopped_[1] = false;
  bool hit = false;
  while (!hit && std::chrono::steady_clock::now() < until) {
    const std::vector<LookupResult> r = client->Lookup(keys);
    hit = std::count(r.begin(), r.end(), LookupResult::kHit) == static_cast<long>(keys.size());
    if (!hit) std::this_thread::sleep_for(5ms);
  }
  EXPECT_TRUE(hit);
}

// A peer whose hello states limits that are not a node's (a foreign or hostile server): the
// client refuses it, saying why, counts the refusal, and a strict lookup returns it; nothing of
// it is read as a block size or a key limit.
TEST(ClusterHelloTest, LimitsThatDoNotParseRefuseTheNodeSayingWhy) {
  auto network = transport::LoopbackNetwork::Create();
  transport::ServerOptions server_options;
  // 0xff: a field tag of wire type 7, which no protobuf parser accepts.
  server_options.service_limits = std::string("\xff\xff\xff\xff not a NodeLimits");
  std::unique_ptr<transport::Listener> peer = network->Listen(server_options);
  peer->Handle(wire::METHOD_ECHO, [](transport::ServerCall call) { call.Reply({}); });
  ASSERT_TRUE(peer->Start().ok());

  connector::NodeClientOptions options;
  options.nodes.push_back({"loopback", peer->port()});
  options.connect = [network](const transport::ClientOptions& client)
      -> Result<std::unique_ptr<transport::Channel>> { return network->Connect(client); };
  auto client = NodeClient::Create(options);
  ASSERT_TRUE(client.ok()) << client.status().ToString();
  const NodeAddress node = (*client)->nodes()[0];
  const Result<connector::NodeLimits> limits = (*client)->Limits(node);
  ASSERT_FALSE(limits.ok());
  EXPECT_EQ(limits.status().code(), StatusCode::kInvalidArgument) << limits.status().ToString();
  EXPECT_THAT(limits.status().message(), ::testing::HasSubstr("do not parse"));
  EXPECT_FALSE((*client)->BlockBytes(node).ok());
  const std::vector<BlockKey> keys = {Key(1), Key(2)};
  const auto strict = (*client)->LookupStrict(keys);
  EXPECT_FALSE(strict.ok()) << "a node refused here is an error, not a miss";
  EXPECT_GE((*client)->counters()[ClientCounter::kRefused], 1u);
  client->reset();
  peer->Stop();
}

}  // namespace
}  // namespace kvstash::node
