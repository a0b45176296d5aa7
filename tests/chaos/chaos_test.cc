// The cluster client against a network that fails without closing anything: two real kvstashd,
// each in a network namespace of its own joined to the test's by a veth pair on a bridge, block
// traffic over UCX's TCP transport (shared memory would not cross the fault). One node is cut off
// (its link down), or its packets delayed (tc netem), and then healed. The rules of
// docs/semantics.md §14 must hold: a lookup never waits past its budget for the faulty node
// (checked against the 10 s call deadline, never against the budget itself), the healthy node's
// keys keep hitting, a faulty node is skipped once suspect, no block read is ever wrong, and every
// key hits again once the fault ends (waited for with a deadline).
//
// Needs root, `ip` and `tc` (iproute2): skipped with the reason otherwise.

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "block_pattern.h"
#include "kvstash/connector/node_client.h"
#include "programs.h"
#include "subprocess.h"

namespace kvstash {
namespace {

using namespace std::chrono_literals;
using connector::NodeClient;
using ::kvstash::testing::FillPattern;
using ::kvstash::testing::MatchesPattern;
using ::kvstash::testing::RunProcess;
using Clock = std::chrono::steady_clock;

constexpr size_t kBlock = 64 << 10;
constexpr int kKeys = 32;

// `ip ARGS...`; "" when it worked, else what it said.
std::string Ip(const std::vector<std::string>& args, const char* program = "ip") {
  std::vector<std::string> argv = {program};
  argv.insert(argv.end(), args.begin(), args.end());
  const auto r = RunProcess(argv);
  return r.exit_code == 0 ? "" : (r.err.empty() ? "exit " + std::to_string(r.exit_code) : r.err);
}

// A bridge in this namespace, 10.201.0.1/24: the namespaces' veth pairs are its ports, so that
// every node is on one subnet with this side (UCX's TCP reaches a peer by its subnet).
class Bridge {
 public:
  static std::unique_ptr<Bridge> Create(std::string* why) {
    auto bridge = std::unique_ptr<Bridge>(new Bridge());
    for (const auto& step : std::vector<std::vector<std::string>>{
             {"link", "add", bridge->dev_, "type", "bridge"},
             {"addr", "add", "10.201.0.1/24", "dev", bridge->dev_},
             {"link", "set", bridge->dev_, "up"}}) {
      if (std::string e = Ip(step); !e.empty()) {
        *why = "ip " + step[0] + " " + step[1] + ": " + e;
        return nullptr;
      }
    }
    return bridge;
  }
  ~Bridge() { (void)Ip({"link", "del", dev_}); }
  const std::string& dev() const { return dev_; }

 private:
  Bridge() : dev_("kvbr" + std::to_string(::getpid() % 1000000)) {}
  std::string dev_;
};

// A network namespace on the bridge by a veth pair: 10.201.0.(N+1) inside.
class NetNs {
 public:
  // nullptr with the reason in *why when it cannot be made (not root, no iproute2).
  static std::unique_ptr<NetNs> Create(int n, const Bridge& bridge, std::string* why) {
    auto ns = std::unique_ptr<NetNs>(new NetNs(n));
    const std::string outer = ns->host_dev_, inner = ns->inner_dev_;
    for (const auto& step : std::vector<std::vector<std::string>>{
             {"netns", "add", ns->name_},
             {"link", "add", outer, "type", "veth", "peer", "name", inner},
             {"link", "set", inner, "netns", ns->name_},
             {"link", "set", outer, "master", bridge.dev()},
             {"link", "set", outer, "up"},
             {"-n", ns->name_, "addr", "add", ns->ip_ + "/24", "dev", inner},
             {"-n", ns->name_, "link", "set", inner, "up"},
             {"-n", ns->name_, "link", "set", "lo", "up"}}) {
      if (std::string e = Ip(step); !e.empty()) {
        *why = "ip " + step[0] + " " + step[1] + ": " + e;
        return nullptr;
      }
    }
    return ns;
  }
  ~NetNs() {
    (void)Ip({"link", "del", host_dev_});
    (void)Ip({"netns", "del", name_});
  }
  const std::string& name() const { return name_; }
  const std::string& ip() const { return ip_; }
  const std::string& inner_dev() const { return inner_dev_; }
  // Its bridge port down (every packet either way lost, no connection told) or up again.
  void Cut(bool cut) { ASSERT_EQ(Ip({"link", "set", host_dev_, cut ? "down" : "up"}), ""); }
  // netem on the way in ("delay 200ms", "loss 5%"), or none (""); "" when it worked, else what
  // tc said (a kernel without sch_netem says its kind is unknown).
  std::string Netem(const std::string& spec) {
    if (spec.empty()) return Ip({"qdisc", "del", "dev", host_dev_, "root"}, "tc");
    std::vector<std::string> args = {"qdisc", "replace", "dev", host_dev_, "root", "netem"};
    for (size_t at = 0, next; at < spec.size(); at = next + 1) {
      next = spec.find(' ', at);
      if (next == std::string::npos) next = spec.size();
      args.push_back(spec.substr(at, next - at));
    }
    return Ip(args, "tc");
  }

