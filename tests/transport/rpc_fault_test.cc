// Failure behaviour across processes (a peer killed mid-transfer or stalled) and bad input
// (random and mutated frames, garbage on the bootstrap socket), over UCX_TLS=shm and tcp.

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <fstream>
#include <future>
#include <mutex>
#include <random>
#include <thread>

#include "block_pattern.h"
#include "kvstash/proto/wire.pb.h"
#include "kvstash/transport/frame.h"
#include "kvstash/transport/rpc.h"
#include "loopback_socket.h"
#include "subprocess.h"
#include "transport_param.h"

namespace kvstash::transport {
namespace {

using namespace std::chrono_literals;
using ::kvstash::testing::ChildProcess;
using ::kvstash::testing::TransportFor;

constexpr uint16_t kEcho = 1;
constexpr uint16_t kPut = 2;
constexpr uint16_t kGet = 3;
constexpr uint16_t kHold = 4;
constexpr uint16_t kCount = 9;  // RpcFuzzTest: counts the calls it serves

Bytes AsBytes(const std::string& s) { return std::as_bytes(std::span(s)); }

CallOptions Within(std::chrono::milliseconds timeout) {
  CallOptions options;
  options.deadline = Clock::now() + timeout;
  return options;
}

// The child's next output line that starts with `prefix` (UCX may log to stdout too), or "".
std::string ReadLineStartingWith(ChildProcess& child, const std::string& prefix) {
  for (int i = 0; i < 20; ++i) {
    auto line = child.ReadLine(10000);
    if (!line) return "";
    if (line->rfind(prefix, 0) == 0) return *line;
  }
  return "";
}

// Waits until process `pid` is stopped (a SIGSTOP takes effect asynchronously).
bool WaitStopped(int pid) {
  for (int i = 0; i < 2000; ++i) {
    std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
    std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
    const size_t paren = text.rfind(')');
    if (paren != std::string::npos && paren + 2 < text.size() && text[paren + 2] == 'T') {
      return true;
    }
    std::this_thread::sleep_for(1ms);
  }
  return false;
}

// A server in a child process; port() once it listens.
class PeerServer {
 public:
  PeerServer(const std::string& tls, uint16_t port = 0)
      : child_(::kvstash::testing::StartChild(
            {KVSTASH_PEER_HELPER, "server", tls, std::to_string(port)})) {
    if (child_ == nullptr) return;
    const std::string line = ReadLineStartingWith(*child_, "port ");
    if (!line.empty()) port_ = static_cast<uint16_t>(std::stoi(line.substr(5)));
  }
  uint16_t port() const { return port_; }
  ChildProcess& process() { return *child_; }

 private:
  std::unique_ptr<ChildProcess> child_;
  uint16_t port_ = 0;
};

class RpcFaultTest : public ::testing::TestWithParam<std::string> {
 protected:
  std::unique_ptr<RpcClient> MakeClient(uint16_t port) {
    ClientOptions options;
    options.port = port;
    options.transport = TransportFor(GetParam());
    options.connect_timeout = 3000ms;
    auto client = RpcClient::Create(options);
    EXPECT_TRUE(client.ok()) << client.status().ToString();
    return client.ok() ? std::move(*client) : nullptr;
  }
};

// Keeps `depth` bulk calls of `size` bytes in flight until told to stop; counts outcomes and
// checks every callback runs exactly once.
struct BulkLoad {
  RpcClient* client = nullptr;
  MemoryRegion* region = nullptr;
  size_t size = 0;
  uint16_t method = kPut;
  std::atomic<bool> stop{false};
  std::atomic<int> issued{0}, ok{0}, unavailable{0}, other{0};
  std::atomic<int> outstanding{0};
  std::mutex mu;
  std::vector<int> completions;  // per call id: how many times its callback ran
  std::string other_status;

