// The cluster client against faults that close nothing: real kvstashd (and a real etcd), each in
// a network namespace of its own joined to the test's by a veth pair on a bridge, block traffic
// over UCX's TCP transport (shared memory would not cross the fault). A node is cut off (its
// link down), its packets delayed (tc netem), stopped (SIGSTOP) with one or two replicas, or
// etcd is parted from the nodes; then the fault ends. The rules of docs/semantics.md §14 must
// hold: no call waits for the faulty node (checked against a bound well under the 10 s call
// deadline, never against the budget itself), the healthy nodes' keys keep hitting, a faulty
// node is skipped once suspect, no block read is ever wrong, and once the fault ends the cluster
// converges (waited for with a deadline, never a sleep).
//
// Needs root and `ip` (iproute2), `tc` for the netem cases, etcd (etcd-server) for the etcd case:
// skipped with the reason otherwise.

#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "block_pattern.h"
#include "kvstash/connector/node_client.h"
#include "kvstash/membership/etcd_client.h"
#include "kvstash/membership/membership.h"
#include "process_state.h"
#include "programs.h"
#include "subprocess.h"
#include "temp_dir.h"

namespace kvstash {
namespace {

using ::kvstash::ClientCounter;
using ::kvstash::ClientCounterDef;

using namespace std::chrono_literals;
using connector::NodeAddress;
using connector::NodeClient;
using connector::NodeClientOptions;
using ::kvstash::testing::FillPattern;
using ::kvstash::testing::MatchesPattern;
using ::kvstash::testing::RunProcess;
using Clock = std::chrono::steady_clock;

constexpr size_t kBlock = 64 << 10;
constexpr int kKeys = 32;
// Every call's deadline, and the bound no call may reach while a fault lasts: well under the
// deadline (what a call waited for a stopped node before bounded waits), far over any budget, so
// that only a call that waited for the faulty node fails it, never a busy machine.
constexpr auto kDeadline = 10000ms;
constexpr auto kBound = 5s;
// The lookup budget of the stop and etcd cases: generous, so that a healthy node on a machine
// shared with other work still answers within it (each of its keys must hit).
constexpr auto kBudget = 500ms;

// `ip ARGS...`; "" when it worked, else what it said.
std::string Ip(const std::vector<std::string>& args, const char* program = "ip") {
  std::vector<std::string> argv = {program};
  argv.insert(argv.end(), args.begin(), args.end());
  const auto r = RunProcess(argv);
  return r.exit_code == 0 ? "" : (r.err.empty() ? "exit " + std::to_string(r.exit_code) : r.err);
}

bool Same(const NodeAddress& a, const NodeAddress& b) { return a.ToString() == b.ToString(); }

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
    if (!direct_dev_.empty()) (void)Ip({"link", "del", direct_dev_});
    (void)Ip({"link", "del", host_dev_});
    (void)Ip({"netns", "del", name_});
  }
  const std::string& name() const { return name_; }
  const std::string& ip() const { return ip_; }
  const std::string& inner_dev() const { return inner_dev_; }
  // Its bridge port down (every packet either way lost, no connection told) or up again.
  void Cut(bool cut) { ASSERT_EQ(Ip({"link", "set", host_dev_, cut ? "down" : "up"}), ""); }
  // A second link from this namespace straight into this one, off the bridge: kDirectIp inside,
  // 10.202.0.1 here. A Cut then parts the namespace from the others but not from this one. ""
  // when it worked, else what ip said.
  static constexpr const char* kDirectIp = "10.202.0.2";
  std::string AddDirectLink() {
    direct_dev_ = "kvd" + std::to_string(::getpid() % 100000) + "n" + std::to_string(n_);
    const std::string inner = "kvd" + std::to_string(n_);
    for (const auto& step : std::vector<std::vector<std::string>>{
             {"link", "add", direct_dev_, "type", "veth", "peer", "name", inner},
             {"link", "set", inner, "netns", name_},
             {"addr", "add", "10.202.0.1/30", "dev", direct_dev_},
             {"link", "set", direct_dev_, "up"},
             {"-n", name_, "addr", "add", std::string(kDirectIp) + "/30", "dev", inner},
             {"-n", name_, "link", "set", inner, "up"}}) {
      if (std::string e = Ip(step); !e.empty()) return "ip " + step[0] + " " + step[1] + ": " + e;
    }
    return "";
  }
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
      : n_(n),
        name_("kvchaos" + std::to_string(::getpid()) + "n" + std::to_string(n)),
        host_dev_("kvh" + std::to_string(::getpid() % 100000) + "n" + std::to_string(n)),
        inner_dev_("kvn" + std::to_string(n)),
        ip_("10.201.0." + std::to_string(n + 1)) {}
  int n_;
  std::string name_, host_dev_, inner_dev_, ip_;
  std::string direct_dev_;  // AddDirectLink's end here, when made
};