 private:
  explicit NetNs(int n)
      : name_("kvchaos" + std::to_string(::getpid()) + "n" + std::to_string(n)),
        host_dev_("kvh" + std::to_string(::getpid() % 100000) + "n" + std::to_string(n)),
        inner_dev_("kvn" + std::to_string(n)),
        ip_("10.201.0." + std::to_string(n + 1)) {}
  std::string name_, host_dev_, inner_dev_, ip_;
};

// A kvstashd inside `ns`, listening on its address; port() is 0 when it did not start.
class NsDaemon {
 public:
  explicit NsDaemon(const NetNs& ns) {
    // UCX's TCP on the namespace's veth only: an address of its loopback would name this
    // namespace's loopback to the client.
    ChildOptions options;
    options.env = EnvironmentWith("UCX_NET_DEVICES", ns.inner_dev());
    auto child =
        ChildProcess::Create({"ip", "netns", "exec", ns.name(), testing::KvstashdPath(), "--listen",
                              ns.ip(), "--port", "0", "--metrics-address", "off", "--log-level",
                              "warn", "--block-bytes", "64KiB", "--cpu-bytes", "8MiB"},
                             options);
    if (!child.ok()) return;
    child_ = std::move(*child);
    const std::string prefix = "kvstashd listening on " + ns.ip() + ":";
    for (int i = 0; i < 50; ++i) {
      std::optional<std::string> line = child_->ReadLine(10000);
      if (!line) break;
      if (line->rfind(prefix, 0) == 0) {
        port_ = static_cast<uint16_t>(std::stoi(line->substr(prefix.size())));
        break;
      }
    }
  }
  uint16_t port() const { return port_; }

 private:
  std::unique_ptr<ChildProcess> child_;
  uint16_t port_ = 0;
};

BlockKey Key(uint64_t k) {
  BlockKey key;
  key.hash.lo = k * 0x9e3779b97f4a7c15ULL + 1;
  key.hash.hi = k;
  return key;
}

class ChaosTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (::geteuid() != 0) GTEST_SKIP() << "needs root (network namespaces)";
    std::string why;
    bridge_ = Bridge::Create(&why);
    if (bridge_ == nullptr) GTEST_SKIP() << "no bridge here: " << why;
    for (int n = 1; n <= 2; ++n) {
      auto ns = NetNs::Create(n, *bridge_, &why);
      if (ns == nullptr) GTEST_SKIP() << "no network namespace here: " << why;
      spaces_.push_back(std::move(ns));
    }
    // This side's UCX on the bridge only, as the nodes' on their veth (a node reaches no other
    // address of this side).
    ::setenv("UCX_NET_DEVICES", bridge_->dev().c_str(), 1);
    connector::NodeClientOptions options;
    for (const auto& ns : spaces_) {
      daemons_.push_back(std::make_unique<NsDaemon>(*ns));
      ASSERT_NE(daemons_.back()->port(), 0) << "kvstashd did not start in " << ns->name();
      options.nodes.push_back({ns->ip(), daemons_.back()->port()});
    }
    options.transport.tls = "tcp";
    options.timeout = 10000ms;
    options.connect_timeout = 2000ms;
    options.lookup_budget = 100ms;
    options.probe_interval = 200ms;
    auto client = NodeClient::Create(options);
    ASSERT_TRUE(client.ok()) << client.status().ToString();
    client_ = std::move(*client);
    for (int k = 0; k < kKeys; ++k) {
      keys_.push_back(Key(k));
      blocks_.emplace_back(kBlock);
      FillPattern(k, blocks_.back());
    }
    std::vector<transport::Bytes> views(blocks_.begin(), blocks_.end());
    ASSERT_TRUE(client_->Put(keys_, views).ok());
    ASSERT_TRUE(AllHitWithin(30s));
  }

  // Asks until every key hits (a lookup may miss its budget on a busy machine).
  bool AllHitWithin(std::chrono::seconds limit) {
    const auto deadline = Clock::now() + limit;
    while (Clock::now() < deadline) {
      const std::vector<LookupResult> r = client_->Lookup(keys_);
      if (std::count(r.begin(), r.end(), LookupResult::kHit) == kKeys) return true;
      std::this_thread::sleep_for(50ms);
    }
    return false;
  }

