// The loopback transport and the fault channel: calls, payloads both ways, deadlines,
// cancellation, a cut connection, the hello's checks and the stated limits, as the UCX transport
// behaves (rpc_test.cc); then each fault of FaultChannel as a client sees it.

#include "kvstash/transport/loopback.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <string>
#include <vector>

#include "kvstash/transport/fault_channel.h"

namespace kvstash::transport {
namespace {

using namespace std::chrono_literals;
using ::testing::HasSubstr;

constexpr uint16_t kEcho = 1, kPut = 2, kGet = 3, kSilent = 4;

struct Outcome {
  Status status;
  std::string message;
  size_t payload_bytes = 0;
};

// Waits for one call's outcome.
Outcome CallAndWait(Channel& channel, uint16_t method, std::string_view request,
                    CallOptions options = {}) {
  std::promise<Outcome> promise;
  channel.Call(method, std::as_bytes(std::span(request)), options, [&](const Response& r) {
    promise.set_value(Outcome{
        r.status, std::string(reinterpret_cast<const char*>(r.message.data()), r.message.size()),
        r.payload_bytes});
  });
  return promise.get_future().get();
}

class LoopbackTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ServerOptions options;
    options.service_limits = "stated at hello";
    server_ = network_->Listen(options);
    server_->Handle(kEcho, [](ServerCall call) { call.Reply(call.request()); });
    server_->Handle(kPut, [this](ServerCall call) {
      auto shared = std::make_shared<ServerCall>(std::move(call));
      stored_.assign(shared->payload_bytes(), std::byte{0});
      shared->ReceivePayload(stored_, nullptr, [shared](Status s) {
        if (s.ok()) {
          shared->Reply({});
        } else {
          shared->ReplyError(s);
        }
      });
    });
    server_->Handle(kGet, [this](ServerCall call) { call.Reply({}, stored_); });
    server_->Handle(kSilent, [this](ServerCall call) { held_.push_back(std::move(call)); });
    server_->OnDisconnect([this](uint64_t id) { disconnected_.push_back(id); });
    ASSERT_TRUE(server_->Start().ok());
  }
  void TearDown() override {
    server_->RunOnProgressThread([this] { held_.clear(); });
    network_->Flush();
  }
  std::unique_ptr<Channel> Client(std::string token = "") {
    ClientOptions options;
    options.port = server_->port();
    options.auth_token = std::move(token);
    return network_->Connect(options);
  }

  std::shared_ptr<LoopbackNetwork> network_ = LoopbackNetwork::Create();
  std::unique_ptr<Listener> server_;
  std::vector<std::byte> stored_;       // progress thread
  std::vector<ServerCall> held_;        // progress thread
  std::vector<uint64_t> disconnected_;  // progress thread
};

TEST_F(LoopbackTest, CallsRepliesAndPayloadsBothWays) {
  auto client = Client();
  const Outcome echo = CallAndWait(*client, kEcho, "hello");
  ASSERT_TRUE(echo.status.ok()) << echo.status.ToString();
  EXPECT_EQ(echo.message, "hello");
  std::vector<std::byte> block(64);
  for (size_t i = 0; i < block.size(); ++i) block[i] = std::byte(i * 3);
  CallOptions put;
  put.send_payload = block;
  ASSERT_TRUE(CallAndWait(*client, kPut, "", put).status.ok());
  std::vector<std::byte> back(64);
  CallOptions get;
  get.recv_payload = back;
  const Outcome got = CallAndWait(*client, kGet, "", get);
  ASSERT_TRUE(got.status.ok());
  EXPECT_EQ(got.payload_bytes, 64u);
  EXPECT_EQ(back, block);
  // A reply payload larger than the buffer is OutOfRange, as over UCX.
  std::vector<std::byte> small(8);
  get.recv_payload = small;
  EXPECT_EQ(CallAndWait(*client, kGet, "", get).status.code(), StatusCode::kOutOfRange);
  ASSERT_TRUE(client->server_limits().has_value());
  EXPECT_EQ(client->server_limits()->service_limits, "stated at hello");
  EXPECT_EQ(server_->stats().calls, 4u);
}

TEST_F(LoopbackTest, DeadlinesCancellationAndUnknownMethods) {
  auto client = Client();
  CallOptions soon;
  soon.deadline = Clock::now() + 30ms;
  EXPECT_EQ(CallAndWait(*client, kSilent, "", soon).status.code(), StatusCode::kDeadlineExceeded);
  std::promise<Status> cancelled;
  const uint64_t id =
      client->Call(kSilent, {}, {}, [&](const Response& r) { cancelled.set_value(r.status); });
  client->Cancel(id);
  EXPECT_EQ(cancelled.get_future().get().code(), StatusCode::kCancelled);
  EXPECT_EQ(CallAndWait(*client, 99, "").status.code(), StatusCode::kUnimplemented);
}

