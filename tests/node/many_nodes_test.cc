// NodeClient against several real `kvstashd` processes: keys spread by rendezvous hashing,
// batched lookups merged in key order, a node killed with SIGKILL: its keys become misses, the
// others still hit, and no error reaches the caller of a lookup; and a node stopped (SIGSTOP):
// a lookup waits its budget for it, then it is skipped until it answers again.

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <thread>

#include "block_pattern.h"
#include "daemon_process.h"
#include "home_node.h"
#include "kvstash/connector/node_client.h"
#include "process_state.h"

namespace kvstash {
namespace {
using namespace std::chrono_literals;
using connector::NodeClient;
using ::kvstash::testing::Daemon;
using ::kvstash::testing::FillPattern;
using ::kvstash::testing::MatchesPattern;
using ::testing::HasSubstr;

constexpr size_t kBlock = 64 << 10;

BlockKey Key(uint64_t k) {
  BlockKey key;
  key.hash.lo = k;
  key.hash.hi = ~k;
  return key;
}

TEST(NodeAddressTest, ParsesHostPortAndRefusesTheRest) {
  auto a = connector::ParseNodeAddress("127.0.0.1:7373");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->host, "127.0.0.1");
  EXPECT_EQ(a->port, 7373);
  EXPECT_EQ(a->ToString(), "127.0.0.1:7373");
  for (const char* bad : {"127.0.0.1", ":80", "host:", "host:0", "host:70000", "host:x"}) {
    auto r = connector::ParseNodeAddress(bad);
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(std::string(r.status().message()), HasSubstr(bad));
  }
}

TEST(NodeSourceTest, ANodeListOrEtcdWithAClusterAndReplicasWithinRange) {
  connector::NodeClientOptions options;
  connector::NodeSource source;
  source.nodes = {"127.0.0.1:1,127.0.0.1:2", "h:3"};
  ASSERT_TRUE(connector::ApplyNodeSource(source, &options).ok());
  EXPECT_EQ(options.nodes.size(), 3u);
  EXPECT_EQ(options.nodes[2].ToString(), "h:3");
  auto refused = [&](connector::NodeSource s, const char* says) {
    const Status status = connector::ApplyNodeSource(s, &options);
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(status.message()), HasSubstr(says));
  };
  refused({}, "no offload nodes");
  refused({{"h:1"}, "http://127.0.0.1:2379", "c", 1}, "not both");
  refused({{}, "http://127.0.0.1:2379", "", 1}, "--etcd needs --cluster");
  refused({{}, "", "c", 1}, "--cluster needs --etcd");
  refused({{}, "https://127.0.0.1:2379", "c", 1}, "--etcd");
  refused({{}, "http://127.0.0.1:2379", "a/b", 1}, "--cluster");
  refused({{"h:1"}, "", "", 0}, "--replicas");
  refused({{"h:1"}, "", "", 9}, "--replicas");
  refused({{"nohostport"}, "", "", 1}, "nohostport");
  ASSERT_TRUE(connector::ApplyNodeSource({{}, "127.0.0.1:2379", "c", 2}, &options).ok());
  EXPECT_TRUE(options.nodes.empty());
  EXPECT_EQ(options.cluster, "c");
  EXPECT_EQ(options.replicas, 2u);
}

TEST(BlockKeyTest, ParsesHexDecimalAndGroups) {
  auto k = ParseBlockKey("0x2a/g3");
  ASSERT_TRUE(k.ok());
  EXPECT_EQ(k->hash.lo, 42u);
  EXPECT_EQ(k->hash.hi, 0u);
  EXPECT_EQ(k->group, 3u);
  EXPECT_EQ(k->ToString(), "0x2a/g3");
  auto wide = ParseBlockKey("0x1ffffffffffffffff");
  ASSERT_TRUE(wide.ok());
  EXPECT_EQ(wide->hash.hi, 1u);
  EXPECT_EQ(wide->hash.lo, ~uint64_t{0});
  EXPECT_EQ(ParseBlockKey("42")->hash.lo, 42u);
  for (const std::string& bad : std::vector<std::string>{"", "0x", "0xzz", "4x2", "0x2a/3",
                                                         "0x2a/gx", "0x" + std::string(33, 'f')}) {
    EXPECT_EQ(ParseBlockKey(bad).status().code(), StatusCode::kInvalidArgument) << bad;
  }
}

