// What a put says of its blocks (wire.BlockMeta: the block before each in its request, its
// tokens) and what the node's KV events then say (docs/semantics.md §19): a NodeServer over real
// UCX (TCP) with a real ZMQ subscriber. Chains go in one BlockStored each, with their parent and
// block size; puts without metadata publish what they always did; metadata a node cannot take
// is refused with a clear error, and nothing of that call is stored.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "block_pattern.h"
#include "kv_event_watch.h"
#include "kvstash/common/hash.h"
#include "kvstash/events/kv_events.h"
#include "kvstash/node/node_server.h"
#include "kvstash/proto/wire.pb.h"
#include "node_test_client.h"

namespace kvstash::node {
namespace {

using ::kvstash::testing::FillPattern;
using ::kvstash::testing::NodeTestClient;
using ::kvstash::testing::WireKey;
using ::testing::HasSubstr;

constexpr size_t kBlock = 16 << 10;

// Key k's hash as events name it (WireKey's: 128 bits, so 16 bytes).
events::ExternalHash X(uint64_t k) {
  return events::ExternalHashOf(Hash128{.lo = k, .hi = k * 7 + 1});
}

wire::BlockMeta Meta(std::optional<uint64_t> parent, uint32_t tokens, uint32_t group = 0) {
  wire::BlockMeta meta;
  if (parent) *meta.mutable_parent() = WireKey(*parent, group);
  meta.set_tokens(tokens);
  return meta;
}

using Said = ::kvstash::testing::KvEventWatch::Said;

class NodeBlockMetaTest : public ::testing::Test {
 protected:
  void StartNode(bool events) {
    NodeOptions options;
    options.server.transport.tls = "tcp";
    options.server.auth_token = "token";
    options.max_keys_per_request = 16;
    options.max_batch_bytes = 8 * kBlock;
    options.store.block_bytes = kBlock;
    options.store.cpu_capacity_blocks = 64;
    options.store.prefault = false;
    if (events) options.kv_events.publisher.endpoint = "tcp://127.0.0.1:*";
    auto node = NodeServer::Create(options);
    ASSERT_TRUE(node.ok()) << node.status().ToString();
    node_ = std::move(*node);
    client_ = std::make_unique<NodeTestClient>(node_->port(), "tenant", "token", "tcp", kBlock);
    ASSERT_TRUE(client_->ok());
    if (!events) return;
    watch_ = std::make_unique<::kvstash::testing::KvEventWatch>(node_->kv_events()->endpoint());
    // Probes in a namespace of their own until the subscriber hears one.
    NodeTestClient probe(node_->port(), "probe", "token", "tcp", kBlock);
    ASSERT_TRUE(probe.ok());
    ASSERT_TRUE(watch_->Join([&](int i) { probe.Store({1000 + static_cast<uint64_t>(i)}); }));
  }

  void TearDown() override {
    watch_.reset();
    client_.reset();
    node_.reset();
  }

  // Reads the tenant's events until each of blocks `ks` was stored: what they said of each.
  std::map<uint64_t, Said> StoredEvents(const std::vector<uint64_t>& ks) {
    std::vector<events::ExternalHash> hashes;
    for (uint64_t k : ks) hashes.push_back(X(k));
    const auto said = watch_->Stored("tenant", hashes);
    std::map<uint64_t, Said> out;
    for (uint64_t k : ks) {
      if (auto it = said.find(X(k)); it != said.end()) out[k] = it->second;
    }
    return out;
  }

  // PutBlocks of blocks `ks` (pattern k) with `metas` (none: no field).
  Status PutMany(const std::vector<uint64_t>& ks, const std::vector<wire::BlockMeta>& metas) {
    std::vector<std::byte> payload(ks.size() * kBlock);
    wire::PutBlocksRequest request;
    for (size_t i = 0; i < ks.size(); ++i) {
      FillPattern(ks[i], std::span(payload).subspan(i * kBlock, kBlock));
      *request.add_keys() = WireKey(ks[i]);
      request.add_lengths(kBlock);
    }
    for (const wire::BlockMeta& meta : metas) *request.add_metas() = meta;
    request.set_checksum(Xxh3Hash64(payload));
    transport::CallOptions options;
    options.send_payload = payload;
    wire::PutBlocksReply reply;
    const Status s = client_->Call(wire::METHOD_PUT_BLOCKS, request, &reply, options);
    if (s.ok()) {
      for (const wire::BlockResult& r : reply.results()) EXPECT_EQ(r.code(), wire::OK);
    }
    return s;
  }

