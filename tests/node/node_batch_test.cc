// Batched calls of small blocks (GetBlocks, PutBlocks): over real UCX against a NodeServer,
// once over shared memory and once over TCP, each key answered as its one-block call would
// answer it, and every malformed batch refused whole with a clear error; then, through the
// loopback, a client against a peer whose batch replies lie, which gets errors, never a wrong
// block.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <map>
#include <thread>

#include "block_pattern.h"
#include "kvstash/common/hash.h"
#include "kvstash/connector/node_client.h"
#include "kvstash/node/node_server.h"
#include "kvstash/proto/convert.h"
#include "kvstash/proto/wire.pb.h"
#include "kvstash/transport/loopback.h"
#include "node_test_client.h"

namespace kvstash::node {
namespace {

using namespace std::chrono_literals;
using connector::NodeClient;
using ::kvstash::testing::FillPattern;
using ::kvstash::testing::MatchesPattern;
using ::kvstash::testing::NodeTestClient;
using ::kvstash::testing::WireKey;
using ::testing::HasSubstr;
using transport::CallOptions;

constexpr size_t kBlock = 16 << 10;
constexpr uint64_t kBatchBytes = 4 * kBlock;  // four blocks to a call

class NodeBatchTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override { StartNode(kBatchBytes); }

  void StartNode(uint64_t batch_bytes) {
    node_.reset();
    NodeOptions options;
    options.server.transport.tls = GetParam();
    options.server.auth_token = "token";
    options.max_keys_per_request = 8;
    options.max_batch_bytes = batch_bytes;
    options.store.block_bytes = kBlock;
    options.store.cpu_capacity_blocks = 16;
    options.store.prefault = false;
    auto node = NodeServer::Create(options);
    ASSERT_TRUE(node.ok()) << node.status().ToString();
    node_ = std::move(*node);
  }

  std::unique_ptr<NodeTestClient> Client(const std::string& ns) {
    auto client = std::make_unique<NodeTestClient>(node_->port(), ns, "token", GetParam(), kBlock);
    return client->ok() ? std::move(client) : nullptr;
  }

  // PutBlocks of the blocks of `ks` (block k: pattern k + `pattern_offset`), with the payload's
  // checksum xor `checksum_xor`; `lengths` stated instead of one block per key when given.
  static Status PutMany(NodeTestClient& client, const std::vector<uint64_t>& ks,
                        wire::PutBlocksReply* reply, uint64_t checksum_xor = 0,
                        uint64_t pattern_offset = 0, std::vector<uint64_t> lengths = {}) {
    std::vector<std::byte> payload(ks.size() * kBlock);
    wire::PutBlocksRequest request;
    for (size_t i = 0; i < ks.size(); ++i) {
      FillPattern(ks[i] + pattern_offset, std::span(payload).subspan(i * kBlock, kBlock));
      *request.add_keys() = WireKey(ks[i]);
    }
    if (lengths.empty()) lengths.assign(ks.size(), kBlock);
    for (uint64_t length : lengths) request.add_lengths(length);
    request.set_checksum(Xxh3Hash64(payload) ^ checksum_xor);
    CallOptions options;
    options.send_payload = payload;
    return client.Call(wire::METHOD_PUT_BLOCKS, request, reply, options);
  }

  // GetBlocks of `ks` into *out (room for every block); the payload's bytes in *payload.
  static Status GetMany(NodeTestClient& client, const std::vector<uint64_t>& ks,
                        wire::GetBlocksReply* reply, std::vector<std::byte>* out, size_t* payload) {
    out->assign(ks.size() * kBlock, std::byte{0});
    wire::GetBlocksRequest request;
    for (uint64_t k : ks) *request.add_keys() = WireKey(k);
    CallOptions options;
    options.recv_payload = *out;
    return client.Call(wire::METHOD_GET_BLOCKS, request, reply, options, payload);
  }

  uint64_t Counter(const std::string& name) { return node_->Counters().at(name); }

