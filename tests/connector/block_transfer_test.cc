// BlockTransfer against real `kvstashd` processes: pages pushed and pulled through the nodes
// come back byte for byte; a store snapshots its pages at submit; a block that is not what the
// engine asked for (another key, another model, corrupt, missing, its node dead) is refused
// and leaves the job's other blocks loaded; a node of the wrong block size is named at start.

#include "kvstash/connector/block_transfer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <cstring>
#include <numeric>

#include "daemon_process.h"
#include "home_node.h"
#include "kv_event_watch.h"
#include "kvstash/common/hash.h"
#include "kvstash/connector/node_client.h"

namespace kvstash::connector {
namespace {

using ::kvstash::testing::Daemon;
using ::testing::HasSubstr;

constexpr size_t kPage = 4096;
constexpr size_t kPages = 64;

BlockKey Key(uint64_t k, uint32_t group = 0) {
  BlockKey key;
  key.hash = Hash128{Mix64(k), Mix64(~k)};
  key.group = group;
  return key;
}

class BlockTransferTest : public ::testing::Test {
 protected:
  void SetUp() override { pool_.resize(kPages * kPage); }

  // Starts `n` nodes storing blocks of `pages_per_block` pages, and a client of all of them.
  void StartNodes(size_t n, size_t pages_per_block, size_t block_bytes = 0) {
    if (block_bytes == 0) block_bytes = OffloadedBlockBytes(pages_per_block, kPage);
    NodeClientOptions options;
    for (size_t i = 0; i < n; ++i) {
      daemons_.push_back(std::make_unique<Daemon>(
          std::vector<std::string>{"--block-bytes", std::to_string(block_bytes), "--cpu-bytes",
                                   "4MiB"},
          /*sizes=*/false));
      ASSERT_NE(daemons_.back()->port(), 0);
      options.nodes.push_back({"127.0.0.1", daemons_.back()->port()});
    }
    options.timeout = std::chrono::milliseconds(1500);
    options.connect_timeout = std::chrono::milliseconds(1000);
    auto client = NodeClient::Create(options);
    ASSERT_TRUE(client.ok()) << client.status().ToString();
    client_ = std::move(client).value();
  }

  Result<std::unique_ptr<BlockTransfer>> Make(size_t pages_per_block, uint64_t fingerprint = 7) {
    BlockTransferOptions o;
    o.client = client_.get();
    o.pool = {pool_.data(), kPage, kPages};
    o.pages_per_block = pages_per_block;
    o.fingerprint = fingerprint;
    return BlockTransfer::Create(o);
  }

  std::byte* Page(uint32_t p) { return pool_.data() + p * kPage; }
  void Fill(uint32_t p, uint64_t seed) {
    for (size_t i = 0; i < kPage / 8; ++i) {
      const uint64_t v = Mix64(seed * 1000003 + i);
      std::memcpy(Page(p) + i * 8, &v, 8);
    }
  }
  bool Holds(uint32_t p, uint64_t seed) {
    for (size_t i = 0; i < kPage / 8; ++i) {
      uint64_t v;
      std::memcpy(&v, Page(p) + i * 8, 8);
      if (v != Mix64(seed * 1000003 + i)) return false;
    }
    return true;
  }

  BlockJobResult RunJob(BlockTransfer& t, BlockJob job) {
    const uint64_t id = job.id;
    EXPECT_TRUE(t.Submit(std::move(job)).ok());
    t.Wait({&id, 1});
    for (BlockJobResult& r : t.Poll()) {
      if (r.id == id) return r;
    }
    ADD_FAILURE() << "job " << id << " finished without a result";
    return {};
  }