  void Issue() {
    if (stop.load()) return;
    int index;
    {
      std::lock_guard lock(mu);
      index = static_cast<int>(completions.size());
      completions.push_back(0);
    }
    issued.fetch_add(1);
    outstanding.fetch_add(1);
    CallOptions options = Within(20s);
    if (method == kPut) {
      options.send_payload = region->bytes().first(size);
      options.send_region = region;
    } else {
      options.recv_payload = region->bytes().first(size);
      options.recv_region = region;
    }
    client->Call(method, {}, options, [this, index](const Response& r) {
      {
        std::lock_guard lock(mu);
        completions[index]++;
        if (!r.status.ok() && r.status.code() != StatusCode::kUnavailable) {
          other_status = r.status.ToString();
        }
      }
      if (r.status.ok()) {
        ok.fetch_add(1);
        Issue();
      } else if (r.status.code() == StatusCode::kUnavailable) {
        unavailable.fetch_add(1);
      } else {
        other.fetch_add(1);
      }
      outstanding.fetch_sub(1);
    });
  }
};

TEST_P(RpcFaultTest, ServerKilledMidTransferFailsEveryCallOnceThenReconnects) {
  if (GetParam() == "shm_rndv") {
    // UCX 1.13 rendezvous over shared memory with peer-failure endpoints: after a peer is
    // killed mid-transfer the survivor sometimes cannot reach a new peer (measured: the
    // reconnect after a server kill; the third killed client). Mapped payloads, the shared-
    // memory default, do not use it; see the issue 4 notes.
    GTEST_SKIP() << "killed-peer recovery of rendezvous over shm is not reliable in UCX 1.13";
  }
  for (uint16_t method : {kPut, kGet}) {
    SCOPED_TRACE(method == kPut ? "put" : "get");
    auto server = std::make_unique<PeerServer>(GetParam());
    ASSERT_NE(server->port(), 0);
    const uint16_t port = server->port();
    auto client = MakeClient(port);
    ASSERT_NE(client, nullptr);
    auto region = client->AllocateMemory(size_t{8} << 20);
    ASSERT_TRUE(region.ok());
    if (method == kGet) {
      // Something to get: 8 MiB stored by one put.
      CallOptions put = Within(10s);
      put.send_payload = region->bytes();
      put.send_region = &*region;
      ASSERT_TRUE(client->CallSync(kPut, {}, put, nullptr).ok());
    }
    BulkLoad load;
    load.client = client.get();
    load.region = &*region;
    load.size = region->size();
    load.method = method;
    for (int i = 0; i < 4; ++i) load.Issue();
    for (int i = 0; i < 10000 && load.ok.load() < 8 && load.outstanding.load() > 0; ++i) {
      std::this_thread::sleep_for(1ms);
    }
    ASSERT_GE(load.ok.load(), 8) << load.other_status;

    const auto killed_at = Clock::now();
    server->process().Kill(SIGKILL);
    while (load.outstanding.load() > 0 && Clock::now() - killed_at < 10s) {
      std::this_thread::sleep_for(1ms);
    }
    const auto failed_after = Clock::now() - killed_at;
    ASSERT_EQ(load.outstanding.load(), 0) << "calls left hanging after the server died";
    EXPECT_LT(failed_after, 3s);
    EXPECT_EQ(load.other.load(), 0) << load.other_status;
    EXPECT_EQ(load.unavailable.load(), 4);  // the window in flight when the server died
    {
      std::lock_guard lock(load.mu);
      for (int count : load.completions) EXPECT_EQ(count, 1);
    }
    // Calls while the server is down fail fast.
    EXPECT_EQ(client->CallSync(kEcho, {}, Within(5s), nullptr).code(), StatusCode::kUnavailable);

    // The server comes back on its port: the next call reconnects.
    server = std::make_unique<PeerServer>(GetParam(), port);
    ASSERT_EQ(server->port(), port);
    std::vector<std::byte> reply;
    const Status back = client->CallSync(kEcho, AsBytes("back"), Within(5s), &reply);
    ASSERT_TRUE(back.ok()) << back.ToString();
    EXPECT_EQ(std::string(reinterpret_cast<const char*>(reply.data()), reply.size()), "back");
    EXPECT_EQ(client->stats().connects, 2u);
  }
}

TEST_P(RpcFaultTest, StalledServerFailsCallsAtTheirDeadline) {
  PeerServer server(GetParam());
  ASSERT_NE(server.port(), 0);
  auto client = MakeClient(server.port());
  ASSERT_NE(client, nullptr);
  ASSERT_TRUE(client->CallSync(kEcho, {}, Within(5s), nullptr).ok());
  auto region = client->AllocateMemory(size_t{8} << 20);
  ASSERT_TRUE(region.ok());

  ASSERT_EQ(::kill(server.process().pid(), SIGSTOP), 0);
  ASSERT_TRUE(WaitStopped(server.process().pid()));
  std::vector<std::future<Status>> results;
  std::vector<std::shared_ptr<std::promise<Status>>> promises;
  const auto start = Clock::now();
  for (int i = 0; i < 6; ++i) {
    auto promise = std::make_shared<std::promise<Status>>();
    results.push_back(promise->get_future());
    CallOptions options = Within(300ms);
    if (i % 2 == 0) {  // bulk puts stuck in rendezvous, and plain calls
      options.send_payload = region->bytes();
      options.send_region = &*region;
    }
    client->Call(i % 2 == 0 ? kPut : kEcho, {}, options,
                 [promise](const Response& r) { promise->set_value(r.status); });
  }
  // Each fails at its deadline; calls whose transfer the stalled peer holds make the client
  // reset the connection, which fails the rest of that instant as Unavailable.
  int deadline_exceeded = 0;
  for (auto& result : results) {
    ASSERT_EQ(result.wait_for(5s), std::future_status::ready);
    const Status status = result.get();
    EXPECT_TRUE(status.code() == StatusCode::kDeadlineExceeded ||
                status.code() == StatusCode::kUnavailable)
        << status.ToString();
    deadline_exceeded += status.code() == StatusCode::kDeadlineExceeded;
  }
  EXPECT_GE(deadline_exceeded, 1);
  const auto took = Clock::now() - start;
  EXPECT_GE(took, 290ms);
  EXPECT_LT(took, 2s);
  ASSERT_EQ(::kill(server.process().pid(), SIGCONT), 0);
  // The server wakes up; the client reconnects.
  EXPECT_TRUE(client->CallSync(kEcho, {}, Within(5s), nullptr).ok());
}

// A node that stalls right after answering a client's hello, before its UCX endpoint answers
// the client's: the client's first frame waits on a connection that cannot complete. The client
// gives up at the call's deadline, is destroyed while the node is stopped, and another client
// in the same state sees the node killed. Before, over TCP alone (endpoints without UCX
// peer-failure mode), UCX aborted the client process at each of these ("ucp_request.c:684 ...
// got REQ message"); reaching the end of this test is the check.
TEST_P(RpcFaultTest, ServerStoppedAfterHelloThenKilledLeavesTheClientStanding) {
  PeerServer server(GetParam());
  ASSERT_NE(server.port(), 0);
  auto stalled_call = [&](RpcClient& client) {
    auto result = std::make_shared<std::promise<Status>>();
    auto future = result->get_future();
    client.Call(kEcho, AsBytes("x"), Within(400ms),
                [result](const Response& r) { result->set_value(r.status); });
    if (future.wait_for(10s) != std::future_status::ready) return InternalError("no answer");
    return future.get();
  };
  auto make_client = [&] {
    ClientOptions options;
    options.port = server.port();
    options.transport = TransportFor(GetParam());
    options.tenant = "stop-after-hello";
    options.connect_timeout = 3000ms;
    auto client = RpcClient::Create(options);
    EXPECT_TRUE(client.ok()) << client.status().ToString();
    return client.ok() ? std::move(*client) : nullptr;
  };
  auto first = make_client();
  ASSERT_NE(first, nullptr);
  const Status status = stalled_call(*first);
  EXPECT_TRUE(status.code() == StatusCode::kDeadlineExceeded ||
              status.code() == StatusCode::kUnavailable)
      << status.ToString();
  ASSERT_TRUE(WaitStopped(server.process().pid()));
  first.reset();  // destroyed with its endpoint to the stopped node

  // The node goes on a moment and stops again at the next client's hello.
  ASSERT_EQ(::kill(server.process().pid(), SIGCONT), 0);
  auto second = make_client();
  ASSERT_NE(second, nullptr);
  std::promise<Status> pending;
  second->Call(kEcho, AsBytes("y"), Within(5s),
               [&](const Response& r) { pending.set_value(r.status); });
  ASSERT_TRUE(WaitStopped(server.process().pid()));
  ASSERT_EQ(::kill(server.process().pid(), SIGKILL), 0);
  auto answer = pending.get_future();
  ASSERT_EQ(answer.wait_for(10s), std::future_status::ready);
  EXPECT_EQ(answer.get().code(), StatusCode::kUnavailable);
  EXPECT_EQ(stalled_call(*second).code(), StatusCode::kUnavailable);  // nothing listens now
  second.reset();
}

TEST_P(RpcFaultTest, ClientKilledMidTransferLeavesServerServing) {
  if (GetParam() == "shm_rndv") {
    // UCX 1.13 rendezvous over shared memory with peer-failure endpoints: after a peer is
    // killed mid-transfer the survivor sometimes cannot reach a new peer (measured: the
    // reconnect after a server kill; the third killed client). Mapped payloads, the shared-
    // memory default, do not use it; see the issue 4 notes.
    GTEST_SKIP() << "killed-peer recovery of rendezvous over shm is not reliable in UCX 1.13";
  }
  ServerOptions options;
  options.transport = TransportFor(GetParam());
  auto server = RpcServer::Create(options);
  ASSERT_TRUE(server.ok());
  auto memory = (*server)->AllocateMemory(size_t{8} << 20);
  ASSERT_TRUE(memory.ok());
  std::atomic<int> received{0}, failed{0};
  (*server)->Handle(kEcho, [](ServerCall call) { call.Reply(call.request()); });
  (*server)->Handle(kPut, [&](ServerCall call) {
    auto shared = std::make_shared<ServerCall>(std::move(call));
    shared->ReceivePayload(memory->bytes(), &*memory, [shared, &received, &failed](Status s) {
      (s.ok() ? received : failed).fetch_add(1);
      shared->Reply({});
    });
  });
  ASSERT_TRUE((*server)->Start().ok());

  for (int round = 0; round < 3; ++round) {
    auto client = ::kvstash::testing::StartChild({KVSTASH_PEER_HELPER, "client", GetParam(),
                                                  std::to_string((*server)->port()),
                                                  std::to_string(8 << 20)});
    ASSERT_NE(client, nullptr);
    ASSERT_EQ(ReadLineStartingWith(*client, "connected"), "connected");
    ASSERT_EQ(ReadLineStartingWith(*client, "progress"), "progress");
    std::this_thread::sleep_for(20ms);
    client->Kill(SIGKILL);
    // Within 10 s: 3 s was once too short beside a CPU hog (1 run in 20).
    for (int i = 0; i < 1000 && (*server)->connection_count() != 0; ++i) {
      std::this_thread::sleep_for(10ms);
    }
    EXPECT_EQ((*server)->connection_count(), 0u);
  }
  EXPECT_GT(received.load(), 0);
  auto client = MakeClient((*server)->port());
  ASSERT_NE(client, nullptr);
  EXPECT_TRUE(client->CallSync(kEcho, AsBytes("alive"), Within(5s), nullptr).ok());
  EXPECT_EQ((*server)->stats().disconnects, 3u);
}

// UCX 1.13's TCP transport completed a zero-copy send twice when its socket failed under it and
// asserted on the second completion, aborting the survivor of a peer killed mid-transfer: about
// 1 server kill in 14 beside a CPU hog (the worker now sends copied; worker.cc). Many kills in a
// row, each direction: the client that was putting, and the server that was answering gets.
TEST_P(RpcFaultTest, PeersKilledMidTransferOverAndOverNeverTakeTheSurvivorDown) {
  if (GetParam() == "shm_rndv") {
    GTEST_SKIP() << "killed-peer recovery of rendezvous over shm is not reliable in UCX 1.13";
  }
  constexpr int kRounds = 20;
  for (int round = 0; round < kRounds; ++round) {
    SCOPED_TRACE("server kill " + std::to_string(round));
    PeerServer server(GetParam());
    ASSERT_NE(server.port(), 0);
    auto client = MakeClient(server.port());
    ASSERT_NE(client, nullptr);
    auto region = client->AllocateMemory(size_t{8} << 20);
    ASSERT_TRUE(region.ok());
    BulkLoad load;
    load.client = client.get();
    load.region = &*region;
    load.size = region->size();
    for (int i = 0; i < 4; ++i) load.Issue();
    const auto started = Clock::now();
    while (load.ok.load() < 2 && load.outstanding.load() > 0 && Clock::now() - started < 10s) {
      std::this_thread::sleep_for(1ms);
    }
    ASSERT_GE(load.ok.load(), 2) << load.other_status;
    server.process().Kill(SIGKILL);
    const auto killed_at = Clock::now();
    while (load.outstanding.load() > 0 && Clock::now() - killed_at < 10s) {
      std::this_thread::sleep_for(1ms);
    }
    ASSERT_EQ(load.outstanding.load(), 0) << "calls left hanging after the server died";
    EXPECT_EQ(load.other.load(), 0) << load.other_status;
  }

  ServerOptions options;
  options.transport = TransportFor(GetParam());
  auto server = RpcServer::Create(options);
  ASSERT_TRUE(server.ok());
  auto memory = (*server)->AllocateMemory(size_t{8} << 20);
  ASSERT_TRUE(memory.ok());
  (*server)->Handle(kEcho, [](ServerCall call) { call.Reply(call.request()); });
  (*server)->Handle(kGet, [&](ServerCall call) { call.Reply({}, memory->bytes(), &*memory); });
  ASSERT_TRUE((*server)->Start().ok());
  for (int round = 0; round < kRounds; ++round) {
    SCOPED_TRACE("client kill " + std::to_string(round));
    auto client = ::kvstash::testing::StartChild({KVSTASH_PEER_HELPER, "client", GetParam(),
                                                  std::to_string((*server)->port()),
                                                  std::to_string(8 << 20), "get"});
    ASSERT_NE(client, nullptr);
    ASSERT_EQ(ReadLineStartingWith(*client, "progress"), "progress");
    client->Kill(SIGKILL);
    for (int i = 0; i < 1000 && (*server)->connection_count() != 0; ++i) {
      std::this_thread::sleep_for(10ms);
    }
    EXPECT_EQ((*server)->connection_count(), 0u);
  }
  auto client = MakeClient((*server)->port());
  ASSERT_NE(client, nullptr);
  EXPECT_TRUE(client->CallSync(kEcho, AsBytes("alive"), Within(5s), nullptr).ok());
}

// ---- bad input -------------------------------------------------------------------------------

class RpcFuzzTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    ServerOptions options;
    options.transport = TransportFor(GetParam());
    options.transport.max_message_bytes = 64 << 10;
    options.transport.max_payload_bytes = 1 << 20;
    auto server = RpcServer::Create(options);
    ASSERT_TRUE(server.ok());
    server_ = std::move(*server);
    memory_ = std::vector<std::byte>(1 << 20);
    server_->Handle(kEcho, [](ServerCall call) { call.Reply(call.request()); });
    server_->Handle(kCount, [this](ServerCall call) {
      ++counted_;
      call.Reply({});
    });
    server_->Handle(kPut, [this](ServerCall call) {
      auto shared = std::make_shared<ServerCall>(std::move(call));
      shared->ReceivePayload(memory_, nullptr, [shared](Status s) {
        if (s.ok()) {
          shared->Reply({});
        } else {
          shared->ReplyError(s);
        }
      });
    });
    ASSERT_TRUE(server_->Start().ok());
    ClientOptions client_options;
    client_options.port = server_->port();
    client_options.transport = TransportFor(GetParam());
    auto client = RpcClient::Create(client_options);
    ASSERT_TRUE(client.ok());
    client_ = std::move(*client);
    ASSERT_TRUE(client_->Connect().ok());
  }

