// NodeServer over real UCX in this process, once over shared memory and once over TCP: stores,
// lookups, pinned loads, namespaces, the error answers, and what a session that ends leaves
// behind (nothing). The service's own rules are tested without a transport in
// node_service_test.cc, and through the loopback and fault transports in node_loopback_test.cc.

#include "kvstash/node/node_server.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <spdlog/sinks/ostream_sink.h>

#include <algorithm>
#include <condition_variable>
#include <functional>
#include <future>
#include <map>
#include <mutex>
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
                 std::map<std::string, size_t> quotas = {},
                 const std::function<void(NodeOptions&)>& tweak = {}) {
    NodeOptions options;
    options.server.transport.tls = GetParam();
    options.server.auth_token = "token";
    options.max_keys_per_request = 64;
    options.store.block_bytes = kBlock;
    options.store.cpu_capacity_blocks = cpu_blocks;
    options.store.prefault = false;
    options.lease_timeout = lease;
    options.store.ssd = std::move(ssd);
    options.namespace_quota_blocks = std::move(quotas);
    if (tweak) tweak(options);
    auto node = NodeServer::Create(options);
    ASSERT_TRUE(node.ok()) << node.status().ToString();
    node_ = std::move(*node);
  }

  std::unique_ptr<NodeTestClient> Client(const std::string& ns) {
    auto client = std::make_unique<NodeTestClient>(node_->port(), ns, "token", GetParam(), kBlock);
    return client->ok() ? std::move(client) : nullptr;
  }

  std::unique_ptr<NodeServer> node_;
};

// A store of block k (pattern k, with its checksum) by `client`: the call's own status.
Status PutOne(NodeTestClient& client, uint64_t k) {
  std::vector<std::byte> block(kBlock);
  FillPattern(k, block);
  wire::PutBlockRequest request;
  *request.mutable_key() = WireKey(k);
  request.set_length(kBlock);
  request.set_checksum(Xxh3Hash64(block));
  CallOptions options;
  options.send_payload = block;
  return client.Call(wire::METHOD_PUT_BLOCK, request, (wire::PutBlockReply*)nullptr, options);
}

TEST_P(NodeServerTest, StoreLookupAndLoadRoundTrip) {
  auto client = Client("tenant");
  ASSERT_NE(client, nullptr);
  client->Store({1, 2, 3, 4});
  EXPECT_EQ(node_->shares_cpu_memory(), true);

  EXPECT_THAT(client->PerKey({1, 4, 99}),
              ::testing::ElementsAre(wire::LOOKUP_HIT, wire::LOOKUP_HIT, wire::LOOKUP_MISS));
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

// PutBlock stores a block in one call; GetBlock reads one without a Load, pinned for the
// transfer only.
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
  EXPECT_EQ(node_->Counters().at("node.blocks_stored"), 2u);
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
  CallOptions short_block;
  short_block.send_payload = std::span(block).first(100);
  put.set_length(100);
  Status s = client->Call(wire::METHOD_PUT_BLOCK, put, (wire::PutBlockReply*)nullptr, short_block);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_THAT(std::string(s.message()), HasSubstr("block size is 65536"));

  put.set_length(kBlock);
  put.set_checksum(12345);  // wrong
  s = client->Call(wire::METHOD_PUT_BLOCK, put, (wire::PutBlockReply*)nullptr, with_block);
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s.ToString();
  EXPECT_EQ(node_->Counters().at("node.checksum_failures"), 1u);
  EXPECT_THAT(client->PerKey({5}), ::testing::ElementsAre(wire::LOOKUP_MISS));

  wire::GetBlockRequest get;
  *get.mutable_key() = WireKey(5);
  s = client->Call(wire::METHOD_GET_BLOCK, get, (wire::GetBlockReply*)nullptr);
  EXPECT_EQ(s.code(), StatusCode::kNotFound) << s.ToString();

  wire::LookupRequest many;
  for (int k = 0; k < 65; ++k) *many.add_keys() = WireKey(k);
  s = client->Call(wire::METHOD_LOOKUP, many, (wire::LookupReply*)nullptr);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_THAT(std::string(s.message()), HasSubstr("limit is 64"));

  const std::string garbage = "\xff\xff\xff\xff not a protobuf";
  s = client->rpc().CallSync(wire::METHOD_LOAD, std::as_bytes(std::span(garbage)), {}, nullptr);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
}

