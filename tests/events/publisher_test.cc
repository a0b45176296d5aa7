// The publisher against real libzmq sockets, as a vLLM subscriber drives them: a SUB socket for
// the three-frame messages, a DEALER for replay requests.
#include "kvstash/events/publisher.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <zmq.h>

#include <chrono>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace kvstash::events {
namespace {

using ::testing::HasSubstr;
using Clock = std::chrono::steady_clock;

class Context {
 public:
  Context() : ctx_(zmq_ctx_new()) {}
  ~Context() {
    for (void* s : sockets_) zmq_close(s);
    zmq_ctx_term(ctx_);
  }
  void* Socket(int type, const std::string& endpoint) {
    void* s = zmq_socket(ctx_, type);
    const int linger = 0;
    zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof(linger));
    const int timeout_ms = 10000;  // every receive of the test is bounded
    zmq_setsockopt(s, ZMQ_RCVTIMEO, &timeout_ms, sizeof(timeout_ms));
    if (type == ZMQ_SUB) zmq_setsockopt(s, ZMQ_SUBSCRIBE, "", 0);
    EXPECT_EQ(zmq_connect(s, endpoint.c_str()), 0) << zmq_strerror(zmq_errno());
    sockets_.push_back(s);
    return s;
  }

 private:
  void* ctx_;
  std::vector<void*> sockets_;
};

// One whole message, or nullopt after the socket's receive timeout.
std::optional<std::vector<std::string>> Receive(void* socket) {
  std::vector<std::string> frames;
  int more = 1;
  while (more != 0) {
    zmq_msg_t msg;
    zmq_msg_init(&msg);
    if (zmq_msg_recv(&msg, socket, 0) < 0) {
      zmq_msg_close(&msg);
      return std::nullopt;
    }
    frames.emplace_back(static_cast<const char*>(zmq_msg_data(&msg)), zmq_msg_size(&msg));
    more = zmq_msg_more(&msg);
    zmq_msg_close(&msg);
  }
  return frames;
}

void SendFrames(void* socket, const std::vector<std::string>& frames) {
  for (size_t i = 0; i < frames.size(); ++i) {
    ASSERT_GE(zmq_send(socket, frames[i].data(), frames[i].size(),
                       i + 1 < frames.size() ? ZMQ_SNDMORE : 0),
              0);
  }
}

