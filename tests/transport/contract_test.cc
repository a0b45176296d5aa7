// The contract of the transport seam (kvstash/transport/channel.h), run against every
// implementation of it: UCX over shared memory and over TCP (rpc.h), the stream transport over
// plain TCP (stream.h), the in-process loopback (loopback.h), and the fault channel with no
// fault planned over UCX, the stream transport and the loopback (fault_channel.h). Only the seam's
// interfaces are used: what passes here is what a service and its clients may count on whatever
// carries their calls. ctest label `contract`.
//
// ContractCoverage.EveryImplementationOfTheSeamRunsTheSuite reads the product's sources for
// classes that implement Channel or Listener and fails for one no instantiation exercises; each
// instantiation checks at run time that it gets the classes it claims.

#include <cxxabi.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <typeinfo>
#include <vector>

#include "call_helpers.h"
#include "kvstash/transport/channel.h"
#include "kvstash/transport/fault_channel.h"
#include "kvstash/transport/loopback.h"
#include "kvstash/transport/rpc.h"
#include "kvstash/transport/stream.h"

namespace kvstash::transport {
namespace {

using namespace std::chrono_literals;
using test_calls::AsBytes;
using test_calls::AsString;
using test_calls::Await;
using test_calls::CallAndWait;
using test_calls::Outcome;
using test_calls::Start;
using test_calls::WaitFor;
using test_calls::Within;
using ::testing::HasSubstr;

constexpr uint16_t kEcho = 1;   // replies with the request
constexpr uint16_t kPut = 2;    // receives the payload into heap memory, replies with its size
constexpr uint16_t kGet = 3;    // replies with the last payload put
constexpr uint16_t kHold = 4;   // keeps the call unanswered until the test answers it
constexpr uint16_t kDrop = 5;   // lets the call go unanswered
constexpr uint16_t kLater = 6;  // replies from another thread
constexpr uint16_t kUnknown = 99;

// A transport under test: makes servers and the clients of them.
class Transport {
 public:
  virtual ~Transport() = default;
  virtual Result<std::unique_ptr<Listener>> Listen(ServerOptions options) = 0;
  virtual Result<std::unique_ptr<Channel>> Connect(ClientOptions options) = 0;
};

class UcxTransport : public Transport {
 public:
  explicit UcxTransport(std::string tls) : tls_(std::move(tls)) {}
  Result<std::unique_ptr<Listener>> Listen(ServerOptions options) override {
    options.transport.tls = tls_;
    KVSTASH_ASSIGN_OR_RETURN(std::unique_ptr<RpcServer> server, RpcServer::Create(options));
    return std::unique_ptr<Listener>(std::move(server));
  }
  Result<std::unique_ptr<Channel>> Connect(ClientOptions options) override {
    options.transport.tls = tls_;
    options.connect_timeout = 5000ms;
    KVSTASH_ASSIGN_OR_RETURN(std::unique_ptr<RpcClient> client, RpcClient::Create(options));
    return std::unique_ptr<Channel>(std::move(client));
  }

 private:
  std::string tls_;
};

class StreamTransport : public Transport {
 public:
  Result<std::unique_ptr<Listener>> Listen(ServerOptions options) override {
    KVSTASH_ASSIGN_OR_RETURN(std::unique_ptr<StreamServer> server, StreamServer::Create(options));
    return std::unique_ptr<Listener>(std::move(server));
  }
  Result<std::unique_ptr<Channel>> Connect(ClientOptions options) override {
    options.connect_timeout = 5000ms;
    KVSTASH_ASSIGN_OR_RETURN(std::unique_ptr<StreamClient> client, StreamClient::Create(options));
    return std::unique_ptr<Channel>(std::move(client));
  }
};

class LoopbackTransport : public Transport {
 public:
  Result<std::unique_ptr<Listener>> Listen(ServerOptions options) override {
    return network_->Listen(std::move(options));
  }
  Result<std::unique_ptr<Channel>> Connect(ClientOptions options) override {
    return network_->Connect(std::move(options));
  }