  // One lookup: how long it took, the faulty node's keys never HIT wrongly and the healthy
  // node's keys counted.
  struct Round {
    Clock::duration took;
    int healthy_hits = 0, healthy = 0;
  };
  Round LookupRound(size_t faulty) {
    Round round;
    const auto start = Clock::now();
    const std::vector<LookupResult> r = client_->Lookup(keys_);
    round.took = Clock::now() - start;
    for (int k = 0; k < kKeys; ++k) {
      if (client_->NodeOf(keys_[k]) == faulty) continue;
      ++round.healthy;
      round.healthy_hits += r[k] == LookupResult::kHit ? 1 : 0;
    }
    return round;
  }

  // Every block reads back whole and right (no wrong byte, whatever happened).
  void ExpectEveryBlockRight() {
    std::vector<std::byte> out(kBlock);
    for (int k = 0; k < kKeys; ++k) {
      auto got = client_->Get(keys_[k], out);
      ASSERT_TRUE(got.ok()) << "key " << k << ": " << got.status().ToString();
      EXPECT_EQ(*got, kBlock);
      EXPECT_TRUE(MatchesPattern(k, out)) << "key " << k;
    }
  }

  std::unique_ptr<Bridge> bridge_;  // first: it goes last
  std::vector<std::unique_ptr<NetNs>> spaces_;
  std::vector<std::unique_ptr<NsDaemon>> daemons_;
  std::unique_ptr<NodeClient> client_;
  std::vector<BlockKey> keys_;
  std::vector<std::vector<std::byte>> blocks_;
};

// A node cut off (not killed): lookups give the other node's keys and never wait for the
// call's deadline; the node is skipped once suspect; healed, every key hits and reads right.
TEST_F(ChaosTest, ANodeCutOffCostsLookupsTheirBudgetThenNothingAndComesBack) {
  spaces_[1]->Cut(true);
  int healthy_rounds = 0;
  for (int i = 0; i < 10; ++i) {
    const Round round = LookupRound(1);
    EXPECT_LT(round.took, 5s) << "lookup " << i << " waited for the cut-off node";
    healthy_rounds += round.healthy_hits == round.healthy ? 1 : 0;
  }
  // The healthy node's keys hit in (nearly) every round; a busy machine may miss a budget.
  EXPECT_GE(healthy_rounds, 8);
  EXPECT_GT(client_->counters()[ClientCounter::kSkippedCalls], 0u);
  spaces_[1]->Cut(false);
  EXPECT_TRUE(AllHitWithin(60s)) << "the cluster did not converge after the cut was healed";
  ExpectEveryBlockRight();
}

// Added latency on one node: past the lookup budget (200 ms) its keys miss and nothing waits
// for it; within it (50 ms) every key still hits. Removed, every key hits and reads right.
TEST_F(ChaosTest, LatencyOnOneNodeMissesItsKeysOnlyPastTheBudget) {
  if (std::string e = spaces_[1]->Netem("delay 50ms"); !e.empty()) {
    GTEST_SKIP() << "tc netem is not available here: " << e;
  }
  EXPECT_TRUE(AllHitWithin(30s)) << "50 ms of latency is within the 100 ms budget";
  ASSERT_EQ(spaces_[1]->Netem("delay 200ms"), "");
  int healthy_rounds = 0;
  for (int i = 0; i < 10; ++i) {
    const Round round = LookupRound(1);
    EXPECT_LT(round.took, 5s) << "lookup " << i << " waited for the slow node";
    healthy_rounds += round.healthy_hits == round.healthy ? 1 : 0;
  }
  EXPECT_GE(healthy_rounds, 8);
  EXPECT_GT(client_->counters()[ClientCounter::kLateKeys], 0u);
  EXPECT_EQ(spaces_[1]->Netem(""), "");
  EXPECT_TRUE(AllHitWithin(60s)) << "the cluster did not converge once the latency was gone";
  ExpectEveryBlockRight();
}

// 5 % loss on one node: TCP repairs it; nothing is wrong, every key hits in time.
TEST_F(ChaosTest, LossOnOneNodeLosesNoByteAndEveryKeyHits) {
  if (std::string e = spaces_[1]->Netem("loss 5%"); !e.empty()) {
    GTEST_SKIP() << "tc netem is not available here: " << e;
  }
  EXPECT_TRUE(AllHitWithin(60s));
  ExpectEveryBlockRight();
  EXPECT_EQ(spaces_[1]->Netem(""), "");
}

}  // namespace
}  // namespace kvstash