// A kvstashd inside `ns`, listening on its address; port() is 0 when it did not start.
class NsDaemon {
 public:
  NsDaemon(const NetNs& ns, const std::vector<std::string>& args = {}) : ip_(ns.ip()) {
    // UCX's TCP on the namespace's veth only: an address of its loopback would name this
    // namespace's loopback to the client.
    ChildOptions options;
    options.env = EnvironmentWith("UCX_NET_DEVICES", ns.inner_dev());
    std::vector<std::string> argv = {"ip", "netns", "exec", ns.name(), testing::KvstashdPath()};
    argv.insert(argv.end(),
                {"--listen", ns.ip(), "--port", "0", "--metrics-address", "off", "--log-level",
                 "warn", "--block-bytes", "64KiB", "--cpu-bytes", "8MiB"});
    argv.insert(argv.end(), args.begin(), args.end());
    auto child = ChildProcess::Create(argv, options);
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
  // Running again if stopped: a stopped node would hold the client's calls to it until their
  // deadlines as the test goes away.
  ~NsDaemon() { Resume(); }
  uint16_t port() const { return port_; }
  NodeAddress address() const { return {ip_, port_}; }

  // SIGSTOP, waited for until every thread has taken it: whether it has. `ip netns exec` execs
  // the program, so the child is kvstashd itself (checked: a stopped `ip` would stop nothing).
  ::testing::AssertionResult Stop() {
    if (child_ == nullptr) return ::testing::AssertionFailure() << "no kvstashd";
    std::ifstream comm("/proc/" + std::to_string(child_->pid()) + "/comm");
    std::string name;
    std::getline(comm, name);
    if (name != "kvstashd") {
      return ::testing::AssertionFailure() << "process " << child_->pid() << " is " << name;
    }
    if (::kill(child_->pid(), SIGSTOP) != 0) return ::testing::AssertionFailure() << "kill";
    stopped_ = true;
    if (!testing::WaitUntilStopped(child_->pid(), 5000ms)) {
      return ::testing::AssertionFailure() << "kvstashd did not stop within 5 s";
    }
    return ::testing::AssertionSuccess();
  }
  void Resume() {
    if (stopped_ && child_ != nullptr) ::kill(child_->pid(), SIGCONT);
    stopped_ = false;
  }

 private:
  std::string ip_;
  std::unique_ptr<ChildProcess> child_;
  uint16_t port_ = 0;
  bool stopped_ = false;
};

// etcd inside `ns` on its fixed ports (the namespace is the test's own): the nodes reach it at
// the namespace's bridge address, this side at its direct link's (NetNs::AddDirectLink).
class NsEtcd {
 public:
  static constexpr const char* kEtcd = "/usr/bin/etcd";
  explicit NsEtcd(const NetNs& ns)
      : for_nodes_("http://" + ns.ip() + ":2379"),
        for_us_(std::string("http://") + NetNs::kDirectIp + ":2379") {
    ChildOptions options;
    options.output = ChildOptions::Output::kMemory;
    options.merge_stderr = true;
    // One member, its peer port on the namespace's loopback.
    const std::string peer = "http://127.0.0.1:2380";
    std::vector<std::string> argv = {"ip", "netns", "exec", ns.name(), kEtcd};
    argv.insert(argv.end(), {"--name", "chaos", "--data-dir", dir_ / "data", "--listen-client-urls",
                             "http://0.0.0.0:2379", "--advertise-client-urls", for_nodes_,
                             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                             "--initial-cluster", "chaos=" + peer, "--log-level", "error"});
    auto child = ChildProcess::Create(argv, options);
    if (child.ok()) child_ = std::move(*child);
    membership::EtcdOptions etcd;
    etcd.endpoints = {for_us_};
    etcd.timeout = 1000ms;
    auto client = membership::EtcdClient::Create(etcd);
    if (client.ok()) client_ = std::move(*client);
  }
  // Whether etcd answers this side within `limit`.
  bool AnswersWithin(Clock::duration limit) {
    const auto until = Clock::now() + limit;
    while (child_ != nullptr && client_ != nullptr && Clock::now() < until) {
      if (client_->GetPrefix("/").ok()) return true;
      if (child_->Exited()) return false;
      std::this_thread::sleep_for(50ms);
    }
    return false;
  }
  // The members of `cluster` etcd lists, as this side reads them; -1 when it does not answer.
  int Members(const std::string& cluster) {
    auto range = client_->GetPrefix(membership::MembersPrefix(cluster));
    return range.ok() ? static_cast<int>(range->kvs.size()) : -1;
  }
  const std::string& for_nodes() const { return for_nodes_; }
  const std::string& for_us() const { return for_us_; }
  std::string log() const { return child_ != nullptr ? child_->Output() : "not started"; }

