// NodeService without a transport: sessions, pins, leases on a clock the test moves, stores
// checked against their checksum, quotas and the counters that report them. Each test is
// milliseconds in one thread; the same rules over a real or faulty transport are in
// node_server_test.cc and node_loopback_test.cc.

#include "kvstash/node/node_service.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <vector>

#include "block_pattern.h"
#include "kvstash/common/hash.h"

namespace kvstash::node {
namespace {

using namespace std::chrono_literals;
using ::kvstash::testing::FillPattern;
using ::kvstash::testing::MatchesPattern;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr size_t kBlock = 4096;
constexpr uint64_t kA = 1;  // connections
constexpr uint64_t kB = 2;

class NodeServiceTest : public ::testing::Test {
 protected:
  void SetUp() override { Start(8); }

  void Start(size_t cpu_blocks, std::map<std::string, size_t> quotas = {}) {
    service_.reset();
    NodeServiceOptions options;
    options.store.block_bytes = kBlock;
    options.store.cpu_capacity_blocks = cpu_blocks;
    options.store.prefault = false;
    options.lease_timeout = 1000ms;
    options.namespace_quota_blocks = std::move(quotas);
    options.clock = [this] { return now_; };
    auto service = NodeService::Create(std::move(options));
    ASSERT_TRUE(service.ok()) << service.status().ToString();
    service_ = std::move(*service);
  }

  BlockKey Key(uint64_t k, NamespaceId ns) const { return BlockKey{{k, k * 7 + 1}, 0, ns}; }

  // Begins a request of `connection` in namespace `name`: the key of k there.
  BlockKey Begin(uint64_t connection, uint64_t k, const char* name = "tenant") {
    Result<NamespaceId> ns = service_->BeginRequest(connection, name);
    EXPECT_TRUE(ns.ok()) << ns.status().ToString();
    return Key(k, ns.ok() ? *ns : 0);
  }

  // A whole store of block k (pattern k) by `connection`: BeginPut, the bytes, EndPut.
  Status Put(uint64_t connection, uint64_t k, const char* name = "tenant",
             uint64_t checksum_xor = 0) {
    const BlockKey key = Begin(connection, k, name);
    auto put = service_->BeginPut(connection, key, kBlock);
    if (!put.ok()) return put.status();
    if (put->skipped) return Status::OK();
    FillPattern(k, put->slot);
    std::vector<std::byte> copy(put->slot.begin(), put->slot.end());
    return service_->EndPut(connection, key, Status::OK(), Xxh3Hash64(copy) ^ checksum_xor);
  }

  LookupResult LookupOne(uint64_t connection, uint64_t k, const char* name = "tenant") {
    const BlockKey key = Begin(connection, k, name);
    return service_->Lookup(std::span(&key, 1))[0];
  }

  uint64_t Counter(const std::string& name) const { return service_->Counters().at(name); }

