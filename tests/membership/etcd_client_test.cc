// EtcdClient against a real etcd: leases, puts, prefix reads, deletes, watches, and the errors
// a caller sees when etcd is not there.

#include "kvstash/membership/etcd_client.h"

#include <gtest/gtest.h>
#include <httplib.h>

#include <future>
#include <map>
#include <mutex>
#include <string>
#include <thread>

#include "etcd_process.h"

namespace kvstash::membership {
namespace {

using namespace std::chrono_literals;
using ::kvstash::testing::EtcdProcess;

TEST(EtcdEndpointsTest, ParsesListsAndRefusesWhatIsNotPlainHttp) {
  auto parsed = ParseEtcdEndpoints("http://127.0.0.1:2379, 10.0.0.2:2379");
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  EXPECT_EQ(*parsed, (std::vector<std::string>{"http://127.0.0.1:2379", "http://10.0.0.2:2379"}));
  EXPECT_EQ(ParseEtcdEndpoints("https://a:1").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseEtcdEndpoints("a:1,,b:2").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseEtcdEndpoints("a").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseEtcdEndpoints("a:99999").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(EtcdClient::Create({}).status().code(), StatusCode::kInvalidArgument);
}

class EtcdClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(etcd_.Started());
    EtcdOptions options;
    options.endpoints = {etcd_.endpoint()};
    auto client = EtcdClient::Create(options);
    ASSERT_TRUE(client.ok()) << client.status().ToString();
    client_ = std::move(*client);
  }

