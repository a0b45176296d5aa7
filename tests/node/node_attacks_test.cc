// A real `kvstashd` under the attacks and accidents that once took one down or let a tenant
// into another's namespace: garbage for a UCX worker address at hello, a client whose UCX
// settings differ, a frame naming another client's connection, a namespace name chosen so its
// old id (a hash of the name) was a victim's, and a flood of connections at the node's file
// descriptor limit. Each test says what the node did before the fix. Programs come from
// tests/util/programs.h (KVSTASH_TEST_KVSTASHD and KVSTASH_TEST_CLI run them against other
// binaries).

#include <arpa/inet.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <future>
#include <random>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "daemon_process.h"
#include "kvstash/common/hash.h"
#include "kvstash/proto/wire.pb.h"
#include "kvstash/transport/frame.h"
#include "loopback_socket.h"
#include "node_test_client.h"
#include "programs.h"
#include "subprocess.h"
#include "temp_dir.h"

namespace kvstash {
namespace {

using namespace std::chrono_literals;
using ::kvstash::testing::ConnectLoopback;
using ::kvstash::testing::Daemon;
using ::kvstash::testing::NodeTestClient;
using ::kvstash::testing::TempDir;
using ::kvstash::testing::WireKey;
using ::testing::HasSubstr;

constexpr size_t kBlock = 64 << 10;

// Sends `body` as one bootstrap message (a 4-byte length, then the bytes) and reads the reply
// message; "" when the node closed the connection without one.
std::string RawHello(uint16_t port, const std::string& body) {
  const int fd = ConnectLoopback(port);
  if (fd < 0) return "";
  timeval timeout{5, 0};  // a node that never answers fails the read, not the test run
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  std::string message(4, '\0');
  const uint32_t length = static_cast<uint32_t>(body.size());
  std::memcpy(message.data(), &length, 4);
  message += body;
  (void)!::write(fd, message.data(), message.size());
  uint32_t reply_length = 0;
  std::string reply;
  if (::recv(fd, &reply_length, 4, MSG_WAITALL) == 4 && reply_length < (1 << 20)) {
    reply.resize(reply_length);
    if (::recv(fd, reply.data(), reply_length, MSG_WAITALL) != static_cast<ssize_t>(reply_length)) {
      reply.clear();
    }
  }
  ::close(fd);
  return reply;
}

bool Alive(Daemon& daemon) { return !daemon.process().Exited(); }

// A node's counter by its name in the Stats reply ("transport.foreign_frames"); 0 if absent.
uint64_t NodeCounter(NodeTestClient& client, const std::string& name) {
  wire::StatsRequest request;
  wire::StatsReply reply;
  if (!client.Call(wire::METHOD_STATS, request, &reply).ok()) return 0;
  auto it = reply.counters().find(name);
  return it == reply.counters().end() ? 0 : it->second;
}

// Before: the bytes went to ucp_ep_create unchecked and UCX aborted the node ("addr version
// 15", exit 134), with or without a token.
TEST(NodeAttacksTest, GarbageForAWorkerAddressIsRefusedAndTheNodeServesOn) {
  Daemon daemon({"--auth-token", "t0ken"});
  ASSERT_NE(daemon.port(), 0);
  std::mt19937 random(29);
  std::vector<std::string> addresses = {std::string(64, '\xff'), std::string(1, '\x0f'), ""};
  for (int i = 0; i < 20; ++i) {
    std::string noise(300, '\0');
    for (char& c : noise) c = static_cast<char>(random());
    addresses.push_back(noise);
  }
  for (const std::string& address : addresses) {
    // Every protocol version a node has had, so a node of any version reads the address.
    for (const int version : {2, static_cast<int>(wire::PROTOCOL_VERSION_CURRENT)}) {
      wire::Hello hello;
      hello.set_protocol_version(version);
      hello.set_namespace_("default");
      hello.set_auth_token("t0ken");
      hello.set_worker_address(address);
      const std::string reply_bytes = RawHello(daemon.port(), hello.SerializeAsString());
      ASSERT_TRUE(Alive(daemon)) << "the node died of a hello with a " << address.size()
                                 << "-byte worker address (version " << version << ")";
      wire::HelloReply reply;
      ASSERT_TRUE(reply.ParseFromString(reply_bytes)) << "no reply to a bad hello";
      EXPECT_NE(reply.error().code(), wire::OK);
      EXPECT_EQ(reply.connection_id(), 0u);
    }
  }
  // Raw bytes that are no hello at all.
  for (int i = 0; i < 5; ++i) {
    std::string noise(300, '\0');
    for (char& c : noise) c = static_cast<char>(random());
    (void)RawHello(daemon.port(), noise);
    ASSERT_TRUE(Alive(daemon));
  }
  NodeTestClient client(daemon.port(), "default", "t0ken", "", kBlock);
  ASSERT_TRUE(client.ok());
  client.Store({1});
  EXPECT_TRUE(client.ReadBack(1));
  EXPECT_GE(NodeCounter(client, "transport.bad_hellos"), addresses.size());
  EXPECT_EQ(daemon.process().Kill(SIGTERM), 0);
}

// Before: the clients set UCX_POSIX_ERROR_HANDLING only when the environment had not, the node
// chose lanes the client's endpoint then contradicted, and UCX aborted the node ("endpoint
// reconfiguration not supported yet", exit 134), 4 of 4 times; a client on TCP alone was cut off
// with only "lost (End of file)".
TEST(NodeAttacksTest, AClientsUcxEnvironmentCannotAbortTheNode) {
  Daemon daemon({});
  ASSERT_NE(daemon.port(), 0);
  TempDir dir;
  const std::string in = dir / "block.in";
  std::ofstream(in, std::ios::binary) << std::string(kBlock, 'k');
  const std::string node = "127.0.0.1:" + std::to_string(daemon.port());
  for (const std::string setting :
       {"UCX_POSIX_ERROR_HANDLING=n", "UCX_SYSV_ERROR_HANDLING=n", "UCX_POSIX_ERROR_HANDLING=y"}) {
    SCOPED_TRACE(setting);
    RunOptions run;
    run.env = EnvironmentWith(setting.substr(0, setting.find('=')),
                              setting.substr(setting.find('=') + 1));
    run.timeout = 30s;
    auto put =
        RunProgram({testing::CliPath(), "put", "--node", node, "--key", "7", "--file", in}, run);
    ASSERT_TRUE(put.ok()) << put.status().ToString();
    ASSERT_TRUE(Alive(daemon)) << "the node died of a client with " << setting;
    EXPECT_EQ(put->exit_code, 0) << put->err;
  }
  // A client on TCP alone (its endpoints without peer-failure mode, by default) of a node that
  // also has shared memory: it was cut off at once ("lost (End of file)", UCX's "error handling
  // level mismatch"); it now opens its endpoint as the node says, and reads the block.
  const std::string out = dir / "block.out";
  auto get = RunProgram(
      {testing::CliPath(), "get", "--tls", "tcp", "--node", node, "--key", "7", "--out", out},
      RunOptions{.timeout = 30s});
  ASSERT_TRUE(get.ok()) << get.status().ToString();
  EXPECT_EQ(get->exit_code, 0) << get->err;
  std::ifstream read_back(out, std::ios::binary);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(read_back), {}), std::string(kBlock, 'k'));
  ASSERT_TRUE(Alive(daemon));
  EXPECT_EQ(daemon.process().Kill(SIGTERM), 0);
}

