// `kvstash bench ssd` as users run it: a tiny run with fio whose JSON carries every figure, and
// the usage errors (bad byte count, missing directory) that must name what was wrong.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <string>

#include "nlohmann/json.hpp"
#include "subprocess.h"
#include "temp_dir.h"

namespace kvstash {
namespace {

using ::testing::HasSubstr;
using testing::RunProcess;
using testing::TempDir;

const std::string kKvstash = KVSTASH_CLI_PATH;

void ExpectPositiveFinite(const nlohmann::json& v, const std::string& name) {
  ASSERT_TRUE(v.is_number()) << name << " is " << v.dump();
  EXPECT_TRUE(std::isfinite(v.get<double>())) << name;
  EXPECT_GT(v.get<double>(), 0.0) << name;
}

TEST(BenchSsdCliTest, JsonCarriesEveryFigureAndRatiosMatchThem) {
  TempDir dir;
  auto r = RunProcess({kKvstash, "bench", "ssd", "--dir", dir.path(), "--block-size", "64K",
                       "--total", "4M", "--rounds", "1", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  // Exactly one JSON object on stdout: parse rejects anything around it.
  const nlohmann::json doc = nlohmann::json::parse(r.out, nullptr, false);
  ASSERT_FALSE(doc.is_discarded()) << r.out;
  ASSERT_TRUE(doc.is_object());

  EXPECT_EQ(doc.at("block_bytes"), 65536);
  EXPECT_EQ(doc.at("total_bytes"), 4 << 20);
  EXPECT_EQ(doc.at("rounds"), 1);
  ASSERT_TRUE(doc.at("direct_io").is_boolean());
  for (const char* name : {"write_gbps", "read_gbps", "fio_write_gbps", "fio_read_gbps",
                           "write_ratio", "read_ratio"}) {
    ASSERT_TRUE(doc.contains(name)) << name;
    ExpectPositiveFinite(doc[name], name);
  }
  EXPECT_NEAR(doc["write_ratio"].get<double>(),
              doc["write_gbps"].get<double>() / doc["fio_write_gbps"].get<double>(), 1e-9);
  EXPECT_NEAR(doc["read_ratio"].get<double>(),
              doc["read_gbps"].get<double>() / doc["fio_read_gbps"].get<double>(), 1e-9);

  const nlohmann::json& per_round = doc.at("per_round");
  for (const char* name : {"write_gbps", "read_gbps", "fio_write_gbps", "fio_read_gbps"}) {
    ASSERT_TRUE(per_round.contains(name)) << name;
    ASSERT_EQ(per_round[name].size(), 1u) << name;
    // With one round the median is that round.
    EXPECT_EQ(per_round[name][0], doc[name]) << name;
  }
  // Both sides clean up after themselves.
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
}

TEST(BenchSsdCliTest, NoFioLeavesFioFiguresNull) {
  TempDir dir;
  auto r = RunProcess({kKvstash, "bench", "ssd", "--dir", dir.path(), "--block-size", "4096",
                       "--total", "64KiB", "--rounds", "2", "--json", "--no-fio"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json doc = nlohmann::json::parse(r.out, nullptr, false);
  ASSERT_FALSE(doc.is_discarded()) << r.out;
  ExpectPositiveFinite(doc.at("write_gbps"), "write_gbps");
  ExpectPositiveFinite(doc.at("read_gbps"), "read_gbps");
  EXPECT_TRUE(doc.at("fio_write_gbps").is_null());
  EXPECT_TRUE(doc.at("write_ratio").is_null());
  EXPECT_EQ(doc.at("per_round").at("write_gbps").size(), 2u);
}

TEST(BenchSsdCliTest, BadBlockSizeExitsTwoNamingTheFlag) {
  TempDir dir;
  for (const char* bad : {"64X", "K", "-1", "1024", "2G"}) {
    auto r = RunProcess({kKvstash, "bench", "ssd", "--dir", dir.path(), "--block-size", bad,
                         "--total", "4M", "--no-fio"});
    EXPECT_EQ(r.exit_code, 2) << bad;
    EXPECT_THAT(r.err, HasSubstr("--block-size")) << bad;
    EXPECT_EQ(r.out, "") << bad;
  }
  auto r = RunProcess({kKvstash, "bench", "ssd", "--dir", dir.path(), "--block-size", "1M",
                       "--total", "512K", "--no-fio"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("--total"));
}

TEST(BenchSsdCliTest, MissingDirExitsNonZeroNamingIt) {
  TempDir dir;
  const std::string missing = dir / "absent";
  auto r = RunProcess({kKvstash, "bench", "ssd", "--dir", missing, "--block-size", "64K", "--total",
                       "4M", "--no-fio"});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.err, HasSubstr("--dir: '" + missing + "' does not exist"));
  auto no_flag = RunProcess({kKvstash, "bench", "ssd", "--block-size", "64K", "--total", "4M"});
  EXPECT_EQ(no_flag.exit_code, 2);
  EXPECT_THAT(no_flag.err, HasSubstr("--dir"));
}

TEST(BenchSsdCliTest, HelpExplainsFlagsAndFigures) {
  auto r = RunProcess({kKvstash, "bench", "ssd", "--help"});
  EXPECT_EQ(r.exit_code, 0);
  for (const char* text : {"--dir", "--block-size", "--total", "--capacity", "--rounds", "--json",
                           "--no-fio", "ratio"}) {
    EXPECT_THAT(r.out, HasSubstr(text));
  }
  EXPECT_EQ(RunProcess({kKvstash, "bench"}).exit_code, 2);
}

}  // namespace
}  // namespace kvstash