  EtcdProcess etcd_;
  std::unique_ptr<EtcdClient> client_;
};

TEST_F(EtcdClientTest, KeysBoundToALeaseGoWithIt) {
  auto lease = client_->GrantLease(30);
  ASSERT_TRUE(lease.ok()) << lease.status().ToString();
  ASSERT_TRUE(client_->Put("/t/a/1", "one", *lease).ok());
  ASSERT_TRUE(client_->Put("/t/a/2", std::string("two\0\xff", 5)).ok());  // any bytes
  ASSERT_TRUE(client_->Put("/t/b", "elsewhere").ok());

  auto range = client_->GetPrefix("/t/a/");
  ASSERT_TRUE(range.ok()) << range.status().ToString();
  ASSERT_EQ(range->kvs.size(), 2u);
  EXPECT_EQ(range->kvs[0].key, "/t/a/1");
  EXPECT_EQ(range->kvs[0].value, "one");
  EXPECT_EQ(range->kvs[0].lease, *lease);
  EXPECT_EQ(range->kvs[1].value, std::string("two\0\xff", 5));
  EXPECT_GT(range->revision, 0);

  auto ttl = client_->KeepAlive(*lease);
  ASSERT_TRUE(ttl.ok()) << ttl.status().ToString();
  EXPECT_GT(*ttl, 25);

  ASSERT_TRUE(client_->RevokeLease(*lease).ok());
  range = client_->GetPrefix("/t/a/");
  ASSERT_TRUE(range.ok());
  ASSERT_EQ(range->kvs.size(), 1u);  // the leased key went with its lease
  EXPECT_EQ(range->kvs[0].key, "/t/a/2");
  EXPECT_EQ(client_->KeepAlive(*lease).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(client_->Put("/t/a/3", "x", *lease).code(), StatusCode::kNotFound);
  EXPECT_TRUE(client_->RevokeLease(*lease).ok());  // gone already: fine

  auto deleted = client_->Delete("/t/a/2");
  ASSERT_TRUE(deleted.ok());
  EXPECT_TRUE(*deleted);
  deleted = client_->Delete("/t/a/2");
  ASSERT_TRUE(deleted.ok());
  EXPECT_FALSE(*deleted);
}

TEST_F(EtcdClientTest, ALeaseNotRefreshedExpires) {
  auto lease = client_->GrantLease(2);
  ASSERT_TRUE(lease.ok());
  ASSERT_TRUE(client_->Put("/t/short", "x", *lease).ok());
  for (int i = 0; i < 100; ++i) {
    auto range = client_->GetPrefix("/t/short");
    ASSERT_TRUE(range.ok());
    if (range->kvs.empty()) break;
    std::this_thread::sleep_for(100ms);
  }
  auto range = client_->GetPrefix("/t/short");
  ASSERT_TRUE(range.ok());
  EXPECT_TRUE(range->kvs.empty());
  EXPECT_EQ(client_->KeepAlive(*lease).status().code(), StatusCode::kNotFound);
}

TEST_F(EtcdClientTest, AWatchSeesPutsAndDeletesInOrderUntilStopped) {
  auto start = client_->GetPrefix("/w/");
  ASSERT_TRUE(start.ok());
  std::mutex mu;
  std::vector<std::pair<WatchEvent::Type, std::string>> seen;
  std::promise<void> created;
  std::thread watcher([&] {
    const Status status = client_->Watch(
        "/w/", start->revision + 1,
        [&](const WatchEvent& event) {
          std::lock_guard lock(mu);
          seen.emplace_back(event.type, event.kv.key + "=" + event.kv.value);
        },
        [&] { created.set_value(); });
    EXPECT_EQ(status.code(), StatusCode::kCancelled) << status.ToString();
  });
  ASSERT_EQ(created.get_future().wait_for(5s), std::future_status::ready);
  ASSERT_TRUE(client_->Put("/w/1", "a").ok());
  ASSERT_TRUE(client_->Put("/other", "b").ok());
  ASSERT_TRUE(client_->Put("/w/2", "c").ok());
  ASSERT_TRUE(client_->Delete("/w/1").ok());
  for (int i = 0; i < 100; ++i) {
    {
      std::lock_guard lock(mu);
      if (seen.size() >= 3) break;
    }
    std::this_thread::sleep_for(20ms);
  }
  client_->StopWatches();
  watcher.join();
  std::lock_guard lock(mu);
  ASSERT_EQ(seen.size(), 3u);
  EXPECT_EQ(seen[0], std::make_pair(WatchEvent::Type::kPut, std::string("/w/1=a")));
  EXPECT_EQ(seen[1], std::make_pair(WatchEvent::Type::kPut, std::string("/w/2=c")));
  EXPECT_EQ(seen[2], std::make_pair(WatchEvent::Type::kDelete, std::string("/w/1=")));
  // Stopped for good: a new watch ends at once.
  EXPECT_EQ(client_->Watch("/w/", 0, [](const WatchEvent&) {}).code(), StatusCode::kCancelled);
}

TEST_F(EtcdClientTest, AWatchEndsWhenEtcdStops) {
  std::promise<void> created;
  std::promise<Status> ended;
  std::thread watcher([&] {
    ended.set_value(client_->Watch(
        "/w/", 0, [](const WatchEvent&) {}, [&] { created.set_value(); }));
  });
  ASSERT_EQ(created.get_future().wait_for(5s), std::future_status::ready);
  etcd_.Stop();
  auto future = ended.get_future();
  ASSERT_EQ(future.wait_for(10s), std::future_status::ready);
  EXPECT_EQ(future.get().code(), StatusCode::kUnavailable);
  watcher.join();
}

TEST(EtcdClientDownTest, NothingListeningIsUnavailableNamingTheEndpoint) {
  EtcdOptions options;
  const uint16_t port = ::kvstash::testing::FreeLoopbackPort();
  options.endpoints = {"127.0.0.1:" + std::to_string(port)};
  options.timeout = 500ms;
  auto client = EtcdClient::Create(options);
  ASSERT_TRUE(client.ok());
  auto lease = (*client)->GrantLease(5);
  ASSERT_EQ(lease.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(lease.status().message().find(std::to_string(port)), std::string::npos)
      << lease.status().ToString();
  EXPECT_EQ((*client)->GetPrefix("/x").status().code(), StatusCode::kUnavailable);
}

// A gateway whose answers are well-formed JSON with fields of the wrong kind (a revision that is
// not a number, a key that is not a string, events that are not a list): every call returns an
// error naming the malformed response. Before, std::stoll and the JSON library threw, which on
// the watcher's thread ended the process.
TEST(EtcdClientMalformedTest, WrongFieldsAreErrorsNeverExceptions) {
  std::map<std::string, std::string> answers = {
      {"/v3/lease/grant", R"({"ID":"12x"})"},
      {"/v3/lease/keepalive", R"({"result":{"TTL":"99999999999999999999999"}})"},
      {"/v3/kv/deleterange", R"({"deleted":[1]})"},
      {"/v3/kv/range", R"({"header":{"revision":"1"},"kvs":[{"key":5}]})"},
      {"/v3/watch", "{\"result\":{\"created\":true}}\n{\"result\":{\"events\":7}}\n"},
  };
  std::mutex mu;
  int status = 200;
  httplib::Server server;
  for (const auto& [path, unused] : answers) {
    server.Post(path, [&, path = path](const httplib::Request&, httplib::Response& response) {
      std::lock_guard lock(mu);
      response.status = status;
      response.set_content(answers[path], "application/json");
    });
  }
  const int port = server.bind_to_any_port("127.0.0.1");  // listening from here on
  ASSERT_GT(port, 0);
  std::thread serving([&] { server.listen_after_bind(); });
  EtcdOptions options;
  options.endpoints = {"127.0.0.1:" + std::to_string(port)};
  options.timeout = 2000ms;
  auto client = EtcdClient::Create(options);
  ASSERT_TRUE(client.ok()) << client.status().ToString();
  auto malformed = [](const Status& status) {
    return status.code() == StatusCode::kUnavailable &&
           status.message().find("malformed") != std::string::npos;
  };
  EXPECT_PRED1(malformed, (*client)->GrantLease(5).status());
  EXPECT_PRED1(malformed, (*client)->KeepAlive(7).status());
  EXPECT_PRED1(malformed, (*client)->Delete("/k").status());
  EXPECT_PRED1(malformed, (*client)->GetPrefix("/k").status());
  // The gateway's error object with a code that is not a number.
  {
    std::lock_guard lock(mu);
    status = 400;
    answers["/v3/kv/range"] = R"({"error":"x","code":"abc","message":"m"})";
  }
  EXPECT_PRED1(malformed, (*client)->GetPrefix("/k").status());
  {
    std::lock_guard lock(mu);
    status = 200;
  }
  bool created = false;
  int events = 0;
  const Status watched = (*client)->Watch(
      "/k", 0, [&](const WatchEvent&) { ++events; }, [&] { created = true; });
  EXPECT_PRED1(malformed, watched);
  EXPECT_TRUE(created);
  EXPECT_EQ(events, 0);
  server.stop();
  serving.join();
}

TEST_F(EtcdClientTest, ASecondEndpointAnswersWhenTheFirstIsDown) {
  EtcdOptions options;
  options.endpoints = {"127.0.0.1:" + std::to_string(::kvstash::testing::FreeLoopbackPort()),
                       etcd_.endpoint()};
  options.timeout = 500ms;
  auto client = EtcdClient::Create(options);
  ASSERT_TRUE(client.ok());
  ASSERT_TRUE((*client)->Put("/f/1", "x").ok());
  EXPECT_EQ((*client)->endpoint(), etcd_.endpoint());
}

}  // namespace
}  // namespace kvstash::membership