// A client under another user id than the node's, on the node's host (docs/semantics.md §13):
// the node's shared memory is not its to map, so it reaches the node over TCP, and its blocks
// move by UCX rendezvous, never through the node's memory. Without --tls tcp it is told why it
// cannot connect. Needs root (to run the client as `nobody`).
TEST(NodeAttacksTest, AClientOfAnotherUserOnTheNodesHostWorksOverTcpOnly) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root, to run a client as another user";
  const std::vector<std::string> as_nobody = {"setpriv", "--reuid=nobody", "--regid=nogroup",
                                              "--clear-groups"};
  auto run = [&](std::vector<std::string> args) {
    std::vector<std::string> argv = as_nobody;
    argv.push_back(testing::CliPath());
    argv.insert(argv.end(), args.begin(), args.end());
    return RunProgram(argv, RunOptions{.timeout = 30s});
  };
  auto help = run({"--help"});
  if (!help.ok() || help->exit_code != 0) {
    GTEST_SKIP() << "user nobody cannot run " << testing::CliPath()
                 << " (a build directory other users cannot enter)";
  }
  Daemon daemon({});
  ASSERT_NE(daemon.port(), 0);
  TempDir dir;
  ASSERT_EQ(::chmod(dir.path().c_str(), 0777), 0);
  const std::string in = dir / "block.in";
  std::ofstream(in, std::ios::binary) << std::string(kBlock, 'u');
  ASSERT_EQ(::chmod(in.c_str(), 0644), 0);
  const std::string node = "127.0.0.1:" + std::to_string(daemon.port());
  auto refused = run({"put", "--node", node, "--key", "5", "--file", in});
  ASSERT_TRUE(refused.ok());
  EXPECT_NE(refused->exit_code, 0);
  EXPECT_THAT(refused->err, HasSubstr("--tls tcp"));
  auto put = run({"put", "--tls", "tcp", "--node", node, "--key", "5", "--file", in});
  ASSERT_TRUE(put.ok());
  EXPECT_EQ(put->exit_code, 0) << put->err;
  const std::string out = dir / "block.out";
  auto get = run({"get", "--tls", "tcp", "--node", node, "--key", "5", "--out", out});
  ASSERT_TRUE(get.ok());
  EXPECT_EQ(get->exit_code, 0) << get->err;
  std::ifstream read_back(out, std::ios::binary);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(read_back), {}), std::string(kBlock, 'u'));
  NodeTestClient own(daemon.port(), "default", "", "", kBlock);
  EXPECT_EQ(NodeCounter(own, "transport.mapped_payloads"), 0u);
  ASSERT_TRUE(Alive(daemon));
  EXPECT_EQ(daemon.process().Kill(SIGTERM), 0);
}

