// Registration and MembershipWatcher against a real etcd: nodes join, refresh, leave at a stop
// or when their lease expires, and the watcher keeps its last set while etcd is down.

#include "kvstash/membership/membership.h"

#include <gtest/gtest.h>

#include <thread>

#include "etcd_process.h"
#include "membership_wait.h"

namespace kvstash::membership {
namespace {

using namespace std::chrono_literals;
using ::kvstash::testing::EtcdProcess;
using ::kvstash::testing::WaitForMembers;

NodeRecord Record(int n) {
  NodeRecord record;
  record.address = "127.0.0.1:" + std::to_string(7000 + n);
  record.block_bytes = 65536;
  record.cpu_bytes = 4 << 20;
  record.policy = "lru";
  return record;
}

std::vector<std::string> Addresses(const std::vector<NodeRecord>& members) {
  std::vector<std::string> out;
  for (const auto& m : members) out.push_back(m.address);
  return out;
}

TEST(NodeRecordTest, RoundTripsAndRefusesWhatIsNotARecord) {
  NodeRecord record = Record(1);
  record.ssd_bytes = 1 << 30;
  auto back = NodeRecord::FromJson(record.ToJson());
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, record);
  EXPECT_EQ(NodeRecord::FromJson("[]").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(NodeRecord::FromJson("{\"block_bytes\": 1}").status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(NodeRecord::FromJson("{\"address\": \"a:1\", \"cpu_bytes\": \"x\"}").status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_TRUE(ValidateClusterName("prod-1.a_b").ok());
  EXPECT_FALSE(ValidateClusterName("").ok());
  EXPECT_FALSE(ValidateClusterName("a/b").ok());
}

// A node's events endpoints and a worker's role travel in the record; a record without them
// is written as before they existed (older readers see nothing new).
TEST(NodeRecordTest, EventsEndpointsAndARoleRoundTripAndAreLeftOutWhenUnset) {
  NodeRecord node = Record(2);
  EXPECT_EQ(node.ToJson().find("kv_events"), std::string::npos);
  EXPECT_EQ(node.ToJson().find("role"), std::string::npos);
  node.kv_events = "tcp://0.0.0.0:5600";
  node.kv_events_replay = "tcp://0.0.0.0:5601";
  auto back = NodeRecord::FromJson(node.ToJson());
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, node);
  NodeRecord worker;
  worker.address = "10.0.0.7:7390";
  worker.role = "prefill";
  back = NodeRecord::FromJson(worker.ToJson());
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->role, "prefill");
  EXPECT_EQ(MembersPrefix("c1", MemberKind::kWorker), "/kvstash/c1/workers/");
  EXPECT_EQ(MembersPrefix("c1"), "/kvstash/c1/nodes/");
}

class MembershipTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(etcd_.Started()); }

  std::unique_ptr<Registration> Register(int n, int64_t ttl_s = 2) {
    RegistrationOptions options;
    options.etcd.endpoints = {etcd_.endpoint()};
    options.etcd.timeout = 1000ms;
    options.cluster = "c1";
    options.record = Record(n);
    options.ttl_s = ttl_s;
    auto registration = Registration::Create(options);
    EXPECT_TRUE(registration.ok()) << registration.status().ToString();
    return registration.ok() ? std::move(*registration) : nullptr;
  }

  std::unique_ptr<MembershipWatcher> Watch(MembershipWatcher::OnChange on_change = nullptr) {
    WatcherOptions options;
    options.etcd.endpoints = {etcd_.endpoint()};
    options.etcd.timeout = 1000ms;
    options.cluster = "c1";
    auto watcher = MembershipWatcher::Create(options, std::move(on_change));
    EXPECT_TRUE(watcher.ok()) << watcher.status().ToString();
    return watcher.ok() ? std::move(*watcher) : nullptr;
  }

  EtcdProcess etcd_;
};