  std::unique_ptr<NodeServer> node_;
};

TEST_P(NodeBatchTest, ABatchStoresAndReadsEachBlockAsItsOwnCallWould) {
  auto client = Client("tenant");
  ASSERT_NE(client, nullptr);
  wire::PutBlocksReply put;
  ASSERT_TRUE(PutMany(*client, {1, 2, 3}, &put).ok());
  // The node stated its batch limit at hello.
  const std::optional<transport::ServerLimits> stated = client->rpc().server_limits();
  ASSERT_TRUE(stated.has_value());
  const Result<connector::NodeLimits> limits = connector::NodeLimitsFrom(*stated);
  ASSERT_TRUE(limits.ok()) << limits.status().ToString();
  EXPECT_EQ(limits->max_batch_bytes, kBatchBytes);
  EXPECT_EQ(connector::BlocksPerBatch(*limits), 4u);
  ASSERT_EQ(put.results_size(), 3);
  for (const wire::BlockResult& r : put.results()) {
    EXPECT_EQ(r.code(), wire::OK);
    EXPECT_FALSE(r.skipped());
  }
  // A key held already is skipped (and touched); the new one stored.
  ASSERT_TRUE(PutMany(*client, {3, 4}, &put).ok());
  ASSERT_EQ(put.results_size(), 2);
  EXPECT_TRUE(put.results(0).skipped());
  EXPECT_EQ(put.results(1).code(), wire::OK);
  EXPECT_FALSE(put.results(1).skipped());
  EXPECT_EQ(Counter("node.blocks_stored"), 4u);

  wire::GetBlocksReply got;
  std::vector<std::byte> out;
  size_t payload = 0;
  ASSERT_TRUE(GetMany(*client, {4, 99, 1, 2}, &got, &out, &payload).ok());
  ASSERT_EQ(got.results_size(), 4);
  EXPECT_EQ(got.results(0).code(), wire::OK);
  EXPECT_EQ(got.results(1).code(), wire::NOT_FOUND);
  EXPECT_THAT(got.results(1).message(), HasSubstr("not on this node"));
  EXPECT_EQ(got.results(1).length(), 0u);
  // The blocks read lie back to back in key order; the miss takes no room.
  EXPECT_EQ(payload, 3 * kBlock);
  size_t at = 0;
  for (uint64_t k : {4, 1, 2}) {
    EXPECT_TRUE(MatchesPattern(k, std::span(out).subspan(at, kBlock))) << k;
    at += kBlock;
  }
  // Counted once the reply's payload has left; timed per method.
  for (int i = 0; i < 200 && Counter("node.blocks_loaded") < 3; ++i) {
    std::this_thread::sleep_for(10ms);
  }
  EXPECT_EQ(Counter("node.blocks_loaded"), 3u);
  EXPECT_EQ(Counter("node.bytes_out"), 3 * kBlock);
  std::map<std::string, uint64_t> counts;
  for (const MethodLatency& m : node_->Latencies()) counts[m.method] = m.count;
  EXPECT_EQ(counts["put_blocks"], 2u);
  EXPECT_EQ(counts["get_blocks"], 1u);
  // Their pins lasted the copy only: the whole tier takes new blocks, evicting them.
  for (uint64_t k = 100; k < 116; k += 4) {
    ASSERT_TRUE(PutMany(*client, {k, k + 1, k + 2, k + 3}, &put).ok());
    for (const wire::BlockResult& r : put.results()) EXPECT_EQ(r.code(), wire::OK) << k;
  }
  EXPECT_THAT(client->PerKey({1, 2, 3, 4}), ::testing::Each(::testing::Eq(wire::LOOKUP_MISS)));
}

TEST_P(NodeBatchTest, MalformedBatchesAreRefusedWholeWithClearErrors) {
  auto client = Client("tenant");
  ASSERT_NE(client, nullptr);
  wire::PutBlocksReply put;
  // A checksum that does not match: DataLoss, and not one block of the batch is stored.
  Status s = PutMany(*client, {1, 2}, &put, /*checksum_xor=*/1);
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s.ToString();
  EXPECT_THAT(std::string(s.message()), HasSubstr("no block stored"));
  EXPECT_EQ(Counter("node.checksum_failures"), 1u);
  EXPECT_THAT(client->PerKey({1, 2}), ::testing::Each(::testing::Eq(wire::LOOKUP_MISS)));
  // Lengths that are not one per key.
  s = PutMany(*client, {1, 2}, &put, 0, 0, {2 * kBlock});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_THAT(std::string(s.message()), HasSubstr("2 keys with 1 lengths"));
  // Lengths that do not add up to the payload.
  s = PutMany(*client, {1, 2}, &put, 0, 0, {kBlock, kBlock - 1});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_THAT(std::string(s.message()), HasSubstr("but the payload has"));
  // Lengths past the batch limit, even when a huge one would wrap the sum.
  s = PutMany(*client, {1, 2, 3, 4, 5}, &put);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_THAT(std::string(s.message()), HasSubstr("may add up to 65536"));
  s = PutMany(*client, {1, 2}, &put, 0, 0, {~uint64_t{0}, 2 * kBlock + 1});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  // More keys than a request may carry.
  wire::GetBlocksReply got;
  std::vector<std::byte> out;
  size_t payload = 0;
  s = GetMany(*client, {1, 2, 3, 4, 5, 6, 7, 8, 9}, &got, &out, &payload);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_THAT(std::string(s.message()), HasSubstr("limit is 8"));
  // Bytes that do not parse.
  const std::string garbage = "\xff\xff\xff\xff not a protobuf";
  s = client->rpc().CallSync(wire::METHOD_GET_BLOCKS, std::as_bytes(std::span(garbage)), {},
                             nullptr);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_EQ(Counter("node.blocks_stored"), 0u);
  EXPECT_EQ(Counter("cpu.resident_blocks"), 0u);

  // A block of the wrong size inside a well-formed batch is refused alone, as PutBlock would
  // refuse it; the others are stored.
  std::vector<uint64_t> lengths = {kBlock, kBlock - 100, kBlock + 100};
  ASSERT_TRUE(PutMany(*client, {1, 2, 3}, &put, 0, 0, lengths).ok());
  ASSERT_EQ(put.results_size(), 3);
  EXPECT_EQ(put.results(0).code(), wire::OK);
  EXPECT_EQ(put.results(1).code(), wire::INVALID_ARGUMENT);
  EXPECT_THAT(put.results(1).message(), HasSubstr("block size is 16384"));
  EXPECT_EQ(put.results(2).code(), wire::INVALID_ARGUMENT);
  EXPECT_EQ(Counter("node.blocks_stored"), 1u);
  ASSERT_TRUE(GetMany(*client, {1}, &got, &out, &payload).ok());
  EXPECT_TRUE(MatchesPattern(1, std::span(out).first(kBlock)));
}

TEST_P(NodeBatchTest, AReadPastTheBatchLimitAnswersTheRestOutOfRange) {
  auto client = Client("tenant");
  ASSERT_NE(client, nullptr);
  wire::PutBlocksReply put;
  ASSERT_TRUE(PutMany(*client, {1, 2, 3, 4}, &put).ok());
  ASSERT_TRUE(PutMany(*client, {5}, &put).ok());
  wire::GetBlocksReply got;
  std::vector<std::byte> out;
  size_t payload = 0;
  ASSERT_TRUE(GetMany(*client, {1, 2, 3, 4, 5}, &got, &out, &payload).ok());
  ASSERT_EQ(got.results_size(), 5);
  for (int k = 0; k < 4; ++k) EXPECT_EQ(got.results(k).code(), wire::OK) << k;
  EXPECT_EQ(got.results(4).code(), wire::OUT_OF_RANGE);
  EXPECT_THAT(got.results(4).message(), HasSubstr("may add up to 65536"));
  EXPECT_EQ(payload, kBatchBytes);
}

TEST_P(NodeBatchTest, ANamespaceNeverSeesAnothersBlocksInABatch) {
  auto a = Client("a");
  auto b = Client("b");
  ASSERT_TRUE(a && b);
  wire::PutBlocksReply put;
  ASSERT_TRUE(PutMany(*a, {7, 8}, &put).ok());
  wire::GetBlocksReply got;
  std::vector<std::byte> out;
  size_t payload = 0;
  ASSERT_TRUE(GetMany(*b, {7, 8}, &got, &out, &payload).ok());
  EXPECT_EQ(got.results(0).code(), wire::NOT_FOUND);
  EXPECT_EQ(got.results(1).code(), wire::NOT_FOUND);
  EXPECT_EQ(payload, 0u);
  // b's block under the same key is its own; a still reads its own bytes.
  ASSERT_TRUE(PutMany(*b, {7}, &put, 0, /*pattern_offset=*/1000).ok());
  EXPECT_FALSE(put.results(0).skipped());
  ASSERT_TRUE(GetMany(*a, {7}, &got, &out, &payload).ok());
  EXPECT_TRUE(MatchesPattern(7, std::span(out).first(kBlock)));
  ASSERT_TRUE(GetMany(*b, {7}, &got, &out, &payload).ok());
  EXPECT_TRUE(MatchesPattern(1007, std::span(out).first(kBlock)));
}

TEST_P(NodeBatchTest, ANodeWithoutBatchesSaysSoAndRefusesThem) {
  StartNode(0);
  auto client = Client("tenant");
  ASSERT_NE(client, nullptr);
  wire::PutBlocksReply put;
  EXPECT_EQ(PutMany(*client, {1}, &put).code(), StatusCode::kUnimplemented);
  const Result<connector::NodeLimits> limits =
      connector::NodeLimitsFrom(*client->rpc().server_limits());
  ASSERT_TRUE(limits.ok());
  EXPECT_EQ(limits->max_batch_bytes, 0u);
  EXPECT_EQ(connector::BlocksPerBatch(*limits), 0u);
}

INSTANTIATE_TEST_SUITE_P(Tls, NodeBatchTest, ::testing::Values("shm", "tcp"),
                         [](const auto& param_info) { return param_info.param; });

// ---- A client against a peer whose batch replies lie -------------------------------------------

BlockKey Key(uint64_t k) { return BlockKey{Hash128{k, 0xba7c}, 0}; }

// A loopback peer that states a node's limits (4 KiB blocks, batches of 64 KiB) and answers
// GetBlocks and PutBlocks with `reply`'s results and as many payload bytes as it says.
class LyingPeer {
 public:
  struct Answer {
    std::vector<wire::BlockResult> results;
    size_t payload_bytes = 0;
  };
  explicit LyingPeer(std::function<Answer(size_t keys)> answer) {
    transport::ServerOptions options;
    wire::NodeLimits limits;
    limits.set_block_bytes(4096);
    limits.set_max_keys_per_request(64);
    limits.set_max_batch_bytes(64 << 10);
    options.service_limits = limits.SerializeAsString();
    peer_ = network_->Listen(options);
    for (auto method : {wire::METHOD_GET_BLOCKS, wire::METHOD_PUT_BLOCKS}) {
      peer_->Handle(method, [answer, this](transport::ServerCall call) {
        wire::GetBlocksRequest request;  // a PutBlocksRequest's keys are field 1 too
        request.ParseFromArray(call.request().data(), static_cast<int>(call.request().size()));
        const Answer a = answer(static_cast<size_t>(request.keys_size()));
        wire::GetBlocksReply reply;
        for (const wire::BlockResult& r : a.results) *reply.add_results() = r;
        const std::string bytes = reply.SerializeAsString();
        payload_.assign(call.method() == wire::METHOD_GET_BLOCKS ? a.payload_bytes : 0,
                        std::byte{0x5a});
        call.Reply(std::as_bytes(std::span(bytes)), payload_);
      });
    }
    EXPECT_TRUE(peer_->Start().ok());
  }
  ~LyingPeer() { peer_->Stop(); }