// Builds a PutBlock request frame for key k naming `connection` (header in the AM header, the
// block as AM data), as a client that forges the connection id would.
std::vector<std::byte> ForgedPutHeader(uint64_t connection, uint64_t k) {
  wire::PutBlockRequest put;
  *put.mutable_key() = WireKey(k);
  put.set_length(kBlock);
  const std::string message = put.SerializeAsString();
  transport::FrameHeader header;
  header.kind = transport::FrameKind::kRequest;
  header.method = static_cast<uint16_t>(wire::METHOD_PUT_BLOCK);
  header.request_id = 1000 + k;
  header.connection_id = connection;
  header.message_bytes = static_cast<uint32_t>(message.size());
  header.timeout_us = 5'000'000;
  std::vector<std::byte> out(transport::kFrameHeaderBytes + message.size());
  transport::WriteFrame(header, std::as_bytes(std::span(message)), out);
  return out;
}

// Before: the node took a frame's connection, and so its namespace, from the id in its header:
// a client holding only the general token stored into tenant-a's namespace by naming a
// tenant-a client's connection id, and could touch, pin and release in its session.
TEST(NodeAttacksTest, AFrameNamingAnotherClientsConnectionIsRefused) {
  TempDir dir;
  std::ofstream(dir / "tokens") << "tenant-a secret-a\n";
  Daemon daemon({"--auth-token", "general", "--namespace-token-file", dir / "tokens"});
  ASSERT_NE(daemon.port(), 0);
  NodeTestClient victim(daemon.port(), "tenant-a", "secret-a", "", kBlock);
  NodeTestClient intruder(daemon.port(), "intruder", "general", "", kBlock);
  ASSERT_TRUE(victim.ok() && intruder.ok());
  victim.Store({1});
  intruder.Store({2});  // both connected
  const uint64_t target = victim.rpc().connection_id();
  ASSERT_NE(target, 0u);
  std::vector<std::byte> block(kBlock);
  ::kvstash::testing::FillPattern(3, block);
  for (uint64_t k = 3; k < 8; ++k) {
    const std::vector<std::byte> header = ForgedPutHeader(target, k);
    std::promise<Status> sent;
    ASSERT_TRUE(intruder.rpc()
                    .SendRawForTesting(header, block, [&sent](Status s) { sent.set_value(s); })
                    .ok());
    (void)sent.get_future().wait_for(10s);
  }
  // A forged touch, pin and release of tenant-a's block 1 change nothing either; a lookup
  // after a round trip on the intruder's own connection sees what the forged frames did.
  EXPECT_THAT(intruder.PerKey({2}), ::testing::ElementsAre(wire::LOOKUP_HIT));
  ASSERT_TRUE(Alive(daemon));
  EXPECT_THAT(victim.PerKey({1, 3, 4, 5, 6, 7}),
              ::testing::ElementsAre(wire::LOOKUP_HIT, wire::LOOKUP_MISS, wire::LOOKUP_MISS,
                                     wire::LOOKUP_MISS, wire::LOOKUP_MISS, wire::LOOKUP_MISS))
      << "the intruder stored into tenant-a";
  EXPECT_GE(NodeCounter(victim, "transport.foreign_frames"), 5u);
  EXPECT_TRUE(victim.ReadBack(1));
  EXPECT_EQ(daemon.process().Kill(SIGTERM), 0);
}

