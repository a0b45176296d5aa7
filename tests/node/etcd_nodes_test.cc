// Real kvstashd processes in a cluster kept by a real etcd: they register with their address,
// block size and tiers, leave at SIGTERM at once, leave after their lease when killed, and
// serve on (and say so in their metrics) while etcd is away.

#include <gtest/gtest.h>

#include <csignal>
#include <set>
#include <thread>

#include "daemon_process.h"
#include "etcd_process.h"
#include "kvstash/membership/membership.h"
#include "membership_wait.h"
#include "subprocess.h"

namespace kvstash::membership {
namespace {

using namespace std::chrono_literals;
using ::kvstash::testing::Daemon;
using ::kvstash::testing::EtcdProcess;
using ::kvstash::testing::RunProcess;
using ::kvstash::testing::WaitForMembers;

// The metrics page of a node (curl), or "" when it does not answer.
std::string Metrics(uint16_t port) {
  auto out = RunProcess(
      {"curl", "-sf", "-m", "2", "http://127.0.0.1:" + std::to_string(port) + "/metrics"});
  return out.exit_code == 0 ? out.out : std::string();
}

class EtcdNodesTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(etcd_.Started()); }

  std::unique_ptr<Daemon> Node(std::vector<std::string> extra = {}) {
    std::vector<std::string> args = {"--etcd", etcd_.endpoint(), "--cluster",
                                     "t",      "--etcd-ttl-s",   "2"};
    args.insert(args.end(), extra.begin(), extra.end());
    auto node = std::make_unique<Daemon>(args);
    EXPECT_NE(node->port(), 0);
    return node;
  }

  std::unique_ptr<MembershipWatcher> Watch() {
    WatcherOptions options;
    options.etcd.endpoints = {etcd_.endpoint()};
    options.cluster = "t";
    auto watcher = MembershipWatcher::Create(options, nullptr);
    EXPECT_TRUE(watcher.ok()) << watcher.status().ToString();
    return watcher.ok() ? std::move(*watcher) : nullptr;
  }

  EtcdProcess etcd_;
};

TEST_F(EtcdNodesTest, NodesRegisterAndLeaveAtSigtermOrWhenTheirLeaseExpires) {
  std::vector<std::unique_ptr<Daemon>> nodes;
  for (int i = 0; i < 3; ++i) nodes.push_back(Node());
  auto watcher = Watch();
  ASSERT_NE(watcher, nullptr);
  ASSERT_TRUE(WaitForMembers(*watcher, 3, 5s));
  std::set<std::string> addresses;
  for (const NodeRecord& member : watcher->members()) {
    addresses.insert(member.address);
    EXPECT_EQ(member.block_bytes, 64u << 10);  // the test daemon's sizes
    EXPECT_EQ(member.cpu_bytes, 4u << 20);
    EXPECT_EQ(member.policy, "lru");
  }
  for (const auto& node : nodes) {
    EXPECT_EQ(addresses.count("127.0.0.1:" + std::to_string(node->port())), 1u);
    EXPECT_NE(Metrics(node->metrics_port()).find("kvstash_etcd_registered 1"), std::string::npos);
  }

  // SIGTERM: the key goes before the node stops, long before its lease would expire.
  EXPECT_EQ(nodes[0]->process().Kill(SIGTERM), 0);
  ASSERT_TRUE(WaitForMembers(*watcher, 2, 1s));
  // SIGKILL: nothing deletes the key; the lease (2 s) does.
  nodes[1]->process().Kill(SIGKILL);
  EXPECT_EQ(watcher->members().size(), 2u);
  ASSERT_TRUE(WaitForMembers(*watcher, 1, 6s));
  EXPECT_EQ(watcher->members()[0].address, "127.0.0.1:" + std::to_string(nodes[2]->port()));
}

TEST_F(EtcdNodesTest, ANodeServesWhileEtcdIsAwayAndRegistersWhenItIsBack) {
  etcd_.Stop();
  auto node = Node();  // starts with etcd down
  ASSERT_NE(node->port(), 0);
  std::string metrics;
  for (int i = 0; i < 100; ++i) {
    metrics = Metrics(node->metrics_port());
    if (metrics.find("kvstash_etcd_errors_total 0") == std::string::npos) break;
    std::this_thread::sleep_for(50ms);
  }
  EXPECT_NE(metrics.find("kvstash_etcd_registered 0"), std::string::npos) << metrics;
  EXPECT_EQ(metrics.find("kvstash_etcd_errors_total 0"), std::string::npos) << metrics;
  ASSERT_TRUE(etcd_.Start()) << etcd_.log();
  auto watcher = Watch();
  ASSERT_NE(watcher, nullptr);
  ASSERT_TRUE(WaitForMembers(*watcher, 1, 5s));
  EXPECT_NE(Metrics(node->metrics_port()).find("kvstash_etcd_registered 1"), std::string::npos);
  EXPECT_EQ(node->process().Kill(SIGTERM), 0);
  ASSERT_TRUE(WaitForMembers(*watcher, 0, 1s));
}

TEST_F(EtcdNodesTest, BadMembershipSettingsAreRefusedBeforeTheNodeStarts) {
  auto run = [](std::vector<std::string> args) {
    args.insert(args.begin(), ::kvstash::testing::kKvstashd);
    return RunProcess(args);
  };
  auto out = run({"--cluster", "t"});
  EXPECT_EQ(out.exit_code, 2);
  EXPECT_NE(out.err.find("without --etcd"), std::string::npos) << out.err;
  out = run({"--etcd", etcd_.endpoint()});
  EXPECT_EQ(out.exit_code, 2);
  EXPECT_NE(out.err.find("cluster: required"), std::string::npos) << out.err;
  out = run({"--etcd", "https://127.0.0.1:2379", "--cluster", "t"});
  EXPECT_EQ(out.exit_code, 2);
  out = run({"--etcd", etcd_.endpoint(), "--cluster", "a/b"});
  EXPECT_EQ(out.exit_code, 2);
  out = run({"--etcd", etcd_.endpoint(), "--cluster", "t", "--listen", "0.0.0.0"});
  EXPECT_EQ(out.exit_code, 2);
  EXPECT_NE(out.err.find("advertise"), std::string::npos) << out.err;
  out = run({"--etcd", etcd_.endpoint(), "--cluster", "t", "--etcd-ttl-s", "1"});
  EXPECT_EQ(out.exit_code, 2);
  out = run({"--zone", "rack-1"});
  EXPECT_EQ(out.exit_code, 2);
  EXPECT_NE(out.err.find("zone: given without --etcd"), std::string::npos) << out.err;
  out = run({"--etcd", etcd_.endpoint(), "--cluster", "t", "--zone", "rack 1"});
  EXPECT_EQ(out.exit_code, 2);
  EXPECT_NE(out.err.find("zone"), std::string::npos) << out.err;
}

TEST_F(EtcdNodesTest, TheAdvertisedAddressAndZoneAreWhatClientsSee) {
  auto node = Node({"--advertise", "10.1.2.3:9999", "--zone", "rack-1"});
  auto watcher = Watch();
  ASSERT_NE(watcher, nullptr);
  ASSERT_TRUE(WaitForMembers(*watcher, 1, 5s));
  EXPECT_EQ(watcher->members()[0].address, "10.1.2.3:9999");
  EXPECT_EQ(watcher->members()[0].zone, "rack-1");
}

}  // namespace
}  // namespace kvstash::membership