  void ExpectServerHealthy() {
    std::vector<std::byte> reply;
    const Status status = client_->CallSync(kEcho, AsBytes("ping"), Within(5s), &reply);
    ASSERT_TRUE(status.ok()) << status.ToString();
    EXPECT_EQ(reply.size(), 4u);
  }

  std::vector<std::byte> ValidFrame(uint16_t method, const std::string& message) {
    FrameHeader header;
    header.kind = FrameKind::kRequest;
    header.method = method;
    header.request_id = 1u << 30;  // no call of the client's has this id
    header.connection_id = client_->connection_id();
    header.message_bytes = static_cast<uint32_t>(message.size());
    header.timeout_us = 1000000;
    std::vector<std::byte> frame(kFrameHeaderBytes + message.size());
    WriteFrame(header, AsBytes(message), frame);
    return frame;
  }

  std::unique_ptr<RpcServer> server_;
  std::unique_ptr<RpcClient> client_;
  std::vector<std::byte> memory_;
  std::atomic<int> counted_{0};  // kCount calls served
};

TEST_P(RpcFuzzTest, RandomFramesNeverCrashTheServer) {
  std::mt19937_64 random(42);
  for (int i = 0; i < 500; ++i) {
    std::vector<std::byte> header(random() % 128), data(random() % 2 == 0 ? 0 : random() % 70000);
    for (auto& b : header) b = static_cast<std::byte>(random());
    for (auto& b : data) b = static_cast<std::byte>(random());
    ASSERT_TRUE(client_->SendRawForTesting(header, data).ok());
  }
  ExpectServerHealthy();
  EXPECT_GE(server_->stats().malformed_frames, 400u);
}