TEST(ManyNodesTest, KeysSpreadAndAKilledNodeOnlyMissesItsOwn) {
  std::vector<std::unique_ptr<Daemon>> daemons;
  connector::NodeClientOptions options;
  for (int i = 0; i < 3; ++i) {
    daemons.push_back(std::make_unique<Daemon>(std::vector<std::string>{}));
    ASSERT_NE(daemons.back()->port(), 0);
    options.nodes.push_back({"127.0.0.1", daemons.back()->port()});
  }
  options.timeout = std::chrono::milliseconds(2000);
  options.lookup_budget = options.timeout;  // every hit counted, however busy the machine
  auto created = NodeClient::Create(options);
  ASSERT_TRUE(created.ok()) << created.status().ToString();
  NodeClient& client = **created;
  ASSERT_EQ(*client.BlockBytes(client.nodes()[0]), kBlock);

  constexpr int kKeys = 48;  // the 4 MiB CPU tier of each node holds 64 blocks
  std::vector<BlockKey> keys;
  std::vector<std::vector<std::byte>> blocks;
  std::vector<transport::Bytes> views;
  std::vector<int> per_node(3, 0);
  for (int k = 0; k < kKeys; ++k) {
    keys.push_back(Key(k));
    blocks.emplace_back(kBlock);
    FillPattern(k, blocks.back());
    ++per_node[::kvstash::testing::HomeIndex(client, keys.back())];
  }
  for (auto& b : blocks) views.emplace_back(b);
  for (int n = 0; n < 3; ++n) EXPECT_GT(per_node[n], 5) << "node " << n;
  ASSERT_TRUE(client.Put(keys, views).ok());
  for (int n = 0; n < 3; ++n) {
    auto stats = client.Stats(client.nodes()[n]);
    ASSERT_TRUE(stats.ok());
    EXPECT_EQ(stats->at("cpu.resident_blocks"), static_cast<uint64_t>(per_node[n])) << n;
  }
  const std::vector<LookupResult> before = client.Lookup(keys);
  EXPECT_EQ(std::count(before.begin(), before.end(), LookupResult::kHit), kKeys);
  {
    // A batched read across the nodes: each block where it belongs, a never-stored key NotFound.
    std::vector<BlockKey> batch = {keys[3], keys[40], keys[11], BlockKey{{999, 999}, 0}};
    std::vector<std::vector<std::byte>> bufs(batch.size(), std::vector<std::byte>(kBlock));
    std::vector<transport::MutableBytes> outs(bufs.begin(), bufs.end());
    const auto got = client.Get(batch, outs);
    ASSERT_EQ(got.size(), 4u);
    for (int i : {0, 1, 2}) {
      ASSERT_TRUE(got[i].ok()) << got[i].status().ToString();
      EXPECT_EQ(*got[i], kBlock);
    }
    EXPECT_TRUE(MatchesPattern(3, bufs[0]));
    EXPECT_TRUE(MatchesPattern(40, bufs[1]));
    EXPECT_TRUE(MatchesPattern(11, bufs[2]));
    EXPECT_EQ(got[3].status().code(), StatusCode::kNotFound) << got[3].status().ToString();
  }
  std::vector<std::byte> out(kBlock);
  for (int k : {0, 17, 47}) {
    auto got = client.Get(keys[k], out);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_EQ(*got, kBlock);
    EXPECT_TRUE(MatchesPattern(k, out)) << k;
  }

  // Node 1 dies.
  daemons[1]->process().Kill(SIGKILL);
  const std::vector<LookupResult> after = client.Lookup(keys);
  for (int k = 0; k < kKeys; ++k) {
    const LookupResult expected = ::kvstash::testing::HomeIndex(client, keys[k]) == 1
                                      ? LookupResult::kMiss
                                      : LookupResult::kHit;
    EXPECT_EQ(after[k], expected) << "key " << k << " on node "
                                  << ::kvstash::testing::HomeIndex(client, keys[k]);
  }
  EXPECT_GT(client.unreachable(), 0u);
  // A prefix lookup stops at the first key of the dead node.
  size_t first_dead = 0;
  while (::kvstash::testing::HomeIndex(client, keys[first_dead]) != 1) ++first_dead;
  EXPECT_EQ(client.LookupPrefix(keys), first_dead);
  // Reading a dead node's key is an error for that key only.
  int dead_key = static_cast<int>(first_dead);
  auto lost = client.Get(keys[dead_key], out);
  EXPECT_EQ(lost.status().code(), StatusCode::kUnavailable) << lost.status().ToString();
  int live_key = dead_key == 0 ? 1 : 0;
  while (::kvstash::testing::HomeIndex(client, keys[live_key]) == 1) ++live_key;
  ASSERT_TRUE(client.Get(keys[live_key], out).ok());
  EXPECT_TRUE(MatchesPattern(live_key, out));
}