 private:
  testing::TempDir dir_;
  std::string for_nodes_, for_us_;
  std::unique_ptr<ChildProcess> child_;
  std::unique_ptr<membership::EtcdClient> client_;
};

BlockKey Key(uint64_t k) {
  BlockKey key;
  key.hash.lo = k * 0x9e3779b97f4a7c15ULL + 1;
  key.hash.hi = k;
  return key;
}

std::vector<uint64_t> Ids(uint64_t first, size_t count) {
  std::vector<uint64_t> ids(count);
  for (size_t i = 0; i < count; ++i) ids[i] = first + i;
  return ids;
}

std::vector<BlockKey> KeysOf(const std::vector<uint64_t>& ids) {
  std::vector<BlockKey> keys;
  for (uint64_t id : ids) keys.push_back(Key(id));
  return keys;
}

// Stores the block of each of `ids` (its FillPattern): the store's status.
Status Store(NodeClient& client, const std::vector<uint64_t>& ids) {
  std::vector<std::vector<std::byte>> blocks(ids.size(), std::vector<std::byte>(kBlock));
  for (size_t i = 0; i < ids.size(); ++i) FillPattern(ids[i], blocks[i]);
  const std::vector<transport::Bytes> views(blocks.begin(), blocks.end());
  return client.Put(KeysOf(ids), views);
}

// Whether every one of `ids` hits, asked until `limit` (a lookup may miss its budget on a busy
// machine, and a node that runs again is back once a probe answers).
bool AllHitWithin(NodeClient& client, const std::vector<uint64_t>& ids, Clock::duration limit) {
  const std::vector<BlockKey> keys = KeysOf(ids);
  const auto deadline = Clock::now() + limit;
  while (Clock::now() < deadline) {
    const std::vector<LookupResult> r = client.Lookup(keys);
    if (std::count(r.begin(), r.end(), LookupResult::kHit) == static_cast<long>(keys.size())) {
      return true;
    }
    std::this_thread::sleep_for(50ms);
  }
  return false;
}

// Every block of `ids` reads back whole and right (no wrong byte, whatever happened).
void ExpectEveryBlockRight(NodeClient& client, const std::vector<uint64_t>& ids) {
  std::vector<std::byte> out(kBlock);
  for (uint64_t id : ids) {
    auto got = client.Get(Key(id), out);
    ASSERT_TRUE(got.ok()) << "key " << id << ": " << got.status().ToString();
    EXPECT_EQ(*got, kBlock);
    EXPECT_TRUE(MatchesPattern(id, out)) << "key " << id;
  }
}

// The engine's side of a fault: rounds of a lookup of every key it knows, a read of each key that
// hit, and a store of new keys, each call timed. It counts what broke a rule, with the first
// offence of each kind in words, so that a test states each rule once and a failure says what
// happened without a line per round. Keys are numbered; each block is FillPattern of its number.
class Workload {
 public:
  // One kind of offence: how many, and the first.
  struct Tally {
    int count = 0;
    std::string first;
    void Add(const std::string& what) {
      if (count++ == 0) first = what;
    }
  };

  // `known`: keys the cluster holds now; new keys are numbered from `first_new`, at most
  // `most` keys in all (the nodes' CPU tiers hold them all), then stores go round those known.
  Workload(NodeClient& client, std::vector<uint64_t> known, uint64_t first_new, size_t most)
      : client_(client), known_(std::move(known)), next_(first_new), most_(most) {}

  // Which keys must hit now (the others may miss); every key unless told.
  std::function<bool(uint64_t)> must_hit = [](uint64_t) { return true; };
  // Which keys must miss now (a key of a stopped node cannot hit); none unless told.
  std::function<bool(uint64_t)> must_miss = [](uint64_t) { return false; };
  // Which errors of a store are expected (a stopped node's keys with one replica); none unless
  // told. The other blocks of a failed store are stored all the same.
  std::function<bool(const Status&)> store_may_fail = [](const Status&) { return false; };
  // Which keys the faulty node holds (a copy of): the first key of every round's store is one,
  // so that the first store of a fault meets the node whatever the placement. Empty: any keys.
  std::function<bool(uint64_t)> faulty_key;