TEST_P(NodeServerTest, EndedSessionReleasesItsPins) {
  node_.reset();
  StartNode(4);  // room for four blocks
  auto keeper = Client("tenant");
  ASSERT_NE(keeper, nullptr);
  keeper->Store({1, 2, 3, 4});
  {
    auto crashing = Client("tenant");
    ASSERT_NE(crashing, nullptr);
    wire::LoadRequest load;
    for (uint64_t k : {1, 2, 3, 4}) *load.add_keys() = WireKey(k);
    ASSERT_TRUE(crashing->Call(wire::METHOD_LOAD, load, (wire::LoadReply*)nullptr).ok());
    // All four slots are pinned: nothing can be stored now.
    EXPECT_EQ(PutOne(*keeper, 20).code(), StatusCode::kResourceExhausted);
  }  // the client goes away without releasing
  for (int i = 0; i < 200 && node_->Counters().at("node.sessions_closed") == 0; ++i) {
    std::this_thread::sleep_for(10ms);
  }
  const std::map<std::string, uint64_t> counters = node_->Counters();
  EXPECT_EQ(counters.at("node.sessions_closed"), 1u);
  EXPECT_EQ(counters.at("node.pins_released_on_close"), 4u);
  EXPECT_EQ(counters.at("node.pinned_keys"), 4u);
  // The capacity is back: four new blocks fit (evicting 1 to 4).
  keeper->Store({20, 21, 22, 23});
  EXPECT_THAT(keeper->PerKey({20, 21, 22, 23, 1}),
              ::testing::ElementsAre(wire::LOOKUP_HIT, wire::LOOKUP_HIT, wire::LOOKUP_HIT,
                                     wire::LOOKUP_HIT, wire::LOOKUP_MISS));
}

TEST_P(NodeServerTest, SilentClientLosesItsPinsAfterTheLease) {
  node_.reset();
  StartNode(4, 300ms);
  auto keeper = Client("tenant");
  auto silent = Client("tenant");
  ASSERT_TRUE(silent && keeper);
  keeper->Store({1, 2, 3, 4});
  wire::LoadRequest load;
  for (uint64_t k : {1, 2, 3, 4}) *load.add_keys() = WireKey(k);
  ASSERT_TRUE(silent->Call(wire::METHOD_LOAD, load, (wire::LoadReply*)nullptr).ok());
  EXPECT_EQ(PutOne(*keeper, 20).code(), StatusCode::kResourceExhausted);
  // The silent client stays connected and says nothing.
  for (int i = 0; i < 300 && node_->Counters().at("node.leases_expired") == 0; ++i) {
    std::this_thread::sleep_for(10ms);
  }
  const std::map<std::string, uint64_t> counters = node_->Counters();
  EXPECT_EQ(counters.at("node.leases_expired"), 1u);
  EXPECT_EQ(counters.at("node.pins_released_on_expiry"), 4u);
  EXPECT_EQ(counters.at("node.sessions_closed"), 0u);  // still connected
  keeper->Store({20, 21, 22, 23});
  EXPECT_THAT(keeper->PerKey({20, 21, 22, 23}), ::testing::Each(::testing::Eq(wire::LOOKUP_HIT)));
  // Its pins are gone with the blocks: reading one now finds nothing.
  wire::GetBlockRequest get;
  *get.mutable_key() = WireKey(1);
  EXPECT_EQ(silent->Call(wire::METHOD_GET_BLOCK, get, (wire::GetBlockReply*)nullptr).code(),
            StatusCode::kNotFound);
}