TEST_P(RpcFuzzTest, MutatedValidFramesGetErrorsOrAreDropped) {
  std::mt19937_64 random(7);
  const std::vector<std::byte> valid = ValidFrame(kEcho, "hello");
  for (int i = 0; i < 1000; ++i) {
    std::vector<std::byte> frame = valid;
    const int mutations = 1 + static_cast<int>(random() % 4);
    for (int m = 0; m < mutations; ++m) {
      switch (random() % 4) {
        case 0:  // flip a byte
          frame[random() % frame.size()] ^= static_cast<std::byte>(1 + random() % 255);
          break;
        case 1:  // truncate
          frame.resize(random() % frame.size());
          break;
        case 2:  // extend
          frame.resize(frame.size() + random() % 64, std::byte{0x5a});
          break;
        case 3:  // an absurd message length
          if (frame.size() >= 28) {
            const uint32_t huge = static_cast<uint32_t>(random());
            std::memcpy(frame.data() + 24, &huge, 4);
          }
          break;
      }
      if (frame.empty()) break;
    }
    std::vector<std::byte> data(random() % 3 == 0 ? random() % 40000 : 0);
    ASSERT_TRUE(client_->SendRawForTesting(frame, data).ok());
  }
  ExpectServerHealthy();
  EXPECT_GT(server_->stats().malformed_frames, 0u);
}