// Waits until `done` holds, for at most 10 s (the publisher counts a replay after sending it).
template <typename F>
bool Eventually(F done) {
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  while (!done()) {
    if (Clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

KvEventBatch Batch(uint64_t hash) {
  BlockStored e;
  e.block_hashes = {hash};
  e.medium = std::string(kMediumCpu);
  return KvEventBatch{1.0, {e}, std::nullopt};
}

uint64_t FirstHash(const std::string& payload) {
  Result<KvEventBatch> b = DecodeBatch(std::as_bytes(std::span(payload)));
  EXPECT_TRUE(b.ok()) << b.status().ToString();
  if (!b.ok()) return 0;
  return std::get<uint64_t>(std::get<BlockStored>(b->events.at(0)).block_hashes.at(0));
}

int64_t Seq(const std::string& frame) { return *DecodeSequence(std::as_bytes(std::span(frame))); }

std::unique_ptr<EventPublisher> Start(PublisherOptions options = {}) {
  options.endpoint = "tcp://127.0.0.1:*";
  options.replay_endpoint = "tcp://127.0.0.1:*";
  if (options.default_topic.empty()) options.default_topic = "default";
  Result<std::unique_ptr<EventPublisher>> p = EventPublisher::Create(options);
  EXPECT_TRUE(p.ok()) << p.status().ToString();
  return p.ok() ? std::move(*p) : nullptr;
}

// A SUB socket joins asynchronously: publishes on a topic of its own until one arrives.
void AwaitSubscribed(EventPublisher& publisher, void* sub) {
  const int short_ms = 50;
  zmq_setsockopt(sub, ZMQ_RCVTIMEO, &short_ms, sizeof(short_ms));
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  while (Clock::now() < deadline) {
    publisher.Publish("probe", Batch(0));
    if (std::optional<std::vector<std::string>> m = Receive(sub)) break;
  }
  // Drain the probes still coming.
  while (Receive(sub)) {
  }
  const int long_ms = 10000;
  zmq_setsockopt(sub, ZMQ_RCVTIMEO, &long_ms, sizeof(long_ms));
}

TEST(EventPublisherTest, SendsTopicSequenceAndBatchWithNumbersPerTopic) {
  std::unique_ptr<EventPublisher> publisher = Start();
  ASSERT_NE(publisher, nullptr);
  EXPECT_THAT(publisher->endpoint(), HasSubstr("tcp://127.0.0.1:"));
  Context ctx;
  void* sub = ctx.Socket(ZMQ_SUB, publisher->endpoint());
  AwaitSubscribed(*publisher, sub);

  ASSERT_TRUE(publisher->Publish("a", Batch(10)));
  ASSERT_TRUE(publisher->Publish("b", Batch(20)));
  ASSERT_TRUE(publisher->Publish("a", Batch(11)));
  const std::vector<std::tuple<std::string, int64_t, uint64_t>> expected = {
      {"a", 0, 10}, {"b", 0, 20}, {"a", 1, 11}};
  for (const auto& [topic, seq, hash] : expected) {
    std::optional<std::vector<std::string>> m = Receive(sub);
    ASSERT_TRUE(m.has_value());
    ASSERT_EQ(m->size(), 3u);
    EXPECT_EQ((*m)[0], topic);
    EXPECT_EQ(Seq((*m)[1]), seq);
    EXPECT_EQ(FirstHash((*m)[2]), hash);
  }
  EXPECT_EQ(publisher->next_sequence("a"), 2);
  EXPECT_EQ(publisher->next_sequence("c"), 0);
}

TEST(EventPublisherTest, ReplaysATopicFromASequenceNumberThenMinusOne) {
  std::unique_ptr<EventPublisher> publisher = Start();
  ASSERT_NE(publisher, nullptr);
  for (uint64_t i = 0; i < 5; ++i) ASSERT_TRUE(publisher->Publish("default", Batch(100 + i)));
  ASSERT_TRUE(publisher->Publish("other", Batch(200)));
  publisher->Flush();
  Context ctx;
  void* dealer = ctx.Socket(ZMQ_DEALER, publisher->replay_endpoint());

  // vLLM's request: [empty, start], for the default topic.
  SendFrames(dealer, {"", EncodeSequence(2)});
  for (int64_t seq = 2; seq < 5; ++seq) {
    std::optional<std::vector<std::string>> m = Receive(dealer);
    ASSERT_TRUE(m.has_value());
    ASSERT_EQ(m->size(), 3u);
    EXPECT_EQ((*m)[0], "");
    EXPECT_EQ(Seq((*m)[1]), seq);
    EXPECT_EQ(FirstHash((*m)[2]), 100 + static_cast<uint64_t>(seq));
  }
  std::optional<std::vector<std::string>> end = Receive(dealer);
  ASSERT_TRUE(end.has_value());
  ASSERT_EQ(end->size(), 3u);
  EXPECT_EQ(Seq((*end)[1]), -1);
  EXPECT_EQ((*end)[2], "");

  // With a topic frame: that topic's batches only.
  SendFrames(dealer, {"", EncodeSequence(0), "other"});
  std::optional<std::vector<std::string>> m = Receive(dealer);
  ASSERT_TRUE(m.has_value());
  EXPECT_EQ(FirstHash(m->at(2)), 200u);
  end = Receive(dealer);
  ASSERT_TRUE(end.has_value());
  EXPECT_EQ(Seq(end->at(1)), -1);
  EXPECT_TRUE(Eventually([&] { return publisher->stats().replays_served == 2; }));
  EXPECT_EQ(publisher->stats().batches_replayed, 4u);
}

TEST(EventPublisherTest, MalformedReplayRequestsAreIgnoredAndCounted) {
  std::unique_ptr<EventPublisher> publisher = Start();
  ASSERT_NE(publisher, nullptr);
  ASSERT_TRUE(publisher->Publish("default", Batch(1)));
  publisher->Flush();
  Context ctx;
  void* dealer = ctx.Socket(ZMQ_DEALER, publisher->replay_endpoint());
  SendFrames(dealer, {"", "short"});                                    // not 8 bytes
  SendFrames(dealer, {"x", EncodeSequence(0)});                         // no empty delimiter
  SendFrames(dealer, {"", EncodeSequence(0), "t", "extra"});            // too many frames
  SendFrames(dealer, {"", EncodeSequence(0), std::string(1000, 'x')});  // a topic too long
  // A good request after them is still served: its reply is the only one that comes.
  SendFrames(dealer, {"", EncodeSequence(0)});
  std::optional<std::vector<std::string>> m = Receive(dealer);
  ASSERT_TRUE(m.has_value());
  EXPECT_EQ(FirstHash(m->at(2)), 1u);
  std::optional<std::vector<std::string>> end = Receive(dealer);
  ASSERT_TRUE(end.has_value());
  EXPECT_EQ(Seq(end->at(1)), -1);
  EXPECT_TRUE(Eventually([&] { return publisher->stats().replays_served == 1; }));
  EXPECT_EQ(publisher->stats().replays_refused, 4u);
}

TEST(EventPublisherTest, AReplayShowsTheGapOfBatchesNoLongerBuffered) {
  PublisherOptions options;
  options.buffer_batches = 3;
  std::unique_ptr<EventPublisher> publisher = Start(options);
  ASSERT_NE(publisher, nullptr);
  for (uint64_t i = 0; i < 6; ++i) ASSERT_TRUE(publisher->Publish("default", Batch(i)));
  publisher->Flush();
  Context ctx;
  void* dealer = ctx.Socket(ZMQ_DEALER, publisher->replay_endpoint());
  SendFrames(dealer, {"", EncodeSequence(0)});
  std::vector<int64_t> seqs;
  while (true) {
    std::optional<std::vector<std::string>> m = Receive(dealer);
    ASSERT_TRUE(m.has_value());
    const int64_t seq = Seq(m->at(1));
    if (seq == -1) break;
    seqs.push_back(seq);
  }
  // Asked from 0, given 3..5: the requester sees that 0..2 are gone.
  EXPECT_EQ(seqs, (std::vector<int64_t>{3, 4, 5}));
}

TEST(EventPublisherTest, EndpointsItCannotUseAreErrors) {
  PublisherOptions options;
  options.endpoint = "nonsense";
  Result<std::unique_ptr<EventPublisher>> p = EventPublisher::Create(options);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(p.status().message()), HasSubstr("nonsense"));

  std::unique_ptr<EventPublisher> first = Start();
  ASSERT_NE(first, nullptr);
  options.endpoint = "tcp://127.0.0.1:*";
  options.replay_endpoint = first->replay_endpoint();  // taken
  p = EventPublisher::Create(options);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), StatusCode::kUnavailable);
  EXPECT_THAT(std::string(p.status().message()), HasSubstr("replay"));
}

}  // namespace
}  // namespace kvstash::events