  std::unique_ptr<NodeClient> Client() {
    connector::NodeClientOptions options;
    options.nodes.push_back({"loopback", peer_->port()});
    options.timeout = 500ms;
    options.connect = [network = network_](const transport::ClientOptions& c) {
      return Result<std::unique_ptr<transport::Channel>>(network->Connect(c));
    };
    auto client = NodeClient::Create(options);
    EXPECT_TRUE(client.ok()) << client.status().ToString();
    return client.ok() ? std::move(*client) : nullptr;
  }

 private:
  std::shared_ptr<transport::LoopbackNetwork> network_ = transport::LoopbackNetwork::Create();
  std::unique_ptr<transport::Listener> peer_;
  std::vector<std::byte> payload_;
};

wire::BlockResult Said(wire::Code code, uint64_t length = 0) {
  wire::BlockResult r;
  r.set_code(code);
  r.set_length(length);
  if (code != wire::OK) r.set_message("as the peer says");
  return r;
}

// Reads keys 0..n-1 of 4 KiB each through `client`: per key, the outcome.
std::vector<kvstash::Result<size_t>> ReadAll(NodeClient& client, size_t n,
                                             std::vector<std::vector<std::byte>>* blocks) {
  std::vector<BlockKey> keys;
  blocks->assign(n, std::vector<std::byte>(4096, std::byte{0}));
  std::vector<transport::MutableBytes> outs;
  for (size_t k = 0; k < n; ++k) {
    keys.push_back(Key(k));
    outs.push_back((*blocks)[k]);
  }
  return client.Get(keys, outs);
}

TEST(LyingPeerTest, ARepliesCountThatIsNotOnePerKeyFailsEveryKeyOfTheCall) {
  LyingPeer peer([](size_t keys) {
    return LyingPeer::Answer{std::vector<wire::BlockResult>(keys + 1, Said(wire::OK, 4096)),
                             keys * 4096};
  });
  auto client = peer.Client();
  ASSERT_NE(client, nullptr);
  std::vector<std::vector<std::byte>> blocks;
  const auto got = ReadAll(*client, 3, &blocks);
  for (const auto& r : got) {
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kInternal) << r.status().ToString();
  }
  // A store whose reply does not answer each key is an error too, not a stored block.
  std::vector<std::byte> block(4096);
  const BlockKey key = Key(1);
  const transport::Bytes bytes = block;
  const Status put = client->Put(std::span(&key, 1), std::span(&bytes, 1));
  EXPECT_EQ(put.code(), StatusCode::kInternal) << put.ToString();
  EXPECT_GE(client->counters()[ClientCounter::kRefused], 1u);
}