  std::chrono::steady_clock::time_point now_{std::chrono::seconds(1000)};
  std::unique_ptr<NodeService> service_;
};

TEST_F(NodeServiceTest, StoreThenReadBack) {
  ASSERT_TRUE(Put(kA, 7).ok());
  EXPECT_EQ(LookupOne(kA, 7), LookupResult::kHit);
  EXPECT_EQ(LookupOne(kA, 8), LookupResult::kMiss);
  const BlockKey key = Begin(kB, 7);
  auto read = service_->BeginGet(kB, key);
  ASSERT_TRUE(read.ok()) << read.status().ToString();
  EXPECT_TRUE(read->pinned_for_read);  // no Load: pinned for the read only
  std::vector<std::byte> out(read->block.begin(), read->block.end());
  EXPECT_TRUE(MatchesPattern(7, out));
  service_->EndGet(key, *read, Status::OK());
  EXPECT_EQ(Counter("node.blocks_loaded"), 1u);
  EXPECT_EQ(Counter("node.bytes_out"), kBlock);
  EXPECT_EQ(Counter("node.bytes_in"), kBlock);
  EXPECT_EQ(Counter("node.blocks_stored"), 1u);
  EXPECT_EQ(Counter("node.lookup_hits"), 1u);
  EXPECT_EQ(Counter("node.lookup_misses"), 1u);
  EXPECT_EQ(service_->BeginGet(kB, Begin(kB, 99)).status().code(), StatusCode::kNotFound);
}

TEST_F(NodeServiceTest, ABlockWhoseBytesDoNotMatchItsChecksumIsNeverStored) {
  const Status bad = Put(kA, 7, "tenant", /*checksum_xor=*/1);
  EXPECT_EQ(bad.code(), StatusCode::kDataLoss) << bad.ToString();
  EXPECT_THAT(std::string(bad.message()), HasSubstr("checksum"));
  EXPECT_EQ(LookupOne(kA, 7), LookupResult::kMiss);
  EXPECT_EQ(Counter("node.checksum_failures"), 1u);
  EXPECT_EQ(Counter("node.blocks_aborted"), 1u);
  EXPECT_EQ(Counter("node.blocks_stored"), 0u);
  // Bytes that did not arrive abort the store the same way, and leak no slot.
  const BlockKey key = Begin(kA, 8);
  auto put = service_->BeginPut(kA, key, kBlock);
  ASSERT_TRUE(put.ok());
  EXPECT_EQ(LookupOne(kA, 8), LookupResult::kRetry);  // being written
  EXPECT_EQ(service_->EndPut(kA, key, UnavailableError("cut"), 0).code(), StatusCode::kUnavailable);
  EXPECT_EQ(LookupOne(kA, 8), LookupResult::kMiss);
  for (uint64_t k = 100; k < 108; ++k) ASSERT_TRUE(Put(kA, k).ok()) << k;  // all 8 slots
}

TEST_F(NodeServiceTest, BadStoresGetClearErrors) {
  const BlockKey key = Begin(kA, 7);
  auto wrong = service_->BeginPut(kA, key, kBlock - 1);
  EXPECT_EQ(wrong.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(wrong.status().message()), HasSubstr("block size is 4096"));
  auto first = service_->BeginPut(kA, key, kBlock);
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(service_->BeginPut(kA, key, kBlock).status().code(), StatusCode::kAlreadyExists);
  // Another client storing the same key meanwhile is told the bytes are not wanted.
  auto other = service_->BeginPut(kB, Begin(kB, 7), kBlock);
  ASSERT_TRUE(other.ok());
  EXPECT_TRUE(other->skipped);
  ASSERT_TRUE(service_->EndPut(kA, key, Status::OK(), 0).ok());
  // A store of a block held counts as its use.
  const uint64_t touched = Counter("node.touched_keys");
  ASSERT_TRUE(Put(kB, 7).ok());
  EXPECT_EQ(Counter("node.touched_keys"), touched + 1);
  EXPECT_EQ(Counter("node.blocks_stored"), 1u);
}

// A pinned block outlives the churn that evicts every other block: what the connector's
// prepare_load relies on between its lookup and its transfer.
TEST_F(NodeServiceTest, APinnedBlockSurvivesChurn) {
  ASSERT_TRUE(Put(kA, 1).ok());
  ASSERT_TRUE(Put(kA, 2).ok());
  const std::vector<BlockKey> keys = {Begin(kB, 1), Begin(kB, 2), Begin(kB, 3)};
  const std::vector<std::optional<size_t>> loaded = service_->Load(kB, std::span(keys).first(1));
  EXPECT_THAT(loaded, ElementsAre(std::optional<size_t>(kBlock)));
  EXPECT_THAT(service_->Load(kB, std::span(keys).last(1)), ElementsAre(std::nullopt));
  EXPECT_EQ(Counter("node.pinned_keys"), 1u);
  for (uint64_t k = 100; k < 120; ++k) ASSERT_TRUE(Put(kA, k).ok()) << k;  // 20 > 8 slots
  EXPECT_EQ(LookupOne(kA, 1), LookupResult::kHit);                         // pinned
  EXPECT_EQ(LookupOne(kA, 2), LookupResult::kMiss);                        // not pinned: evicted
  auto read = service_->BeginGet(kB, keys[0]);
  ASSERT_TRUE(read.ok());
  EXPECT_FALSE(read->pinned_for_read);  // the session's pin
  std::vector<std::byte> out(read->block.begin(), read->block.end());
  EXPECT_TRUE(MatchesPattern(1, out));
  service_->EndGet(keys[0], *read, Status::OK());
  // Released (twice: the second is ignored), the block goes with the next churn.
  service_->Release(kB, std::span(keys).first(1));
  service_->Release(kB, std::span(keys).first(1));
  for (uint64_t k = 200; k < 220; ++k) ASSERT_TRUE(Put(kA, k).ok()) << k;
  EXPECT_EQ(LookupOne(kA, 1), LookupResult::kMiss);
}

TEST_F(NodeServiceTest, ASilentSessionLosesItsPinsAfterTheLease) {
  ASSERT_TRUE(Put(kA, 1).ok());
  const BlockKey key = Begin(kB, 1);
  ASSERT_THAT(service_->Load(kB, std::span(&key, 1)), ElementsAre(std::optional<size_t>(kBlock)));
  // A request renews the lease: 600 + 600 ms apart is not silent for 1000.
  now_ += 600ms;
  service_->ExpireLeases();
  (void)Begin(kB, 1);
  now_ += 600ms;
  service_->ExpireLeases();
  EXPECT_EQ(Counter("node.leases_expired"), 0u);
  // Silent past the lease: the pin goes, the session's connection stays.
  now_ += 500ms;
  service_->ExpireLeases();
  EXPECT_EQ(Counter("node.leases_expired"), 1u);
  EXPECT_EQ(Counter("node.pins_released_on_expiry"), 1u);
  EXPECT_EQ(Counter("node.sessions_closed"), 0u);
  for (uint64_t k = 100; k < 108; ++k) ASSERT_TRUE(Put(kA, k).ok()) << k;
  EXPECT_EQ(LookupOne(kA, 1), LookupResult::kMiss);  // evicted, no longer pinned
}

TEST_F(NodeServiceTest, AnEndedSessionReleasesItsPinsAndAbortsWhatWasArriving) {
  ASSERT_TRUE(Put(kA, 1).ok());
  const BlockKey pinned = Begin(kB, 1);
  ASSERT_EQ(service_->Load(kB, std::span(&pinned, 1)).size(), 1u);
  const BlockKey arriving = Begin(kB, 2);
  auto put = service_->BeginPut(kB, arriving, kBlock);
  ASSERT_TRUE(put.ok());
  EXPECT_EQ(service_->sessions(), 2u);
  service_->EndSession(kB);
  EXPECT_EQ(Counter("node.pins_released_on_close"), 1u);
  // The bytes may still be landing in the slot: the session waits for them, then the block is
  // aborted even though they arrived whole.
  EXPECT_EQ(service_->sessions(), 2u);
  FillPattern(2, put->slot);
  (void)service_->EndPut(kB, arriving, Status::OK(), 0);
  EXPECT_EQ(service_->sessions(), 1u);
  EXPECT_EQ(Counter("node.stores_aborted_on_close"), 1u);
  EXPECT_EQ(Counter("node.sessions_closed"), 1u);
  EXPECT_EQ(LookupOne(kA, 2), LookupResult::kMiss);
  // Every slot is free again.
  for (uint64_t k = 100; k < 108; ++k) ASSERT_TRUE(Put(kA, k).ok()) << k;
  service_->EndSession(99);  // unknown: ignored
}

TEST_F(NodeServiceTest, ANamespaceAtItsQuotaEvictsItsOwnAndIsRefusedWhenAllArePinned) {
  Start(8, {{"small", 2}});
  for (uint64_t k = 1; k <= 3; ++k) ASSERT_TRUE(Put(kB, k, "big").ok());
  for (uint64_t k = 1; k <= 4; ++k) ASSERT_TRUE(Put(kA, k, "small").ok());
  EXPECT_EQ(LookupOne(kA, 2, "small"), LookupResult::kMiss);
  EXPECT_EQ(LookupOne(kA, 3, "small"), LookupResult::kHit);
  for (uint64_t k = 1; k <= 3; ++k) EXPECT_EQ(LookupOne(kB, k, "big"), LookupResult::kHit) << k;
  const std::vector<BlockKey> own = {Begin(kA, 3, "small"), Begin(kA, 4, "small")};
  ASSERT_EQ(service_->Load(kA, own).size(), 2u);
  const Status refused = Put(kA, 5, "small");
  EXPECT_EQ(refused.code(), StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(refused.message()), HasSubstr("namespace 'small'"));
  const std::vector<NamespaceStats> namespaces = service_->Namespaces();
  auto small = std::find_if(namespaces.begin(), namespaces.end(),
                            [](const NamespaceStats& ns) { return ns.name == "small"; });
  ASSERT_NE(small, namespaces.end());
  EXPECT_EQ(small->quota_refusals, 1u);
  EXPECT_EQ(small->cpu_blocks, 2u);
}

TEST_F(NodeServiceTest, QuotasOutsideTheTierAreRefusedAtCreate) {
  NodeServiceOptions options;
  options.store.block_bytes = kBlock;
  options.store.cpu_capacity_blocks = 8;
  options.store.prefault = false;
  options.namespace_quota_blocks = {{"a", 9}};
  EXPECT_EQ(NodeService::Create(options).status().code(), StatusCode::kInvalidArgument);
  options.namespace_quota_blocks = {{std::string(kOtherNamespaces), 2}};
  EXPECT_EQ(NodeService::Create(options).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvstash::node