// A node stopped, not dead: its connection stays open and its calls are never answered. A
// lookup gives the other node's keys at once and reads the stopped node's as misses after its
// budget (before, it waited for the call's deadline); after `suspect_after` such lookups the
// node is skipped at once, stores to it fail at once, and once it runs again its late answers
// bring it back. Elapsed times are checked against the 10 s call deadline only (what the old
// code waited), never against the budget.
TEST(ManyNodesTest, AStoppedNodeCostsALookupItsBudgetThenIsSkippedUntilItAnswers) {
  std::vector<std::unique_ptr<Daemon>> daemons;
  connector::NodeClientOptions options;
  for (int i = 0; i < 2; ++i) {
    daemons.push_back(std::make_unique<Daemon>(std::vector<std::string>{}));
    ASSERT_NE(daemons.back()->port(), 0);
    options.nodes.push_back({"127.0.0.1", daemons.back()->port()});
  }
  options.timeout = std::chrono::milliseconds(10000);
  options.lookup_budget = std::chrono::milliseconds(100);
  options.suspect_after = 2;
  options.probe_interval = std::chrono::milliseconds(60000);  // back by its late answers only
  auto created = NodeClient::Create(options);
  ASSERT_TRUE(created.ok()) << created.status().ToString();
  NodeClient& client = **created;
  constexpr int kKeys = 32;
  std::vector<BlockKey> keys;
  std::vector<std::vector<std::byte>> blocks;
  std::vector<transport::Bytes> views;
  for (int k = 0; k < kKeys; ++k) {
    keys.push_back(Key(k));
    blocks.emplace_back(kBlock);
    FillPattern(k, blocks.back());
  }
  for (auto& b : blocks) views.emplace_back(b);
  ASSERT_TRUE(client.Put(keys, views).ok());
  // Every key answered (a healthy node may be slower than the budget on a busy machine: ask
  // until it is not).
  auto all_hit = [&] {
    const std::vector<LookupResult> r = client.Lookup(keys);
    return std::count(r.begin(), r.end(), LookupResult::kHit) == kKeys;
  };
  for (int i = 0; i < 100 && !all_hit(); ++i) std::this_thread::sleep_for(10ms);
  ASSERT_TRUE(all_hit());
  const pid_t stopped = daemons[1]->process().pid();
  ASSERT_EQ(::kill(stopped, SIGSTOP), 0);
  ASSERT_TRUE(::kvstash::testing::WaitUntilStopped(stopped, std::chrono::seconds(5)));
  auto lookup_elapsed = [&](std::vector<LookupResult>* out) {
    const auto start = std::chrono::steady_clock::now();
    *out = client.Lookup(keys);
    return std::chrono::steady_clock::now() - start;
  };
  auto check = [&](const std::vector<LookupResult>& r) {
    for (int k = 0; k < kKeys; ++k) {
      if (::kvstash::testing::HomeIndex(client, keys[k]) == 1) {
        EXPECT_EQ(r[k], LookupResult::kMiss) << "key " << k << " of the stopped node";
      }
    }
  };
  std::vector<LookupResult> r;
  for (int i = 0; i < 2; ++i) {  // late twice: the budget each time
    EXPECT_LT(lookup_elapsed(&r), 5s) << "lookup " << i << " waited for the stopped node";
    check(r);
  }
  EXPECT_GT(client.counters()[ClientCounter::kLateKeys], 0u);
  // Suspect: skipped at once, several times.
  const uint64_t skipped = client.counters()[ClientCounter::kSkippedCalls];
  for (int i = 0; i < 5; ++i) {
    EXPECT_LT(lookup_elapsed(&r), 5s);
    check(r);
  }
  EXPECT_GE(client.counters()[ClientCounter::kSkippedCalls], skipped + 5);
  // A store to it fails at once (one replica), naming the node; the other node's keys store.
  int on_stopped = 0;
  while (::kvstash::testing::HomeIndex(client, keys[on_stopped]) != 1) ++on_stopped;
  const auto store_start = std::chrono::steady_clock::now();
  const Status put = client.Put(std::span(&keys[on_stopped], 1), std::span(&views[on_stopped], 1));
  EXPECT_LT(std::chrono::steady_clock::now() - store_start, 5s);
  EXPECT_EQ(put.code(), StatusCode::kUnavailable) << put.ToString();
  EXPECT_THAT(std::string(put.message()), HasSubstr("suspect"));
  // It runs again: its late answers bring it back, every key hits again.
  ASSERT_EQ(::kill(stopped, SIGCONT), 0);
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  while (!all_hit() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(20ms);
  }
  EXPECT_TRUE(all_hit());
}