  std::vector<std::byte> pool_;
  std::vector<std::unique_ptr<Daemon>> daemons_;
  std::unique_ptr<NodeClient> client_;
};

TEST_F(BlockTransferTest, StoredPagesLoadBackByteForByteAcrossNodes) {
  StartNodes(2, 2);
  auto t = Make(2);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  // 6 blocks of 2 pages: pages 1..12.
  BlockJob store{1, BlockJob::Kind::kStore, {}, {}, {}};
  for (uint32_t b = 0; b < 6; ++b) {
    store.keys.push_back(Key(b, b % 3));
    store.pages.push_back({1 + 2 * b, 2 + 2 * b});
    Fill(1 + 2 * b, 100 + 2 * b);
    Fill(2 + 2 * b, 101 + 2 * b);
  }
  ASSERT_TRUE((*t)->Submit(store).ok());
  // The engine reuses the pages at once: the store must have taken its copy already.
  std::memset(Page(1), 0xab, 12 * kPage);
  (*t)->WaitAll();
  auto done = (*t)->Poll();
  ASSERT_EQ(done.size(), 1u);
  EXPECT_TRUE(done[0].status.ok()) << done[0].status.ToString();
  EXPECT_EQ(done[0].num_ok(), 6u);
  EXPECT_EQ(done[0].bytes, 6 * 2 * kPage);

  // Load them into other pages, in another order.
  BlockJob load{2, BlockJob::Kind::kLoad, {}, {}, {}};
  for (uint32_t b = 6; b-- > 0;) {
    load.keys.push_back(Key(b, b % 3));
    load.pages.push_back({40 + 2 * b, 41 + 2 * b});
  }
  BlockJobResult r = RunJob(**t, load);
  EXPECT_TRUE(r.status.ok()) << r.status.ToString();
  ASSERT_EQ(r.num_ok(), 6u);
  for (uint32_t b = 0; b < 6; ++b) {
    EXPECT_TRUE(Holds(40 + 2 * b, 100 + 2 * b)) << b;
    EXPECT_TRUE(Holds(41 + 2 * b, 101 + 2 * b)) << b;
  }
}

TEST_F(BlockTransferTest, ForeignCorruptOrMissingBlocksAreRefusedOthersLoad) {
  StartNodes(1, 1);
  auto t = Make(1, /*fingerprint=*/7);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  Fill(1, 1);
  Fill(2, 2);
  ASSERT_TRUE(
      RunJob(**t, {1, BlockJob::Kind::kStore, {Key(1), Key(2)}, {{1}, {2}}, {}}).status.ok());
  // Another model's engine stores under key 3.
  auto other = Make(1, /*fingerprint=*/8);
  ASSERT_TRUE(other.ok());
  Fill(3, 3);
  ASSERT_TRUE(RunJob(**other, {2, BlockJob::Kind::kStore, {Key(3)}, {{3}}, {}}).status.ok());
  // Raw bytes under key 4 (a node returning something that is not a kvstash block), and key 2's
  // block stored again under key 5 (the right bytes for the wrong key).
  std::vector<std::byte> junk((*t)->block_bytes(), std::byte{0x5a});
  ASSERT_TRUE(
      client_->Put(std::vector<BlockKey>{Key(4)}, std::vector<transport::Bytes>{junk}).ok());
  std::vector<std::byte> two((*t)->block_bytes());
  ASSERT_TRUE(client_->Get(Key(2), two).ok());
  ASSERT_TRUE(client_->Put(std::vector<BlockKey>{Key(5)}, std::vector<transport::Bytes>{two}).ok());
  // A flipped byte in a block: stored with its trailer from key 1, payload changed.
  std::vector<std::byte> flipped((*t)->block_bytes());
  ASSERT_TRUE(client_->Get(Key(1), flipped).ok());
  flipped[100] ^= std::byte{1};
  // Same key as the original so the trailer's key matches; the checksum must catch it.
  ASSERT_TRUE(
      client_->Put(std::vector<BlockKey>{Key(1, 9)}, std::vector<transport::Bytes>{flipped}).ok());

  BlockJob load{3,
                BlockJob::Kind::kLoad,
                {Key(1), Key(3), Key(4), Key(5), Key(6), Key(2)},
                {{10}, {11}, {12}, {13}, {14}, {15}},
                {}};
  BlockJobResult r = RunJob(**t, load);
  EXPECT_EQ(r.ok, (std::vector<bool>{true, false, false, false, false, true}));
  EXPECT_TRUE(Holds(10, 1));
  EXPECT_TRUE(Holds(15, 2));
  EXPECT_EQ(r.status.code(), StatusCode::kDataLoss);
  EXPECT_THAT(std::string(r.status.message()), HasSubstr("another model"));

  // The flipped block under (key 1, group 9) names key 1 group 0 in its trailer: refused; and a
  // block whose trailer matches but whose payload changed fails the checksum.
  r = RunJob(**t, {4, BlockJob::Kind::kLoad, {Key(1, 9)}, {{16}}, {}});
  EXPECT_EQ(r.num_ok(), 0u);
  std::vector<std::byte> bad((*t)->block_bytes());
  ASSERT_TRUE(client_->Get(Key(2), bad).ok());
  bad[7] ^= std::byte{0x80};
  BlockTrailer trailer;
  std::memcpy(&trailer, bad.data() + kPage, sizeof trailer);
  trailer.group = 1;  // names (key 2, group 1), where it is put: only the checksum is wrong
  std::memcpy(bad.data() + kPage, &trailer, sizeof trailer);
  ASSERT_TRUE(
      client_->Put(std::vector<BlockKey>{Key(2, 1)}, std::vector<transport::Bytes>{bad}).ok());
  r = RunJob(**t, {5, BlockJob::Kind::kLoad, {Key(2, 1)}, {{17}}, {}});
  EXPECT_EQ(r.num_ok(), 0u);
  EXPECT_THAT(std::string(r.status.message()), HasSubstr("checksum"));
}

TEST_F(BlockTransferTest, DeadNodeFailsItsBlocksWithoutHanging) {
  StartNodes(2, 1);
  auto t = Make(1);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  BlockJob store{1, BlockJob::Kind::kStore, {}, {}, {}};
  for (uint32_t b = 0; b < 16; ++b) {
    Fill(1 + b, 50 + b);
    store.keys.push_back(Key(b));
    store.pages.push_back({1 + b});
  }
  ASSERT_TRUE(RunJob(**t, store).status.ok());
  std::vector<size_t> on_dead;
  for (uint32_t b = 0; b < 16; ++b) {
    if (::kvstash::testing::HomeIndex(*client_, Key(b)) == 1) on_dead.push_back(b);
  }
  ASSERT_FALSE(on_dead.empty());
  daemons_[1]->process().Kill(SIGKILL);
  BlockJob load{2, BlockJob::Kind::kLoad, {}, {}, {}};
  for (uint32_t b = 0; b < 16; ++b) {
    load.keys.push_back(Key(b));
    load.pages.push_back({30 + b});
  }
  const auto start = std::chrono::steady_clock::now();
  BlockJobResult r = RunJob(**t, load);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  for (uint32_t b = 0; b < 16; ++b) {
    const bool dead = std::find(on_dead.begin(), on_dead.end(), b) != on_dead.end();
    EXPECT_EQ(r.ok[b], !dead) << b;
    if (!dead) {
      EXPECT_TRUE(Holds(30 + b, 50 + b));
    }
  }
  // A store to the dead node reports the failure and does not hang either.
  Fill(60, 9);
  BlockJobResult s = RunJob(**t, {3, BlockJob::Kind::kStore, {Key(on_dead[0] + 100)}, {{60}}, {}});
  (void)s;  // its node may be the live one; what matters is that it returned
}

TEST_F(BlockTransferTest, WrongNodeBlockSizeAndBadJobsAreRefused) {
  StartNodes(1, 1, /*block_bytes=*/8192);
  auto t = Make(1);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(t.status().message()),
              HasSubstr("--block-bytes " + std::to_string(OffloadedBlockBytes(1, kPage))));
  auto two = Make(2);  // 2 pages + trailer is not 8192 either
  EXPECT_FALSE(two.ok());
  daemons_.clear();
  StartNodes(1, 1);
  auto ok = Make(1);
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ((*ok)->Submit({1, BlockJob::Kind::kStore, {Key(1)}, {{0}}, {}}).code(),
            StatusCode::kInvalidArgument);  // page 0 is the null page
  EXPECT_EQ((*ok)->Submit({2, BlockJob::Kind::kLoad, {Key(1)}, {{kPages}}, {}}).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ((*ok)->Submit({3, BlockJob::Kind::kLoad, {Key(1)}, {{1, 2}}, {}}).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ((*ok)->Submit({4, BlockJob::Kind::kLoad, {Key(1), Key(2)}, {{1}}, {}}).code(),
            StatusCode::kInvalidArgument);
  // Block metadata that is not one per key.
  const Status metas =
      (*ok)->Submit({5, BlockJob::Kind::kStore, {Key(1)}, {{1}}, {BlockMeta{}, BlockMeta{}}});
  EXPECT_EQ(metas.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(metas.message()), HasSubstr("1 keys but 2 block metadata"));
  EXPECT_TRUE((*ok)->Poll().empty());
}

// A store job's blocks carry what they hold (BlockJob::metas, from the scheduler's TransferJob):
// the node's KV events say each block's parent and block size (docs/semantics.md §19), whether
// its blocks travel batched (PutBlocks: 1 page) or one to a call (PutBlock: 17 pages, past
// kBatchedBlockBytes). A store without metadata is published as before.
class BlockTransferEventsTest : public BlockTransferTest,
                                public ::testing::WithParamInterface<size_t> {};

TEST_P(BlockTransferEventsTest, StoredBlocksCarryTheirParentAndSizeIntoTheNodesEvents) {
  const size_t pages = GetParam();
  const size_t block_bytes = OffloadedBlockBytes(pages, kPage);
  std::unique_ptr<::kvstash::ChildProcess> node = ::kvstash::testing::StartChild(
      {::kvstash::testing::kKvstashd, "--port", "0", "--metrics-address", "off", "--log-level",
       "warn", "--block-bytes", std::to_string(block_bytes), "--cpu-bytes", "4MiB", "--kv-events",
       "tcp://127.0.0.1:*"});
  ASSERT_NE(node, nullptr);
  uint16_t port = 0;
  std::string endpoint;
  const std::string listening = "kvstashd listening on 127.0.0.1:";
  const std::string publishing = "kvstashd KV events on ";
  for (int i = 0; i < 50 && endpoint.empty(); ++i) {
    std::optional<std::string> line = node->ReadLine(10000);
    if (!line) break;
    if (line->rfind(listening, 0) == 0) port = std::stoi(line->substr(listening.size()));
    if (line->rfind(publishing, 0) == 0) {
      endpoint = line->substr(publishing.size());
      endpoint = endpoint.substr(0, endpoint.find_first_of(", "));
    }
  }
  ASSERT_NE(port, 0);
  ASSERT_FALSE(endpoint.empty());
  NodeClientOptions options;
  options.nodes.push_back({"127.0.0.1", port});
  auto client = NodeClient::Create(options);
  ASSERT_TRUE(client.ok()) << client.status().ToString();
  client_ = std::move(client).value();
  auto t = Make(pages);
  ASSERT_TRUE(t.ok()) << t.status().ToString();

  ::kvstash::testing::KvEventWatch watch(endpoint);
  // Probes (stores without metadata, keys of their own) until the subscriber hears one.
  std::vector<uint32_t> first_block;
  for (size_t p = 0; p < pages; ++p) first_block.push_back(static_cast<uint32_t>(1 + p));
  ASSERT_TRUE(watch.Join([&](int i) {
    RunJob(**t, {100 + static_cast<uint64_t>(i),
                 BlockJob::Kind::kStore,
                 {Key(1000 + static_cast<uint64_t>(i))},
                 {first_block},
                 {}});
  }));

  // Blocks 1, 2 chain under block 0 (stored before, or never); 4 hangs from 3; 5 has none.
  auto meta = [](std::optional<uint64_t> parent, uint32_t tokens) {
    BlockMeta m;
    if (parent) m.parent = Key(*parent).hash;
    m.tokens = tokens;
    return m;
  };
  BlockJob store{1,
                 BlockJob::Kind::kStore,
                 {Key(1), Key(2), Key(4)},
                 {},
                 {meta(0, 16), meta(1, 16), meta(3, 16)}};
  for (uint32_t b = 0; b < store.keys.size(); ++b) {
    std::vector<uint32_t> block;
    for (size_t p = 0; p < pages; ++p) block.push_back(static_cast<uint32_t>(1 + b * pages + p));
    store.pages.push_back(block);
  }
  BlockJobResult r = RunJob(**t, store);
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  BlockJob plain{2, BlockJob::Kind::kStore, {Key(5)}, {first_block}, {}};
  r = RunJob(**t, plain);
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();

  auto hash = [](uint64_t k) { return events::ExternalHashOf(Key(k).hash); };
  using Said = ::kvstash::testing::KvEventWatch::Said;
  EXPECT_EQ(watch.Stored("default", {hash(1), hash(2), hash(4), hash(5)}),
            (std::map<events::ExternalHash, Said>{{hash(1), {hash(0), 16, "CPU"}},
                                                  {hash(2), {hash(1), 16, "CPU"}},
                                                  {hash(4), {hash(3), 16, "CPU"}},
                                                  {hash(5), {std::nullopt, 0, "CPU"}}}));
  if (pages == 1) {
    // A request's worth of small blocks, a chain: as many go to a PutBlocks call as the node's
    // batch holds (1 MiB: 252 here), but the call's message (keys, lengths, metadata) travels
    // in UCX's header beside the payload, 8,100 bytes on TCP. Every block is stored.
    BlockJob many{3, BlockJob::Kind::kStore, {}, {}, {}};
    for (uint32_t b = 0; b < 400; ++b) {
      many.keys.push_back(Key(5000 + b));
      many.pages.push_back({static_cast<uint32_t>(1 + b % 32)});
      many.metas.push_back(meta(b == 0 ? std::nullopt : std::optional<uint64_t>(4999 + b), 16));
    }
    r = RunJob(**t, many);
    EXPECT_TRUE(r.status.ok()) << r.status.ToString();
    EXPECT_EQ(r.num_ok(), many.keys.size());
  }
  client_.reset();
}

INSTANTIATE_TEST_SUITE_P(Batched, BlockTransferEventsTest, ::testing::Values(1, 17),
                         [](const auto& param_info) {
                           return param_info.param == 1 ? std::string("PutBlocks")
                                                        : std::string("PutBlock");
                         });

}  // namespace
}  // namespace kvstash::connector