 private:
  std::shared_ptr<LoopbackNetwork> network_ = LoopbackNetwork::Create();
};

// Another transport's channels inside a FaultChannel that plans no fault.
class NoFaultTransport : public Transport {
 public:
  explicit NoFaultTransport(std::unique_ptr<Transport> inner) : inner_(std::move(inner)) {}
  Result<std::unique_ptr<Listener>> Listen(ServerOptions options) override {
    return inner_->Listen(std::move(options));
  }
  Result<std::unique_ptr<Channel>> Connect(ClientOptions options) override {
    KVSTASH_ASSIGN_OR_RETURN(std::unique_ptr<Channel> inner, inner_->Connect(std::move(options)));
    return std::unique_ptr<Channel>(std::make_unique<FaultChannel>(
        std::move(inner), [](uint16_t, uint64_t) { return Fault{}; }));
  }

 private:
  std::unique_ptr<Transport> inner_;
};

struct Implementation {
  std::string name;
  // The classes this instantiation exercises: its Channel's and its Listener's, unqualified.
  std::string channel_class;
  std::string listener_class;
  std::function<std::unique_ptr<Transport>()> make;
};

// gtest names an instantiation's parameter by this (not by its bytes).
void PrintTo(const Implementation& implementation, std::ostream* out) {
  *out << implementation.name;
}

const std::vector<Implementation>& Implementations() {
  static const std::vector<Implementation> all = {
      {"ucx_shm", "RpcClient", "RpcServer", [] { return std::make_unique<UcxTransport>("shm"); }},
      {"ucx_tcp", "RpcClient", "RpcServer", [] { return std::make_unique<UcxTransport>("tcp"); }},
      {"stream", "StreamClient", "StreamServer",
       [] { return std::make_unique<StreamTransport>(); }},
      {"fault_over_stream", "FaultChannel", "StreamServer",
       [] { return std::make_unique<NoFaultTransport>(std::make_unique<StreamTransport>()); }},
      {"loopback", "LoopbackChannel", "LoopbackListener",
       [] { return std::make_unique<LoopbackTransport>(); }},
      {"fault_over_loopback", "FaultChannel", "LoopbackListener",
       [] { return std::make_unique<NoFaultTransport>(std::make_unique<LoopbackTransport>()); }},
      {"fault_over_ucx_tcp", "FaultChannel", "RpcServer",
       [] { return std::make_unique<NoFaultTransport>(std::make_unique<UcxTransport>("tcp")); }},
  };
  return all;
}

// The unqualified name of an object's dynamic class.
template <typename T>
std::string ClassOf(const T& object) {
  int status = 0;
  char* demangled = abi::__cxa_demangle(typeid(object).name(), nullptr, nullptr, &status);
  std::string name = status == 0 ? demangled : typeid(object).name();
  std::free(demangled);
  if (const size_t colon = name.rfind("::"); colon != std::string::npos) name.erase(0, colon + 2);
  return name;
}

class ContractTest : public ::testing::TestWithParam<Implementation> {
 protected:
  void SetUp() override {
    transport_ = GetParam().make();
    ServerOptions options;
    options.auth_token = "secret";
    options.tenant_tokens = {{"tenant-a", "a-token"}};
    options.admit_tenant = [](std::string_view name) {
      if (name == "closed") return PermissionDeniedError("namespace closed is not served here");
      return Status::OK();
    };
    options.service_limits = std::string("the service's \0 own bytes", 25);
    auto server = transport_->Listen(options);
    ASSERT_TRUE(server.ok()) << server.status().ToString();
    server_ = std::move(*server);
    EXPECT_EQ(ClassOf(*server_), GetParam().listener_class);

    server_->Handle(kEcho, [](ServerCall call) { call.Reply(call.request()); });
    server_->Handle(kPut, [this](ServerCall call) {
      auto buffer = std::make_shared<std::vector<std::byte>>(call.payload_bytes());
      auto shared = std::make_shared<ServerCall>(std::move(call));
      shared->ReceivePayload(*buffer, nullptr, [this, shared, buffer](Status s) {
        if (!s.ok()) {
          shared->ReplyError(s);
          return;
        }
        {
          std::lock_guard lock(mu_);
          stored_ = *buffer;
        }
        shared->Reply(AsBytes(std::to_string(buffer->size())));
      });
    });
    server_->Handle(kGet, [this](ServerCall call) {
      auto block = std::make_shared<std::vector<std::byte>>();
      {
        std::lock_guard lock(mu_);
        *block = stored_;
      }
      call.Reply({}, *block, nullptr, [block](Status) {});
    });
    server_->Handle(kHold, [this](ServerCall call) {
      std::lock_guard lock(mu_);
      held_.push_back(std::move(call));
    });
    server_->Handle(kDrop, [](ServerCall) {});
    server_->Handle(kLater, [this](ServerCall call) {
      std::lock_guard lock(mu_);
      repliers_.emplace_back([call = std::move(call)]() mutable {
        const std::string reply = "later:" + AsString(call.request());
        call.Reply(AsBytes(reply));
      });
    });
    server_->OnDisconnect([this](uint64_t) { disconnects_.fetch_add(1); });
    ASSERT_TRUE(server_->Start().ok());
    ASSERT_NE(server_->port(), 0);
    client_ = Client("secret");
    ASSERT_NE(client_, nullptr);
    EXPECT_EQ(ClassOf(*client_), GetParam().channel_class);
  }

