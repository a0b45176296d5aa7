// RPC and bulk transfer over real UCX, once per payload path: shared memory with mapped
// payloads (the client copies from and into the server's shared memory), shared memory with
// mapped payloads off (UCX rendezvous), and TCP. The server and the client each own a UCX
// context in this process and talk over loopback.

#include "kvstash/transport/rpc.h"

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <future>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "block_pattern.h"
#include "kvstash/proto/wire.pb.h"
#include "kvstash/transport/call_group.h"
#include "kvstash/transport/frame.h"
#include "transport_param.h"

namespace kvstash::transport {
namespace {

using namespace std::chrono_literals;
using ::kvstash::testing::FillPattern;
using ::kvstash::testing::MatchesPattern;
using ::kvstash::testing::TransportFor;

constexpr uint16_t kEcho = 1;
constexpr uint16_t kPut = 2;          // receives the payload into server memory, replies its size
constexpr uint16_t kGet = 3;          // replies with the block stored by the last put
constexpr uint16_t kSilent = 4;       // never replies (keeps the call) until released
constexpr uint16_t kDrop = 5;         // drops the call without a reply
constexpr uint16_t kPutPlain = 6;     // receives the payload into heap memory (kept in plain_)
constexpr uint16_t kGetScribble = 7;  // kGet, then overwrites the block once the reply is sent

Bytes AsBytes(const std::string& s) { return std::as_bytes(std::span(s)); }
std::string AsString(Bytes b) {
  return std::string(reinterpret_cast<const char*>(b.data()), b.size());
}

class RpcTest : public ::testing::TestWithParam<std::string> {
 protected:
  bool ExpectMapped() const { return GetParam() == "shm"; }

  static constexpr size_t kMaxBlock = size_t{8} << 20;

  void SetUp() override {
    ServerOptions options;
    options.transport = TransportFor(GetParam());
    options.auth_token = "secret";
    auto server = RpcServer::Create(options);
    ASSERT_TRUE(server.ok()) << server.status().ToString();
    server_ = std::move(*server);
    auto region = server_->AllocateMemory(kMaxBlock);
    ASSERT_TRUE(region.ok()) << region.status().ToString();
    server_block_ = std::move(*region);

    server_->Handle(kEcho, [](ServerCall call) { call.Reply(call.request()); });
    server_->Handle(kPut, [this](ServerCall call) {
      const size_t n = call.payload_bytes();
      auto shared = std::make_shared<ServerCall>(std::move(call));
      shared->ReceivePayload(server_block_.bytes(), &server_block_, [this, shared, n](Status s) {
        if (!s.ok()) {
          shared->ReplyError(s);
          return;
        }
        stored_bytes_ = n;
        const std::string reply = std::to_string(n);
        shared->Reply(AsBytes(reply));
      });
    });
    server_->Handle(kGet, [this](ServerCall call) {
      call.Reply({}, server_block_.bytes().first(stored_bytes_), &server_block_);
    });
    server_->Handle(kGetScribble, [this](ServerCall call) {
      // As a store does when a block's pin ends: its memory goes to another block at once.
      call.Reply({}, server_block_.bytes().first(stored_bytes_), &server_block_,
                 [this](Status) { std::memset(server_block_.data(), 0xee, stored_bytes_); });
    });
    server_->Handle(kPutPlain, [this](ServerCall call) {
      // Into plain heap memory: no shared region, so the payload comes as data on every path.
      auto buffer = std::make_shared<std::vector<std::byte>>(call.payload_bytes());
      auto shared = std::make_shared<ServerCall>(std::move(call));
      shared->ReceivePayload(*buffer, nullptr, [this, shared, buffer](Status s) {
        if (!s.ok()) {
          shared->ReplyError(s);
          return;
        }
        {
          std::lock_guard lock(mu_);
          plain_ = *buffer;
        }
        shared->Reply({});
      });
    });
    server_->Handle(kSilent, [this](ServerCall call) {
      std::lock_guard lock(mu_);
      held_.push_back(std::move(call));
    });
    server_->Handle(kDrop, [](ServerCall) {});
    ASSERT_TRUE(server_->Start().ok());

    client_ = MakeClient("secret");
    ASSERT_NE(client_, nullptr);
  }

  void TearDown() override {
    client_.reset();
    {
      std::lock_guard lock(mu_);
      held_.clear();
    }
    server_block_ = MemoryRegion();
    server_.reset();
  }

  std::unique_ptr<RpcClient> MakeClient(const std::string& token) {
    ClientOptions options;
    options.port = server_->port();
    options.auth_token = token;
    options.transport = TransportFor(GetParam());
    options.connect_timeout = 3000ms;
    auto client = RpcClient::Create(options);
    EXPECT_TRUE(client.ok()) << client.status().ToString();
    return client.ok() ? std::move(*client) : nullptr;
  }

  CallOptions Within(std::chrono::milliseconds timeout) {
    CallOptions options;
    options.deadline = Clock::now() + timeout;
    return options;
  }

