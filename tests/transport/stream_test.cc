// The stream transport (stream.h) against hostile and stalled peers: raw sockets that send what no
// kvstash peer would (garbage for a hello, frames with a bad field) or stop mid-frame, on both
// ends: a raw client against a StreamServer, a StreamClient against a raw server the test
// scripts. The contract every transport keeps (echo, payloads, deadlines, cancel, reconnect) is
// contract_test.cc's; here are the byte stream's own cases. Nothing a peer sends may crash the
// other end, and a server serves its other clients on.

#include "kvstash/transport/stream.h"

#include <arpa/inet.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "call_helpers.h"
#include "kvstash/proto/wire.pb.h"
#include "kvstash/transport/channel.h"
#include "stream_frame.h"

namespace kvstash::transport {
namespace {

using namespace std::chrono_literals;
using stream::kStreamHeaderBytes;
using stream::StreamHeader;
using stream::StreamKind;
using test_calls::AsBytes;
using test_calls::AsString;
using test_calls::Await;
using test_calls::CallAndWait;
using test_calls::Outcome;
using test_calls::Start;
using test_calls::WaitFor;
using test_calls::Within;
using ::testing::AnyOf;
using ::testing::HasSubstr;

constexpr uint16_t kEcho = 1;       // replies with the request
constexpr uint16_t kPut = 2;        // receives the payload into heap memory, replies its size
constexpr uint16_t kHold = 3;       // keeps the call unanswered until the test takes it
constexpr uint16_t kNoReceive = 4;  // replies at once, without receiving the payload
constexpr uint16_t kSlowPut = 5;    // receives the payload 500 ms late, from another thread
constexpr uint16_t kBig = 6;        // replies with a 32 MiB payload
constexpr uint16_t kUnknown = 99;

constexpr size_t kMiB = size_t{1} << 20;
constexpr size_t kMaxMessage = 64 << 10;  // the server's limits in these tests
constexpr size_t kMaxPayload = 48 * kMiB;

// The byte at offset i of the payloads of these tests: no run of it repeats at a short period,
// so a payload shifted or mixed with another shows.
std::byte Pattern(size_t i) { return std::byte((i * 131 + (i >> 12)) & 0xff); }
std::vector<std::byte> PatternBlock(size_t bytes) {
  std::vector<std::byte> block(bytes);
  for (size_t i = 0; i < bytes; ++i) block[i] = Pattern(i);
  return block;
}

// ---- Raw sockets -------------------------------------------------------------------------------

// One end of a TCP connection on loopback, blocking with short timeouts under deadlines of its
// own: a peer that writes and reads byte by byte what the test says. Move-only; closes its
// socket. Not thread-safe.
class RawSocket {
 public:
  enum class End { kOk, kClosed, kTimedOut };

  RawSocket() = default;
  explicit RawSocket(int fd) : fd_(fd) {
    if (fd_ < 0) return;
    const timeval tick{.tv_sec = 0, .tv_usec = 50'000};
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tick, sizeof(tick));
    ::setsockopt(fd_, SOL_SOCKET, SO_SNDTIMEO, &tick, sizeof(tick));
  }
  RawSocket(RawSocket&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  RawSocket& operator=(RawSocket&& other) noexcept {
    if (this != &other) {
      Close();
      fd_ = std::exchange(other.fd_, -1);
    }
    return *this;
  }
  ~RawSocket() { Close(); }

  // A connection to 127.0.0.1:port (invalid when refused); `receive_buffer` > 0 shrinks its
  // receive buffer first, so that a peer's writes soon block.
  static RawSocket Connect(uint16_t port, int receive_buffer = 0) {
    RawSocket s(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!s.ok()) return s;
    if (receive_buffer > 0) {
      ::setsockopt(s.fd_, SOL_SOCKET, SO_RCVBUF, &receive_buffer, sizeof(receive_buffer));
    }
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_port = htons(port);
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::connect(s.fd_, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) return {};
    return s;
  }

  bool ok() const { return fd_ >= 0; }
  void Close() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

  // Whether all of `bytes` went before `wait` passed (false also when the peer closed).
  bool SendAll(std::string_view bytes, std::chrono::milliseconds wait = 20s) {
    const auto give_up = Clock::now() + wait;
    while (!bytes.empty()) {
      const ssize_t sent = ::send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL);
      if (sent > 0) {
        bytes.remove_prefix(static_cast<size_t>(sent));
      } else if (sent < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
        return false;
      } else if (Clock::now() > give_up) {
        return false;
      }
    }
    return true;
  }

  // Reads exactly n bytes into *out, unless the peer closes (or resets) first or `wait` passes.
  End RecvExactly(size_t n, std::string* out, std::chrono::milliseconds wait = 20s) {
    const auto give_up = Clock::now() + wait;
    out->assign(n, '\0');
    size_t got = 0;
    while (got < n) {
      const ssize_t r = ::recv(fd_, out->data() + got, n - got, 0);
      if (r > 0) {
        got += static_cast<size_t>(r);
      } else if (r == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
        return End::kClosed;
      } else if (Clock::now() > give_up) {
        return End::kTimedOut;
      }
    }
    return End::kOk;
  }

  // Reads and drops what comes until the peer closes (true) or `wait` passes (false).
  bool WaitClosed(std::chrono::milliseconds wait = 20s) {
    std::string scratch;
    for (const auto give_up = Clock::now() + wait; Clock::now() <= give_up;) {
      if (RecvExactly(64 << 10, &scratch, 50ms) == End::kClosed) return true;
    }
    return false;
  }