// Every key looked up is counted once, by its answer.
TEST_P(NodeServerTest, LookupsAreCountedByResult) {
  auto client = Client("tenant");
  ASSERT_NE(client, nullptr);
  client->Store({1, 2, 3});
  EXPECT_THAT(client->PerKey({1, 2, 99}),
              ::testing::ElementsAre(wire::LOOKUP_HIT, wire::LOOKUP_HIT, wire::LOOKUP_MISS));
  EXPECT_THAT(client->PerKey({3, 98, 97}),
              ::testing::ElementsAre(wire::LOOKUP_HIT, wire::LOOKUP_MISS, wire::LOOKUP_MISS));
  const std::map<std::string, uint64_t> counters = node_->Counters();
  EXPECT_EQ(counters.at("node.lookups"), 6u);
  EXPECT_EQ(counters.at("node.lookup_hits"), 3u);
  EXPECT_EQ(counters.at("node.lookup_misses"), 3u);
  EXPECT_EQ(counters.at("node.lookup_retries"), 0u);
  // The same through the Stats method.
  wire::StatsReply reply;
  ASSERT_TRUE(client->Call(wire::METHOD_STATS, wire::StatsRequest(), &reply).ok());
  EXPECT_EQ(reply.counters().at("node.lookup_hits"), 3u);
  EXPECT_EQ(reply.counters().at("node.lookup_misses"), 3u);
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

// Write-back with every staging buffer busy: a store that evicts a block must wait until the
// block is on SSD before its bytes may take the slot. It waits without holding the progress
// thread: with the node's disk I/O held back entirely, another client's lookups and stores of
// blocks that evict nothing still answer, and the waiting store completes, with every block
// intact on its tier, once the disk goes on.
TEST_P(NodeServerTest, AStoreWaitingForWriteBackHoldsNoOtherClient) {
  TempDir dir;
  store::SsdTierOptions ssd;
  ssd.dir = dir / "ssd";
  ssd.capacity_bytes = 64 * kBlock;
  std::mutex io_mu;
  std::condition_variable io_cv;
  bool io_held = false;
  node_.reset();
  StartNode(4, std::chrono::milliseconds(30000), ssd, {}, [&](NodeOptions& options) {
    options.store.cascade = store::CascadeMode::kWriteBack;
    options.store.writeback_staging_blocks = 0;  // every eviction written from its slot
    options.store.before_job_for_testing = [&] {
      std::unique_lock lock(io_mu);
      io_cv.wait(lock, [&] { return !io_held; });
    };
  });
  auto writer = Client("tenant");
  auto reader = Client("tenant");
  ASSERT_NE(writer, nullptr);
  ASSERT_NE(reader, nullptr);
  writer->Store({1, 2, 3, 4});  // the CPU tier is full
  {
    std::lock_guard lock(io_mu);
    io_held = true;
  }
  // Block 5 evicts block 1, whose write to SSD cannot start: the store waits for it.
  auto stored = std::async(std::launch::async, [&] { return PutOne(*writer, 5); });
  for (int i = 0; i < 400 && node_->Counters().at("store.writebacks_unstaged") == 0; ++i) {
    std::this_thread::sleep_for(5ms);
  }
  ASSERT_EQ(node_->Counters().at("store.writebacks_unstaged"), 1u);
  // Meanwhile the node answers the other client, again and again (block 1, on its way to
  // SSD, is RETRY: not lost).
  for (int round = 0; round < 20; ++round) {
    EXPECT_THAT(reader->PerKey({2, 3, 4, 1}),
                ::testing::ElementsAre(wire::LOOKUP_HIT, wire::LOOKUP_HIT, wire::LOOKUP_HIT,
                                       wire::LOOKUP_RETRY));
  }
  wire::StatsReply stats;
  ASSERT_TRUE(reader->Call(wire::METHOD_STATS, wire::StatsRequest(), &stats).ok());
  EXPECT_EQ(stored.wait_for(0ms), std::future_status::timeout) << "stored before the write";
  {
    std::lock_guard lock(io_mu);
    io_held = false;
  }
  io_cv.notify_all();
  ASSERT_TRUE(stored.get().ok());
  node_->store().WaitIdle();
  // Block 1 reached SSD whole and block 5 took its slot whole.
  const std::map<std::string, uint64_t> counters = node_->Counters();
  EXPECT_EQ(counters.at("ssd.resident_blocks"), 1u);
  EXPECT_EQ(counters.at("cpu.resident_blocks"), 4u);
  EXPECT_EQ(counters.at("store.cascade_failures"), 0u);
  std::vector<std::byte> out(kBlock);
  for (uint64_t k : {5, 1}) {
    wire::GetBlockRequest get;
    *get.mutable_key() = WireKey(k);
    CallOptions options;
    options.recv_payload = out;
    size_t payload = 0;
    Status got;
    for (int i = 0; i < 400; ++i) {  // block 1 comes back from SSD: RETRY until promoted
      got = reader->Call(wire::METHOD_GET_BLOCK, get, (wire::GetBlockReply*)nullptr, options,
                         &payload);
      if (got.code() != StatusCode::kAborted) break;
      std::this_thread::sleep_for(5ms);
    }
    ASSERT_TRUE(got.ok()) << k << ": " << got.ToString();
    EXPECT_EQ(payload, kBlock);
    EXPECT_TRUE(MatchesPattern(k, out)) << k;
  }
  node_.reset();  // before the directory goes
}

// The latency histogram of each method counts every reply of that method, errors included,
// and its sum lies within the bounds of the buckets its requests fell in.
TEST_P(NodeServerTest, RequestLatenciesAreCountedPerMethod) {
  auto client = Client("tenant");
  ASSERT_NE(client, nullptr);
  client->Store({1, 2});  // put_block x2
  client->PerKey({1});
  client->PerKey({2, 3});
  client->PerKey({4});
  EXPECT_TRUE(client->ReadBack(1));  // load, get_block, release
  wire::GetBlockRequest absent;      // get_block answered NotFound
  *absent.mutable_key() = WireKey(3);
  EXPECT_EQ(client->Call(wire::METHOD_GET_BLOCK, absent, (wire::GetBlockReply*)nullptr).code(),
            StatusCode::kNotFound);
  const std::string garbage = "\xff\xff not a protobuf";  // touch answered InvalidArgument
  EXPECT_EQ(client->rpc()
                .CallSync(wire::METHOD_TOUCH, std::as_bytes(std::span(garbage)), {}, nullptr)
                .code(),
            StatusCode::kInvalidArgument);
  wire::EchoRequest echo;  // a reply with a payload, timed until it is sent
  echo.set_payload_bytes(1000);
  std::vector<std::byte> echoed(1000);
  CallOptions receive;
  receive.recv_payload = echoed;
  ASSERT_TRUE(client->Call(wire::METHOD_ECHO, echo, (wire::EchoReply*)nullptr, receive).ok());

  const std::map<std::string, uint64_t> expected = {
      {"lookup", 3}, {"put_block", 2}, {"load", 1}, {"get_block", 2},  {"release", 1},
      {"touch", 1},  {"stats", 0},     {"echo", 1}, {"get_blocks", 0}, {"put_blocks", 0}};
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
    options.tenant = "tenant-blue";
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
  // A stores kQuota + 5 blocks: it ends with exactly its kQuota newest, by evicting its own,
  // though the tier has room and B's blocks are older.
  for (uint64_t k = 1; k <= 9; ++k) ASSERT_TRUE(PutOne(*a, k).ok()) << k;
  EXPECT_THAT(a->PerKey({1, 2, 3, 4, 5, 6, 7, 8, 9}),
              ::testing::ElementsAre(wire::LOOKUP_MISS, wire::LOOKUP_MISS, wire::LOOKUP_MISS,
                                     wire::LOOKUP_MISS, wire::LOOKUP_MISS, wire::LOOKUP_HIT,
                                     wire::LOOKUP_HIT, wire::LOOKUP_HIT, wire::LOOKUP_HIT));
  for (uint64_t k : {6, 7, 8, 9}) EXPECT_TRUE(a->ReadBack(k)) << k;
  for (uint64_t k = 1; k <= 6; ++k) EXPECT_TRUE(b->ReadBack(k)) << k;
  EXPECT_EQ(node_->store().cpu().resident_blocks(), 10u);

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
  EXPECT_EQ(na->quota_refusals, 1u);  // the store while all its blocks were pinned
  EXPECT_EQ(nb->cpu_blocks, 8u);
  EXPECT_EQ(nb->cpu_quota_blocks, std::nullopt);
  EXPECT_EQ(nb->quota_refusals, 0u);
  EXPECT_EQ(node_->Counters().at("store.quota_refusals"), 1u);
}

TEST_P(NodeServerTest, QuotasAreCheckedAtStart) {
  NodeOptions options;
  options.server.transport.tls = GetParam();
  options.store.block_bytes = kBlock;
  options.store.cpu_capacity_blocks = 8;
  options.store.prefault = false;
  options.namespace_quota_blocks = {{"a", 9}};
  auto above = NodeServer::Create(options);
  ASSERT_FALSE(above.ok());
  EXPECT_EQ(above.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(above.status().message()), HasSubstr("'a'"));
  options.namespace_quota_blocks = {{"other", 2}};
  EXPECT_EQ(NodeServer::Create(options).status().code(), StatusCode::kInvalidArgument);
  options.namespace_quota_blocks = {};
  options.default_namespace_quota_blocks = 0;
  EXPECT_EQ(NodeServer::Create(options).status().code(), StatusCode::kInvalidArgument);
}

INSTANTIATE_TEST_SUITE_P(Tls, NodeServerTest, ::testing::Values("shm", "tcp"),
                         [](const auto& param_info) { return param_info.param; });

}  // namespace
}  // namespace kvstash::node