  std::unique_ptr<RpcServer> server_;
  std::unique_ptr<RpcClient> client_;
  MemoryRegion server_block_;
  std::atomic<size_t> stored_bytes_{0};
  std::mutex mu_;
  std::vector<ServerCall> held_;
  std::vector<std::byte> plain_;
};

TEST_P(RpcTest, EchoRoundTrip) {
  std::vector<std::byte> reply;
  for (int i = 0; i < 100; ++i) {
    const std::string message = "hello " + std::to_string(i);
    ASSERT_TRUE(client_->CallSync(kEcho, AsBytes(message), Within(5s), &reply).ok());
    EXPECT_EQ(AsString(reply), message);
  }
  EXPECT_EQ(client_->stats().connects, 1u);
  EXPECT_EQ(server_->connection_count(), 1u);
}

TEST_P(RpcTest, LargeMessageTravelsAsData) {
  // Larger than any UCX AM header limit: goes as the AM data.
  std::string message(1 << 20, 'x');
  for (size_t i = 0; i < message.size(); ++i) message[i] = static_cast<char>('a' + i % 26);
  std::vector<std::byte> reply;
  ASSERT_TRUE(client_->CallSync(kEcho, AsBytes(message), Within(5s), &reply).ok());
  EXPECT_EQ(AsString(reply), message);
}

TEST_P(RpcTest, PutThenGetBlocksFrom4KiBTo8MiB) {
  auto send = client_->AllocateMemory(kMaxBlock);
  auto recv = client_->AllocateMemory(kMaxBlock);
  ASSERT_TRUE(send.ok() && recv.ok());
  uint64_t seed = 1;
  for (size_t size = 4096; size <= kMaxBlock; size *= 2, ++seed) {
    for (size_t n : {size, size - 1}) {  // a power of two and an odd length
      FillPattern(seed, send->bytes().first(n));
      CallOptions put = Within(10s);
      put.send_payload = send->bytes().first(n);
      put.send_region = &*send;
      std::vector<std::byte> reply;
      ASSERT_TRUE(client_->CallSync(kPut, {}, put, &reply).ok()) << n;
      EXPECT_EQ(AsString(reply), std::to_string(n));
      EXPECT_TRUE(MatchesPattern(seed, server_block_.bytes().first(n))) << n;

      std::memset(recv->data(), 0, n);
      CallOptions get = Within(10s);
      get.recv_payload = recv->bytes();
      get.recv_region = &*recv;
      size_t got = 0;
      ASSERT_TRUE(client_->CallSync(kGet, {}, get, &reply, &got).ok()) << n;
      EXPECT_EQ(got, n);
      EXPECT_TRUE(MatchesPattern(seed, recv->bytes().first(n))) << n;
    }
  }
  // Each put and get went through the server's shared memory exactly when that path is on.
  const uint64_t transfers = 2 * 2 * 12;  // 4 KiB .. 8 MiB: 12 sizes, 2 lengths, put + get
  EXPECT_EQ(client_->stats().mapped_payloads, ExpectMapped() ? transfers : 0);
  EXPECT_EQ(server_->stats().mapped_payloads, ExpectMapped() ? transfers : 0);
}

// A CallGroup as the calls' copier: over mapped shared memory every put and get hands its copy
// to the thread waiting in Wait, which makes it; on the other paths UCX moves the bytes and no
// copy is posted.
TEST_P(RpcTest, MappedCopiesRunOnTheThreadThatWaits) {
  struct Recorder final : CopyExecutor {
    CallGroup group;
    std::mutex mu;
    std::vector<std::thread::id> ran_on;
    void Post(std::function<void()> copy) override {
      group.Post([this, copy = std::move(copy)] {
        {
          std::lock_guard lock(mu);
          ran_on.push_back(std::this_thread::get_id());
        }
        copy();
      });
    }
  } recorder;
  constexpr size_t kBlock = size_t{256} << 10;
  constexpr int kBlocks = 8;
  std::vector<std::vector<std::byte>> blocks(kBlocks, std::vector<std::byte>(kBlock));
  std::vector<std::vector<std::byte>> back(kBlocks, std::vector<std::byte>(kBlock));
  for (int b = 0; b < kBlocks; ++b) {
    FillPattern(500 + b, blocks[b]);
    std::promise<Status> put_done, get_done;
    CallOptions put = Within(10s);
    put.send_payload = blocks[b];
    put.copier = &recorder;
    client_->Call(kPut, {}, put,
                  recorder.group.Track([&](const Response& r) { put_done.set_value(r.status); }));
    recorder.group.Wait();
    ASSERT_TRUE(put_done.get_future().get().ok());
    EXPECT_TRUE(MatchesPattern(500 + b, server_block_.bytes().first(kBlock)));
    CallOptions get = Within(10s);
    get.recv_payload = back[b];
    get.copier = &recorder;
    size_t got = 0;
    client_->Call(kGet, {}, get, recorder.group.Track([&](const Response& r) {
      got = r.payload_bytes;
      get_done.set_value(r.status);
    }));
    recorder.group.Wait();
    ASSERT_TRUE(get_done.get_future().get().ok());
    EXPECT_EQ(got, kBlock);
    EXPECT_TRUE(MatchesPattern(500 + b, back[b])) << b;
  }
  std::lock_guard lock(recorder.mu);
  EXPECT_EQ(recorder.ran_on.size(), ExpectMapped() ? 2u * kBlocks : 0u);
  for (std::thread::id id : recorder.ran_on) EXPECT_EQ(id, std::this_thread::get_id());
  EXPECT_EQ(client_->stats().mapped_payloads, ExpectMapped() ? 2u * kBlocks : 0u);
  // The server counts a mapped reply when its ack arrives, just after the call completed.
  const uint64_t expected = ExpectMapped() ? 2u * kBlocks : 0u;
  for (int i = 0; i < 400 && server_->stats().mapped_payloads != expected; ++i) {
    std::this_thread::sleep_for(5ms);
  }
  EXPECT_EQ(server_->stats().mapped_payloads, expected);
}

// A copy its copier holds past the call's deadline: the call does not complete while the
// server's memory is lent to it, and then completes with DeadlineExceeded without the copy.
// The server stores nothing from a put whose copy was skipped, and the receive buffer of a get
// whose copy was skipped keeps its bytes.
TEST_P(RpcTest, ACopyHeldPastTheDeadlineIsSkippedAndTheServerStoresNothing) {
  if (!ExpectMapped()) GTEST_SKIP() << "no copies to hold without mapped payloads";
  struct Holder final : CopyExecutor {
    std::mutex mu;
    std::vector<std::function<void()>> held;
    void Post(std::function<void()> copy) override {
      std::lock_guard lock(mu);
      held.push_back(std::move(copy));
    }
    bool WaitForOne() {
      for (int i = 0; i < 400; ++i) {
        {
          std::lock_guard lock(mu);
          if (!held.empty()) return true;
        }
        std::this_thread::sleep_for(5ms);
      }
      return false;
    }
    void RunAll() {
      std::vector<std::function<void()>> copies;
      {
        std::lock_guard lock(mu);
        copies.swap(held);
      }
      for (auto& copy : copies) copy();
    }
  } holder;
  constexpr size_t kBlock = size_t{64} << 10;
  // A block stored first, then a put whose copy is held.
  std::vector<std::byte> first(kBlock), second(kBlock);
  FillPattern(1, first);
  FillPattern(2, second);
  CallOptions put = Within(10s);
  put.send_payload = first;
  ASSERT_TRUE(client_->CallSync(kPut, {}, put, nullptr).ok());

  for (bool is_put : {true, false}) {
    SCOPED_TRACE(is_put ? "put" : "get");
    std::promise<Status> result;
    auto future = result.get_future();
    std::vector<std::byte> back(kBlock, std::byte{0x5a});
    CallOptions options = Within(200ms);
    options.copier = &holder;
    if (is_put) {
      options.send_payload = second;
    } else {
      options.recv_payload = back;
    }
    client_->Call(is_put ? kPut : kGet, {}, options,
                  [&](const Response& r) { result.set_value(r.status); });
    ASSERT_TRUE(holder.WaitForOne());
    std::this_thread::sleep_for(400ms);  // past the deadline
    EXPECT_EQ(future.wait_for(0ms), std::future_status::timeout)
        << "completed while its copy was held";
    holder.RunAll();
    ASSERT_EQ(future.wait_for(5s), std::future_status::ready);
    EXPECT_EQ(future.get().code(), StatusCode::kDeadlineExceeded);
    if (!is_put) {
      EXPECT_EQ(back, std::vector<std::byte>(kBlock, std::byte{0x5a})) << "copied after all";
    }
  }
  // The server's block is still the first one, and the connection still serves.
  EXPECT_TRUE(MatchesPattern(1, server_block_.bytes().first(kBlock)));
  std::vector<std::byte> reply;
  ASSERT_TRUE(client_->CallSync(kEcho, AsBytes("after"), Within(5s), &reply).ok());
  EXPECT_EQ(AsString(reply), "after");
}

// The server may reuse a reply payload's memory as soon as its `sent` callback runs: the
// client must have its copy by then (over mapped shared memory, the ack follows the copy).
TEST_P(RpcTest, ReplyMemoryReusedAfterSentNeverTearsTheCopy) {
  constexpr size_t kBlock = size_t{8} << 20;
  std::vector<std::byte> block(kBlock), back(kBlock);
  for (int round = 0; round < 10; ++round) {
    FillPattern(round, block);
    CallOptions put = Within(5s);
    put.send_payload = block;
    std::vector<std::byte> reply;
    ASSERT_TRUE(client_->CallSync(kPut, {}, put, &reply).ok());
    CallOptions get = Within(5s);
    get.recv_payload = back;
    size_t got = 0;
    ASSERT_TRUE(client_->CallSync(kGetScribble, {}, get, &reply, &got).ok());
    ASSERT_EQ(got, kBlock);
    ASSERT_TRUE(MatchesPattern(round, back)) << "round " << round << ": torn by the reuse";
  }
}

TEST_P(RpcTest, PutIntoServerHeapMemoryComesAsData) {
  for (size_t n : {size_t{100}, size_t{64} << 10, size_t{3} << 20}) {
    std::vector<std::byte> send(n);
    FillPattern(n, send);
    CallOptions put = Within(10s);
    put.send_payload = send;
    ASSERT_TRUE(client_->CallSync(kPutPlain, {}, put, nullptr).ok()) << n;
    std::lock_guard lock(mu_);
    EXPECT_EQ(plain_.size(), n);
    EXPECT_TRUE(MatchesPattern(n, plain_)) << n;
  }
  EXPECT_EQ(client_->stats().mapped_payloads, 0u);
}

TEST_P(RpcTest, UnregisteredBuffersWorkToo) {
  std::vector<std::byte> send(1 << 20), recv(1 << 20);
  FillPattern(7, send);
  CallOptions put = Within(10s);
  put.send_payload = send;
  ASSERT_TRUE(client_->CallSync(kPut, {}, put, nullptr).ok());
  CallOptions get = Within(10s);
  get.recv_payload = recv;
  size_t got = 0;
  ASSERT_TRUE(client_->CallSync(kGet, {}, get, nullptr, &got).ok());
  EXPECT_EQ(got, send.size());
  EXPECT_TRUE(MatchesPattern(7, recv));
}

TEST_P(RpcTest, ManyConcurrentCallsEachCompleteOnce) {
  constexpr int kCalls = 2000;
  std::atomic<int> completed{0}, ok{0};
  std::vector<std::atomic<int>> seen(kCalls);
  std::promise<void> all;
  for (int i = 0; i < kCalls; ++i) {
    const std::string message = std::to_string(i);
    client_->Call(kEcho, AsBytes(message), Within(20s), [&, i, message](const Response& r) {
      seen[i].fetch_add(1);
      if (r.status.ok() && AsString(r.message) == message) ok.fetch_add(1);
      if (completed.fetch_add(1) + 1 == kCalls) all.set_value();
    });
  }
  ASSERT_EQ(all.get_future().wait_for(30s), std::future_status::ready);
  EXPECT_EQ(ok.load(), kCalls);
  for (auto& s : seen) EXPECT_EQ(s.load(), 1);
}

TEST_P(RpcTest, ReplyPayloadLargerThanBufferIsOutOfRange) {
  std::vector<std::byte> send(64 << 10), recv(1 << 10);
  CallOptions put = Within(5s);
  put.send_payload = send;
  ASSERT_TRUE(client_->CallSync(kPut, {}, put, nullptr).ok());
  CallOptions get = Within(5s);
  get.recv_payload = recv;
  const Status status = client_->CallSync(kGet, {}, get, nullptr);
  EXPECT_EQ(status.code(), StatusCode::kOutOfRange) << status.ToString();
  // The connection still works.
  EXPECT_TRUE(client_->CallSync(kEcho, AsBytes("after"), Within(5s), nullptr).ok());
}

TEST_P(RpcTest, DeadlineExceededWhenServerDoesNotReply) {
  const auto start = Clock::now();
  const Status status = client_->CallSync(kSilent, AsBytes("x"), Within(200ms), nullptr);
  const auto took = Clock::now() - start;
  EXPECT_EQ(status.code(), StatusCode::kDeadlineExceeded) << status.ToString();
  EXPECT_GE(took, 190ms);
  EXPECT_LT(took, 2s);
  // The server learns of the cancellation.
  for (int i = 0; i < 200; ++i) {
    {
      std::lock_guard lock(mu_);
      if (!held_.empty() && held_.front().cancelled()) break;
    }
    std::this_thread::sleep_for(5ms);
  }
  std::lock_guard lock(mu_);
  ASSERT_EQ(held_.size(), 1u);
  EXPECT_TRUE(held_.front().cancelled());
}

TEST_P(RpcTest, LateReplyAfterDeadlineIsDropped) {
  ASSERT_EQ(client_->CallSync(kSilent, AsBytes("x"), Within(100ms), nullptr).code(),
            StatusCode::kDeadlineExceeded);
  {
    std::lock_guard lock(mu_);
    ASSERT_EQ(held_.size(), 1u);
    held_.front().Reply(AsBytes("too late"));
  }
  std::vector<std::byte> reply;
  ASSERT_TRUE(client_->CallSync(kEcho, AsBytes("next"), Within(5s), &reply).ok());
  EXPECT_EQ(AsString(reply), "next");
}

TEST_P(RpcTest, CancelCompletesOnceWithCancelled) {
  std::promise<Status> result;
  std::atomic<int> calls{0};
  const uint64_t id = client_->Call(kSilent, AsBytes("x"), Within(10s), [&](const Response& r) {
    if (calls.fetch_add(1) == 0) result.set_value(r.status);
  });
  std::this_thread::sleep_for(20ms);
  client_->Cancel(id);
  client_->Cancel(id);  // twice: still one callback
  auto future = result.get_future();
  ASSERT_EQ(future.wait_for(2s), std::future_status::ready);
  EXPECT_EQ(future.get().code(), StatusCode::kCancelled);
  std::this_thread::sleep_for(50ms);
  EXPECT_EQ(calls.load(), 1);
}

TEST_P(RpcTest, CancelDuringBulkPutLeavesBufferFree) {
  auto send = client_->AllocateMemory(kMaxBlock);
  ASSERT_TRUE(send.ok());
  for (int i = 0; i < 20; ++i) {
    std::promise<Status> result;
    CallOptions put = Within(10s);
    put.send_payload = send->bytes();
    put.send_region = &*send;
    const uint64_t id =
        client_->Call(kPut, {}, put, [&](const Response& r) { result.set_value(r.status); });
    client_->Cancel(id);
    const Status status = result.get_future().get();
    EXPECT_TRUE(status.ok() || status.code() == StatusCode::kCancelled) << status.ToString();
  }
  EXPECT_TRUE(client_->CallSync(kEcho, AsBytes("still fine"), Within(5s), nullptr).ok());
}

TEST_P(RpcTest, ARequestPayloadAHandlerRefusesLaterIsLetGo) {
  // As a node refusing a store after the call was handed on: the handler keeps the call past
  // the frame's arrival, then answers with an error and never takes the payload. Here the
  // payload comes with the request (as from a client that does not hold it for a pull), so a
  // large one arrives by rendezvous. The transport lets it go when the reply goes; before, a
  // rendezvous payload kept past its frame stayed pending: the sender's send never finished,
  // and UCX could abort at the server's teardown.
  std::vector<std::byte> payload(1 << 20);
  FillPattern(5, payload);
  ASSERT_TRUE(client_->Connect().ok());
  for (int i = 0; i < 8; ++i) {
    FrameHeader header;
    header.kind = FrameKind::kRequest;
    header.method = kSilent;
    header.request_id = (1u << 30) + i;  // no call of the client's has this id
    header.connection_id = client_->connection_id();
    header.timeout_us = 5000000;
    std::vector<std::byte> frame(kFrameHeaderBytes);
    WriteFrame(header, {}, frame);
    auto sent = std::make_shared<std::promise<Status>>();
    ASSERT_TRUE(
        client_->SendRawForTesting(frame, payload, [sent](Status s) { sent->set_value(s); }).ok());
    ServerCall call;
    bool held = false;
    for (int wait = 0; wait < 5000 && !held; ++wait) {
      {
        std::lock_guard lock(mu_);
        if (!held_.empty()) {
          call = std::move(held_.front());
          held_.clear();
          held = true;
          break;
        }
      }
      std::this_thread::sleep_for(1ms);
    }
    ASSERT_TRUE(held);
    ASSERT_EQ(call.payload_bytes(), payload.size());
    call.ReplyError(ResourceExhaustedError("no room"));
    // The payload is let go once the reply goes, so the client's send finishes.
    auto finished = sent->get_future();
    ASSERT_EQ(finished.wait_for(5s), std::future_status::ready) << "payload " << i << " kept";
    EXPECT_TRUE(finished.get().ok());
  }
  // The connection still carries payloads, and both workers tear down cleanly.
  CallOptions put = Within(5s);
  put.send_payload = payload;
  EXPECT_TRUE(client_->CallSync(kPut, {}, put, nullptr).ok());
  std::vector<std::byte> back(payload.size());
  CallOptions get = Within(5s);
  get.recv_payload = back;
  ASSERT_TRUE(client_->CallSync(kGet, {}, get, nullptr).ok());
  EXPECT_TRUE(MatchesPattern(5, back));
  client_.reset();
  server_block_ = MemoryRegion();
  server_.reset();
}

TEST_P(RpcTest, UnknownMethodIsUnimplemented) {
  EXPECT_EQ(client_->CallSync(999, {}, Within(5s), nullptr).code(), StatusCode::kUnimplemented);
}

TEST_P(RpcTest, DroppedCallAnswersInternal) {
  EXPECT_EQ(client_->CallSync(kDrop, {}, Within(5s), nullptr).code(), StatusCode::kInternal);
}

TEST_P(RpcTest, WrongTokenIsUnauthenticated) {
  auto intruder = MakeClient("guess");
  ASSERT_NE(intruder, nullptr);
  EXPECT_EQ(intruder->Connect().code(), StatusCode::kUnauthenticated);
  EXPECT_EQ(intruder->CallSync(kEcho, {}, Within(5s), nullptr).code(),
            StatusCode::kUnauthenticated);
}

TEST_P(RpcTest, NothingListeningIsUnavailable) {
  ClientOptions options;
  options.port = 1;  // nothing listens on port 1
  options.transport = TransportFor(GetParam());
  auto client = RpcClient::Create(options);
  ASSERT_TRUE(client.ok());
  EXPECT_EQ((*client)->CallSync(kEcho, {}, Within(5s), nullptr).code(), StatusCode::kUnavailable);
}

TEST_P(RpcTest, ServerGoneFailsOutstandingThenReconnects) {
  std::promise<Status> result;
  client_->Call(kSilent, AsBytes("x"), Within(10s),
                [&](const Response& r) { result.set_value(r.status); });
  std::this_thread::sleep_for(50ms);
  const uint16_t port = server_->port();
  // The server goes away with the call still held (never answered).
  server_block_ = MemoryRegion();
  server_.reset();
  {
    std::lock_guard lock(mu_);
    held_.clear();  // the calls outlive their server: dropping them sends nothing
  }
  auto future = result.get_future();
  ASSERT_EQ(future.wait_for(3s), std::future_status::ready);
  EXPECT_EQ(future.get().code(), StatusCode::kUnavailable);

  // A new server on the same port: the next call reconnects.
  ServerOptions options;
  options.port = port;
  options.auth_token = "secret";
  options.transport = TransportFor(GetParam());
  auto server = RpcServer::Create(options);
  ASSERT_TRUE(server.ok());
  server_ = std::move(*server);
  server_->Handle(kEcho, [](ServerCall call) { call.Reply(call.request()); });
  ASSERT_TRUE(server_->Start().ok());
  std::vector<std::byte> reply;
  ASSERT_TRUE(client_->CallSync(kEcho, AsBytes("again"), Within(5s), &reply).ok());
  EXPECT_EQ(AsString(reply), "again");
  EXPECT_EQ(client_->stats().connects, 2u);
}

TEST_P(RpcTest, ClientDestroyedWithCallsOutstandingCompletesThem) {
  std::atomic<int> cancelled{0};
  for (int i = 0; i < 10; ++i) {
    client_->Call(kSilent, {}, Within(10s), [&](const Response& r) {
      if (r.status.code() == StatusCode::kCancelled) cancelled.fetch_add(1);
    });
  }
  std::this_thread::sleep_for(50ms);
  client_.reset();
  EXPECT_EQ(cancelled.load(), 10);
}

// Per-namespace tokens: a listed namespace needs its own token, an unlisted one is refused
// when the server has no node-wide token, and served with it when it has.
TEST_P(RpcTest, NamespaceTokensRefuseTheWrongNamespace) {
  for (const bool node_token : {false, true}) {
    ServerOptions options;
    options.transport = TransportFor(GetParam());
    options.tenant_tokens = {{"tenant-a", "token-a"}, {"tenant-b", "token-b"}};
    if (node_token) options.auth_token = "node";
    auto server = RpcServer::Create(options);
    ASSERT_TRUE(server.ok());
    (*server)->Handle(kEcho, [](ServerCall call) { call.Reply(call.request()); });
    ASSERT_TRUE((*server)->Start().ok());
    auto connect = [&](const std::string& ns, const std::string& token) {
      ClientOptions client_options;
      client_options.port = (*server)->port();
      client_options.tenant = ns;
      client_options.auth_token = token;
      client_options.transport = TransportFor(GetParam());
      auto client = RpcClient::Create(client_options);
      return client.ok() ? (*client)->Connect() : client.status();
    };
    EXPECT_TRUE(connect("tenant-a", "token-a").ok());
    EXPECT_TRUE(connect("tenant-b", "token-b").ok());
    // Another namespace's token does not open this one.
    EXPECT_EQ(connect("tenant-a", "token-b").code(), StatusCode::kUnauthenticated);
    EXPECT_EQ(connect("tenant-b", "node").code(), StatusCode::kUnauthenticated);
    const Status other = connect("tenant-c", "token-a");
    if (node_token) {
      EXPECT_EQ(other.code(), StatusCode::kUnauthenticated) << other.ToString();
      EXPECT_TRUE(connect("tenant-c", "node").ok());
      EXPECT_EQ((*server)->stats().refused, 3u);
    } else {
      EXPECT_EQ(other.code(), StatusCode::kPermissionDenied) << other.ToString();
      EXPECT_THAT(std::string(other.message()), ::testing::HasSubstr("not served"));
      EXPECT_EQ(connect("tenant-c", "").code(), StatusCode::kPermissionDenied);
      EXPECT_EQ((*server)->stats().refused, 4u);
    }
  }
}

// Clients on one ClientWorker share its thread; each reply reaches the client that called,
// also with a second server in play, and one client going away leaves the others working.
TEST_P(RpcTest, ClientsShareOneWorker) {
  auto worker = ClientWorker::Create(TransportFor(GetParam()));
  ASSERT_TRUE(worker.ok()) << worker.status().ToString();
  ServerOptions second_options;
  second_options.transport = TransportFor(GetParam());
  auto second = RpcServer::Create(second_options);
  ASSERT_TRUE(second.ok());
  (*second)->Handle(
      kEcho, [](ServerCall call) { call.Reply(AsBytes("second:" + AsString(call.request()))); });
  ASSERT_TRUE((*second)->Start().ok());

  std::vector<std::unique_ptr<RpcClient>> clients;
  for (int i = 0; i < 6; ++i) {
    ClientOptions options;
    options.port = i % 2 == 0 ? server_->port() : (*second)->port();
    options.auth_token = i % 2 == 0 ? "secret" : "";
    options.worker = *worker;
    auto client = RpcClient::Create(options);
    ASSERT_TRUE(client.ok()) << client.status().ToString();
    clients.push_back(std::move(*client));
  }
  // Concurrent calls from threads, a block each way for the first server's clients.
  std::atomic<int> wrong{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < 6; ++i) {
    threads.emplace_back([&, i] {
      for (int n = 0; n < 50; ++n) {
        const std::string body = fmt::format("c{}n{}", i, n);
        std::vector<std::byte> reply;
        const Status s = clients[i]->CallSync(kEcho, AsBytes(body), Within(5s), &reply);
        const std::string expected = i % 2 == 0 ? body : "second:" + body;
        if (!s.ok() || AsString(reply) != expected) wrong.fetch_add(1);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(wrong.load(), 0);
  // One thread drives them all.
  std::promise<std::thread::id> on0, on1;
  clients[0]->RunOnProgressThread([&] { on0.set_value(std::this_thread::get_id()); });
  clients[5]->RunOnProgressThread([&] { on1.set_value(std::this_thread::get_id()); });
  EXPECT_EQ(on0.get_future().get(), on1.get_future().get());

  // A client destroyed with a call outstanding completes it; the others go on.
  std::promise<Status> held;
  clients[2]->Call(kSilent, {}, Within(10s), [&](const Response& r) { held.set_value(r.status); });
  std::this_thread::sleep_for(20ms);
  clients[2].reset();
  EXPECT_EQ(held.get_future().get().code(), StatusCode::kCancelled);
  std::vector<std::byte> reply;
  ASSERT_TRUE(clients[4]->CallSync(kEcho, AsBytes("still"), Within(5s), &reply).ok());
  EXPECT_EQ(AsString(reply), "still");

  // Blocks move on a shared worker as on an own one.
  std::vector<std::byte> block(1 << 20), back(1 << 20);
  FillPattern(77, block);
  CallOptions put = Within(5s);
  put.send_payload = block;
  ASSERT_TRUE(clients[0]->CallSync(kPut, {}, put, &reply).ok());
  CallOptions get = Within(5s);
  get.recv_payload = back;
  size_t got = 0;
  ASSERT_TRUE(clients[4]->CallSync(kGet, {}, get, &reply, &got).ok());
  EXPECT_EQ(got, block.size());
  EXPECT_TRUE(MatchesPattern(77, back));
  EXPECT_EQ((*worker)->unrouted_frames(), 0u);
  clients.clear();
}

// A server with several progress threads hands each connection to the least busy one, which
// serves it alone from its hello on (its handlers included), and blocks move between any of
// them and memory the server allocated once (its workers share one UCX context).
TEST_P(RpcTest, ConnectionsSpreadOverTheServersProgressThreads) {
  constexpr size_t kThreads = 3;
  constexpr size_t kClients = 6;
  constexpr size_t kBlock = 256 << 10;
  ServerOptions options;
  options.transport = TransportFor(GetParam());
  options.transport.progress_threads = kThreads;
  auto created = RpcServer::Create(options);
  ASSERT_TRUE(created.ok()) << created.status().ToString();
  std::unique_ptr<RpcServer> server = std::move(*created);
  EXPECT_EQ(server->progress_threads(), kThreads);
  auto memory = server->AllocateMemory(kClients * kBlock);
  ASSERT_TRUE(memory.ok()) << memory.status().ToString();
  std::mutex mu;
  std::map<uint64_t, std::set<std::thread::id>> threads_of;  // connection -> handler threads
  auto note = [&](const ServerCall& call) {
    std::lock_guard lock(mu);
    threads_of[call.connection_id()].insert(std::this_thread::get_id());
  };
  // The request names the client's slot (its index); puts land there, gets read it back.
  auto slot = [&](const ServerCall& call) {
    const size_t i = std::stoul(AsString(call.request()));
    return memory->bytes().subspan(i * kBlock, kBlock);
  };
  server->Handle(kPut, [&](ServerCall call) {
    note(call);
    auto shared = std::make_shared<ServerCall>(std::move(call));
    shared->ReceivePayload(slot(*shared), &*memory, [shared](Status s) {
      if (!s.ok()) {
        shared->ReplyError(s);
        return;
      }
      shared->Reply({});
    });
  });
  server->Handle(kGet, [&](ServerCall call) {
    note(call);
    call.Reply({}, slot(call), &*memory);
  });
  ASSERT_TRUE(server->Start().ok());

  std::vector<std::unique_ptr<RpcClient>> clients;
  for (size_t i = 0; i < kClients; ++i) {
    ClientOptions client_options;
    client_options.port = server->port();
    client_options.transport = TransportFor(GetParam());
    auto client = RpcClient::Create(client_options);
    ASSERT_TRUE(client.ok()) << client.status().ToString();
    ASSERT_TRUE((*client)->Connect().ok());
    clients.push_back(std::move(*client));
  }
  std::atomic<int> wrong{0};
  std::vector<std::thread> threads;
  for (size_t i = 0; i < kClients; ++i) {
    threads.emplace_back([&, i] {
      std::vector<std::byte> block(kBlock), back(kBlock);
      const std::string index = std::to_string(i);
      for (int n = 0; n < 20; ++n) {
        const uint64_t seed = i * 1000 + n;
        FillPattern(seed, block);
        CallOptions put = Within(10s);
        put.send_payload = block;
        std::vector<std::byte> reply;
        if (!clients[i]->CallSync(kPut, AsBytes(index), put, &reply).ok()) wrong.fetch_add(1);
        CallOptions get = Within(10s);
        get.recv_payload = back;
        size_t got = 0;
        if (!clients[i]->CallSync(kGet, AsBytes(index), get, &reply, &got).ok() || got != kBlock ||
            !MatchesPattern(seed, back)) {
          wrong.fetch_add(1);
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(wrong.load(), 0);
  std::map<std::thread::id, size_t> connections_per_thread;
  {
    std::lock_guard lock(mu);
    ASSERT_EQ(threads_of.size(), kClients);
    for (const auto& [connection, seen] : threads_of) {
      EXPECT_EQ(seen.size(), 1u) << "connection " << connection << " served by several threads";
      ++connections_per_thread[*seen.begin()];
    }
  }
  EXPECT_EQ(connections_per_thread.size(), kThreads);
  for (const auto& [thread, n] : connections_per_thread) EXPECT_EQ(n, kClients / kThreads);
  EXPECT_EQ(server->connection_count(), kClients);
  clients.clear();
  server->Stop();
}

// Clients on one worker connecting at once from many threads: UCX pairs each of the client's
// endpoints with one of the server's by the order each side made them, and that order can
// differ between the two sides. Half of them leaving must leave the others working, their
// blocks too (a server that closed the endpoint a leaving client's hello made would reset
// another client's).
TEST_P(RpcTest, ClientsConnectingAtOnceOutliveTheOnesThatLeave) {
  auto worker = ClientWorker::Create(TransportFor(GetParam()));
  ASSERT_TRUE(worker.ok()) << worker.status().ToString();
  constexpr int kClients = 32;
  std::vector<std::unique_ptr<RpcClient>> clients(kClients);
  std::vector<std::thread> threads;
  for (int i = 0; i < kClients; ++i) {
    threads.emplace_back([&, i] {
      ClientOptions options;
      options.port = server_->port();
      options.auth_token = "secret";
      options.transport = TransportFor(GetParam());
      options.worker = *worker;
      options.connect_timeout = 10000ms;
      auto client = RpcClient::Create(options);
      if (client.ok()) clients[i] = std::move(*client);
    });
  }
  for (std::thread& t : threads) t.join();
  for (int i = 0; i < kClients; ++i) ASSERT_NE(clients[i], nullptr) << "client " << i;
  std::vector<std::byte> reply;
  for (int i = 0; i < kClients; ++i) {
    ASSERT_TRUE(clients[i]->CallSync(kEcho, AsBytes("first"), Within(5s), &reply).ok());
  }
  // Every other one leaves; the server sees them go.
  const size_t stay = server_->connection_count() - kClients / 2;
  for (int i = 0; i < kClients; i += 2) clients[i].reset();
  const auto deadline = Clock::now() + 10s;
  while (server_->connection_count() > stay && Clock::now() < deadline) {
    std::this_thread::sleep_for(5ms);
  }
  ASSERT_EQ(server_->connection_count(), stay);
  // The rest still call, and move blocks both ways.
  std::vector<std::byte> block(256 << 10), back(256 << 10);
  for (int i = 1; i < kClients; i += 2) {
    const std::string body = fmt::format("still {}", i);
    const Status s = clients[i]->CallSync(kEcho, AsBytes(body), Within(5s), &reply);
    ASSERT_TRUE(s.ok()) << "client " << i << ": " << s.ToString();
    EXPECT_EQ(AsString(reply), body);
    FillPattern(static_cast<uint64_t>(i), block);
    CallOptions put = Within(5s);
    put.send_payload = block;
    ASSERT_TRUE(clients[i]->CallSync(kPut, {}, put, &reply).ok()) << "client " << i;
    CallOptions get = Within(5s);
    get.recv_payload = back;
    size_t got = 0;
    ASSERT_TRUE(clients[i]->CallSync(kGet, {}, get, &reply, &got).ok()) << "client " << i;
    EXPECT_TRUE(MatchesPattern(static_cast<uint64_t>(i), back)) << "client " << i;
  }
  for (int i = 1; i < kClients; i += 2) {
    EXPECT_EQ(clients[i]->stats().connects, 1u) << "client " << i << " had to reconnect";
  }
  clients.clear();
}

// A process's channels spread over its pool's workers: a new worker while every one has a
// channel and the pool is not full, then the one with the fewest channels.
TEST(ClientWorkerPoolTest, ChannelsSpreadOverAtMostSizeWorkers) {
  auto pool = ClientWorkerPool::Create(TransportFor("tcp"), 2);
  EXPECT_EQ(pool->size(), 2u);
  std::vector<std::shared_ptr<ClientWorker>> channels;  // each holds its worker, as a channel
  for (int i = 0; i < 5; ++i) {
    auto worker = pool->Next();
    ASSERT_TRUE(worker.ok()) << worker.status().ToString();
    channels.push_back(std::move(*worker));
  }
  EXPECT_EQ(pool->workers(), 2u);
  std::map<ClientWorker*, int> per_worker;
  for (const auto& worker : channels) ++per_worker[worker.get()];
  ASSERT_EQ(per_worker.size(), 2u);
  for (const auto& [worker, n] : per_worker) EXPECT_GE(n, 2);
  // A worker whose channels all went takes the next channel before the busier one.
  ClientWorker* busy = channels[0].get();
  std::erase_if(channels, [&](const auto& w) { return w.get() != busy; });
  auto next = pool->Next();
  ASSERT_TRUE(next.ok());
  EXPECT_NE(next->get(), busy);
  // The default size: one per core, at most 4.
  EXPECT_EQ(ClientWorkerPool::Create(TransportFor("tcp"))->size(),
            std::clamp<size_t>(std::thread::hardware_concurrency(), 1, 4));
}

TEST(ClientWorkerPoolTest, OnePoolPerProcessAndSetting) {
  TransportOptions tcp = TransportFor("tcp");
  auto a = ClientWorkerPool::ForProcess(tcp);
  EXPECT_EQ(ClientWorkerPool::ForProcess(tcp), a);
  TransportOptions other = tcp;
  other.spin_before_sleep = std::chrono::microseconds(7);
  EXPECT_NE(ClientWorkerPool::ForProcess(other), a);
}

INSTANTIATE_TEST_SUITE_P(Tls, RpcTest, ::testing::Values("shm", "shm_rndv", "tcp"),
                         [](const auto& param_info) { return param_info.param; });

}  // namespace
}  // namespace kvstash::transport