 private:
  int fd_ = -1;
};

// A listening socket on an ephemeral loopback port, and a script the test writes that plays the
// server on a thread of its own: a kvstash server as a hostile or stalled one would act. The
// destructor (or Join) waits for the script, which must end by deadlines of its own.
class RawServer {
 public:
  RawServer() {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t length = sizeof(address);
    if (fd_ < 0 || ::bind(fd_, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0 ||
        ::listen(fd_, 16) != 0 ||
        ::getsockname(fd_, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
      ADD_FAILURE() << "no listening socket on loopback: " << std::strerror(errno);
      return;
    }
    port_ = ntohs(address.sin_port);
  }
  ~RawServer() {
    Join();
    if (fd_ >= 0) ::close(fd_);
  }

  uint16_t port() const { return port_; }
  // The next connection, or an invalid socket when none came within `wait`.
  RawSocket Accept(std::chrono::milliseconds wait = 20s) {
    pollfd ready{.fd = fd_, .events = POLLIN, .revents = 0};
    if (::poll(&ready, 1, static_cast<int>(wait.count())) != 1) return {};
    return RawSocket(::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC));
  }
  template <typename Script>
  void Run(Script script) {
    thread_ = std::thread(std::move(script));
  }
  void Join() {
    if (thread_.joinable()) thread_.join();
  }

 private:
  int fd_ = -1;
  uint16_t port_ = 0;
  std::thread thread_;
};

// ---- The hello and frames, as bytes -------------------------------------------------------------

// The hello's framing (transport/src/bootstrap.h): a 4-byte little-endian length, the protobuf.
std::string Framed(const google::protobuf::MessageLite& message) {
  std::string out(4, '\0');
  const auto length = static_cast<uint32_t>(message.ByteSizeLong());
  std::memcpy(out.data(), &length, 4);
  message.AppendToString(&out);
  return out;
}

template <typename Message>
std::optional<Message> ReadFramed(RawSocket& s, std::chrono::milliseconds wait = 20s) {
  std::string length_bytes, body;
  if (s.RecvExactly(4, &length_bytes, wait) != RawSocket::End::kOk) return std::nullopt;
  uint32_t length = 0;
  std::memcpy(&length, length_bytes.data(), 4);
  if (length > (64 << 10) || s.RecvExactly(length, &body, wait) != RawSocket::End::kOk) {
    return std::nullopt;
  }
  Message message;
  if (!message.ParseFromString(body)) return std::nullopt;
  return message;
}

wire::Hello MakeHello(const std::string& token) {
  wire::Hello hello;
  hello.set_protocol_version(wire::PROTOCOL_VERSION_CURRENT);
  hello.set_namespace_("default");
  hello.set_auth_token(token);
  hello.set_client_name("stream_test raw peer");
  return hello;
}

// A frame's header as the transport encodes it, its sizes as given (not those of what follows).
std::string HeaderBytes(const StreamHeader& header) {
  std::string out(kStreamHeaderBytes, '\0');
  stream::EncodeStreamHeader(header, reinterpret_cast<std::byte*>(out.data()));
  return out;
}

// A header with `patch` written over its bytes at `offset`: a field no encoder writes.
std::string PatchedHeader(const StreamHeader& header, size_t offset, std::string_view patch) {
  std::string out = HeaderBytes(header);
  out.replace(offset, patch.size(), patch);
  return out;
}

// A whole frame: the header with the sizes of `message` and `payload`, then both.
std::string Frame(StreamHeader header, std::string_view message, std::string_view payload = {}) {
  header.message_bytes = static_cast<uint32_t>(message.size());
  header.payload_bytes = static_cast<uint32_t>(payload.size());
  std::string out = HeaderBytes(header);
  out.append(message);
  out.append(payload);
  return out;
}

StreamHeader Request(uint16_t method, uint64_t id) {
  return StreamHeader{.kind = StreamKind::kRequest, .method = method, .request_id = id};
}
StreamHeader ResponseTo(uint64_t id) {
  return StreamHeader{.kind = StreamKind::kResponse, .request_id = id};
}

struct ReadFrame {
  StreamHeader header;
  std::string message;
  std::string payload;
};

// Reads one whole frame from the peer, checked as the reader's end would check it: `server` for
// the server's end (which takes requests). Nullopt, the test failed, when none came whole.
std::optional<ReadFrame> ReadFrameFrom(RawSocket& s, bool server,
                                       std::chrono::milliseconds wait = 20s) {
  std::string head;
  if (s.RecvExactly(kStreamHeaderBytes, &head, wait) != RawSocket::End::kOk) return std::nullopt;
  const stream::StreamLimits limits{
      .server = server, .max_message_bytes = 1u << 30, .max_payload_bytes = 1u << 30};
  const auto parsed = stream::ParseStreamHeader(
      std::span<const std::byte, kStreamHeaderBytes>(
          reinterpret_cast<const std::byte*>(head.data()), kStreamHeaderBytes),
      limits);
  if (!parsed.ok()) {
    ADD_FAILURE() << "the peer sent a malformed frame: " << parsed.status().ToString();
    return std::nullopt;
  }
  ReadFrame frame;
  frame.header = *parsed;
  if (s.RecvExactly(frame.header.message_bytes, &frame.message, wait) != RawSocket::End::kOk ||
      s.RecvExactly(frame.header.payload_bytes, &frame.payload, wait) != RawSocket::End::kOk) {
    ADD_FAILURE() << "the peer stopped inside a frame";
    return std::nullopt;
  }
  return frame;
}

// ---- A real server, raw clients ---------------------------------------------------------------

class StreamServerTest : public ::testing::Test {
 protected:
  void StartServer(std::chrono::milliseconds stall_timeout = 10s) {
    ServerOptions options;
    options.auth_token = "secret";
    options.hello_timeout = 1s;
    options.transport.max_message_bytes = kMaxMessage;
    options.transport.max_payload_bytes = kMaxPayload;
    options.transport.stall_timeout = stall_timeout;
    options.transport.progress_threads = 2;
    auto server = StreamServer::Create(options);
    ASSERT_TRUE(server.ok()) << server.status().ToString();
    server_ = std::move(*server);

    server_->Handle(kEcho, [](ServerCall call) { call.Reply(call.request()); });
    server_->Handle(kPut, [this](ServerCall call) {
      auto buffer = std::make_shared<std::vector<std::byte>>(call.payload_bytes());
      auto shared = std::make_shared<ServerCall>(std::move(call));
      shared->ReceivePayload(*buffer, nullptr, [this, shared, buffer](Status s) {
        {
          std::lock_guard lock(mu_);
          receives_.push_back(s);
        }
        if (s.ok()) shared->Reply(AsBytes(std::to_string(buffer->size())));
      });
    });
    server_->Handle(kHold, [this](ServerCall call) {
      std::lock_guard lock(mu_);
      held_.push_back(std::move(call));
    });
    server_->Handle(kNoReceive, [](ServerCall call) { call.Reply(AsBytes("not received")); });
    server_->Handle(kSlowPut, [this](ServerCall call) {
      // The handler must not block its progress thread: the late receive is another thread's.
      std::lock_guard lock(mu_);
      threads_.emplace_back([this, shared = std::make_shared<ServerCall>(std::move(call))] {
        std::this_thread::sleep_for(500ms);
        auto buffer = std::make_shared<std::vector<std::byte>>(shared->payload_bytes());
        shared->ReceivePayload(*buffer, nullptr, [this, shared, buffer](Status s) {
          size_t mismatch = 0;
          while (mismatch < buffer->size() && (*buffer)[mismatch] == Pattern(mismatch)) ++mismatch;
          std::lock_guard guard(mu_);
          slow_receive_ = {s, mismatch == buffer->size() ? std::string::npos : mismatch};
        });
      });
    });
    server_->Handle(kBig, [this](ServerCall call) {
      auto block = std::make_shared<std::vector<std::byte>>(32 * kMiB, std::byte{7});
      call.Reply(AsBytes("big"), *block, nullptr, [this, block](Status s) {
        std::lock_guard lock(mu_);
        sents_.push_back(s);
      });
    });
    server_->OnDisconnect([this](uint64_t) { disconnects_.fetch_add(1); });
    ASSERT_TRUE(server_->Start().ok());
    ASSERT_NE(server_->port(), 0);
  }