  // One round, storing `fresh` blocks: new keys while there are fewer than `most`.
  void Round(size_t fresh) {
    ++rounds_;
    const std::vector<BlockKey> keys = KeysOf(known_);
    auto start = Clock::now();
    const std::vector<LookupResult> r = client_.Lookup(keys);
    Took(start, "lookup of " + std::to_string(keys.size()) + " keys");
    std::vector<uint64_t> hits;
    for (size_t i = 0; i < keys.size(); ++i) {
      const uint64_t id = known_[i];
      if (r[i] == LookupResult::kHit) hits.push_back(id);
      if (r[i] != LookupResult::kHit && must_hit(id)) {
        misses.Add(Where(id) + (r[i] == LookupResult::kRetry ? " read RETRY" : " missed"));
      }
      if (r[i] == LookupResult::kHit && must_miss(id)) hits_wrongly.Add(Where(id) + " hit");
    }
    std::vector<std::vector<std::byte>> blocks(hits.size(), std::vector<std::byte>(kBlock));
    const std::vector<transport::MutableBytes> outs(blocks.begin(), blocks.end());
    start = Clock::now();
    const std::vector<Result<size_t>> got = client_.Get(KeysOf(hits), outs);
    Took(start, "read of " + std::to_string(hits.size()) + " blocks");
    for (size_t j = 0; j < hits.size(); ++j) {
      if (!got[j].ok()) {
        failed_reads.Add(Where(hits[j]) + " hit but did not read: " + got[j].status().ToString());
      } else if (*got[j] != kBlock || !MatchesPattern(hits[j], blocks[j])) {
        wrong_blocks.Add(Where(hits[j]) + " read " + std::to_string(*got[j]) +
                         " bytes, not its own");
      }
    }
    // The next key to store: a new one while there are fewer than `most`, else one known; of
    // the faulty node when asked (new numbers skipped so are never used).
    const auto next = [&](bool on_faulty) {
      if (known_.size() < most_) {
        while (on_faulty && !faulty_key(next_)) ++next_;
        known_.push_back(next_++);
        return known_.back();
      }
      for (size_t n = 0; on_faulty && n < known_.size(); ++n, ++again_) {
        if (faulty_key(known_[again_ % known_.size()])) break;
      }
      return known_[again_++ % known_.size()];
    };
    std::vector<uint64_t> stored;
    for (size_t i = 0; i < fresh; ++i) stored.push_back(next(i == 0 && faulty_key != nullptr));
    if (stored.empty()) return;
    start = Clock::now();
    const Status status = Store(client_, stored);
    Took(start, "store of " + std::to_string(stored.size()) + " blocks");
    if (!status.ok() && !store_may_fail(status)) {
      failed_stores.Add("round " + std::to_string(rounds_) + ": " + status.ToString());
    }
  }

  // Rounds until `end`, an engine's step apart.
  void RoundsUntil(Clock::time_point end, size_t fresh) {
    while (Clock::now() < end) {
      Round(fresh);
      std::this_thread::sleep_for(20ms);  // the pace of an engine's steps, not a wait for a state
    }
  }

  const std::vector<uint64_t>& known() const { return known_; }
  int rounds() const { return rounds_; }
  Clock::duration slowest() const { return slowest_; }
  const std::string& slowest_call() const { return slowest_call_; }

  // Calls that took the bound or longer; keys that missed (or read RETRY) but must hit, and hit
  // but must miss; hits that did not read, or read wrong; stores that failed unexpectedly.
  Tally over_bound, misses, hits_wrongly, failed_reads, wrong_blocks, failed_stores;

 private:
  std::string Where(uint64_t id) const {
    const std::vector<NodeAddress> places = client_.PlacesOf(Key(id));
    return "round " + std::to_string(rounds_) + ": key " + std::to_string(id) + " (first place " +
           (places.empty() ? std::string("none") : places[0].ToString()) + ")";
  }
  void Took(Clock::time_point start, const std::string& what) {
    const Clock::duration took = Clock::now() - start;
    const std::string said =
        "round " + std::to_string(rounds_) + ": " + what + " took " +
        std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(took).count()) + " ms";
    if (took >= kBound) over_bound.Add(said);
    if (took > slowest_) {
      slowest_ = took;
      slowest_call_ = said;
    }
  }

  NodeClient& client_;
  std::vector<uint64_t> known_;
  uint64_t next_;
  size_t most_;
  size_t again_ = 0;
  int rounds_ = 0;
  Clock::duration slowest_{};
  std::string slowest_call_ = "none";
};

// Every rule of a fault held in `work`'s rounds: no call reached the bound, every key that must
// hit did and none that must miss did, every hit read back and right, every store took.
void ExpectNoOffence(const Workload& work, const std::string& fault) {
  EXPECT_GT(work.rounds(), 0);
  EXPECT_EQ(work.over_bound.count, 0)
      << fault << ": calls waited for the faulty node, first " << work.over_bound.first
      << "; slowest " << work.slowest_call();
  EXPECT_EQ(work.misses.count, 0) << fault << ": keys that must hit missed, first "
                                  << work.misses.first;
  EXPECT_EQ(work.hits_wrongly.count, 0) << fault << ": " << work.hits_wrongly.first;
  EXPECT_EQ(work.failed_reads.count, 0) << fault << ": " << work.failed_reads.first;
  EXPECT_EQ(work.wrong_blocks.count, 0) << fault << ": " << work.wrong_blocks.first;
  EXPECT_EQ(work.failed_stores.count, 0)
      << fault << ": stores failed, first " << work.failed_stores.first;
  // What the fault cost, for the log.
  std::cout << "[ chaos    ] " << fault << ": " << work.rounds() << " rounds, slowest call "
            << work.slowest_call() << ", " << work.misses.count << " keys missed that must hit"
            << std::endl;
}

// The client's counters of bounded waits, for the log.
std::string Describe(const connector::BlockStoreCounters& c) {
  std::string out;
  c.ForEach([&](const ClientCounterDef& def, uint64_t value) {
    out += (out.empty() ? "" : ", ") + std::string(def.name) + " " + std::to_string(value);
  });
  return out;
}

// The namespaces of a test: a bridge and three namespaces on it, kvstashd started in them by
// StartNodes, the clients the test makes. Processes end (and stopped ones run again) before
// the namespaces go, the bridge last, also when a test fails.
class ChaosFixture : public ::testing::Test {
 protected:
  static constexpr int kSpaces = 3;