TEST(LyingPeerTest, ALengthPastItsBufferIsAnErrorAndSoIsEveryBlockAfterIt) {
  // Key 1 says it is longer than its buffer: where key 2's bytes begin is then unknown. Key 3
  // has a status code no build knows.
  LyingPeer peer([](size_t) {
    wire::BlockResult unknown = Said(wire::OK);
    unknown.set_code(static_cast<wire::Code>(99));
    unknown.set_message("as the peer says");
    return LyingPeer::Answer{
        {Said(wire::OK, 4096), Said(wire::OK, 8192), Said(wire::OK, 4096), unknown}, 4 * 4096};
  });
  auto client = peer.Client();
  ASSERT_NE(client, nullptr);
  std::vector<std::vector<std::byte>> blocks;
  const auto got = ReadAll(*client, 4, &blocks);
  ASSERT_EQ(got.size(), 4u);
  ASSERT_TRUE(got[0].ok()) << got[0].status().ToString();
  EXPECT_EQ(*got[0], 4096u);
  EXPECT_EQ(blocks[0][0], std::byte{0x5a});
  EXPECT_EQ(got[1].status().code(), StatusCode::kInternal) << got[1].status().ToString();
  EXPECT_THAT(std::string(got[1].status().message()), HasSubstr("the buffer holds 4096"));
  EXPECT_EQ(got[2].status().code(), StatusCode::kInternal) << got[2].status().ToString();
  EXPECT_EQ(got[3].status().code(), StatusCode::kUnknown) << got[3].status().ToString();
  EXPECT_THAT(std::string(got[3].status().message()), HasSubstr("status code 99"));
}

TEST(LyingPeerTest, BlocksPastThePayloadThatCameAreErrors) {
  LyingPeer peer([](size_t keys) {
    return LyingPeer::Answer{std::vector<wire::BlockResult>(keys, Said(wire::OK, 4096)), 2 * 4096};
  });
  auto client = peer.Client();
  ASSERT_NE(client, nullptr);
  std::vector<std::vector<std::byte>> blocks;
  const auto got = ReadAll(*client, 3, &blocks);
  EXPECT_TRUE(got[0].ok() && got[1].ok());
  ASSERT_FALSE(got[2].ok());
  EXPECT_EQ(got[2].status().code(), StatusCode::kInternal);
  EXPECT_THAT(std::string(got[2].status().message()), HasSubstr("8192 bytes came"));
}

}  // namespace
}  // namespace kvstash::node