  // PutBlock of block k (pattern k) with `meta`.
  Status PutOne(uint64_t k, const wire::BlockMeta& meta) {
    std::vector<std::byte> block(kBlock);
    FillPattern(k, block);
    wire::PutBlockRequest put;
    *put.mutable_key() = WireKey(k);
    put.set_length(kBlock);
    put.set_checksum(Xxh3Hash64(block));
    *put.mutable_meta() = meta;
    transport::CallOptions options;
    options.send_payload = block;
    return client_->Call(wire::METHOD_PUT_BLOCK, put, (wire::PutBlockReply*)nullptr, options);
  }

  std::unique_ptr<NodeServer> node_;
  std::unique_ptr<NodeTestClient> client_;
  std::unique_ptr<::kvstash::testing::KvEventWatch> watch_;
};

TEST_F(NodeBlockMetaTest, ChainsArePublishedWithTheirParentAndSizeAndPutsWithoutAsBefore) {
  StartNode(/*events=*/true);
  // 1, 2, 3 chain under 0; 5 hangs from 4 (a break); 6 from 5 but of another size.
  ASSERT_TRUE(
      PutMany({1, 2, 3, 5, 6}, {Meta(0, 16), Meta(1, 16), Meta(2, 16), Meta(4, 16), Meta(5, 32)})
          .ok());
  EXPECT_EQ(StoredEvents({1, 2, 3, 5, 6}), (std::map<uint64_t, Said>{{1, {X(0), 16, "CPU"}},
                                                                     {2, {X(1), 16, "CPU"}},
                                                                     {3, {X(2), 16, "CPU"}},
                                                                     {5, {X(4), 16, "CPU"}},
                                                                     {6, {X(5), 32, "CPU"}}}));
  // A request's first block (no parent) through PutBlock, then blocks without metadata.
  ASSERT_TRUE(PutOne(7, Meta(std::nullopt, 16)).ok());
  EXPECT_EQ(StoredEvents({7}), (std::map<uint64_t, Said>{{7, {std::nullopt, 16, "CPU"}}}));
  ASSERT_TRUE(PutMany({8, 9}, {}).ok());
  EXPECT_EQ(StoredEvents({8, 9}), (std::map<uint64_t, Said>{{8, {std::nullopt, 0, "CPU"}},
                                                            {9, {std::nullopt, 0, "CPU"}}}));
  EXPECT_EQ(node_->Counters().at("events.block_metas_dropped"), 0u);
}

TEST_F(NodeBlockMetaTest, MetadataANodeCannotTakeIsRefusedWithAClearErrorAndStoresNothing) {
  StartNode(/*events=*/true);
  Status s = PutMany({1, 2}, {Meta(0, 16)});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_THAT(std::string(s.message()), HasSubstr("2 keys with 1 block metadata"));
  s = PutMany({1}, {Meta(0, 0)});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("metadata of 0 tokens; a block holds 1..1048576"));
  s = PutMany({1}, {Meta(0, (1u << 20) + 1)});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_THAT(std::string(s.message()), HasSubstr("1048577 tokens"));
  s = PutMany({1}, {Meta(0, 16, /*group=*/2)});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_THAT(std::string(s.message()), HasSubstr("is in group 2, not the block's 0"));
  s = PutOne(1, Meta(0, ~0u));
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_THAT(std::string(s.message()), HasSubstr("4294967295 tokens"));
  EXPECT_THAT(client_->PerKey({1, 2}), ::testing::Each(::testing::Eq(wire::LOOKUP_MISS)));
  EXPECT_EQ(node_->Counters().at("node.blocks_aborted"), 0u);
  // The node goes on serving, and the next put's block is published with what it says.
  ASSERT_TRUE(PutMany({1}, {Meta(0, 16)}).ok());
  EXPECT_EQ(StoredEvents({1}), (std::map<uint64_t, Said>{{1, {X(0), 16, "CPU"}}}));
}

// What a put says a block is for decides how the node stores it (docs/semantics.md §4b): a
// state or sliding-window block that no expected hit end needs is spare, evicted before every
// other block until a request uses it; full-attention blocks and blocks at a hit end are not.
TEST_F(NodeBlockMetaTest, SpareBlocksGoFirstUntilARequestUsesThem) {
  StartNode(/*events=*/false);
  auto meta = [](wire::BlockMeta::Kind kind, bool at_hit_end) {
    wire::BlockMeta m = Meta(std::nullopt, 16);
    m.set_kind(kind);
    m.set_window_blocks(1);
    m.set_at_hit_end(at_hit_end);
    return m;
  };
  // 64 blocks fill the tier: 0..1 spare states, 2 a state at a hit end, 3 a full block, 4..63
  // without metadata. 0 and 1 are the most recent (stored last), yet they go first.
  std::vector<uint64_t> rest;
  for (uint64_t k = 4; k < 64; ++k) rest.push_back(k);
  for (size_t i = 0; i < rest.size(); i += 6) {  // 60 blocks, 6 to a call
    ASSERT_TRUE(PutMany(std::vector<uint64_t>(rest.begin() + i, rest.begin() + i + 6), {}).ok());
  }
  ASSERT_TRUE(PutMany({3, 2, 1, 0}, {meta(wire::BlockMeta::KIND_FULL, false),
                                     meta(wire::BlockMeta::KIND_STATE, true),
                                     meta(wire::BlockMeta::KIND_STATE, false),
                                     meta(wire::BlockMeta::KIND_SLIDING_WINDOW, false)})
                  .ok());
  EXPECT_EQ(node_->Counters().at("cpu.spare_blocks"), 2u);
  // A use of block 1 makes it the policy's; a store evicts the other spare one, block 0.
  wire::TouchRequest touch;
  *touch.add_keys() = WireKey(1);
  ASSERT_TRUE(client_->Call(wire::METHOD_TOUCH, touch, (wire::TouchReply*)nullptr).ok());
  EXPECT_EQ(node_->Counters().at("cpu.spare_blocks"), 1u);
  ASSERT_TRUE(PutMany({100}, {}).ok());
  EXPECT_EQ(client_->PerKey({0, 1, 2, 3}),
            (std::vector<wire::LookupResult>{wire::LOOKUP_MISS, wire::LOOKUP_HIT, wire::LOOKUP_HIT,
                                             wire::LOOKUP_HIT}));
  EXPECT_EQ(node_->Counters().at("cpu.spare_blocks"), 0u);
  // Then the policy's own order: block 4, the least recent.
  ASSERT_TRUE(PutMany({101}, {}).ok());
  EXPECT_EQ(client_->PerKey({4}), (std::vector<wire::LookupResult>{wire::LOOKUP_MISS}));
}

TEST_F(NodeBlockMetaTest, AnUnknownGroupKindOrAHugeWindowIsRefused) {
  StartNode(/*events=*/false);
  wire::BlockMeta meta = Meta(std::nullopt, 16);
  meta.set_kind(static_cast<wire::BlockMeta::Kind>(9));
  Status s = PutMany({1}, {meta});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_THAT(std::string(s.message()), HasSubstr("unknown group kind 9"));
  meta.set_kind(wire::BlockMeta::KIND_SLIDING_WINDOW);
  meta.set_window_blocks(~0u);
  s = PutOne(1, meta);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_THAT(std::string(s.message()), HasSubstr("a window of 4294967295 blocks"));
  EXPECT_THAT(client_->PerKey({1}), ::testing::Each(::testing::Eq(wire::LOOKUP_MISS)));
}

// A node that publishes no events takes the metadata (checked the same) and keeps none.
TEST_F(NodeBlockMetaTest, ANodeWithoutEventsStoresBlocksWithMetadata) {
  StartNode(/*events=*/false);
  ASSERT_TRUE(PutMany({1, 2}, {Meta(0, 16), Meta(1, 16)}).ok());
  ASSERT_TRUE(PutOne(3, Meta(2, 16)).ok());
  EXPECT_THAT(client_->PerKey({1, 2, 3}), ::testing::Each(::testing::Eq(wire::LOOKUP_HIT)));
  EXPECT_EQ(PutMany({4}, {Meta(3, 0)}).code(), StatusCode::kInvalidArgument);
  EXPECT_FALSE(node_->Counters().contains("events.block_metas_dropped"));
}

}  // namespace
}  // namespace kvstash::node