  void TearDown() override {
    std::vector<std::thread> threads;
    {
      std::lock_guard lock(mu_);
      held_.clear();
      threads.swap(threads_);
    }
    for (std::thread& t : threads) t.join();
    if (server_) server_->Stop();
    server_.reset();
  }

  std::unique_ptr<StreamClient> Client(const std::string& token = "secret") {
    ClientOptions options;
    options.port = server_->port();
    options.auth_token = token;
    auto client = StreamClient::Create(options);
    EXPECT_TRUE(client.ok()) << client.status().ToString();
    return client.ok() ? std::move(*client) : nullptr;
  }

  // The server serves a new client: its echo comes back.
  void ExpectServes() {
    auto client = Client();
    ASSERT_NE(client, nullptr);
    const Outcome echo = CallAndWait(*client, kEcho, "still serving");
    EXPECT_TRUE(echo.status.ok()) << echo.status.ToString();
    EXPECT_EQ(echo.message, "still serving");
  }

  // A raw connection that said hello with the server's token and was let in (invalid, the test
  // failed, otherwise).
  RawSocket Admitted(int receive_buffer = 0) {
    RawSocket s = RawSocket::Connect(server_->port(), receive_buffer);
    if (!s.ok() || !s.SendAll(Framed(MakeHello("secret")))) {
      ADD_FAILURE() << "could not say hello to the server";
      return {};
    }
    const auto reply = ReadFramed<wire::HelloReply>(s);
    if (!reply || reply->has_error()) {
      ADD_FAILURE() << "the server refused a good hello: "
                    << (reply ? reply->error().message() : "no reply");
      return {};
    }
    EXPECT_EQ(reply->max_message_bytes(), kMaxMessage);
    EXPECT_EQ(reply->max_payload_bytes(), kMaxPayload);
    return s;
  }

  // The reply to a hello the server refuses; the connection must close after it.
  wire::HelloReply Refused(const wire::Hello& hello) {
    RawSocket s = RawSocket::Connect(server_->port());
    EXPECT_TRUE(s.SendAll(Framed(hello)));
    const auto reply = ReadFramed<wire::HelloReply>(s);
    if (!reply) {
      ADD_FAILURE() << "no HelloReply to a refused hello";
      return {};
    }
    EXPECT_TRUE(reply->has_error() && reply->error().code() != wire::OK);
    EXPECT_TRUE(s.WaitClosed()) << "the server kept a refused connection open";
    return *reply;
  }