  void SetUp() override {
    if (::geteuid() != 0) GTEST_SKIP() << "needs root (network namespaces)";
    if (std::string e = Ip({"-V"}); !e.empty()) GTEST_SKIP() << "needs ip (iproute2): " << e;
    std::string why;
    bridge_ = Bridge::Create(&why);
    if (bridge_ == nullptr) GTEST_SKIP() << "no bridge here: " << why;
    for (int n = 1; n <= kSpaces; ++n) {
      auto ns = NetNs::Create(n, *bridge_, &why);
      if (ns == nullptr) GTEST_SKIP() << "no network namespace here: " << why;
      spaces_.push_back(std::move(ns));
    }
    // This side's UCX on the bridge only, as the nodes' on their veth (a node reaches no other
    // address of this side).
    ::setenv("UCX_NET_DEVICES", bridge_->dev().c_str(), 1);
  }
  void TearDown() override {
    for (auto& daemon : daemons_) daemon->Resume();
  }

  // A kvstashd in each of the first `count` namespaces, `args` added to its command line.
  void StartNodes(size_t count, const std::vector<std::string>& args = {}) {
    ASSERT_LE(count, spaces_.size());
    for (size_t n = 0; n < count; ++n) {
      daemons_.push_back(std::make_unique<NsDaemon>(*spaces_[n], args));
      ASSERT_NE(daemons_.back()->port(), 0) << "kvstashd did not start in " << spaces_[n]->name();
    }
  }

  // A client of every node started, over UCX's TCP, with `replicas`.
  NodeClientOptions Options(size_t replicas) const {
    NodeClientOptions options;
    for (const auto& daemon : daemons_) options.nodes.push_back(daemon->address());
    options.transport.tls = "tcp";
    options.timeout = kDeadline;
    options.connect_timeout = 2000ms;
    options.lookup_budget = kBudget;
    options.probe_interval = 200ms;
    options.replicas = replicas;
    return options;
  }
  // A client, kept until the test ends (nullptr and a failure when it cannot be made).
  NodeClient* Client(NodeClientOptions options) {
    auto client = NodeClient::Create(std::move(options));
    EXPECT_TRUE(client.ok()) << client.status().ToString();
    if (!client.ok()) return nullptr;
    clients_.push_back(std::move(*client));
    return clients_.back().get();
  }

  std::unique_ptr<Bridge> bridge_;  // first: it goes last
  std::vector<std::unique_ptr<NetNs>> spaces_;
  std::unique_ptr<NetNs> etcd_space_;
  std::unique_ptr<NsEtcd> etcd_;
  std::vector<std::unique_ptr<NsDaemon>> daemons_;
  std::vector<std::unique_ptr<NodeClient>> clients_;  // last: they go first
};

// Two nodes, a client of both (100 ms budget) and kKeys blocks stored: the network faults.
class ChaosTest : public ChaosFixture {
 protected:
  void SetUp() override {
    ChaosFixture::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    ASSERT_NO_FATAL_FAILURE(StartNodes(2));
    NodeClientOptions options = Options(1);
    options.lookup_budget = 100ms;
    client_ = Client(options);
    ASSERT_NE(client_, nullptr);
    for (int k = 0; k < kKeys; ++k) {
      keys_.push_back(Key(k));
      blocks_.emplace_back(kBlock);
      FillPattern(k, blocks_.back());
    }
    std::vector<transport::Bytes> views(blocks_.begin(), blocks_.end());
    ASSERT_TRUE(client_->Put(keys_, views).ok());
    ASSERT_TRUE(AllHitWithin(*client_, Ids(0, kKeys), 30s));
  }

  // One lookup: how long it took, the faulty node's keys never HIT wrongly and the healthy
  // node's keys counted.
  struct Round {
    Clock::duration took;
    int healthy_hits = 0, healthy = 0;
  };
  Round LookupRound(size_t faulty) {
    const NodeAddress at = daemons_[faulty]->address();
    Round round;
    const auto start = Clock::now();
    const std::vector<LookupResult> r = client_->Lookup(keys_);
    round.took = Clock::now() - start;
    for (int k = 0; k < kKeys; ++k) {
      if (Same(client_->PlacesOf(keys_[k])[0], at)) continue;
      ++round.healthy;
      round.healthy_hits += r[k] == LookupResult::kHit ? 1 : 0;
    }
    return round;
  }

  NodeClient* client_ = nullptr;
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
    EXPECT_LT(round.took, kBound) << "lookup " << i << " waited for the cut-off node";
    healthy_rounds += round.healthy_hits == round.healthy ? 1 : 0;
  }
  // The healthy node's keys hit in (nearly) every round; a busy machine may miss a budget.
  EXPECT_GE(healthy_rounds, 8);
  EXPECT_GT(client_->counters()[ClientCounter::kSkippedCalls], 0u);
  spaces_[1]->Cut(false);
  EXPECT_TRUE(AllHitWithin(*client_, Ids(0, kKeys), 60s))
      << "the cluster did not converge after the cut was healed";
  ExpectEveryBlockRight(*client_, Ids(0, kKeys));
}