  void TearDown() override {
    client_.reset();
    std::vector<std::thread> repliers;
    {
      std::lock_guard lock(mu_);
      held_.clear();
      repliers.swap(repliers_);
    }
    for (std::thread& t : repliers) t.join();
    if (server_) server_->Stop();
    server_.reset();
  }

  std::unique_ptr<Channel> Client(std::string token, std::string tenant = "default",
                                  TransportOptions transport = {}) {
    ClientOptions options;
    options.port = server_->port();
    options.auth_token = std::move(token);
    options.tenant = std::move(tenant);
    options.transport = std::move(transport);
    auto client = transport_->Connect(options);
    EXPECT_TRUE(client.ok()) << client.status().ToString();
    return client.ok() ? std::move(*client) : nullptr;
  }

  Status Connect(Channel& channel) {
    std::promise<Status> connected;
    channel.ConnectAsync([&](const Status& s) { connected.set_value(s); });
    auto future = connected.get_future();
    if (future.wait_for(20s) != std::future_status::ready) {
      return DeadlineExceededError("ConnectAsync did not call back within 20 s");
    }
    return future.get();
  }

  size_t HeldCount() {
    std::lock_guard lock(mu_);
    return held_.size();
  }

  std::unique_ptr<Transport> transport_;
  std::unique_ptr<Listener> server_;
  std::unique_ptr<Channel> client_;
  std::mutex mu_;
  std::vector<std::byte> stored_;
  std::vector<ServerCall> held_;
  std::vector<std::thread> repliers_;
  std::atomic<int> disconnects_{0};
};

TEST_P(ContractTest, EachCallCompletesOnceWithItsReply) {
  for (size_t size : {size_t{0}, size_t{1}, size_t{100}, size_t{5000}, size_t{200000}}) {
    const std::string message(size, static_cast<char>('a' + size % 26));
    const Outcome echo = CallAndWait(*client_, kEcho, message);
    ASSERT_TRUE(echo.status.ok()) << size << ": " << echo.status.ToString();
    EXPECT_EQ(echo.message, message);
    EXPECT_EQ(echo.payload_bytes, 0u);
  }
  EXPECT_GE(server_->stats().calls, 5u);
  EXPECT_EQ(server_->connection_count(), 1u);
}

TEST_P(ContractTest, PayloadsTravelBothWaysWhole) {
  for (size_t size : {size_t{1}, size_t{4096}, size_t{1} << 20}) {
    std::vector<std::byte> block(size);
    for (size_t i = 0; i < size; ++i) block[i] = std::byte((i * 7 + size) & 0xff);
    CallOptions put = Within(10s);
    put.send_payload = block;
    const Outcome stored = CallAndWait(*client_, kPut, "", put);
    ASSERT_TRUE(stored.status.ok()) << stored.status.ToString();
    EXPECT_EQ(stored.message, std::to_string(size));

    std::vector<std::byte> back(size + 16, std::byte{0x5a});
    CallOptions get = Within(10s);
    get.recv_payload = back;
    const Outcome got = CallAndWait(*client_, kGet, "", get);
    ASSERT_TRUE(got.status.ok()) << got.status.ToString();
    ASSERT_EQ(got.payload_bytes, size);
    EXPECT_TRUE(std::equal(block.begin(), block.end(), back.begin())) << size;
    EXPECT_EQ(back[size], std::byte{0x5a}) << "wrote past the payload";
  }
}

TEST_P(ContractTest, AReplyPayloadLargerThanItsBufferIsOutOfRange) {
  std::vector<std::byte> block(4096, std::byte{1});
  CallOptions put = Within(10s);
  put.send_payload = block;
  ASSERT_TRUE(CallAndWait(*client_, kPut, "", put).status.ok());
  std::vector<std::byte> small(100);
  CallOptions get = Within(10s);
  get.recv_payload = small;
  EXPECT_EQ(CallAndWait(*client_, kGet, "", get).status.code(), StatusCode::kOutOfRange);
  // The connection still serves.
  EXPECT_TRUE(CallAndWait(*client_, kEcho, "after").status.ok());
}

TEST_P(ContractTest, AnUnknownMethodIsUnimplementedAndADroppedCallInternal) {
  const Outcome unknown = CallAndWait(*client_, kUnknown, "x");
  EXPECT_EQ(unknown.status.code(), StatusCode::kUnimplemented) << unknown.status.ToString();
  const Outcome dropped = CallAndWait(*client_, kDrop, "x");
  EXPECT_EQ(dropped.status.code(), StatusCode::kInternal) << dropped.status.ToString();
  EXPECT_TRUE(CallAndWait(*client_, kEcho, "after").status.ok());
}

TEST_P(ContractTest, AnUnansweredCallFailsAtItsDeadlineAndItsLateReplyGoesNowhere) {
  const auto start = Clock::now();
  const Outcome held = CallAndWait(*client_, kHold, "", Within(200ms));
  EXPECT_EQ(held.status.code(), StatusCode::kDeadlineExceeded) << held.status.ToString();
  EXPECT_GE(Clock::now() - start, 190ms);
  ASSERT_TRUE(WaitFor([&] { return HeldCount() == 1; }));
  // The server sees the call is no longer wanted; a reply now reaches no callback (Start fails
  // the test on a second completion) and the connection serves on.
  ServerCall late;
  {
    std::lock_guard lock(mu_);
    late = std::move(held_.front());
    held_.clear();
  }
  EXPECT_TRUE(WaitFor([&] { return late.cancelled(); }));
  late.Reply(AsBytes("too late"));
  EXPECT_TRUE(CallAndWait(*client_, kEcho, "after").status.ok());
}

TEST_P(ContractTest, ACancelledCallCompletesOnceWithCancelled) {
  uint64_t id = 0;
  std::future<Outcome> call = Start(*client_, kHold, "", Within(10s), &id);
  ASSERT_TRUE(WaitFor([&] { return HeldCount() == 1; }));
  client_->Cancel(id);
  const Outcome cancelled = Await(std::move(call));
  EXPECT_EQ(cancelled.status.code(), StatusCode::kCancelled) << cancelled.status.ToString();
  client_->Cancel(id);  // again, and for an id that never was: nothing happens
  client_->Cancel(id + 1000);
  EXPECT_TRUE(CallAndWait(*client_, kEcho, "after").status.ok());
}

TEST_P(ContractTest, AHandlerRepliesFromAnotherThread) {
  const Outcome later = CallAndWait(*client_, kLater, "x");
  ASSERT_TRUE(later.status.ok()) << later.status.ToString();
  EXPECT_EQ(later.message, "later:x");
}

TEST_P(ContractTest, ManyCallsFromManyThreadsEachCompleteOnce) {
  constexpr int kThreads = 4, kCalls = 50;
  std::atomic<int> ok{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::vector<std::future<Outcome>> calls;
      for (int i = 0; i < kCalls; ++i) {
        calls.push_back(Start(*client_, kEcho, std::to_string(t * 1000 + i), Within(20s)));
      }
      for (int i = 0; i < kCalls; ++i) {
        const Outcome o = Await(std::move(calls[i]));
        if (o.status.ok() && o.message == std::to_string(t * 1000 + i)) ok.fetch_add(1);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(ok.load(), kThreads * kCalls);
}

TEST_P(ContractTest, TheHelloChecksTheTokenOfTheNamespace) {
  auto wrong = Client("guess");
  const Outcome refused = CallAndWait(*wrong, kEcho, "x");
  EXPECT_EQ(refused.status.code(), StatusCode::kUnauthenticated) << refused.status.ToString();

  auto tenant = Client("a-token", "tenant-a");
  EXPECT_TRUE(CallAndWait(*tenant, kEcho, "x").status.ok());
  // The server's token is not the namespace's.
  auto tenant_with_server_token = Client("secret", "tenant-a");
  EXPECT_EQ(CallAndWait(*tenant_with_server_token, kEcho, "x").status.code(),
            StatusCode::kUnauthenticated);
  // The server's own say on a namespace answers the hello.
  auto closed = Client("secret", "closed");
  const Outcome not_served = CallAndWait(*closed, kEcho, "x");
  EXPECT_EQ(not_served.status.code(), StatusCode::kPermissionDenied);
  EXPECT_THAT(not_served.status.message(), HasSubstr("closed"));
}

TEST_P(ContractTest, TheServerStatesItsLimitsAtHello) {
  TransportOptions tighter;
  tighter.max_message_bytes = 64 << 10;
  auto client = Client("secret", "default", tighter);
  EXPECT_FALSE(client->server_limits().has_value());
  ASSERT_TRUE(Connect(*client).ok());
  const std::optional<ServerLimits> limits = client->server_limits();
  ASSERT_TRUE(limits.has_value());
  // The service's statement arrives byte for byte, a zero byte included.
  EXPECT_EQ(limits->service_limits, std::string("the service's \0 own bytes", 25));
  // The client's own limit is the tighter one.
  EXPECT_EQ(limits->max_message_bytes, uint64_t{64} << 10);
  EXPECT_EQ(limits->max_payload_bytes, TransportOptions{}.max_payload_bytes);
}

TEST_P(ContractTest, ConnectAsyncSaysWhetherAServerAnswers) {
  ASSERT_TRUE(Connect(*client_).ok());
  ASSERT_TRUE(Connect(*client_).ok());  // connected: OK at once
  const uint16_t port = server_->port();
  server_->Stop();
  ClientOptions options;
  options.port = port;
  options.auth_token = "secret";
  auto nobody = transport_->Connect(options);
  ASSERT_TRUE(nobody.ok());
  const Status refused = Connect(**nobody);
  EXPECT_EQ(refused.code(), StatusCode::kUnavailable) << refused.ToString();
  EXPECT_EQ(CallAndWait(**nobody, kEcho, "x").status.code(), StatusCode::kUnavailable);
}

TEST_P(ContractTest, ResetFailsTheCallsInFlightAndTheNextCallConnectsAgain) {
  ASSERT_TRUE(CallAndWait(*client_, kEcho, "before").status.ok());
  std::future<Outcome> held = Start(*client_, kHold, "", Within(20s));
  ASSERT_TRUE(WaitFor([&] { return HeldCount() == 1; }));
  client_->Reset(UnavailableError("no answer to a probe"));
  const Outcome reset = Await(std::move(held));
  EXPECT_EQ(reset.status.code(), StatusCode::kUnavailable) << reset.status.ToString();
  EXPECT_THAT(reset.status.message(), HasSubstr("no answer to a probe"));
  EXPECT_TRUE(WaitFor([&] { return disconnects_.load() == 1; }));
  EXPECT_TRUE(CallAndWait(*client_, kEcho, "after").status.ok());
}

TEST_P(ContractTest, AStoppedServerFailsItsCallsAndEndsItsConnections) {
  std::future<Outcome> held = Start(*client_, kHold, "", Within(20s));
  ASSERT_TRUE(WaitFor([&] { return HeldCount() == 1; }));
  server_->Stop();
  EXPECT_EQ(disconnects_.load(), 1) << "OnDisconnect runs for each connection before Stop returns";
  EXPECT_EQ(server_->connection_count(), 0u);
  const Outcome lost = Await(std::move(held));
  EXPECT_EQ(lost.status.code(), StatusCode::kUnavailable) << lost.status.ToString();
  server_->Stop();  // idempotent
  EXPECT_EQ(CallAndWait(*client_, kEcho, "x").status.code(), StatusCode::kUnavailable);
}

TEST_P(ContractTest, ADestroyedChannelCompletesItsOutstandingCalls) {
  std::future<Outcome> held = Start(*client_, kHold, "", Within(20s));
  ASSERT_TRUE(WaitFor([&] { return HeldCount() == 1; }));
  client_.reset();
  ASSERT_EQ(held.wait_for(0s), std::future_status::ready)
      << "the destructor returned before the call completed";
  EXPECT_FALSE(held.get().status.ok());
}

TEST_P(ContractTest, TheProgressThreadRunsTasksAndTimersUntilStop) {
  std::promise<void> ran;
  server_->RunOnProgressThread([&] { ran.set_value(); });
  EXPECT_EQ(ran.get_future().wait_for(10s), std::future_status::ready);
  std::atomic<int> ticks{0};
  server_->RunEvery(5ms, [&] { ticks.fetch_add(1); });
  EXPECT_TRUE(WaitFor([&] { return ticks.load() >= 3; }));
  server_->Stop();
  // After Stop no timer runs: its count stays, through a Stop again (idempotent).
  const int at_stop = ticks.load();
  server_->Stop();
  EXPECT_EQ(ticks.load(), at_stop);
}

INSTANTIATE_TEST_SUITE_P(Transports, ContractTest, ::testing::ValuesIn(Implementations()),
                         [](const auto& param_info) { return param_info.param.name; });

// Every class of the product that implements the seam's Channel or Listener is exercised by
// an instantiation above (which checks at run time that it gets that class).
TEST(ContractCoverage, EveryImplementationOfTheSeamRunsTheSuite) {
  const std::filesystem::path root = KVSTASH_SOURCE_DIR;
  const std::regex implements(
      R"(class\s+(\w+)\s*(?:final\s*)?:\s*public\s+(?:(?:kvstash::)?transport::)?(Channel|Listener)\b)");
  std::map<std::string, std::string> found;  // class -> file
  for (auto it = std::filesystem::recursive_directory_iterator(root);
       it != std::filesystem::recursive_directory_iterator(); ++it) {
    const std::filesystem::directory_entry& entry = *it;
    const std::string relative = std::filesystem::relative(entry.path(), root).string();
    if (relative.starts_with("build") || relative.starts_with("tests") ||
        relative.starts_with(".")) {
      if (entry.is_directory()) it.disable_recursion_pending();
      continue;
    }
    const std::string ext = entry.path().extension().string();
    if (!entry.is_regular_file() || (ext != ".h" && ext != ".cc")) continue;
    std::ifstream in(entry.path());
    std::stringstream text;
    text << in.rdbuf();
    const std::string source = text.str();
    for (std::sregex_iterator match(source.begin(), source.end(), implements), end; match != end;
         ++match) {
      found[(*match)[1]] = relative;
    }
  }
  std::set<std::string> covered;
  for (const Implementation& implementation : Implementations()) {
    covered.insert(implementation.channel_class);
    covered.insert(implementation.listener_class);
  }
  ASSERT_FALSE(found.empty()) << "no implementation found under " << root;
  for (const auto& [name, file] : found) {
    EXPECT_TRUE(covered.count(name))
        << name << " (" << file << ") implements the transport seam but no instantiation of "
        << "tests/transport/contract_test.cc runs the contract suite over it";
  }
  // And the other way: a class named here that no longer exists is a stale claim.
  for (const std::string& name : covered) {
    EXPECT_TRUE(found.count(name)) << name << " is named by the contract suite but not found";
  }
}

}  // namespace
}  // namespace kvstash::transport