// Two namespace names whose ids were equal when an id was the low 32 bits of xxh3-64 of the
// name: a birthday search over "tenant-N" names, milliseconds.
std::pair<std::string, std::string> NamesWithTheSameOldId() {
  std::unordered_map<uint32_t, std::string> seen;
  for (uint64_t i = 0;; ++i) {
    std::string name = "tenant-" + std::to_string(i);
    const auto id = static_cast<uint32_t>(Xxh3Hash64(std::as_bytes(std::span(name))));
    auto [it, added] = seen.try_emplace(id, name);
    if (!added) return {it->second, name};
  }
}

// Before: a namespace's id was a 32-bit hash of its name; a client with the general token named
// a namespace whose id was tenant-a's and read and wrote tenant-a's blocks. The per-namespace
// token guarded the exact name only.
TEST(NodeAttacksTest, ANameWhoseHashIsAVictimsIsAnotherNamespace) {
  const auto [victim_ns, intruder_ns] = NamesWithTheSameOldId();
  TempDir dir;
  std::ofstream(dir / "tokens") << victim_ns << " secret\n";
  Daemon daemon({"--auth-token", "general", "--namespace-token-file", dir / "tokens"});
  ASSERT_NE(daemon.port(), 0);
  NodeTestClient victim(daemon.port(), victim_ns, "secret", "", kBlock);
  NodeTestClient intruder(daemon.port(), intruder_ns, "general", "", kBlock);
  ASSERT_TRUE(victim.ok() && intruder.ok());
  victim.Store({1, 2, 3});
  EXPECT_THAT(intruder.PerKey({1, 2, 3}),
              ::testing::ElementsAre(wire::LOOKUP_MISS, wire::LOOKUP_MISS, wire::LOOKUP_MISS))
      << victim_ns << " and " << intruder_ns << " share blocks";
  EXPECT_FALSE(intruder.ReadBack(2));
  intruder.Store({4});
  EXPECT_THAT(victim.PerKey({1, 4}), ::testing::ElementsAre(wire::LOOKUP_HIT, wire::LOOKUP_MISS));
  // The victim's name without its token is refused, as before.
  NodeTestClient guess(daemon.port(), victim_ns, "general", "", kBlock);
  wire::LookupRequest request;
  *request.add_keys() = WireKey(1);
  wire::LookupReply reply;
  EXPECT_EQ(guess.Call(wire::METHOD_LOOKUP, request, &reply).code(), StatusCode::kUnauthenticated);
  EXPECT_EQ(daemon.process().Kill(SIGTERM), 0);
}

// A node's ids are its own, kept with its SSD blocks: after a restart a namespace finds its
// blocks and no other does, whatever order clients come back in.
TEST(NodeAttacksTest, NamespacesKeepTheirBlocksAcrossARestartAndNoOtherGetsThem) {
  TempDir dir;
  const std::vector<std::string> args = {"--ssd-dir", dir / "ssd", "--ssd-bytes",
                                         "8MiB",      "--cascade", "write-through"};
  {
    Daemon daemon(args);
    ASSERT_NE(daemon.port(), 0);
    NodeTestClient a(daemon.port(), "alpha", "", "", kBlock);
    NodeTestClient b(daemon.port(), "beta", "", "", kBlock);
    a.Store({1, 2});
    b.Store({3});
    EXPECT_EQ(daemon.process().Kill(SIGTERM), 0);
  }
  Daemon daemon(args);
  ASSERT_NE(daemon.port(), 0);
  // A new name first: under ids given in order of arrival it would take alpha's id.
  NodeTestClient gamma(daemon.port(), "gamma", "", "", kBlock);
  NodeTestClient beta(daemon.port(), "beta", "", "", kBlock);
  NodeTestClient alpha(daemon.port(), "alpha", "", "", kBlock);
  auto found = [](NodeTestClient& c, std::vector<uint64_t> keys) {
    // An SSD block answers RETRY while it is promoted: ask until the answers settle.
    std::vector<wire::LookupResult> r;
    for (int i = 0; i < 200; ++i) {
      r = c.PerKey(keys);
      if (std::find(r.begin(), r.end(), wire::LOOKUP_RETRY) == r.end()) break;
      std::this_thread::sleep_for(10ms);
    }
    return r;
  };
  EXPECT_THAT(found(gamma, {1, 2, 3}),
              ::testing::ElementsAre(wire::LOOKUP_MISS, wire::LOOKUP_MISS, wire::LOOKUP_MISS));
  EXPECT_THAT(found(beta, {1, 2, 3}),
              ::testing::ElementsAre(wire::LOOKUP_MISS, wire::LOOKUP_MISS, wire::LOOKUP_HIT));
  EXPECT_THAT(found(alpha, {1, 2, 3}),
              ::testing::ElementsAre(wire::LOOKUP_HIT, wire::LOOKUP_HIT, wire::LOOKUP_MISS));
  EXPECT_TRUE(alpha.ReadBack(2));
  EXPECT_EQ(daemon.process().Kill(SIGTERM), 0);
}