// Added latency on one node: past the lookup budget (200 ms) its keys miss and nothing waits
// for it; within it (50 ms) every key still hits. Removed, every key hits and reads right.
TEST_F(ChaosTest, LatencyOnOneNodeMissesItsKeysOnlyPastTheBudget) {
  if (std::string e = spaces_[1]->Netem("delay 50ms"); !e.empty()) {
    GTEST_SKIP() << "tc netem is not available here: " << e;
  }
  EXPECT_TRUE(AllHitWithin(*client_, Ids(0, kKeys), 30s))
      << "50 ms of latency is within the 100 ms budget";
  ASSERT_EQ(spaces_[1]->Netem("delay 200ms"), "");
  int healthy_rounds = 0;
  for (int i = 0; i < 10; ++i) {
    const Round round = LookupRound(1);
    EXPECT_LT(round.took, kBound) << "lookup " << i << " waited for the slow node";
    healthy_rounds += round.healthy_hits == round.healthy ? 1 : 0;
  }
  EXPECT_GE(healthy_rounds, 8);
  EXPECT_GT(client_->counters()[ClientCounter::kLateKeys], 0u);
  EXPECT_EQ(spaces_[1]->Netem(""), "");
  EXPECT_TRUE(AllHitWithin(*client_, Ids(0, kKeys), 60s))
      << "the cluster did not converge once the latency was gone";
  ExpectEveryBlockRight(*client_, Ids(0, kKeys));
}

// 5 % loss on one node: TCP repairs it; nothing is wrong, every key hits in time.
TEST_F(ChaosTest, LossOnOneNodeLosesNoByteAndEveryKeyHits) {
  if (std::string e = spaces_[1]->Netem("loss 5%"); !e.empty()) {
    GTEST_SKIP() << "tc netem is not available here: " << e;
  }
  EXPECT_TRUE(AllHitWithin(*client_, Ids(0, kKeys), 60s));
  ExpectEveryBlockRight(*client_, Ids(0, kKeys));
  EXPECT_EQ(spaces_[1]->Netem(""), "");
}

// A node stopped (SIGSTOP: a paused VM, a process stuck in the kernel), its connections open
// and silent, for kStop; then it runs again. 20 s, as issue 30 names it: its connections sit
// silent that long and many probes time out before one brings it back.
using ChaosStopTest = ChaosFixture;
constexpr auto kStop = 20s;
// Keys stored before the stop, and at most this many in all (new ones stored while it lasts):
// each node's 8 MiB CPU tier (128 blocks) holds its share of them with two replicas on three
// nodes, so that no miss is an eviction.
constexpr size_t kBefore = 48, kMost = 120;

// Two replicas on three nodes, one stopped: while it is, every round of lookups, reads and stores
// goes on within the bound, every key hits (its other replica holds it, also those stored
// meanwhile), every block reads right and every store takes. Once it runs again, a probe brings
// it back and it is used again: the client's lookups reach it, and it holds every key placed on
// it, the ones stored while it was stopped too (copied there by reads, as a lookup found it
// missing them).
TEST_F(ChaosStopTest, WithTwoReplicasAStoppedNodeCostsNoHitNoWrongByteAndNoWait) {
  ASSERT_NO_FATAL_FAILURE(StartNodes(3));
  NodeClient* client = Client(Options(2));
  ASSERT_NE(client, nullptr);
  ASSERT_TRUE(Store(*client, Ids(0, kBefore)).ok());
  ASSERT_TRUE(AllHitWithin(*client, Ids(0, kBefore), 30s));
  NsDaemon& stopped = *daemons_[1];
  const NodeAddress at = stopped.address();

  ASSERT_TRUE(stopped.Stop());
  Workload work(*client, Ids(0, kBefore), 1000, kMost);
  work.faulty_key = [&](uint64_t id) {
    const std::vector<NodeAddress> places = client->PlacesOf(Key(id));
    return std::any_of(places.begin(), places.end(),
                       [&](const NodeAddress& a) { return Same(a, at); });
  };
  work.RoundsUntil(Clock::now() + kStop, 4);
  stopped.Resume();
  ExpectNoOffence(work, "node " + at.ToString() + " stopped, two replicas");
  const connector::BlockStoreCounters during = client->counters();
  std::cout << "[ chaos    ] " << Describe(during) << std::endl;
  EXPECT_GT(during[ClientCounter::kSkippedCalls], 0u)
      << "the stopped node was never skipped as suspect";
  EXPECT_EQ(during[ClientCounter::kUnservedKeys], 0u) << "keys none of whose replicas answered";
  EXPECT_GT(during[ClientCounter::kProbes], 0u);

  // Back: the client's own lookups reach it again (its lookup hits grow by them alone: the
  // stats call is answered after whatever came before it), and a client of it alone finds every
  // key placed on it. Each round reads every key, which copies those stored meanwhile to it.
  std::vector<uint64_t> on_it;
  for (uint64_t id : work.known()) {
    for (const NodeAddress& place : client->PlacesOf(Key(id))) {
      if (Same(place, at)) on_it.push_back(id);
    }
  }
  ASSERT_FALSE(on_it.empty());
  NodeClientOptions alone = Options(1);
  alone.nodes = {at};
  NodeClient* solo = Client(alone);
  ASSERT_NE(solo, nullptr);
  const std::vector<BlockKey> all = KeysOf(work.known()), mine = KeysOf(on_it);
  std::vector<std::vector<std::byte>> blocks(all.size(), std::vector<std::byte>(kBlock));
  const std::vector<transport::MutableBytes> outs(blocks.begin(), blocks.end());
  bool used = false, holds = false;
  size_t held = 0;
  for (const auto until = Clock::now() + 60s; !(used && holds) && Clock::now() < until;) {
    auto before = client->Stats(at);
    (void)client->Lookup(all);
    auto after = client->Stats(at);
    used = used || (before.ok() && after.ok() &&
                    (*after)["node.lookup_hits"] > (*before)["node.lookup_hits"]);
    (void)client->Get(all, outs);
    const std::vector<LookupResult> r = solo->Lookup(mine);
    held = static_cast<size_t>(std::count(r.begin(), r.end(), LookupResult::kHit));
    holds = held == mine.size();
    if (!(used && holds)) std::this_thread::sleep_for(50ms);
  }
  EXPECT_TRUE(used) << "the client never sent the node a lookup again after it ran again";
  EXPECT_TRUE(holds) << "the node holds " << held << " of its " << mine.size() << " keys";
  EXPECT_TRUE(AllHitWithin(*client, work.known(), 30s));
  ExpectEveryBlockRight(*client, work.known());
  ExpectEveryBlockRight(*solo, on_it);
}