TEST_F(LoopbackTest, ACutConnectionFailsItsCallsTellsTheServerAndReconnects) {
  auto client = Client();
  ASSERT_TRUE(CallAndWait(*client, kEcho, "x").status.ok());
  const uint64_t connection = LoopbackNetwork::ConnectionOf(*client);
  ASSERT_NE(connection, 0u);
  std::promise<Status> lost;
  client->Call(kSilent, {}, {}, [&](const Response& r) { lost.set_value(r.status); });
  network_->Flush();
  network_->Disconnect(connection);
  EXPECT_EQ(lost.get_future().get().code(), StatusCode::kUnavailable);
  network_->Flush();
  std::vector<uint64_t> seen;
  server_->RunOnProgressThread([&] { seen = disconnected_; });
  network_->Flush();
  EXPECT_EQ(seen, std::vector<uint64_t>{connection});
  // The next call connects again, on a new connection.
  ASSERT_TRUE(CallAndWait(*client, kEcho, "y").status.ok());
  EXPECT_NE(LoopbackNetwork::ConnectionOf(*client), connection);
  // A server that stops ends its connections: calls fail until one listens again.
  server_->Stop();
  EXPECT_EQ(CallAndWait(*client, kEcho, "z").status.code(), StatusCode::kUnavailable);
}

TEST_F(LoopbackTest, TheHelloChecksTheTokenAsTheNodeDoes) {
  ServerOptions options;
  options.auth_token = "secret";
  auto guarded = network_->Listen(options);
  guarded->Handle(kEcho, [](ServerCall call) { call.Reply(call.request()); });
  ASSERT_TRUE(guarded->Start().ok());
  ASSERT_NE(guarded->port(), server_->port());
  ClientOptions wrong;
  wrong.port = guarded->port();
  wrong.auth_token = "guess";
  auto refused = network_->Connect(wrong);
  const Outcome r = CallAndWait(*refused, kEcho, "x");
  EXPECT_EQ(r.status.code(), StatusCode::kUnauthenticated);
  EXPECT_THAT(std::string(r.status.message()), HasSubstr("wrong auth token"));
  ClientOptions right = wrong;
  right.auth_token = "secret";
  EXPECT_TRUE(CallAndWait(*network_->Connect(right), kEcho, "x").status.ok());
}

TEST_F(LoopbackTest, FaultsAsAClientSeesThem) {
  std::vector<Fault> plan = {
      {Fault::Kind::kDrop},
      {Fault::Kind::kDelay, 20ms},
      {Fault::Kind::kCorruptRequest},
      {Fault::Kind::kNone},
  };
  FaultChannel channel(Client(),
                       [&](uint16_t, uint64_t i) { return i < plan.size() ? plan[i] : Fault{}; });
  CallOptions soon;
  soon.deadline = Clock::now() + 50ms;
  const auto start = Clock::now();
  EXPECT_EQ(CallAndWait(channel, kEcho, "a", soon).status.code(), StatusCode::kDeadlineExceeded);
  EXPECT_GE(Clock::now() - start, 45ms);
  EXPECT_EQ(server_->stats().calls, 0u);  // the dropped call never arrived
  const Outcome delayed = CallAndWait(channel, kEcho, "b");
  ASSERT_TRUE(delayed.status.ok());
  EXPECT_EQ(delayed.message, "b");
  const Outcome corrupted = CallAndWait(channel, kEcho, "cc");
  ASSERT_TRUE(corrupted.status.ok());
  EXPECT_EQ(corrupted.message[0], '\xff');  // what arrived was damaged
  EXPECT_EQ(corrupted.message[1], 'c');
  EXPECT_EQ(CallAndWait(channel, kEcho, "d").message, "d");
  const FaultCounts counts = channel.counts();
  EXPECT_EQ(counts.dropped, 1u);
  EXPECT_EQ(counts.delayed, 1u);
  EXPECT_EQ(counts.corrupted, 1u);
}

TEST_F(LoopbackTest, ACorruptPayloadArrivesDamagedAndADisconnectLosesIt) {
  std::vector<Fault> plan = {{Fault::Kind::kCorruptPayload},
                             {Fault::Kind::kDisconnectAfterRequest}};
  Channel* inner = nullptr;
  auto client = Client();
  inner = client.get();
  FaultChannel channel(
      std::move(client), [&](uint16_t, uint64_t i) { return i < plan.size() ? plan[i] : Fault{}; },
      [&] { LoopbackNetwork::CutAfterNextRequest(*inner); });
  ASSERT_TRUE(CallAndWait(channel, kEcho, "connect").status.ok());  // plan index 0 is kEcho's
  std::vector<std::byte> block(64, std::byte{7});
  CallOptions put;
  put.send_payload = block;
  // kPut's first call: the payload is flipped on its way.
  ASSERT_TRUE(CallAndWait(channel, kPut, "", put).status.ok());
  network_->Flush();
  std::vector<std::byte> seen;
  server_->RunOnProgressThread([&] { seen = stored_; });
  network_->Flush();
  ASSERT_EQ(seen.size(), 64u);
  EXPECT_NE(seen, block);
  // kPut's second call: the connection is cut after the request: the payload never comes.
  const Outcome lost = CallAndWait(channel, kPut, "", put);
  EXPECT_EQ(lost.status.code(), StatusCode::kUnavailable) << lost.status.ToString();
  EXPECT_EQ(channel.counts().disconnects, 1u);
}

}  // namespace
}  // namespace kvstash::transport
