// NodeServer over real UCX in this process, once over shared memory and once over TCP: the
// two-phase store, the lookups, pinned loads, namespaces, the error answers, and what a session
// that ends leaves behind (nothing).

#include "kvstash/node/node_server.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <spdlog/sinks/ostream_sink.h>

#include <algorithm>
#include <map>
#include <sstream>
#include <thread>

#include "kvstash/common/logging.h"
#include "node_test_client.h"
#include "temp_dir.h"

namespace kvstash::node {
namespace {

using namespace std::chrono_literals;
using ::kvstash::testing::FillPattern;
using ::kvstash::testing::MatchesPattern;
using ::kvstash::testing::NodeTestClient;
using ::kvstash::testing::TempDir;
using ::kvstash::testing::WireKey;
using ::testing::HasSubstr;
using transport::CallOptions;

constexpr size_t kBlock = 64 << 10;

class NodeServerTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override { StartNode(16); }

  void StartNode(size_t cpu_blocks,
                 std::chrono::milliseconds lease = std::chrono::milliseconds(30000),
                 std::optional<store::SsdTierOptions> ssd = std::nullopt,
                 std::map<std::string, size_t> quotas = {}) {
    NodeOptions options;
    options.server.transport.tls = GetParam();
    options.server.auth_token = "token";
    options.server.max_keys_per_request = 64;
    options.store.block_bytes = kBlock;
    options.store.cpu_capacity_blocks = cpu_blocks;
    options.store.prefault = false;
    options.lease_timeout = lease;
    options.store.ssd = std::move(ssd);
    options.namespace_quota_blocks = std::move(quotas);
    auto node = NodeServer::Start(options);
    ASSERT_TRUE(node.ok()) << node.status().ToString();
    node_ = std::move(*node);
  }

  std::unique_ptr<NodeTestClient> Client(const std::string& ns) {
    auto client = std::make_unique<NodeTestClient>(node_->port(), ns, "token", GetParam(), kBlock);
    return client->ok() ? std::move(client) : nullptr;
  }

