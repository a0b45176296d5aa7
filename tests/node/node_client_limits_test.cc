// NodeClient against real `kvstashd` processes, on what makes the nodes work as a cache:
//   - every node's limits are learnt at hello, and a batch over them (keys per request, message
//     bytes) is split into calls within them, so a long request hits instead of being refused;
//   - touches reach the nodes, the first key most recent, and a store of a block a node holds
//     counts as a use: LRU keeps a used block over newer idle ones, ARC moves it to T2, and a
//     lookup alone changes nothing;
//   - an error is never a silent miss: a refusal is counted as such (and LookupStrict returns
//     it), an unreachable node is counted apart, and a block the node would refuse for its size
//     is refused before its bytes move.

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <filesystem>
#include <fstream>

#include "block_pattern.h"
#include "daemon_process.h"
#include "home_node.h"
#include "kvstash/connector/node_client.h"

namespace kvstash {
namespace {
using connector::NodeClient;
using ::kvstash::testing::Daemon;
using ::kvstash::testing::FillPattern;
using ::kvstash::testing::MatchesPattern;
using ::testing::HasSubstr;

constexpr size_t kBlock = 64 << 10;  // the Daemon's test size; 4 MiB of CPU tier: 64 blocks

BlockKey Key(uint64_t k) {
  BlockKey key;
  key.hash.lo = k;
  key.hash.hi = 0x11117e57;
  return key;
}

std::vector<BlockKey> Keys(uint64_t first, uint64_t count) {
  std::vector<BlockKey> keys;
  for (uint64_t k = first; k < first + count; ++k) keys.push_back(Key(k));
  return keys;
}

std::unique_ptr<NodeClient> Client(const std::vector<std::unique_ptr<Daemon>>& daemons,
                                   std::string token = "") {
  connector::NodeClientOptions options;
  for (const auto& d : daemons) options.nodes.push_back({"127.0.0.1", d->port()});
  options.timeout = std::chrono::milliseconds(3000);
  options.lookup_budget = options.timeout;
  options.auth_token = std::move(token);
  auto client = NodeClient::Create(options);
  EXPECT_TRUE(client.ok()) << client.status().ToString();
  return client.ok() ? std::move(*client) : nullptr;
}

// Stores each key's pattern block; every put must succeed.
void PutAll(NodeClient& client, const std::vector<BlockKey>& keys) {
  std::vector<std::vector<std::byte>> blocks;
  std::vector<transport::Bytes> views;
  for (const BlockKey& k : keys) {
    blocks.emplace_back(kBlock);
    FillPattern(k.hash.lo, blocks.back());
  }
  for (const auto& b : blocks) views.emplace_back(b);
  const Status put = client.Put(keys, views);
  ASSERT_TRUE(put.ok()) << put.ToString();
}

uint64_t Counter(NodeClient& client, size_t node, const std::string& name) {
  auto stats = client.Stats(client.nodes()[node]);
  EXPECT_TRUE(stats.ok()) << stats.status().ToString();
  if (!stats.ok() || !stats->contains(name)) return ~uint64_t{0};
  return stats->at(name);
}

std::vector<std::unique_ptr<Daemon>> StartNodes(int count, std::vector<std::string> args) {
  std::vector<std::unique_ptr<Daemon>> daemons;
  // The test sizes (64 KiB blocks, 4 MiB of CPU tier) unless the test sets the tier.
  const bool sizes = std::find(args.begin(), args.end(), "--cpu-bytes") == args.end();
  if (!sizes) args.insert(args.begin(), {"--block-bytes", "64KiB"});
  for (int i = 0; i < count; ++i) {
    daemons.push_back(std::make_unique<Daemon>(args, sizes));
    EXPECT_NE(daemons.back()->port(), 0);
  }
  return daemons;
}

size_t Occurrences(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

TEST(KeysPerCallTest, TheKeyLimitAndTheMessageLimitBothBound) {
  connector::NodeLimits limits;
  limits.max_keys_per_request = 32;
  limits.max_message_bytes = 4 << 20;
  EXPECT_EQ(connector::KeysPerCall(limits), 32u);
  limits.max_keys_per_request = 4096;
  limits.max_message_bytes = 4096;
  EXPECT_EQ(connector::KeysPerCall(limits), (4096u - 64) / connector::kKeyWireBytes);
  limits.max_message_bytes = 10;
  EXPECT_EQ(connector::KeysPerCall(limits), 1u);  // never 0
  EXPECT_EQ(connector::KeysPerCall(connector::NodeLimits{}), 4096u);
}

TEST(NodeClientLimitsTest, LimitsComeFromTheHello) {
  auto daemons = StartNodes(1, {"--max-keys-per-request", "32", "--max-message-bytes", "8KiB",
                                "--max-payload-bytes", "1MiB"});
  auto client = Client(daemons);
  ASSERT_NE(client, nullptr);
  auto limits = client->Limits(client->nodes()[0]);
  ASSERT_TRUE(limits.ok()) << limits.status().ToString();
  EXPECT_EQ(limits->block_bytes, kBlock);
  EXPECT_EQ(limits->max_keys_per_request, 32u);
  EXPECT_EQ(limits->max_message_bytes, 8u << 10);
  EXPECT_EQ(limits->max_payload_bytes, 1u << 20);
  EXPECT_EQ(*client->BlockBytes(client->nodes()[0]), kBlock);
}

// A request of more keys than a node takes in one call, on one node and on two.
class NodeClientSplitTest : public ::testing::TestWithParam<int> {};

TEST_P(NodeClientSplitTest, BatchesOverTheLimitsAreSplitAndEveryKeyHits) {
  // 8 keys per request, and a message limit of 4 KiB (about 125 keys) that does not bind.
  auto daemons = StartNodes(GetParam(), {"--max-keys-per-request", "8"});
  auto client = Client(daemons);
  ASSERT_NE(client, nullptr);
  const std::vector<BlockKey> keys = Keys(0, 40);
  PutAll(*client, keys);
  const uint64_t calls_before = client->counters()[ClientCounter::kCalls];

  const std::vector<LookupResult> states = client->Lookup(keys);
  EXPECT_EQ(std::count(states.begin(), states.end(), LookupResult::kHit), 40);
  // At least 40 / 8 lookup calls went out (more with two nodes: each gets its own).
  EXPECT_GE(client->counters()[ClientCounter::kCalls] - calls_before, 5u);
  auto strict = client->LookupStrict(keys);
  ASSERT_TRUE(strict.ok()) << strict.status().ToString();
  EXPECT_EQ(client->LookupPrefix(keys), 40u);

  ASSERT_TRUE(client->TouchSync(keys).ok());
  uint64_t touched = 0;
  for (int n = 0; n < GetParam(); ++n) touched += Counter(*client, n, "node.touched_keys");
  EXPECT_EQ(touched, 40u);
  EXPECT_EQ(client->counters()[ClientCounter::kTouchedKeys], 40u);

  std::vector<std::vector<std::byte>> bufs(keys.size(), std::vector<std::byte>(kBlock));
  std::vector<transport::MutableBytes> outs(bufs.begin(), bufs.end());
  const auto got = client->Get(keys, outs);
  for (size_t i = 0; i < keys.size(); ++i) {
    ASSERT_TRUE(got[i].ok()) << i << ": " << got[i].status().ToString();
    EXPECT_TRUE(MatchesPattern(keys[i].hash.lo, bufs[i])) << i;
  }
  EXPECT_EQ(client->counters()[ClientCounter::kRefused], 0u);
  EXPECT_EQ(client->counters()[ClientCounter::kUnreachable], 0u);
}

TEST_P(NodeClientSplitTest, TheMessageLimitSplitsToo) {
  // 4 KiB messages hold about 125 keys; the key limit (4096) does not bind.
  auto daemons = StartNodes(GetParam(), {"--max-message-bytes", "4KiB", "--cpu-bytes", "32MiB"});
  auto client = Client(daemons);
  ASSERT_NE(client, nullptr);
  const std::vector<BlockKey> keys = Keys(100, 400);
  PutAll(*client, keys);
  auto strict = client->LookupStrict(keys);
  ASSERT_TRUE(strict.ok()) << strict.status().ToString();
  EXPECT_EQ(std::count(strict->begin(), strict->end(), LookupResult::kHit), 400);
  EXPECT_TRUE(client->TouchSync(keys).ok());
  EXPECT_EQ(client->counters()[ClientCounter::kRefused], 0u);
}

INSTANTIATE_TEST_SUITE_P(Nodes, NodeClientSplitTest, ::testing::Values(1, 2));

TEST(NodeClientRecencyTest, TouchedAndReStoredBlocksOutliveNewerIdleOnes) {
  auto daemons = StartNodes(1, {"--cpu-policy", "lru"});
  auto client = Client(daemons);
  ASSERT_NE(client, nullptr);
  ASSERT_EQ(Counter(*client, 0, "cpu.capacity_blocks"), 64u);
  // Full. A call's new blocks go in with its first key most recent: key 63 is the least recent.
  PutAll(*client, Keys(0, 64));
  // A lookup is not a use.
  (void)client->Lookup(Keys(60, 4));
  // Key 63 is touched (asynchronously: the next call on the connection comes after it) and
  // key 62 stored again (the node holds it: a use). Keys 61 and 60 are now the least recent.
  client->Touch(Keys(63, 1));
  PutAll(*client, Keys(62, 1));
  PutAll(*client, Keys(1000, 2));  // evicts two blocks
  const std::vector<LookupResult> states = client->Lookup(Keys(59, 5));
  EXPECT_EQ(states,
            (std::vector<LookupResult>{LookupResult::kHit, LookupResult::kMiss, LookupResult::kMiss,
                                       LookupResult::kHit, LookupResult::kHit}));
}

TEST(NodeClientRecencyTest, TouchesOfOneCallLeaveTheFirstKeyMostRecentAcrossSplitCalls) {
  // 4 keys per request: a touch of 12 keys goes as 3 calls, whose order must not matter.
  auto daemons = StartNodes(1, {"--max-keys-per-request", "4"});
  auto client = Client(daemons);
  ASSERT_NE(client, nullptr);
  PutAll(*client, Keys(0, 64));
  std::vector<BlockKey> touch = Keys(0, 12);  // 0 most recent, then 1, ..., 11
  ASSERT_TRUE(client->TouchSync(touch).ok());
  // 52 new blocks evict keys 12..63; 11 more evict 11, 10, ... 1: key 0 stays.
  PutAll(*client, Keys(1000, 52));
  PutAll(*client, Keys(2000, 11));
  const std::vector<LookupResult> states = client->Lookup(Keys(0, 12));
  EXPECT_EQ(states[0], LookupResult::kHit);
  for (int k = 1; k < 12; ++k) EXPECT_EQ(states[k], LookupResult::kMiss) << k;
}

TEST(NodeClientRecencyTest, ArcMovesABlockToT2OnItsSecondUseAndALookupIsNone) {
  auto daemons = StartNodes(1, {"--cpu-policy", "arc"});
  auto client = Client(daemons);
  ASSERT_NE(client, nullptr);
  PutAll(*client, Keys(0, 4));
  EXPECT_EQ(Counter(*client, 0, "cpu.arc_t1_blocks"), 4u);
  EXPECT_EQ(Counter(*client, 0, "cpu.arc_t2_blocks"), 0u);
  (void)client->Lookup(Keys(0, 4));
  EXPECT_EQ(Counter(*client, 0, "cpu.arc_t2_blocks"), 0u);
  ASSERT_TRUE(client->TouchSync(Keys(0, 1)).ok());
  EXPECT_EQ(Counter(*client, 0, "cpu.arc_t2_blocks"), 1u);
  PutAll(*client, Keys(1, 1));  // a store of a held block is its second use too
  EXPECT_EQ(Counter(*client, 0, "cpu.arc_t2_blocks"), 2u);
  EXPECT_EQ(Counter(*client, 0, "cpu.arc_t1_blocks"), 2u);
}

// AF-LRU counts the requests that use a block (docs/semantics.md §4a): a touch moves a block a
// class up; the same request's touch after its stores (refresh) and a store of a block the node
// holds do not.
TEST(NodeClientRecencyTest, AfLruCountsAUseOncePerRequest) {
  auto daemons = StartNodes(1, {"--cpu-policy", "aflru"});
  auto client = Client(daemons);
  ASSERT_NE(client, nullptr);
  PutAll(*client, Keys(0, 4));
  EXPECT_EQ(Counter(*client, 0, "cpu.policy_aflru"), 1u);
  EXPECT_EQ(Counter(*client, 0, "cpu.aflru_class1_blocks"), 4u);
  client->TouchAfterStore(Keys(0, 2));
  client->WaitForTouches();
  PutAll(*client, Keys(2, 1));  // held: a refresh
  EXPECT_EQ(Counter(*client, 0, "cpu.aflru_class2_blocks"), 0u);
  ASSERT_TRUE(client->TouchSync(Keys(0, 1)).ok());
  EXPECT_EQ(Counter(*client, 0, "cpu.aflru_class2_blocks"), 1u);
  ASSERT_TRUE(client->TouchSync(Keys(0, 1)).ok());
  EXPECT_EQ(Counter(*client, 0, "cpu.aflru_class3_blocks"), 1u);
  EXPECT_EQ(Counter(*client, 0, "cpu.aflru_class1_blocks"), 3u);
  EXPECT_EQ(Counter(*client, 0, "cpu.aflru_ghosts"), 0u);
  // Under LRU the class counters are absent.
  auto lru = StartNodes(1, {"--cpu-policy", "lru"});
  auto lru_client = Client(lru);
  ASSERT_NE(lru_client, nullptr);
  EXPECT_EQ(Counter(*lru_client, 0, "cpu.aflru_class1_blocks"), ~uint64_t{0});
}

// --cpu-admission filter (docs/semantics.md §2a): a block is stored on its second lookup; a put
// before that is answered skipped and counted as not admitted. Adaptive says its regime.
TEST(NodeClientRecencyTest, TheReuseFilterStoresABlockOnItsSecondLookup) {
  auto daemons = StartNodes(1, {"--cpu-admission", "filter"});
  auto client = Client(daemons);
  ASSERT_NE(client, nullptr);
  EXPECT_EQ(Counter(*client, 0, "cpu.reuse_filter_on"), 1u);
  EXPECT_EQ(Counter(*client, 0, "cpu.admission_adaptive"), 0u);
  EXPECT_EQ(client->Lookup(Keys(0, 2)), (std::vector<LookupResult>(2, LookupResult::kMiss)));
  PutAll(*client, Keys(0, 2));
  EXPECT_EQ(Counter(*client, 0, "node.blocks_not_admitted"), 2u);
  EXPECT_EQ(client->Lookup(Keys(0, 2)), (std::vector<LookupResult>(2, LookupResult::kMiss)));
  PutAll(*client, Keys(0, 2));  // looked up twice now
  EXPECT_EQ(client->Lookup(Keys(0, 2)), (std::vector<LookupResult>(2, LookupResult::kHit)));
  EXPECT_EQ(Counter(*client, 0, "node.blocks_not_admitted"), 2u);

  auto adaptive = StartNodes(1, {"--cpu-admission", "adaptive"});
  auto adaptive_client = Client(adaptive);
  ASSERT_NE(adaptive_client, nullptr);
  EXPECT_EQ(Counter(*adaptive_client, 0, "cpu.admission_adaptive"), 1u);
  EXPECT_EQ(Counter(*adaptive_client, 0, "cpu.reuse_filter_on"), 0u);  // it starts off
  PutAll(*adaptive_client, Keys(0, 2));
  EXPECT_EQ(adaptive_client->Lookup(Keys(0, 2)),
            (std::vector<LookupResult>(2, LookupResult::kHit)));
}

TEST(NodeClientErrorsTest, ARefusalIsCountedAndReturnedNeverASilentMiss) {
  const std::filesystem::path token_file =
      std::filesystem::temp_directory_path() / ("kvstash-token-" + std::to_string(::getpid()));
  std::ofstream(token_file) << "right-token\n";
  auto daemons = StartNodes(1, {"--auth-token-file", token_file.string()});
  auto wrong = Client(daemons, "wrong-token");
  ASSERT_NE(wrong, nullptr);
  const std::vector<LookupResult> states = wrong->Lookup(Keys(0, 3));
  EXPECT_EQ(states, std::vector<LookupResult>(3, LookupResult::kMiss));  // the engine goes on ...
  EXPECT_GE(wrong->counters()[ClientCounter::kRefused], 1u);             // ... but it is counted
  EXPECT_EQ(wrong->counters()[ClientCounter::kUnreachable], 0u);
  auto strict = wrong->LookupStrict(Keys(0, 3));
  EXPECT_EQ(strict.status().code(), StatusCode::kUnauthenticated) << strict.status().ToString();
  std::filesystem::remove(token_file);
}

TEST(NodeClientErrorsTest, ABlockOfTheWrongSizeIsRefusedBeforeItsBytesMove) {
  auto daemons = StartNodes(1, {});
  auto client = Client(daemons);
  ASSERT_NE(client, nullptr);
  std::vector<std::byte> small(kBlock / 2);
  const std::vector<transport::Bytes> views(3, transport::Bytes(small));
  const std::vector<BlockKey> keys = Keys(7, 3);
  ::testing::internal::CaptureStderr();
  const Status put = client->Put(keys, views);
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(put.code(), StatusCode::kInvalidArgument) << put.ToString();
  EXPECT_THAT(std::string(put.message()), HasSubstr(std::to_string(kBlock)));
  // Every refusal counted, the first logged with the value and the limit, once.
  EXPECT_EQ(client->counters()[ClientCounter::kRefused], 3u);
  EXPECT_EQ(Occurrences(log, "refused a call"), 1u) << log;
  EXPECT_THAT(log, HasSubstr("a block of 32768 bytes; the node's block size is 65536"));
  EXPECT_EQ(Counter(*client, 0, "node.bytes_in"), 0u);
}

TEST(NodeClientErrorsTest, AnUnreachableNodeIsMissesCountedApartFromRefusals) {
  auto daemons = StartNodes(2, {});
  auto client = Client(daemons);
  ASSERT_NE(client, nullptr);
  const std::vector<BlockKey> keys = Keys(0, 16);
  PutAll(*client, keys);
  daemons[1]->process().Kill(SIGKILL);
  ::testing::internal::CaptureStderr();
  for (int i = 0; i < 3; ++i) (void)client->Lookup(keys);
  auto strict = client->LookupStrict(keys);
  const std::string log = ::testing::internal::GetCapturedStderr();
  // Logged once when the node went down, however many calls failed since; after two failures
  // it is suspect, and calls skip it (counted apart).
  EXPECT_EQ(Occurrences(log, "is unreachable"), 1u) << log;
  EXPECT_GE(client->counters()[ClientCounter::kUnreachable], 2u);
  EXPECT_GE(client->counters()[ClientCounter::kUnreachable] +
                client->counters()[ClientCounter::kSkippedCalls],
            4u);
  ASSERT_TRUE(strict.ok()) << strict.status().ToString();  // down is not a refusal
  for (size_t i = 0; i < keys.size(); ++i) {
    EXPECT_EQ((*strict)[i], ::kvstash::testing::HomeIndex(*client, keys[i]) == 1
                                ? LookupResult::kMiss
                                : LookupResult::kHit)
        << i;
  }
  EXPECT_GE(client->counters()[ClientCounter::kUnreachable], 1u);
  EXPECT_EQ(client->counters()[ClientCounter::kRefused], 0u);
  // Touches of a dead node's keys are counted, never thrown.
  EXPECT_EQ(client->TouchSync(keys).code(), StatusCode::kUnavailable);
}

}  // namespace
}  // namespace kvstash
