// Every counter of the cluster client's registry (kvstash/common/client_counters.h) reaches an
// engine worker's /kvstash/stats and /metrics (issue 30: six of thirteen never did). The engine's
// offload runs the real connector over an in-memory node client that reports a distinct value
// per row, and a WorkerServer in this process serves it on a loopback port. The test iterates
// the registry, so a row that any link of the chain (KvConnector::stats, the engine's offload
// stats, the worker's totals, its JSON and its Prometheus text) leaves out fails it.

#include "kvstash/common/client_counters.h"

#include <gtest/gtest.h>
#include <httplib.h>

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>

#include "fake_node_store.h"
#include "kvstash/connector/block_transfer.h"
#include "kvstash/engine/engine.h"
#include "kvstash/engine/node_offload.h"
#include "kvstash/worker/server.h"

namespace kvstash::worker {
namespace {

using engine::fakes::FakeNodeStore;
using engine::fakes::FakeStoreClient;
using nlohmann::json;

// Distinct values, past 2^32, so that a row read from another's name or truncated shows.
uint64_t ValueOf(const ClientCounterDef& def) {
  return (uint64_t{1} << 33) + 1000 * (static_cast<uint64_t>(def.id) + 1) + 7;
}

std::string MetricOf(const ClientCounterDef& def) {
  return std::string("kvstash_worker_") + def.export_name +
         (def.kind == CounterKind::kCounter ? "_total" : "");
}

class WorkerClientCountersTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ClientCounters counters;
    for (const ClientCounterDef& def : kClientCounterDefs) counters[def.id] = ValueOf(def);
    store_.set_counters(counters);

    auto config = engine::ModelConfig::Load("builtin:tiny-full");
    ASSERT_TRUE(config.ok()) << config.status().ToString();
    engine::EngineOptions options;
    FakeNodeStore* store = &store_;
    options.offload = engine::NodeOffload(
        [store](const engine::OffloadContext& c) -> Result<engine::ConnectorParts> {
          store->set_block_bytes(connector::OffloadedBlockBytes(1, c.layout->page_bytes()));
          engine::ConnectorParts parts;
          parts.client = std::make_unique<FakeStoreClient>(store);
          return parts;
        });
    auto created = engine::Engine::Create(*config, std::move(options));
    ASSERT_TRUE(created.ok()) << created.status().ToString();
    engine_ = std::move(created).value();

    ServerOptions server_options;
    server_options.port = 0;
    server_options.http_threads = 2;
    auto server = WorkerServer::Create(engine_.get(), server_options);
    ASSERT_TRUE(server.ok()) << server.status().ToString();
    server_ = std::move(server).value();
    serving_ = std::thread([this] { EXPECT_TRUE(server_->Serve().ok()); });
  }

  void TearDown() override {
    if (server_ != nullptr) server_->Stop();
    if (serving_.joinable()) serving_.join();
  }

  std::string Get(const std::string& path) {
    httplib::Client http("127.0.0.1", server_->port());
    http.set_read_timeout(10, 0);
    const httplib::Result res = http.Get(path);
    if (!res) {
      ADD_FAILURE() << "GET " << path << ": " << httplib::to_string(res.error());
      return "";
    }
    EXPECT_EQ(res->status, 200) << path << ": " << res->body;
    return res->body;
  }

  FakeNodeStore store_;
  std::unique_ptr<engine::Engine> engine_;
  std::unique_ptr<WorkerServer> server_;
  std::thread serving_;
};

TEST_F(WorkerClientCountersTest, EveryRowIsInTheJsonStatsByItsExportName) {
  const json stats = json::parse(Get("/kvstash/stats"), nullptr, /*allow_exceptions=*/false);
  ASSERT_TRUE(stats.is_object());
  for (const ClientCounterDef& def : kClientCounterDefs) {
    ASSERT_TRUE(stats.contains(def.export_name)) << def.export_name << " in " << stats.dump();
    EXPECT_EQ(stats[def.export_name].get<uint64_t>(), ValueOf(def)) << def.export_name;
  }
  // The names users scraped before the registry are kept.
  for (const char* name : {"node_unreachable", "node_refusals", "touched_keys",
                           "node_unserved_keys", "members_joined", "members_left"}) {
    EXPECT_TRUE(stats.contains(name)) << name;
  }
}

TEST_F(WorkerClientCountersTest, EveryRowIsAMetricOfItsTypeWithItsValue) {
  const std::string text = Get("/metrics");
  for (const ClientCounterDef& def : kClientCounterDefs) {
    const std::string name = MetricOf(def);
    const std::string type = def.kind == CounterKind::kCounter ? "counter" : "gauge";
    EXPECT_NE(text.find("\n# TYPE " + name + " " + type + "\n"), std::string::npos)
        << name << " in\n"
        << text;
    EXPECT_NE(text.find(std::string("\n# HELP ") + name + " " + def.help + "\n"), std::string::npos)
        << name;
    EXPECT_NE(text.find("\n" + name + " " + std::to_string(ValueOf(def)) + "\n"), std::string::npos)
        << name << " = " << ValueOf(def) << " in\n"
        << text;
  }
  // The text stays valid exposition: every line a comment or one sample of a family typed
  // before it, and every family once.
  const std::regex sample(R"(^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})? (\S+)$)");
  const std::regex type_line(R"(^# TYPE ([a-zA-Z_:][a-zA-Z0-9_:]*) (counter|gauge)$)");
  std::set<std::string> families;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    std::smatch m;
    if (std::regex_match(line, m, type_line)) {
      EXPECT_TRUE(families.insert(m[1]).second) << "family " << m[1] << " twice";
    } else if (line.rfind("# HELP ", 0) != 0) {
      ASSERT_TRUE(std::regex_match(line, m, sample)) << line;
      EXPECT_TRUE(families.count(m[1])) << "sample before its TYPE: " << line;
    }
  }
}

}  // namespace
}  // namespace kvstash::worker