  std::unique_ptr<NodeServer> node_;
};

TEST_P(NodeServerTest, StoreLookupAndLoadRoundTrip) {
  auto client = Client("tenant");
  ASSERT_NE(client, nullptr);
  client->Store({1, 2, 3, 4});
  EXPECT_EQ(node_->shares_cpu_memory(), true);

  EXPECT_THAT(client->PerKey({1, 4, 99}),
              ::testing::ElementsAre(wire::LOOKUP_HIT, wire::LOOKUP_HIT, wire::LOOKUP_MISS));
  wire::LookupRequest scans;
  wire::Lookup* prefix = scans.add_lookups();
  prefix->set_mode(wire::LOOKUP_MODE_PREFIX);
  for (uint64_t k : {1, 2, 3, 99, 4}) *prefix->add_keys() = WireKey(k);
  wire::Lookup* window = scans.add_lookups();
  window->set_mode(wire::LOOKUP_MODE_WINDOW);
  window->set_window_size(2);
  for (uint64_t k : {99, 98, 3, 4}) *window->add_keys() = WireKey(k);
  wire::LookupReply scanned;
  ASSERT_TRUE(client->Call(wire::METHOD_LOOKUP, scans, &scanned).ok());
  ASSERT_EQ(scanned.answers_size(), 2);
  EXPECT_EQ(scanned.answers(0).hit_length(), 3u);  // stops at the miss
  EXPECT_EQ(scanned.answers(1).hit_length(), 4u);  // the last two form a window
  EXPECT_FALSE(scanned.answers(0).retry());

  wire::LoadRequest load;
  for (uint64_t k : {2, 3, 99}) *load.add_keys() = WireKey(k);
  wire::LoadReply loaded;
  ASSERT_TRUE(client->Call(wire::METHOD_LOAD, load, &loaded).ok());
  ASSERT_EQ(loaded.pinned_size(), 3);
  EXPECT_TRUE(loaded.pinned(0));
  EXPECT_TRUE(loaded.pinned(1));
  EXPECT_FALSE(loaded.pinned(2));
  EXPECT_EQ(loaded.length(0), kBlock);
  std::vector<std::byte> out(kBlock);
  for (uint64_t k : {2, 3}) {
    wire::GetBlockRequest get;
    *get.mutable_key() = WireKey(k);
    wire::GetBlockReply got;
    CallOptions options;
    options.recv_payload = out;
    size_t payload = 0;
    ASSERT_TRUE(client->Call(wire::METHOD_GET_BLOCK, get, &got, options, &payload).ok());
    EXPECT_EQ(payload, kBlock);
    EXPECT_EQ(got.length(), kBlock);
    EXPECT_TRUE(MatchesPattern(k, out)) << k;
  }
  wire::ReleaseRequest release;
  for (uint64_t k : {2, 3}) *release.add_keys() = WireKey(k);
  ASSERT_TRUE(client->Call(wire::METHOD_RELEASE, release, (wire::ReleaseReply*)nullptr).ok());

  wire::StatsReply stats;
  ASSERT_TRUE(client->Call(wire::METHOD_STATS, wire::StatsRequest(), &stats).ok());
  EXPECT_EQ(stats.counters().at("node.blocks_stored"), 4u);
  EXPECT_EQ(stats.counters().at("node.blocks_loaded"), 2u);
  EXPECT_EQ(stats.counters().at("node.bytes_in"), 4 * kBlock);
  EXPECT_EQ(stats.counters().at("cpu.resident_blocks"), 4u);
  // Over shared memory the four puts and two gets copied straight through the node's memory.
  EXPECT_EQ(stats.counters().at("transport.mapped_payloads"), GetParam() == "shm" ? 6u : 0u);
}

// PutBlock with prepare and commit stores a block in one call; GetBlock with pin reads one
// without a Load, and the pin ends with the transfer.
TEST_P(NodeServerTest, OneCallStoreAndRead) {
  auto client = Client("tenant");
  ASSERT_NE(client, nullptr);
  std::vector<std::byte> block(kBlock);
  auto put = [&](uint64_t k, uint64_t checksum_xor, wire::PutBlockReply* reply) {
    FillPattern(k, block);
    wire::PutBlockRequest request;
    *request.mutable_key() = WireKey(k);
    request.set_length(kBlock);
    request.set_checksum(Xxh3Hash64(block) ^ checksum_xor);
    request.set_prepare(true);
    request.set_commit(true);
    CallOptions options;
    options.send_payload = block;
    return client->Call(wire::METHOD_PUT_BLOCK, request, reply, options);
  };
  wire::PutBlockReply reply;
  ASSERT_TRUE(put(7, 0, &reply).ok());
  EXPECT_FALSE(reply.skipped());
  EXPECT_THAT(client->PerKey({7}), ::testing::ElementsAre(wire::LOOKUP_HIT));
  ASSERT_TRUE(put(7, 0, &reply).ok());  // held already: the bytes are not taken again
  EXPECT_TRUE(reply.skipped());
  // A corrupted block is refused and aborted: nothing of it stays.
  const Status bad = put(8, 1, &reply);
  EXPECT_EQ(bad.code(), StatusCode::kDataLoss) << bad.ToString();
  EXPECT_THAT(client->PerKey({8}), ::testing::ElementsAre(wire::LOOKUP_MISS));

  auto get = [&](uint64_t k, size_t* payload) {
    std::fill(block.begin(), block.end(), std::byte{0});
    wire::GetBlockRequest request;
    *request.mutable_key() = WireKey(k);
    request.set_pin(true);
    CallOptions options;
    options.recv_payload = block;
    return client->Call(wire::METHOD_GET_BLOCK, request, (wire::GetBlockReply*)nullptr, options,
                        payload);
  };
  size_t payload = 0;
  ASSERT_TRUE(get(7, &payload).ok());
  EXPECT_EQ(payload, kBlock);
  EXPECT_TRUE(MatchesPattern(7, block));
  EXPECT_EQ(get(99, &payload).code(), StatusCode::kNotFound);
  // Without pin, GetBlock still wants a Load first.
  wire::GetBlockRequest unpinned;
  *unpinned.mutable_key() = WireKey(7);
  EXPECT_EQ(client->Call(wire::METHOD_GET_BLOCK, unpinned, (wire::GetBlockReply*)nullptr).code(),
            StatusCode::kFailedPrecondition);

  // The transfer's pin is gone: filling the tier with other blocks evicts block 7.
  std::vector<uint64_t> others;
  for (uint64_t k = 100; k < 100 + 16; ++k) others.push_back(k);
  client->Store(others);
  EXPECT_THAT(client->PerKey({7}), ::testing::ElementsAre(wire::LOOKUP_MISS));
  wire::StatsReply stats;
  ASSERT_TRUE(client->Call(wire::METHOD_STATS, wire::StatsRequest(), &stats).ok());
  EXPECT_EQ(stats.counters().at("node.blocks_stored"), 17u);
  EXPECT_EQ(stats.counters().at("node.blocks_aborted"), 1u);
  EXPECT_EQ(stats.counters().at("node.checksum_failures"), 1u);
}

TEST_P(NodeServerTest, NamespacesDoNotSeeEachOther) {
  auto a = Client("a");
  auto b = Client("b");
  ASSERT_TRUE(a && b);
  a->Store({7});
  EXPECT_THAT(a->PerKey({7}), ::testing::ElementsAre(wire::LOOKUP_HIT));
  EXPECT_THAT(b->PerKey({7}), ::testing::ElementsAre(wire::LOOKUP_MISS));
  wire::LoadRequest load;
  *load.add_keys() = WireKey(7);
  wire::LoadReply loaded;
  ASSERT_TRUE(b->Call(wire::METHOD_LOAD, load, &loaded).ok());
  EXPECT_FALSE(loaded.pinned(0));
  // b may store the same key; a's block is untouched.
  b->Store({7});
  EXPECT_EQ(node_->stats().blocks_stored, 2u);
}

TEST_P(NodeServerTest, BadRequestsGetClearErrors) {
  auto client = Client("tenant");
  ASSERT_NE(client, nullptr);
  std::vector<std::byte> block(kBlock);
  wire::PutBlockRequest put;
  *put.mutable_key() = WireKey(5);
  put.set_length(kBlock);
  CallOptions with_block;
  with_block.send_payload = block;
  Status s = client->Call(wire::METHOD_PUT_BLOCK, put, (wire::PutBlockReply*)nullptr, with_block);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
  EXPECT_THAT(std::string(s.message()), HasSubstr("PrepareStore first"));

  wire::PrepareStoreRequest prepare;
  *prepare.add_keys() = WireKey(5);
  ASSERT_TRUE(
      client->Call(wire::METHOD_PREPARE_STORE, prepare, (wire::PrepareStoreReply*)nullptr).ok());
  CallOptions short_block;
  short_block.send_payload = std::span(block).first(100);
  put.set_length(100);
  s = client->Call(wire::METHOD_PUT_BLOCK, put, (wire::PutBlockReply*)nullptr, short_block);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_THAT(std::string(s.message()), HasSubstr("block size is 65536"));

  put.set_length(kBlock);
  put.set_checksum(12345);  // wrong
  s = client->Call(wire::METHOD_PUT_BLOCK, put, (wire::PutBlockReply*)nullptr, with_block);
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s.ToString();
  EXPECT_EQ(node_->stats().checksum_failures, 1u);
  wire::CommitRequest commit;
  *commit.add_keys() = WireKey(5);
  commit.set_success(true);
  wire::CommitReply committed;
  ASSERT_TRUE(client->Call(wire::METHOD_COMMIT, commit, &committed).ok());
  ASSERT_EQ(committed.failed_size(), 1);
  EXPECT_THAT(committed.failed(0).message(), HasSubstr("never sent"));
  EXPECT_THAT(client->PerKey({5}), ::testing::ElementsAre(wire::LOOKUP_MISS));

  wire::GetBlockRequest get;
  *get.mutable_key() = WireKey(5);
  s = client->Call(wire::METHOD_GET_BLOCK, get, (wire::GetBlockReply*)nullptr);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();

  wire::LookupRequest many;
  wire::Lookup* lookup = many.add_lookups();
  lookup->set_mode(wire::LOOKUP_MODE_PER_KEY);
  for (int k = 0; k < 65; ++k) *lookup->add_keys() = WireKey(k);
  s = client->Call(wire::METHOD_LOOKUP, many, (wire::LookupReply*)nullptr);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_THAT(std::string(s.message()), HasSubstr("limit is 64"));

  const std::string garbage = "\xff\xff\xff\xff not a protobuf";
  s = client->rpc().CallSync(wire::METHOD_COMMIT, std::as_bytes(std::span(garbage)), {}, nullptr);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
}

TEST_P(NodeServerTest, EndedSessionReleasesPinsAndAbortsStores) {
  node_.reset();
  StartNode(4);  // room for four blocks
  auto keeper = Client("tenant");
  keeper->Store({1, 2});
  {
    auto crashing = Client("tenant");
    ASSERT_NE(crashing, nullptr);
    wire::LoadRequest load;
    *load.add_keys() = WireKey(1);
    *load.add_keys() = WireKey(2);
    ASSERT_TRUE(crashing->Call(wire::METHOD_LOAD, load, (wire::LoadReply*)nullptr).ok());
    wire::PrepareStoreRequest prepare;
    *prepare.add_keys() = WireKey(10);
    *prepare.add_keys() = WireKey(11);
    ASSERT_TRUE(
        crashing->Call(wire::METHOD_PREPARE_STORE, prepare, (wire::PrepareStoreReply*)nullptr)
            .ok());
    // All four slots are pinned or being written: nothing can be stored now.
    wire::PrepareStoreRequest more;
    *more.add_keys() = WireKey(20);
    EXPECT_FALSE(
        keeper->Call(wire::METHOD_PREPARE_STORE, more, (wire::PrepareStoreReply*)nullptr).ok());
  }  // the client goes away without releasing or committing
  for (int i = 0; i < 200 && node_->stats().sessions_closed == 0; ++i) {
    std::this_thread::sleep_for(10ms);
  }
  const NodeStats stats = node_->stats();
  EXPECT_EQ(stats.pins_released_on_close, 2u);
  EXPECT_EQ(stats.stores_aborted_on_close, 2u);
  // The capacity is back: four new blocks fit (evicting 1 and 2).
  keeper->Store({20, 21, 22, 23});
  EXPECT_THAT(keeper->PerKey({20, 21, 22, 23, 10}),
              ::testing::ElementsAre(wire::LOOKUP_HIT, wire::LOOKUP_HIT, wire::LOOKUP_HIT,
                                     wire::LOOKUP_HIT, wire::LOOKUP_MISS));
}

TEST_P(NodeServerTest, SilentClientLosesItsPinsAndStoresAfterTheLease) {
  node_.reset();
  StartNode(4, 300ms);
  auto keeper = Client("tenant");
  keeper->Store({1, 2});
  auto silent = Client("tenant");
  ASSERT_TRUE(silent && keeper);
  wire::LoadRequest load;
  *load.add_keys() = WireKey(1);
  *load.add_keys() = WireKey(2);
  ASSERT_TRUE(silent->Call(wire::METHOD_LOAD, load, (wire::LoadReply*)nullptr).ok());
  wire::PrepareStoreRequest prepare;
  *prepare.add_keys() = WireKey(10);
  *prepare.add_keys() = WireKey(11);
  ASSERT_TRUE(
      silent->Call(wire::METHOD_PREPARE_STORE, prepare, (wire::PrepareStoreReply*)nullptr).ok());
  // The silent client stays connected and says nothing.
  for (int i = 0; i < 300 && node_->stats().leases_expired == 0; ++i) {
    std::this_thread::sleep_for(10ms);
  }
  const NodeStats stats = node_->stats();
  EXPECT_EQ(stats.leases_expired, 1u);
  EXPECT_EQ(stats.pins_released_on_expiry, 2u);
  EXPECT_EQ(stats.sessions_closed, 0u);  // still connected
  keeper->Store({20, 21, 22, 23});
  EXPECT_THAT(keeper->PerKey({20, 21, 22, 23}), ::testing::Each(::testing::Eq(wire::LOOKUP_HIT)));
  // Its pin is gone: reading now asks for a new Load.
  wire::GetBlockRequest get;
  *get.mutable_key() = WireKey(1);
  EXPECT_EQ(silent->Call(wire::METHOD_GET_BLOCK, get, (wire::GetBlockReply*)nullptr).code(),
            StatusCode::kFailedPrecondition);
}

// Each lookup kind counts under its own name; the totals are their sums. Scans count their
// hit_length keys as hits (a window's may include misses before it), the rest as misses, and a
// scan answered RETRY as one retry.
TEST_P(NodeServerTest, LookupsAreCountedByKind) {
  auto client = Client("tenant");
  ASSERT_NE(client, nullptr);
  client->Store({1, 2, 3});
  wire::PrepareStoreRequest prepare;  // 50 is being written: lookups of it answer RETRY
  *prepare.add_keys() = WireKey(50);
  ASSERT_TRUE(
      client->Call(wire::METHOD_PREPARE_STORE, prepare, (wire::PrepareStoreReply*)nullptr).ok());

  EXPECT_THAT(client->PerKey({1, 2, 99, 50}),
              ::testing::ElementsAre(wire::LOOKUP_HIT, wire::LOOKUP_HIT, wire::LOOKUP_MISS,
                                     wire::LOOKUP_RETRY));
  wire::LookupRequest scans;
  auto scan = [&](wire::LookupMode mode, std::vector<uint64_t> keys, uint32_t window = 0) {
    wire::Lookup* lookup = scans.add_lookups();
    lookup->set_mode(mode);
    lookup->set_window_size(window);
    for (uint64_t k : keys) *lookup->add_keys() = WireKey(k);
  };
  scan(wire::LOOKUP_MODE_PREFIX, {1, 2, 99, 3});          // 2 hits, 2 misses
  scan(wire::LOOKUP_MODE_PREFIX, {1, 50, 2});             // a retry
  scan(wire::LOOKUP_MODE_WINDOW, {99, 98, 1, 2, 97}, 2);  // 4 hits (to the end of 1, 2), 1 miss
  scan(wire::LOOKUP_MODE_WINDOW, {50, 99}, 2);            // a retry
  scan(wire::LOOKUP_MODE_WINDOW, {50, 99}, 2);            // another
  wire::LookupReply scanned;
  ASSERT_TRUE(client->Call(wire::METHOD_LOOKUP, scans, &scanned).ok());
  ASSERT_EQ(scanned.answers_size(), 5);
  EXPECT_EQ(scanned.answers(0).hit_length(), 2u);
  EXPECT_TRUE(scanned.answers(1).retry());
  EXPECT_EQ(scanned.answers(2).hit_length(), 4u);
  EXPECT_TRUE(scanned.answers(3).retry());

  const NodeStats stats = node_->stats();
  EXPECT_EQ(stats.per_key.hits, 2u);
  EXPECT_EQ(stats.per_key.misses, 1u);
  EXPECT_EQ(stats.per_key.retries, 1u);
  EXPECT_EQ(stats.prefix.hits, 2u);
  EXPECT_EQ(stats.prefix.misses, 2u);
  EXPECT_EQ(stats.prefix.retries, 1u);
  EXPECT_EQ(stats.window.hits, 4u);
  EXPECT_EQ(stats.window.misses, 1u);
  EXPECT_EQ(stats.window.retries, 2u);
  EXPECT_EQ(stats.lookup_hits, 8u);
  EXPECT_EQ(stats.lookup_misses, 4u);
  EXPECT_EQ(stats.lookup_retries, 4u);
  EXPECT_EQ(stats.lookups, 4u + 4 + 3 + 5 + 2 + 2);
  // The same through the Stats method.
  wire::StatsReply reply;
  ASSERT_TRUE(client->Call(wire::METHOD_STATS, wire::StatsRequest(), &reply).ok());
  EXPECT_EQ(reply.counters().at("node.lookup_hits.per_key"), 2u);
  EXPECT_EQ(reply.counters().at("node.lookup_misses.prefix"), 2u);
  EXPECT_EQ(reply.counters().at("node.lookup_retries.window"), 2u);
  EXPECT_EQ(reply.counters().at("node.lookup_hits"), 8u);
}

TEST_P(NodeServerTest, CpuEvictionsAreCounted) {
  node_.reset();
  StartNode(4);
  auto client = Client("tenant");
  ASSERT_NE(client, nullptr);
  client->Store({1, 2, 3, 4});
  EXPECT_EQ(node_->Counters().at("store.cpu_evictions"), 0u);
  EXPECT_EQ(node_->Counters().at("cpu.resident_bytes"), 4 * kBlock);
  client->Store({5, 6});  // the tier is full: 1 and 2 make room
  client->Store({7});
  EXPECT_THAT(client->PerKey({1, 2, 3}),
              ::testing::ElementsAre(wire::LOOKUP_MISS, wire::LOOKUP_MISS, wire::LOOKUP_MISS));
  const std::map<std::string, uint64_t> counters = node_->Counters();
  EXPECT_EQ(counters.at("store.cpu_evictions"), 3u);
  EXPECT_EQ(counters.at("ssd.evictions"), 0u);
  EXPECT_EQ(counters.at("cpu.resident_blocks"), 4u);
  EXPECT_EQ(counters.at("cpu.resident_bytes"), 4 * kBlock);
}

TEST_P(NodeServerTest, SsdEvictionsAreCounted) {
  TempDir dir;
  store::SsdTierOptions ssd;
  ssd.dir = dir / "ssd";
  ssd.capacity_bytes = 2 * kBlock;  // two blocks
  node_.reset();
  StartNode(8, std::chrono::milliseconds(30000), ssd);
  auto client = Client("tenant");
  ASSERT_NE(client, nullptr);
  // Write-through: each commit cascades its block to SSD; the third makes room there.
  for (uint64_t k : {1, 2, 3}) {
    client->Store({k});
    node_->store().WaitIdle();
  }
  const std::map<std::string, uint64_t> counters = node_->Counters();
  EXPECT_EQ(counters.at("store.cascades_done"), 3u);
  EXPECT_EQ(counters.at("ssd.evictions"), 1u);
  EXPECT_EQ(counters.at("ssd.resident_blocks"), 2u);
  EXPECT_EQ(counters.at("ssd.resident_bytes"), 2 * kBlock);
  EXPECT_EQ(counters.at("store.cpu_evictions"), 0u);
  node_.reset();  // before the directory goes
}

// The latency histogram of each method counts every reply of that method, errors included,
// and its sum lies within the bounds of the buckets its requests fell in.
TEST_P(NodeServerTest, RequestLatenciesAreCountedPerMethod) {
  auto client = Client("tenant");
  ASSERT_NE(client, nullptr);
  client->Store({1, 2});  // prepare_store, put_block x2, commit
  client->PerKey({1});
  client->PerKey({2, 3});
  client->PerKey({4});
  EXPECT_TRUE(client->ReadBack(1));  // load, get_block, release
  wire::GetBlockRequest unpinned;    // get_block answered FailedPrecondition
  *unpinned.mutable_key() = WireKey(2);
  EXPECT_EQ(client->Call(wire::METHOD_GET_BLOCK, unpinned, (wire::GetBlockReply*)nullptr).code(),
            StatusCode::kFailedPrecondition);
  const std::string garbage = "\xff\xff not a protobuf";  // commit answered InvalidArgument
  EXPECT_EQ(client->rpc()
                .CallSync(wire::METHOD_COMMIT, std::as_bytes(std::span(garbage)), {}, nullptr)
                .code(),
            StatusCode::kInvalidArgument);
  wire::EchoRequest echo;  // a reply with a payload, timed until it is sent
  echo.set_payload_bytes(1000);
  std::vector<std::byte> echoed(1000);
  CallOptions receive;
  receive.recv_payload = echoed;
  ASSERT_TRUE(client->Call(wire::METHOD_ECHO, echo, (wire::EchoReply*)nullptr, receive).ok());

  const std::map<std::string, uint64_t> expected = {
      {"lookup", 3},    {"prepare_store", 1}, {"put_block", 2}, {"commit", 2}, {"load", 1},
      {"get_block", 2}, {"release", 1},       {"touch", 0},     {"stats", 0},  {"echo", 1}};
  auto counts = [&] {
    std::map<std::string, uint64_t> out;
    for (const MethodLatency& m : node_->Latencies()) out[m.method] = m.count;
    return out;
  };
  // Replies with a payload are counted when the transport reports them sent, which may come
  // just after the client has them.
  for (int i = 0; i < 200 && counts() != expected; ++i) std::this_thread::sleep_for(10ms);
  EXPECT_EQ(counts(), expected);

  // A request in bucket i took more than bound i-1 and at most bound i.
  for (const MethodLatency& m : node_->Latencies()) {
    uint64_t in_buckets = 0;
    std::chrono::nanoseconds low{0}, high{0};
    for (size_t i = 0; i < m.buckets.size(); ++i) {
      const auto n = static_cast<int64_t>(m.buckets[i]);
      in_buckets += m.buckets[i];
      if (i > 0) low += n * std::chrono::nanoseconds(kLatencyBuckets[i - 1]);
      if (i < kLatencyBuckets.size()) high += n * std::chrono::nanoseconds(kLatencyBuckets[i]);
    }
    EXPECT_EQ(in_buckets, m.count) << m.method;
    EXPECT_GE(m.sum, low) << m.method;
    if (m.buckets.back() == 0) {  // else unbounded
      EXPECT_LE(m.sum, high) << m.method;
    }
    if (m.count != 0) {
      EXPECT_GT(m.sum.count(), 0) << m.method;
    }
  }
}

// A refused client is logged with the name and namespace it gave and its address, never with
// the token it tried; the refusal is counted.
TEST_P(NodeServerTest, RefusalLogNamesTheClientNotTheToken) {
  std::ostringstream log;
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(log);
  // The logger's sinks change only while no thread of this test's node or clients runs.
  node_.reset();
  internal::Logger()->sinks().push_back(sink);
  StartNode(4);
  {
    transport::ClientOptions options;
    options.port = node_->port();
    options.auth_token = "guess-7f3a";
    options.key_namespace = "tenant-blue";
    options.client_name = "engine \"7\"";
    options.transport.tls = GetParam();
    auto intruder = transport::RpcClient::Create(options);
    ASSERT_TRUE(intruder.ok()) << intruder.status().ToString();
    EXPECT_EQ((*intruder)->Connect().code(), StatusCode::kUnauthenticated);
  }
  EXPECT_EQ(node_->Counters().at("transport.refused"), 1u);
  node_.reset();
  auto& sinks = internal::Logger()->sinks();
  sinks.erase(std::remove(sinks.begin(), sinks.end(), sink), sinks.end());
  const std::string text = log.str();
  EXPECT_THAT(text, HasSubstr("refused a client: UNAUTHENTICATED"));
  EXPECT_THAT(text, HasSubstr("client \"engine \\\"7\\\"\""));  // escaped
  EXPECT_THAT(text, HasSubstr("namespace \"tenant-blue\""));
  EXPECT_THAT(text, HasSubstr("from 127.0.0.1:"));
  EXPECT_THAT(text, ::testing::Not(HasSubstr("guess-7f3a")));
}

// A one-call store (PutBlock with prepare and commit) of block k by `client`.
Status PutOne(NodeTestClient& client, uint64_t k) {
  std::vector<std::byte> block(kBlock);
  FillPattern(k, block);
  wire::PutBlockRequest request;
  *request.mutable_key() = WireKey(k);
  request.set_length(kBlock);
  request.set_checksum(Xxh3Hash64(block));
  request.set_prepare(true);
  request.set_commit(true);
  CallOptions options;
  options.send_payload = block;
  return client.Call(wire::METHOD_PUT_BLOCK, request, (wire::PutBlockReply*)nullptr, options);
}

const NamespaceStats* FindNamespace(const std::vector<NamespaceStats>& all,
                                    const std::string& name) {
  for (const NamespaceStats& ns : all) {
    if (ns.name == name) return &ns;
  }
  return nullptr;
}

TEST_P(NodeServerTest, NamespaceQuotaKeepsItsNewestBlocksAndNeverEvictsAnother) {
  constexpr size_t kQuota = 4;
  node_.reset();
  StartNode(16, 30000ms, std::nullopt, {{"tenant-a", kQuota}});
  auto a = Client("tenant-a");
  auto b = Client("tenant-b");
  ASSERT_TRUE(a && b);
  b->Store({1, 2, 3, 4, 5, 6});  // the tier's least recent blocks
  // A stores kQuota + 5 blocks, one call each and in two-phase batches: it ends with exactly
  // its kQuota newest, by evicting its own, though the tier has room and B's blocks are older.
  for (uint64_t k = 1; k <= 5; ++k) ASSERT_TRUE(PutOne(*a, k).ok()) << k;
  a->Store({6, 7});
  a->Store({8, 9});
  EXPECT_THAT(a->PerKey({1, 2, 3, 4, 5, 6, 7, 8, 9}),
              ::testing::ElementsAre(wire::LOOKUP_MISS, wire::LOOKUP_MISS, wire::LOOKUP_MISS,
                                     wire::LOOKUP_MISS, wire::LOOKUP_MISS, wire::LOOKUP_HIT,
                                     wire::LOOKUP_HIT, wire::LOOKUP_HIT, wire::LOOKUP_HIT));
  for (uint64_t k : {6, 7, 8, 9}) EXPECT_TRUE(a->ReadBack(k)) << k;
  for (uint64_t k = 1; k <= 6; ++k) EXPECT_TRUE(b->ReadBack(k)) << k;
  EXPECT_EQ(node_->store().cpu().resident_blocks(), 10u);

  // One call of more new blocks than the quota can never fit: refused, like a full tier.
  wire::PrepareStoreRequest too_many;
  for (uint64_t k = 20; k < 20 + kQuota + 1; ++k) *too_many.add_keys() = WireKey(k);
  const Status refused =
      a->Call(wire::METHOD_PREPARE_STORE, too_many, (wire::PrepareStoreReply*)nullptr);
  EXPECT_EQ(refused.code(), StatusCode::kResourceExhausted) << refused.ToString();
  // With all of A's blocks pinned, A's store is refused; B still stores (under no quota).
  wire::LoadRequest load;
  for (uint64_t k : {6, 7, 8, 9}) *load.add_keys() = WireKey(k);
  ASSERT_TRUE(a->Call(wire::METHOD_LOAD, load, (wire::LoadReply*)nullptr).ok());
  const Status pinned = PutOne(*a, 10);
  EXPECT_EQ(pinned.code(), StatusCode::kResourceExhausted) << pinned.ToString();
  EXPECT_THAT(std::string(pinned.message()), HasSubstr("quota"));
  b->Store({7, 8});

  const std::vector<NamespaceStats> namespaces = node_->Namespaces();
  ASSERT_EQ(namespaces.size(), 2u);
  const NamespaceStats* na = FindNamespace(namespaces, "tenant-a");
  const NamespaceStats* nb = FindNamespace(namespaces, "tenant-b");
  ASSERT_TRUE(na && nb);
  EXPECT_EQ(na->cpu_blocks, kQuota);
  EXPECT_EQ(na->cpu_quota_blocks, std::optional<uint64_t>(kQuota));
  EXPECT_EQ(na->quota_refusals, kQuota + 2);  // the five of the batch and the pinned one
  EXPECT_EQ(nb->cpu_blocks, 8u);
  EXPECT_EQ(nb->cpu_quota_blocks, std::nullopt);
  EXPECT_EQ(nb->quota_refusals, 0u);
  EXPECT_EQ(node_->Counters().at("store.quota_refusals"), kQuota + 2);
}

TEST_P(NodeServerTest, QuotasAreCheckedAtStart) {
  NodeOptions options;
  options.server.transport.tls = GetParam();
  options.store.block_bytes = kBlock;
  options.store.cpu_capacity_blocks = 8;
  options.store.prefault = false;
  options.namespace_quota_blocks = {{"a", 9}};
  auto above = NodeServer::Start(options);
  ASSERT_FALSE(above.ok());
  EXPECT_EQ(above.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(above.status().message()), HasSubstr("'a'"));
  options.namespace_quota_blocks = {{"other", 2}};
  EXPECT_EQ(NodeServer::Start(options).status().code(), StatusCode::kInvalidArgument);
  options.namespace_quota_blocks = {};
  options.default_namespace_quota_blocks = 0;
  EXPECT_EQ(NodeServer::Start(options).status().code(), StatusCode::kInvalidArgument);
}

INSTANTIATE_TEST_SUITE_P(Tls, NodeServerTest, ::testing::Values("shm", "tcp"),
                         [](const auto& param_info) { return param_info.param; });

}  // namespace
}  // namespace kvstash::node