TEST_P(RpcFuzzTest, BadFramesNamingTheConnectionGetAnErrorReply) {
  const auto late_before = client_->stats().late_replies;
  std::vector<std::byte> frame = ValidFrame(kEcho, "hello");
  frame[4] = std::byte{9};  // version 9
  ASSERT_TRUE(client_->SendRawForTesting(frame, {}).ok());
  frame = ValidFrame(kEcho, "hello");
  const uint32_t wrong = 3;  // says 3 message bytes, carries 5
  std::memcpy(frame.data() + 24, &wrong, 4);
  ASSERT_TRUE(client_->SendRawForTesting(frame, {}).ok());
  ExpectServerHealthy();
  // Both came back as error replies (to a request id the client never used).
  for (int i = 0; i < 200 && client_->stats().late_replies < late_before + 2; ++i) {
    std::this_thread::sleep_for(5ms);
  }
  EXPECT_EQ(client_->stats().late_replies, late_before + 2);
  EXPECT_EQ(server_->stats().malformed_frames, 2u);
}

// A connection is its endpoint: a frame naming another client's connection id is refused and
// counted (before, the server took the connection, and its namespace, from the header), and so
// is a bind to it without its token. The other client's calls go on.
TEST_P(RpcFuzzTest, AFrameNamingAnotherConnectionIsRefused) {
  std::atomic<int>& served = counted_;
  ClientOptions options;
  options.port = server_->port();
  options.transport = TransportFor(GetParam());
  auto other = RpcClient::Create(options);
  ASSERT_TRUE(other.ok());
  ASSERT_TRUE((*other)->Connect().ok());
  ASSERT_NE((*other)->connection_id(), client_->connection_id());
  const uint64_t foreign_before = server_->stats().foreign_frames;
  std::vector<std::byte> frame = ValidFrame(kCount, "x");
  FrameHeader header;
  std::memcpy(&header, frame.data(), kFrameHeaderBytes);
  header.connection_id = (*other)->connection_id();
  std::memcpy(frame.data(), &header, kFrameHeaderBytes);
  for (int i = 0; i < 10; ++i) ASSERT_TRUE(client_->SendRawForTesting(frame, {}).ok());
  header.kind = FrameKind::kBind;  // a bind to the other connection, with a guessed token
  header.method = 0;
  header.message_bytes = 0;
  header.request_id = 12345;
  std::vector<std::byte> bind(kFrameHeaderBytes);
  WriteFrame(header, {}, bind);
  ASSERT_TRUE(client_->SendRawForTesting(bind, {}).ok());
  ExpectServerHealthy();  // after the forged frames, on the same endpoint
  EXPECT_EQ(served.load(), 0);
  EXPECT_EQ(server_->stats().foreign_frames, foreign_before + 11);
  EXPECT_TRUE((*other)->CallSync(kEcho, AsBytes("mine"), Within(5s), nullptr).ok());
  // Its own frames, named right, still serve.
  ASSERT_TRUE(client_->SendRawForTesting(ValidFrame(kCount, "x"), {}).ok());
  for (int i = 0; i < 400 && served.load() == 0; ++i) std::this_thread::sleep_for(5ms);
  EXPECT_EQ(served.load(), 1);
}