  // What `read` returns from the handlers' record, read under its lock.
  template <typename Read>
  auto Locked(Read read) {
    std::lock_guard lock(mu_);
    return read();
  }
  // kSlowPut's ReceivePayload completes, and when OK it received the pattern whole: the bytes
  // of the call as it was started, not those the caller wrote once its call had ended.
  void ExpectSlowPutWholeOrFailed() {
    ASSERT_TRUE(WaitFor([&] { return Locked([&] { return slow_receive_.has_value(); }); }))
        << "the handler's ReceivePayload never completed";
    const auto [status, mismatch] = *Locked([&] { return slow_receive_; });
    if (status.ok()) {
      EXPECT_EQ(mismatch, std::string::npos)
          << "the server received bytes the caller wrote after its call ended, from offset "
          << mismatch;
    }
  }
  size_t HeldCount() {
    return Locked([&] { return held_.size(); });
  }

  std::unique_ptr<StreamServer> server_;
  std::atomic<int> disconnects_{0};
  std::mutex mu_;
  std::vector<ServerCall> held_;
  std::vector<std::thread> threads_;
  std::vector<Status> receives_;  // kPut's ReceivePayload outcomes
  std::vector<Status> sents_;     // kBig's reply outcomes
  // kSlowPut's ReceivePayload outcome, and the first byte off the pattern (npos: none).
  std::optional<std::pair<Status, size_t>> slow_receive_;
};

TEST_F(StreamServerTest, GarbageInsteadOfAHelloIsCutOffAndTheServerServesOn) {
  ASSERT_NO_FATAL_FAILURE(StartServer());
  std::mt19937 random(42);
  std::string noise(4096, '\0');
  for (char& c : noise) c = static_cast<char>(random());
  std::string huge(4, '\0');  // a length of 2^31
  const uint32_t length = uint32_t{1} << 31;
  std::memcpy(huge.data(), &length, 4);
  huge += "and some";
  // 16 bytes that no protobuf parses (a varint longer than 10 bytes).
  const std::string unparseable = std::string("\x10\0\0\0", 4) + std::string(16, '\xff');
  // 3 bytes of a hello of 64, then nothing: cut at the hello timeout.
  const std::string unfinished = std::string("\x40\0\0\0", 4) + "abc";
  const uint64_t bad_before = server_->stats().bad_hellos;
  for (const std::string& bytes : {noise, huge, unparseable, unfinished}) {
    SCOPED_TRACE(bytes.size());
    RawSocket s = RawSocket::Connect(server_->port());
    ASSERT_TRUE(s.ok());
    s.SendAll(bytes);  // the server may close before all went
    EXPECT_TRUE(s.WaitClosed()) << "the server kept a connection that sent garbage";
  }
  EXPECT_TRUE(WaitFor([&] { return server_->stats().bad_hellos > bad_before; }));
  EXPECT_TRUE(WaitFor([&] { return server_->connection_count() == 0; }));
  ExpectServes();
}

// A hello that names a UCX worker is a bad hello (no stream client sends one); a wrong token is
// Unauthenticated. Each is answered, counted, and its connection closed.
TEST_F(StreamServerTest, ARefusedHelloIsAnsweredCountedAndClosed) {
  ASSERT_NO_FATAL_FAILURE(StartServer());
  const TransportStats before = server_->stats();
  wire::Hello ucx = MakeHello("secret");
  ucx.set_worker_address("a UCX worker address");
  Refused(ucx);
  EXPECT_TRUE(WaitFor([&] { return server_->stats().bad_hellos == before.bad_hellos + 1; }));
  const wire::HelloReply wrong = Refused(MakeHello("guess"));
  EXPECT_EQ(wrong.error().code(), wire::UNAUTHENTICATED) << wrong.error().message();
  EXPECT_TRUE(WaitFor([&] { return server_->stats().refused == before.refused + 1; }));
  EXPECT_EQ(server_->connection_count(), 0u);
  ExpectServes();
}

TEST_F(StreamServerTest, EachMalformedFrameClosesItsConnectionAndOnlyIt) {
  ASSERT_NO_FATAL_FAILURE(StartServer());
  const StreamHeader echo = Request(kEcho, 1);
  StreamHeader response = ResponseTo(1);
  StreamHeader big_message = echo, big_payload = echo, cancel = echo;
  big_message.message_bytes = kMaxMessage + 1;
  big_payload.payload_bytes = kMaxPayload + 1;
  cancel.kind = StreamKind::kCancel;
  cancel.message_bytes = 4;
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"bad magic", PatchedHeader(echo, 0, "KVSX")},
      {"unknown kind", PatchedHeader(echo, 4, "\x09")},
      {"a response from a client", HeaderBytes(response)},
      {"unknown version", PatchedHeader(echo, 5, "\x02")},
      {"message over the limit", HeaderBytes(big_message)},
      {"payload over the limit", HeaderBytes(big_payload)},
      {"cancel with a message", HeaderBytes(cancel) + "oops"},
      {"nonzero reserved", PatchedHeader(echo, 30, "\x01")},
  };
  // A real client's connection outlives every malformed one.
  auto client = Client();
  ASSERT_TRUE(CallAndWait(*client, kEcho, "first").status.ok());
  for (const auto& [name, bytes] : cases) {
    SCOPED_TRACE(name);
    const uint64_t malformed = server_->stats().malformed_frames;
    const int disconnects = disconnects_.load();
    RawSocket s = Admitted();
    ASSERT_TRUE(s.ok());
    ASSERT_TRUE(s.SendAll(bytes));
    EXPECT_TRUE(s.WaitClosed()) << "the server kept the connection";
    EXPECT_TRUE(WaitFor([&] { return server_->stats().malformed_frames > malformed; }));
    EXPECT_EQ(server_->stats().malformed_frames, malformed + 1);
    EXPECT_TRUE(WaitFor([&] { return disconnects_.load() == disconnects + 1; }))
        << "OnDisconnect did not run";
    EXPECT_TRUE(WaitFor([&] { return server_->connection_count() == 1; }));
    const Outcome still = CallAndWait(*client, kEcho, name);
    EXPECT_TRUE(still.status.ok()) << still.status.ToString();
    EXPECT_EQ(still.message, name);
  }
}

TEST_F(StreamServerTest, APeerThatStopsMidHeaderIsCutOffAfterTheStallTimeout) {
  ASSERT_NO_FATAL_FAILURE(StartServer(300ms));
  RawSocket idle = Admitted();
  RawSocket stalled = Admitted();
  ASSERT_TRUE(idle.ok() && stalled.ok());
  ASSERT_TRUE(WaitFor([&] { return server_->connection_count() == 2; }));
  const auto start = Clock::now();
  ASSERT_TRUE(stalled.SendAll(HeaderBytes(Request(kEcho, 1)).substr(0, 16)));
  EXPECT_TRUE(stalled.WaitClosed()) << "a connection stalled mid-header was kept";
  const auto took = Clock::now() - start;
  EXPECT_GE(took, 250ms);
  EXPECT_LT(took, 10s);
  EXPECT_TRUE(WaitFor([&] { return server_->connection_count() == 1; }));
  // A connection idle between frames is not stalled: it is kept past the timeout, and serves.
  std::string nothing;
  EXPECT_EQ(idle.RecvExactly(1, &nothing, 700ms), RawSocket::End::kTimedOut);
  ASSERT_TRUE(idle.SendAll(Frame(Request(kEcho, 2), "idle")));
  const auto reply = ReadFrameFrom(idle, /*server=*/false);
  ASSERT_TRUE(reply.has_value());
  EXPECT_EQ(reply->header.request_id, 2u);
  EXPECT_EQ(reply->message, "idle");
}

TEST_F(StreamServerTest, APayloadThatStopsHalfwayFailsItsReceiveAndTheConnection) {
  ASSERT_NO_FATAL_FAILURE(StartServer(300ms));
  RawSocket s = Admitted();
  ASSERT_TRUE(s.ok());
  StreamHeader put = Request(kPut, 1);
  put.payload_bytes = kMiB;
  ASSERT_TRUE(s.SendAll(HeaderBytes(put) + std::string(kMiB / 2, 'p')));
  ASSERT_TRUE(WaitFor([&] { return Locked([&] { return receives_.size(); }) == 1; }))
      << "ReceivePayload's callback did not run for a payload that stopped halfway";
  EXPECT_FALSE(Locked([&] { return receives_[0]; }).ok());
  EXPECT_TRUE(s.WaitClosed());
  EXPECT_TRUE(WaitFor([&] { return server_->connection_count() == 0; }));
  ExpectServes();
}

TEST_F(StreamServerTest, AClientThatLeavesMidCallCancelsItsCall) {
  ASSERT_NO_FATAL_FAILURE(StartServer());
  RawSocket s = Admitted();
  ASSERT_TRUE(s.ok());
  ASSERT_TRUE(s.SendAll(Frame(Request(kHold, 1), "hold")));
  ASSERT_TRUE(WaitFor([&] { return HeldCount() == 1; }));
  const int disconnects = disconnects_.load();
  s.Close();
  ServerCall held = Locked([&] { return std::move(held_.front()); });
  EXPECT_TRUE(WaitFor([&] { return held.cancelled() || disconnects_.load() > disconnects; }));
  EXPECT_TRUE(WaitFor([&] { return server_->connection_count() == 0; }));
  held.Reply(AsBytes("too late"));  // goes nowhere, and crashes nothing
  ExpectServes();
}

TEST_F(StreamServerTest, AnUnknownMethodIsAnsweredUnimplementedOnTheWire) {
  ASSERT_NO_FATAL_FAILURE(StartServer());
  RawSocket s = Admitted();
  ASSERT_TRUE(s.ok());
  ASSERT_TRUE(s.SendAll(Frame(Request(kUnknown, 7), "what")));
  const auto reply = ReadFrameFrom(s, /*server=*/false);
  ASSERT_TRUE(reply.has_value());
  EXPECT_EQ(reply->header.kind, StreamKind::kResponse);
  EXPECT_EQ(reply->header.request_id, 7u);
  EXPECT_EQ(reply->header.status, static_cast<uint16_t>(StatusCode::kUnimplemented));
  EXPECT_EQ(reply->header.payload_bytes, 0u);
  wire::Error error;
  ASSERT_TRUE(error.ParseFromString(reply->message)) << "the error is no wire.Error";
  EXPECT_EQ(error.code(), wire::UNIMPLEMENTED) << error.message();
  // The connection serves on.
  ASSERT_TRUE(s.SendAll(Frame(Request(kEcho, 8), "next")));
  const auto next = ReadFrameFrom(s, /*server=*/false);
  ASSERT_TRUE(next.has_value());
  EXPECT_EQ(next->header.request_id, 8u);
  EXPECT_EQ(next->header.status, 0u);
  EXPECT_EQ(next->message, "next");
}

TEST_F(StreamServerTest, APayloadTheHandlerDoesNotReceiveIsSkipped) {
  ASSERT_NO_FATAL_FAILURE(StartServer());
  RawSocket s = Admitted();
  ASSERT_TRUE(s.ok());
  const std::string payload(64 << 10, 'q');
  // The payload right behind its request, and the next request right behind the payload.
  ASSERT_TRUE(
      s.SendAll(Frame(Request(kNoReceive, 1), "a", payload) + Frame(Request(kEcho, 2), "next")));
  for (const auto& [id, message] : {std::pair<uint64_t, std::string>{1, "not received"},
                                    std::pair<uint64_t, std::string>{2, "next"}}) {
    const auto reply = ReadFrameFrom(s, /*server=*/false);
    ASSERT_TRUE(reply.has_value());
    EXPECT_EQ(reply->header.request_id, id);
    EXPECT_EQ(reply->header.status, 0u);
    EXPECT_EQ(reply->message, message);
  }
  // The payload sent only after the reply to its request came back.
  StreamHeader late = Request(kNoReceive, 3);
  late.message_bytes = 1;
  late.payload_bytes = static_cast<uint32_t>(payload.size());
  ASSERT_TRUE(s.SendAll(HeaderBytes(late) + "b"));
  const auto third = ReadFrameFrom(s, /*server=*/false);
  ASSERT_TRUE(third.has_value());
  EXPECT_EQ(third->header.request_id, 3u);
  ASSERT_TRUE(s.SendAll(payload + Frame(Request(kEcho, 4), "after")));
  const auto fourth = ReadFrameFrom(s, /*server=*/false);
  ASSERT_TRUE(fourth.has_value());
  EXPECT_EQ(fourth->header.request_id, 4u);
  EXPECT_EQ(fourth->message, "after");
  EXPECT_EQ(server_->stats().malformed_frames, 0u);
}

TEST_F(StreamServerTest, AClientThatReadsNoReplyIsCutOffAfterTheStallTimeout) {
  ASSERT_NO_FATAL_FAILURE(StartServer(300ms));
  // A small receive buffer: the 32 MiB reply soon fills what the kernels hold.
  RawSocket s = Admitted(/*receive_buffer=*/4096);
  ASSERT_TRUE(s.ok());
  ASSERT_TRUE(s.SendAll(Frame(Request(kBig, 1), "")));
  ASSERT_TRUE(WaitFor([&] { return Locked([&] { return sents_.size(); }) == 1; }))
      << "the reply's sent callback did not run for a client that reads nothing";
  EXPECT_FALSE(Locked([&] { return sents_[0]; }).ok());
  EXPECT_TRUE(WaitFor([&] { return server_->connection_count() == 0; }));
  ExpectServes();
}

// A call whose deadline passes while its 32 MiB payload is still going: the client sends the
// rest from a copy of its own (the caller's buffer is the caller's again once the callback ran),
// so the server receives the bytes as they were at the call, or none; never a mix.
TEST_F(StreamServerTest, ACallThatEndsMidSendSendsItsPayloadAsItWasOrNotAtAll) {
  ASSERT_NO_FATAL_FAILURE(StartServer());
  auto client = Client();
  ASSERT_TRUE(CallAndWait(*client, kEcho, "connect").status.ok());
  std::vector<std::byte> block = PatternBlock(32 * kMiB);
  CallOptions put = Within(100ms);
  put.send_payload = block;
  const Outcome late = CallAndWait(*client, kSlowPut, "", put);
  EXPECT_EQ(late.status.code(), StatusCode::kDeadlineExceeded) << late.status.ToString();
  std::fill(block.begin(), block.end(), std::byte{0xff});
  ExpectSlowPutWholeOrFailed();
  const Outcome after = CallAndWait(*client, kEcho, "after");
  EXPECT_TRUE(after.status.ok()) << after.status.ToString();
}

TEST_F(StreamServerTest, ResetFailsTheOutstandingCallsNamingWhy) {
  ASSERT_NO_FATAL_FAILURE(StartServer());
  auto client = Client();
  ASSERT_TRUE(CallAndWait(*client, kEcho, "connect").status.ok());
  std::vector<std::byte> block = PatternBlock(32 * kMiB);
  CallOptions put = Within(20s);
  put.send_payload = block;
  std::vector<std::future<Outcome>> calls;
  calls.push_back(Start(*client, kHold, "held", Within(20s)));
  calls.push_back(Start(*client, kSlowPut, "", put));  // its payload waits for the handler
  ASSERT_TRUE(
      WaitFor([&] { return HeldCount() == 1 && Locked([&] { return !threads_.empty(); }); }));
  client->Reset(UnavailableError("the probe went unanswered"));
  for (std::future<Outcome>& call : calls) {
    const Outcome reset = Await(std::move(call));
    EXPECT_EQ(reset.status.code(), StatusCode::kUnavailable) << reset.status.ToString();
    EXPECT_THAT(reset.status.message(), HasSubstr("the probe went unanswered"));
  }
  // The buffer is the caller's again: what the server receives is the call's bytes, or nothing.
  std::fill(block.begin(), block.end(), std::byte{0xff});
  EXPECT_TRUE(WaitFor([&] { return disconnects_.load() == 1; }));
  ExpectSlowPutWholeOrFailed();
  EXPECT_TRUE(CallAndWait(*client, kEcho, "after").status.ok());
}

// ---- A real client, raw servers ---------------------------------------------------------------

wire::HelloReply Welcome() {
  wire::HelloReply reply;
  reply.set_protocol_version(wire::PROTOCOL_VERSION_CURRENT);
  reply.set_connection_id(77);
  reply.set_max_message_bytes(4 * kMiB);
  reply.set_max_payload_bytes(64 * kMiB);
  return reply;
}

// Accepts the client's connection, reads its hello (checked as a StreamClient must send it) and
// answers `reply`. Invalid, the test failed, when no client came or said hello.
RawSocket AcceptHello(RawServer& server, const wire::HelloReply& reply = Welcome()) {
  RawSocket s = server.Accept();
  const auto hello = s.ok() ? ReadFramed<wire::Hello>(s) : std::nullopt;
  if (!hello) {
    ADD_FAILURE() << "the client did not connect and say hello";
    return {};
  }
  EXPECT_EQ(hello->protocol_version(), static_cast<uint32_t>(wire::PROTOCOL_VERSION_CURRENT));
  EXPECT_EQ(hello->namespace_(), "tenant-a");
  EXPECT_EQ(hello->auth_token(), "secret");
  EXPECT_TRUE(hello->worker_address().empty()) << "a stream client named a UCX worker";
  EXPECT_TRUE(s.SendAll(Framed(reply)));
  return s;
}

// The next request the client sends, past its cancels (a call that ended early may send one).
std::optional<ReadFrame> NextRequest(RawSocket& s, std::chrono::milliseconds wait = 20s) {
  for (const auto give_up = Clock::now() + wait;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(give_up - Clock::now());
    auto frame = ReadFrameFrom(s, /*server=*/true, std::max(left, 1ms));
    if (!frame || frame->header.kind == StreamKind::kRequest) return frame;
  }
}

// Reads the next request and answers it with its own message (an echo).
void EchoNext(RawSocket& s, std::chrono::milliseconds wait = 20s) {
  const auto request = NextRequest(s, wait);
  if (request) s.SendAll(Frame(ResponseTo(request->header.request_id), request->message));
}

class StreamClientTest : public ::testing::Test {
 protected:
  void TearDown() override {
    client_.reset();  // first: the script's reads of it end
    raw_.Join();
  }