// Two replicas over two nodes: a block only the second-ranked node holds (stored there by a
// client that knows only that node) is a hit, and a read falls back to it past the first
// node's miss; a block only the first holds reads from the first. Pins reach both, and the
// read copies each block to the replica the lookup found without it.
TEST(ManyNodesTest, ReplicasTakeTheBestAnswerAndReadsFallBackToTheNextReplica) {
  std::vector<std::unique_ptr<Daemon>> daemons;
  std::vector<connector::NodeAddress> addresses;
  for (int i = 0; i < 2; ++i) {
    daemons.push_back(std::make_unique<Daemon>(std::vector<std::string>{}));
    ASSERT_NE(daemons.back()->port(), 0);
    addresses.push_back({"127.0.0.1", daemons.back()->port()});
  }
  auto make = [](std::vector<connector::NodeAddress> nodes, size_t replicas) {
    connector::NodeClientOptions options;
    options.nodes = std::move(nodes);
    options.replicas = replicas;
    options.timeout = std::chrono::milliseconds(2000);
    options.lookup_budget = options.timeout;
    auto created = NodeClient::Create(options);
    EXPECT_TRUE(created.ok()) << created.status().ToString();
    return std::move(*created);
  };
  std::unique_ptr<NodeClient> both = make(addresses, 2);
  constexpr int kKeys = 16;
  // Per key, one client of its first-ranked node alone and one of its second alone.
  std::vector<std::vector<std::byte>> blocks(kKeys, std::vector<std::byte>(kBlock));
  for (int k = 0; k < kKeys; ++k) {
    const std::vector<connector::NodeAddress> places = both->PlacesOf(Key(k));
    ASSERT_EQ(places.size(), 2u);
    FillPattern(k, blocks[k]);
    const connector::NodeAddress& holder = places[k % 2];  // even keys: first; odd: second
    std::unique_ptr<NodeClient> one = make({holder}, 1);
    const BlockKey key = Key(k);
    const transport::Bytes bytes = blocks[k];
    ASSERT_TRUE(one->Put(std::span(&key, 1), std::span(&bytes, 1)).ok());
  }
  std::vector<BlockKey> keys;
  for (int k = 0; k < kKeys; ++k) keys.push_back(Key(k));
  for (LookupResult r : both->Lookup(keys)) EXPECT_EQ(r, LookupResult::kHit);
  both->Pin(keys);
  std::vector<std::vector<std::byte>> read(kKeys, std::vector<std::byte>(kBlock));
  std::vector<transport::MutableBytes> outs(read.begin(), read.end());
  const std::vector<Result<size_t>> got = both->Get(keys, outs);
  for (int k = 0; k < kKeys; ++k) {
    ASSERT_TRUE(got[k].ok()) << k << ": " << got[k].status().ToString();
    EXPECT_TRUE(MatchesPattern(k, read[k])) << k;
  }
  // The lookup found each key on one replica only: the read copied it to the other.
  EXPECT_EQ(both->counters()[ClientCounter::kRepairedBlocks], static_cast<uint64_t>(kKeys));
  for (const connector::NodeAddress& address : addresses) {
    std::unique_ptr<NodeClient> one = make({address}, 1);
    for (LookupResult r : one->Lookup(keys)) EXPECT_EQ(r, LookupResult::kHit) << address.ToString();
  }
  // Nothing is left to repair: the next read copies nothing.
  (void)both->Lookup(keys);
  ASSERT_TRUE(both->Get(keys, outs)[0].ok());
  EXPECT_EQ(both->counters()[ClientCounter::kRepairedBlocks], static_cast<uint64_t>(kKeys));
  both->Unpin(keys);
  both->WaitForTouches();
  // The pins went to both replicas: each node pinned the keys it holds, so 16 in all.
  uint64_t pinned = 0;
  for (size_t n = 0; n < 2; ++n) {
    auto stats = both->Stats(both->nodes()[n]);
    ASSERT_TRUE(stats.ok());
    pinned += (*stats)["node.pinned_keys"];
  }
  EXPECT_EQ(pinned, static_cast<uint64_t>(kKeys));
  EXPECT_EQ(both->counters()[ClientCounter::kPinnedKeys], static_cast<uint64_t>(kKeys));
  EXPECT_EQ(both->counters()[ClientCounter::kUnservedKeys], 0u);
  EXPECT_EQ(both->counters()[ClientCounter::kRefused], 0u);
  // A key neither holds reads as NotFound, never as an error.
  const BlockKey absent = Key(1000);
  std::vector<std::byte> out(kBlock);
  auto missing = both->Get(absent, out);
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound) << missing.status().ToString();
}

}  // namespace
}  // namespace kvstash