// UCX pairs a client's endpoints with the server's by the order each side made them. A hello
// whose client made no endpoint for it (it gave up, or another thread of the process connected
// first) shifts the pairing: the next client of that worker is paired with the endpoint made
// for the abandoned hello. When that hello's connection closes, the client paired with its
// endpoint must go on (before, the server closed it, and the client's calls went unanswered
// until UCX's keepalive reset the endpoint 20 s later).
TEST_P(RpcFuzzTest, AHelloWithoutAnEndpointLeavesItsWorkersNextClientWorking) {
  auto worker = ClientWorker::Create(TransportFor(GetParam()));
  ASSERT_TRUE(worker.ok()) << worker.status().ToString();
  const size_t open_before = server_->connection_count();
  // The hello alone, carrying the worker's address, over a socket kept open.
  wire::Hello hello;
  hello.set_protocol_version(wire::PROTOCOL_VERSION_CURRENT);
  hello.set_namespace_("default");
  hello.set_worker_address((*worker)->AddressForTesting());
  hello.set_client_name("abandoned");
  const std::string body = hello.SerializeAsString();
  const int fd = ::kvstash::testing::ConnectLoopback(server_->port());
  ASSERT_GE(fd, 0);
  std::string message(4, '\0');
  const uint32_t length = static_cast<uint32_t>(body.size());
  std::memcpy(message.data(), &length, 4);
  message += body;
  ASSERT_EQ(::send(fd, message.data(), message.size(), MSG_NOSIGNAL),
            static_cast<ssize_t>(message.size()));
  timeval timeout{5, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  uint32_t reply_length = 0;
  ASSERT_EQ(::recv(fd, &reply_length, 4, MSG_WAITALL), 4);
  std::string reply_bytes(reply_length, '\0');
  ASSERT_EQ(::recv(fd, reply_bytes.data(), reply_length, MSG_WAITALL),
            static_cast<ssize_t>(reply_length));
  wire::HelloReply reply;
  ASSERT_TRUE(reply.ParseFromString(reply_bytes));
  ASSERT_FALSE(reply.has_error()) << reply.error().message();
  // A client of that worker: its endpoint is paired with the one the hello above made.
  ClientOptions options;
  options.port = server_->port();
  options.worker = *worker;
  auto client = RpcClient::Create(options);
  ASSERT_TRUE(client.ok());
  std::vector<std::byte> echoed;
  ASSERT_TRUE((*client)->CallSync(kEcho, AsBytes("before"), Within(5s), &echoed).ok());
  // The abandoned hello's connection closes; the client goes on, on the same connection.
  ::close(fd);
  for (int i = 0; i < 1000 && server_->connection_count() > open_before + 1; ++i) {
    std::this_thread::sleep_for(5ms);
  }
  ASSERT_EQ(server_->connection_count(), open_before + 1);
  for (int i = 0; i < 20; ++i) {
    const Status s = (*client)->CallSync(kEcho, AsBytes("after"), Within(3s), &echoed);
    ASSERT_TRUE(s.ok()) << "call " << i << ": " << s.ToString();
    EXPECT_EQ(std::string(reinterpret_cast<const char*>(echoed.data()), echoed.size()), "after");
  }
  std::vector<std::byte> payload(256 << 10, std::byte{7});
  CallOptions put = Within(5s);
  put.send_payload = payload;
  EXPECT_TRUE((*client)->CallSync(kPut, {}, put, nullptr).ok());
  EXPECT_EQ((*client)->stats().connects, 1u);
}

TEST_P(RpcFuzzTest, OversizedMessageAndPayloadAreRefused) {
  // Over the server's 64 KiB message limit (the client's own limit is larger).
  const std::string big(100 << 10, 'm');
  ASSERT_TRUE(client_->SendRawForTesting(ValidFrame(kEcho, "x"), {}).ok());
  std::vector<std::byte> frame = ValidFrame(kEcho, "");
  FrameHeader header;
  std::memcpy(&header, frame.data(), kFrameHeaderBytes);
  header.flags = kMessageInData;
  header.message_bytes = static_cast<uint32_t>(big.size());
  WriteFrame(header, {}, frame);
  ASSERT_TRUE(client_->SendRawForTesting(frame, AsBytes(big)).ok());
  // A 2 MiB payload against the server's 1 MiB limit.
  std::vector<std::byte> payload(2 << 20);
  CallOptions put = Within(5s);
  put.send_payload = payload;
  const Status status = client_->CallSync(kPut, {}, put, nullptr);
  EXPECT_FALSE(status.ok());
  // The server is still there for a new client.
  ClientOptions options;
  options.port = server_->port();
  options.transport = TransportFor(GetParam());
  auto fresh = RpcClient::Create(options);
  ASSERT_TRUE(fresh.ok());
  EXPECT_TRUE((*fresh)->CallSync(kEcho, AsBytes("x"), Within(5s), nullptr).ok());
}

TEST_P(RpcFuzzTest, GarbageOnTheBootstrapSocketIsRefused) {
  std::mt19937_64 random(3);
  for (int i = 0; i < 50; ++i) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    ASSERT_GE(fd, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_port = htons(server_->port());
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
    std::vector<uint8_t> bytes(random() % 200);
    for (auto& b : bytes) b = static_cast<uint8_t>(random());
    if (i % 3 == 0 && bytes.size() >= 4) {  // a plausible length prefix, garbage body
      const uint32_t length = static_cast<uint32_t>(bytes.size() - 4);
      std::memcpy(bytes.data(), &length, 4);
    }
    if (!bytes.empty()) {
      ASSERT_GT(::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL), 0);
    }
    ::close(fd);
  }
  ExpectServerHealthy();
}

INSTANTIATE_TEST_SUITE_P(Tls, RpcFaultTest, ::testing::Values("shm", "shm_rndv", "tcp"),
                         [](const auto& param_info) { return param_info.param; });
INSTANTIATE_TEST_SUITE_P(Tls, RpcFuzzTest, ::testing::Values("shm", "tcp"),
                         [](const auto& param_info) { return param_info.param; });

}  // namespace
}  // namespace kvstash::transport