  void MakeClient(std::chrono::milliseconds connect_timeout = 5000ms) {
    ClientOptions options;
    options.port = raw_.port();
    options.tenant = "tenant-a";
    options.auth_token = "secret";
    options.client_name = "stream_test";
    options.connect_timeout = connect_timeout;
    auto client = StreamClient::Create(options);
    ASSERT_TRUE(client.ok()) << client.status().ToString();
    client_ = std::move(*client);
  }

  RawServer raw_;
  std::unique_ptr<StreamClient> client_;
};

TEST_F(StreamClientTest, AMalformedFrameFailsTheCallUnavailableAndTheNextConnects) {
  raw_.Run([this] {
    RawSocket s = AcceptHello(raw_);
    const auto request = NextRequest(s);
    if (!request) return;
    s.SendAll(PatchedHeader(ResponseTo(request->header.request_id), 0, "XXXX"));
    EXPECT_TRUE(s.WaitClosed()) << "the client kept a connection that sent a malformed frame";
    RawSocket again = AcceptHello(raw_);
    EchoNext(again);
  });
  ASSERT_NO_FATAL_FAILURE(MakeClient());
  const Outcome broken = CallAndWait(*client_, kEcho, "x");
  EXPECT_EQ(broken.status.code(), StatusCode::kUnavailable) << broken.status.ToString();
  EXPECT_TRUE(WaitFor([&] { return client_->stats().malformed_frames == 1; }));
  const Outcome again = CallAndWait(*client_, kEcho, "again");
  EXPECT_TRUE(again.status.ok()) << again.status.ToString();
  EXPECT_EQ(again.message, "again");
}

TEST_F(StreamClientTest, AReplyPayloadLargerThanTheBufferIsOutOfRangeAndSkipped) {
  raw_.Run([this] {
    RawSocket s = AcceptHello(raw_);
    const auto request = NextRequest(s);
    if (!request) return;
    s.SendAll(Frame(ResponseTo(request->header.request_id), "big", std::string(200, 'x')));
    EchoNext(s);
  });
  ASSERT_NO_FATAL_FAILURE(MakeClient());
  std::vector<std::byte> small(100);
  CallOptions get = Within(10s);
  get.recv_payload = small;
  const Outcome big = CallAndWait(*client_, kEcho, "", get);
  EXPECT_EQ(big.status.code(), StatusCode::kOutOfRange) << big.status.ToString();
  const Outcome next = CallAndWait(*client_, kEcho, "next");
  EXPECT_TRUE(next.status.ok()) << next.status.ToString();
  EXPECT_EQ(next.message, "next");
  EXPECT_EQ(client_->stats().malformed_frames, 0u);
}

// A reply whose payload stops halfway: the call fails at its deadline, and from its callback on
// the buffer is the caller's alone: the rest of the payload, when it comes, is not written there.
TEST_F(StreamClientTest, ACallThatTimesOutMidPayloadNeverWritesItsBufferAfterward) {
  // Shared with the script, which may outlive this body when an assertion ends it early.
  auto filled = std::make_shared<std::promise<void>>();
  auto rest_sent = std::make_shared<std::promise<void>>();
  std::future<void> rest_was_sent = rest_sent->get_future();
  raw_.Run([this, filled_future = filled->get_future(), rest_sent]() mutable {
    RawSocket s = AcceptHello(raw_);
    const auto request = NextRequest(s);
    if (!request) return;
    const std::string payload(kMiB, 'p');
    StreamHeader response = ResponseTo(request->header.request_id);
    response.payload_bytes = static_cast<uint32_t>(payload.size());
    s.SendAll(HeaderBytes(response) + payload.substr(0, kMiB / 2));
    filled_future.wait_for(20s);
    s.SendAll(payload.substr(kMiB / 2));  // fails where the client closed the connection
    rest_sent->set_value();
    // The next call, on this connection, or on a new one where the client closed this one.
    auto next = NextRequest(s, 5s);
    if (!next) {
      s = AcceptHello(raw_);
      next = NextRequest(s);
    }
    if (next) s.SendAll(Frame(ResponseTo(next->header.request_id), next->message));
  });
  ASSERT_NO_FATAL_FAILURE(MakeClient());
  std::vector<std::byte> buffer(kMiB);
  CallOptions get = Within(300ms);
  get.recv_payload = buffer;
  const auto start = Clock::now();
  const Outcome stalled = CallAndWait(*client_, kEcho, "", get);
  const auto took = Clock::now() - start;
  EXPECT_EQ(stalled.status.code(), StatusCode::kDeadlineExceeded) << stalled.status.ToString();
  EXPECT_GE(took, 290ms);
  EXPECT_LT(took, 3s);
  std::fill(buffer.begin(), buffer.end(), std::byte{0xa5});
  filled->set_value();
  ASSERT_EQ(rest_was_sent.wait_for(20s), std::future_status::ready);
  // The reply to the next call comes after the rest of the payload: once it is here, the rest
  // was read (or its connection was gone).
  const Outcome next = CallAndWait(*client_, kEcho, "next");
  EXPECT_TRUE(next.status.ok()) << next.status.ToString();
  const size_t written =
      std::find_if(buffer.begin(), buffer.end(), [](std::byte b) { return b != std::byte{0xa5}; }) -
      buffer.begin();
  EXPECT_EQ(written, buffer.size())
      << "the client wrote into the buffer of a completed call, at offset " << written;
}

TEST_F(StreamClientTest, AReplyToACallNeverMadeIsLateAndSkipped) {
  raw_.Run([this] {
    RawSocket s = AcceptHello(raw_);
    const auto request = NextRequest(s);
    if (!request) return;
    const uint64_t id = request->header.request_id;
    s.SendAll(Frame(ResponseTo(id + 1000), "stray", std::string(1000, 'z')) +
              Frame(ResponseTo(id), "real"));
  });
  ASSERT_NO_FATAL_FAILURE(MakeClient());
  std::vector<std::byte> buffer(4096, std::byte{0x5a});
  CallOptions get = Within(10s);
  get.recv_payload = buffer;
  const Outcome real = CallAndWait(*client_, kEcho, "x", get);
  ASSERT_TRUE(real.status.ok()) << real.status.ToString();
  EXPECT_EQ(real.message, "real");
  EXPECT_EQ(real.payload_bytes, 0u);
  EXPECT_TRUE(std::all_of(buffer.begin(), buffer.end(), [](std::byte b) {
    return b == std::byte{0x5a};
  })) << "the stray reply's payload landed in a call's buffer";
  EXPECT_TRUE(WaitFor([&] { return client_->stats().late_replies == 1; }));
  EXPECT_EQ(client_->stats().malformed_frames, 0u);
}

TEST_F(StreamClientTest, ARefusedHelloFailsTheCallWithItsCode) {
  raw_.Run([this] {
    wire::HelloReply refusal;
    refusal.mutable_error()->set_code(wire::PERMISSION_DENIED);
    refusal.mutable_error()->set_message("namespace tenant-a is closed");
    RawSocket s = AcceptHello(raw_, refusal);
    s.WaitClosed(5s);
  });
  ASSERT_NO_FATAL_FAILURE(MakeClient());
  const Outcome refused = CallAndWait(*client_, kEcho, "x");
  EXPECT_EQ(refused.status.code(), StatusCode::kPermissionDenied) << refused.status.ToString();
  EXPECT_THAT(refused.status.message(), HasSubstr("is closed"));
}

TEST_F(StreamClientTest, AServerThatNeverAnswersTheHelloFailsTheCallByTheConnectTimeout) {
  auto done = std::make_shared<std::promise<void>>();
  raw_.Run([this, done_future = done->get_future()] {
    RawSocket s = raw_.Accept();
    const auto hello = s.ok() ? ReadFramed<wire::Hello>(s) : std::nullopt;
    EXPECT_TRUE(hello.has_value()) << "the client did not say hello";
    done_future.wait_for(20s);  // and never answers
  });
  ASSERT_NO_FATAL_FAILURE(MakeClient(300ms));
  const auto start = Clock::now();
  const Outcome silent = CallAndWait(*client_, kEcho, "x", Within(10s));
  const auto took = Clock::now() - start;
  done->set_value();
  EXPECT_THAT(silent.status.code(), AnyOf(StatusCode::kUnavailable, StatusCode::kDeadlineExceeded))
      << silent.status.ToString();
  EXPECT_LT(took, 3s) << "the connect timeout of 300 ms did not bound the hello";
}

}  // namespace
}  // namespace kvstash::transport