// One replica on two nodes, one stopped: while it is, only its keys miss (the other node's hit in
// every round, also those stored meanwhile), every call is within the bound, every hit reads
// right, and a store fails only for the stopped node's keys (naming it). Once it runs again every
// key it held hits again, and the keys whose stores failed store now.
//
// FAILS at a37ab70 (issue 30, point 4; the test states the rule, the client is to be fixed): the
// first store after the stop, sent while the node is not yet suspect (one lookup missed its
// budget, suspect_after is 2), waits the whole 10 s deadline: "round 1: store of 4 blocks took
// 10001 ms". With one replica a store has no bound but the deadline (WaitForReplicas waits for
// one replica to hold each block, and the only one is the stopped node); every later call is
// bounded, as the node is suspect by then.
TEST_F(ChaosStopTest, WithOneReplicaOnlyAStoppedNodesKeysMissAndNoCallWaits) {
  ASSERT_NO_FATAL_FAILURE(StartNodes(2));
  NodeClient* client = Client(Options(1));
  ASSERT_NE(client, nullptr);
  ASSERT_TRUE(Store(*client, Ids(0, kBefore)).ok());
  ASSERT_TRUE(AllHitWithin(*client, Ids(0, kBefore), 30s));
  NsDaemon& stopped = *daemons_[1];
  const NodeAddress at = stopped.address();
  const auto on_stopped = [&](uint64_t id) { return Same(client->PlacesOf(Key(id))[0], at); };

  ASSERT_TRUE(stopped.Stop());
  Workload work(*client, Ids(0, kBefore), 1000, kMost);
  work.must_hit = [&](uint64_t id) { return !on_stopped(id); };
  work.must_miss = on_stopped;
  work.faulty_key = on_stopped;
  work.store_may_fail = [&](const Status& s) {
    const bool unreachable = s.code() == StatusCode::kUnavailable ||
                             s.code() == StatusCode::kDeadlineExceeded ||
                             s.code() == StatusCode::kCancelled;
    return unreachable && std::string(s.message()).find(at.ToString()) != std::string::npos;
  };
  work.RoundsUntil(Clock::now() + kStop, 4);
  stopped.Resume();
  ExpectNoOffence(work, "node " + at.ToString() + " stopped, one replica");
  std::cout << "[ chaos    ] " << Describe(client->counters()) << std::endl;
  EXPECT_GT(client->counters()[ClientCounter::kSkippedCalls], 0u)
      << "the stopped node was never skipped";
  EXPECT_GT(client->counters()[ClientCounter::kProbes], 0u);

  EXPECT_TRUE(AllHitWithin(*client, Ids(0, kBefore), 30s))
      << "the stopped node's keys did not hit again once it ran";
  ExpectEveryBlockRight(*client, Ids(0, kBefore));
  ASSERT_TRUE(Store(*client, work.known()).ok());
  EXPECT_TRUE(AllHitWithin(*client, work.known(), 30s));
  ExpectEveryBlockRight(*client, work.known());
}

// etcd in a namespace of its own (NsEtcd), on the bridge for the nodes and on a link of its own
// for the test's client, which follows the cluster in it.
class ChaosEtcdTest : public ChaosFixture {
 protected:
  static constexpr const char* kCluster = "chaos";
  static constexpr int kTtlS = 2;