TEST_F(MembershipTest, NodesJoinAndLeaveAndTheWatcherFollows) {
  std::vector<std::unique_ptr<Registration>> nodes;
  for (int n = 0; n < 3; ++n) nodes.push_back(Register(n));
  for (auto& node : nodes) {
    for (int i = 0; i < 200 && !node->stats().registered; ++i) std::this_thread::sleep_for(10ms);
    ASSERT_TRUE(node->stats().registered);
  }
  std::mutex mu;
  std::vector<std::vector<std::string>> changes;
  auto watcher = Watch([&](const std::vector<NodeRecord>& members) {
    std::lock_guard lock(mu);
    changes.push_back(Addresses(members));
  });
  ASSERT_NE(watcher, nullptr);
  EXPECT_EQ(Addresses(watcher->members()),
            (std::vector<std::string>{"127.0.0.1:7000", "127.0.0.1:7001", "127.0.0.1:7002"}));
  EXPECT_EQ(watcher->members()[0], Record(0));

  // A fourth joins: seen without reading again.
  nodes.push_back(Register(3));
  ASSERT_TRUE(WaitForMembers(*watcher, 4, 10s));
  // One stops: its key is deleted at once, long before its lease would expire.
  nodes[1]->Stop();
  EXPECT_FALSE(nodes[1]->stats().registered);
  ASSERT_TRUE(WaitForMembers(*watcher, 3, 1500ms));
  EXPECT_EQ(Addresses(watcher->members()),
            (std::vector<std::string>{"127.0.0.1:7000", "127.0.0.1:7002", "127.0.0.1:7003"}));
  // The registrations keep their leases alive well past the TTL.
  std::this_thread::sleep_for(3s);
  EXPECT_EQ(watcher->members().size(), 3u);
  std::lock_guard lock(mu);
  ASSERT_EQ(changes.size(), 2u);
  EXPECT_EQ(changes[0].size(), 4u);
  EXPECT_EQ(changes[1].size(), 3u);
  EXPECT_EQ(watcher->stats().changes, 5u);  // 3 at the first read, one joined, one left
}

TEST_F(MembershipTest, ANodeThatStopsRefreshingLeavesWhenItsLeaseExpires) {
  // As a node killed with SIGKILL: its key stays until its lease runs out.
  EtcdOptions options;
  options.endpoints = {etcd_.endpoint()};
  auto etcd = EtcdClient::Create(options);
  ASSERT_TRUE(etcd.ok());
  auto lease = (*etcd)->GrantLease(2);
  ASSERT_TRUE(lease.ok());
  ASSERT_TRUE(
      (*etcd)->Put(MembersPrefix("c1") + "127.0.0.1:7009", Record(9).ToJson(), *lease).ok());
  auto live = Register(0);
  auto watcher = Watch();
  ASSERT_NE(watcher, nullptr);
  ASSERT_TRUE(WaitForMembers(*watcher, 2, 2s));
  ASSERT_TRUE(WaitForMembers(*watcher, 1, 6s));
  EXPECT_EQ(watcher->members()[0].address, "127.0.0.1:7000");
}

TEST_F(MembershipTest, WithEtcdDownNodesKeepTryingAndWatchersKeepTheLastSet) {
  auto a = Register(0);
  auto b = Register(1);
  auto watcher = Watch();
  ASSERT_NE(watcher, nullptr);
  ASSERT_TRUE(WaitForMembers(*watcher, 2, 10s));
  etcd_.Stop();
  // Down for longer than the lease TTL: the registrations fail and say so, the watcher keeps
  // what it knew.
  for (int i = 0; i < 500 && a->stats().errors == 0; ++i) std::this_thread::sleep_for(10ms);
  EXPECT_GT(a->stats().errors, 0u);
  EXPECT_FALSE(a->stats().last_error.empty());
  std::this_thread::sleep_for(3s);
  EXPECT_EQ(watcher->members().size(), 2u);
  EXPECT_FALSE(watcher->stats().connected);
  EXPECT_GT(watcher->stats().errors, 0u);

  ASSERT_TRUE(etcd_.Start()) << etcd_.log();
  // Back: the nodes are registered again (same key), the watcher watches again and sees news.
  for (int i = 0; i < 1000 && !(a->stats().registered && a->stats().last_error.empty()); ++i) {
    std::this_thread::sleep_for(10ms);
  }
  EXPECT_TRUE(a->stats().registered);
  EXPECT_TRUE(a->stats().last_error.empty());
  auto c = Register(2);
  ASSERT_TRUE(WaitForMembers(*watcher, 3, 10s));
  EXPECT_EQ(Addresses(watcher->members()),
            (std::vector<std::string>{"127.0.0.1:7000", "127.0.0.1:7001", "127.0.0.1:7002"}));
}

TEST_F(MembershipTest, AWatcherWithoutEtcdFailsSayingSo) {
  etcd_.Stop();
  WatcherOptions options;
  options.etcd.endpoints = {etcd_.endpoint()};
  options.etcd.timeout = 300ms;
  options.cluster = "c1";
  options.first_read_timeout = 1000ms;
  auto watcher = MembershipWatcher::Create(options, nullptr);
  ASSERT_FALSE(watcher.ok());
  EXPECT_EQ(watcher.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(watcher.status().message().find("cluster 'c1'"), std::string::npos)
      << watcher.status().ToString();
}

}  // namespace
}  // namespace kvstash::membership