// Before: at the file-descriptor limit the accept loop retried at once, forever: 2.3 million
// "accept: Too many open files" lines (243 MB of log) in 12 s, a core spinning, and clients
// that could not connect once descriptors were free again... The node now pauses, says so once,
// serves the connections it has, and accepts again when it can.
TEST(NodeAttacksTest, AtItsDescriptorLimitTheNodeServesOnAndLogsOnce) {
  ChildOptions options;
  options.output = ChildOptions::Output::kMemory;
  options.merge_stderr = true;
  auto child = ChildProcess::Create(
      {"prlimit", "--nofile=96", testing::KvstashdPath(), "--port", "0", "--metrics-address", "off",
       "--log-level", "info", "--block-bytes", "64KiB", "--cpu-bytes", "4MiB"},
      options);
  ASSERT_TRUE(child.ok()) << child.status().ToString();
  uint16_t port = 0;
  const std::string prefix = "kvstashd listening on 127.0.0.1:";
  for (auto deadline = std::chrono::steady_clock::now() + 20s;
       port == 0 && std::chrono::steady_clock::now() < deadline;) {
    const std::string out = (*child)->Output();
    if (const size_t at = out.find(prefix); at != std::string::npos) {
      port = static_cast<uint16_t>(std::stoi(out.substr(at + prefix.size())));
    } else {
      std::this_thread::sleep_for(20ms);
    }
  }
  ASSERT_NE(port, 0) << (*child)->Output();
  NodeTestClient before(port, "default", "", "", kBlock);
  before.Store({1});
  std::vector<int> flood;
  for (int i = 0; i < 200; ++i) {
    const int fd = ConnectLoopback(port);  // accepted into the backlog even when the node cannot
    if (fd >= 0) flood.push_back(fd);
  }
  // Until the node has said it is out of descriptors (it says so once), bounded.
  auto said = [&] { return (*child)->Output().find("Too many open files") != std::string::npos; };
  for (auto deadline = std::chrono::steady_clock::now() + 10s;
       !said() && std::chrono::steady_clock::now() < deadline;) {
    std::this_thread::sleep_for(20ms);
  }
  ASSERT_TRUE(said()) << "the flood did not reach the node's limit";
  // The connection it had is served meanwhile.
  EXPECT_TRUE(before.ReadBack(1));
  std::this_thread::sleep_for(2s);  // the time in which the old loop logged ~400,000 lines
  const std::string log = (*child)->Output();
  size_t lines = 0;
  for (size_t at = 0; (at = log.find("Too many open files", at)) != std::string::npos; ++at) {
    ++lines;
  }
  EXPECT_LE(lines, 2u) << "the accept loop spins and floods the log";
  for (const int fd : flood) ::close(fd);
  // Once descriptors are free, a new client connects (within the pause, a second at most).
  NodeTestClient after(port, "default", "", "", kBlock);
  EXPECT_THAT(after.PerKey({1}), ::testing::ElementsAre(wire::LOOKUP_HIT));
  EXPECT_EQ((*child)->Kill(SIGTERM), 0);
}

}  // namespace
}  // namespace kvstash