  void SetUp() override {
    ChaosFixture::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    if (!std::filesystem::exists(NsEtcd::kEtcd)) {
      GTEST_SKIP() << "etcd-server is not installed (scripts/lib/setup.sh installs it)";
    }
    std::string why;
    etcd_space_ = NetNs::Create(99, *bridge_, &why);  // 10.201.0.100
    if (etcd_space_ == nullptr) GTEST_SKIP() << "no network namespace here: " << why;
    ASSERT_EQ(etcd_space_->AddDirectLink(), "");
    etcd_ = std::make_unique<NsEtcd>(*etcd_space_);
    ASSERT_TRUE(etcd_->AnswersWithin(30s)) << "etcd did not start: " << etcd_->log();
  }

  // Whether etcd lists `count` members and `client` sees as many, within `limit`.
  bool MembersWithin(NodeClient& client, int count, Clock::duration limit) {
    const auto until = Clock::now() + limit;
    while (Clock::now() < until) {
      if (etcd_->Members(kCluster) == count &&
          client.nodes().size() == static_cast<size_t>(count)) {
        return true;
      }
      std::this_thread::sleep_for(50ms);
    }
    return false;
  }
};

// etcd parted from every node (its bridge port down; the test's client still reaches it): the
// nodes cannot renew their leases, etcd lets them go and drops the nodes from the cluster. The
// nodes themselves are up and the client reaches them: what a user expects is that nothing an
// engine sees changes, as when etcd itself is away (EtcdClientsTest.
// ClientsKeepTheirLastSetWhileEtcdIsAway): every key hits, every block reads right, stores take,
// no call waits. Healed, the nodes register again, etcd and the client list all three, and every
// key hits.
//
// FAILS at a37ab70 (issue 30, point 4; the test states what a user expects, the client is to be
// fixed): once etcd deletes the nodes' keys (their leases lapsed), the client applies etcd's
// empty set and drops every member ("cluster chaos has no live offload nodes"), although every
// node is up and answers it: every lookup misses ("key 0 (first place none) missed") and every
// store fails ("UNAVAILABLE: no live offload node in cluster chaos for 4 block(s)") until the
// nodes register again.
TEST_F(ChaosEtcdTest, NodesPartedFromEtcdKeepServingAndRegisterAgainWhenHealed) {
  ASSERT_NO_FATAL_FAILURE(StartNodes(3, {"--etcd", etcd_->for_nodes(), "--cluster", kCluster,
                                         "--etcd-ttl-s", std::to_string(kTtlS)}));
  NodeClientOptions options = Options(1);
  options.nodes.clear();
  options.etcd = etcd_->for_us();
  options.cluster = kCluster;
  NodeClient* client = Client(options);
  ASSERT_NE(client, nullptr);
  ASSERT_TRUE(MembersWithin(*client, 3, 30s)) << "etcd lists " << etcd_->Members(kCluster)
                                              << ", the client sees " << client->nodes().size();
  ASSERT_TRUE(Store(*client, Ids(0, kBefore)).ok());
  ASSERT_TRUE(AllHitWithin(*client, Ids(0, kBefore), 30s));

  etcd_space_->Cut(true);
  // The fault lasts until etcd has dropped every node (their leases lapsed), then a few TTLs
  // more, every round checked all along.
  Workload work(*client, Ids(0, kBefore), 1000, kMost);
  std::optional<Clock::time_point> dropped;
  size_t fewest = client->nodes().size();
  for (const auto until = Clock::now() + 30s; Clock::now() < until;) {
    work.Round(4);
    fewest = std::min(fewest, client->nodes().size());
    if (!dropped && etcd_->Members(kCluster) == 0) dropped = Clock::now();
    if (dropped && Clock::now() > *dropped + std::chrono::seconds(2 * kTtlS)) break;
    std::this_thread::sleep_for(20ms);
  }
  etcd_space_->Cut(false);
  EXPECT_TRUE(dropped.has_value()) << "etcd still listed the nodes 30 s after they were parted "
                                      "from it: the fault was not what this test means";
  ExpectNoOffence(work, "etcd parted from the nodes (the client saw as few as " +
                            std::to_string(fewest) + " of 3 nodes)");
  std::cout << "[ chaos    ] " << Describe(client->counters()) << std::endl;

  EXPECT_TRUE(MembersWithin(*client, 3, 30s)) << "healed, etcd lists " << etcd_->Members(kCluster)
                                              << ", the client sees " << client->nodes().size();
  EXPECT_TRUE(AllHitWithin(*client, Ids(0, kBefore), 30s));
  ExpectEveryBlockRight(*client, Ids(0, kBefore));
  // Stored again: a store that failed meanwhile, or went to the nodes of a smaller set, is
  // counted above; every key then hits where the whole set places it.
  EXPECT_TRUE(Store(*client, work.known()).ok());
  EXPECT_TRUE(AllHitWithin(*client, work.known(), 30s));
  ExpectEveryBlockRight(*client, work.known());
}

}  // namespace
}  // namespace kvstash
