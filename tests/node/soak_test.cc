// 64 concurrent clients against one real kvstashd for 60 s of mixed traffic: stores, reads,
// per-key and prefix lookups, with a CPU tier far smaller than the data so blocks keep moving
// between the CPU and SSD tiers. Every block a client read back must be the one it stored, and
// at the end every committed block reads back with its content. The daemon's resident memory
// is sampled each second and must stay flat after the warm-up (a leak of a few hundred bytes
// per request would show).

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <random>
#include <thread>

#include "daemon_process.h"
#include "kvstash/common/hash.h"
#include "kvstash/connector/node_client.h"

namespace kvstash::connector {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

constexpr int kClients = 64;
constexpr int kKeysPerClient = 48;
constexpr size_t kBlock = 32 << 10;
constexpr auto kRun = 60s;
constexpr auto kWarmUp = 20s;

// Block content: words start + i * step, start drawn from the key.
void Fill(uint64_t key, std::span<std::byte> out) {
  const uint64_t start = Mix64(key);
  auto* w = reinterpret_cast<uint64_t*>(out.data());
  for (size_t i = 0; i < out.size() / 8; ++i) w[i] = start + i * 0x9e3779b97f4a7c15ULL;
}

bool Matches(uint64_t key, std::span<const std::byte> block) {
  const uint64_t start = Mix64(key);
  const auto* w = reinterpret_cast<const uint64_t*>(block.data());
  uint64_t diff = 0;
  for (size_t i = 0; i < block.size() / 8; ++i) diff |= w[i] ^ (start + i * 0x9e3779b97f4a7c15ULL);
  return diff == 0;
}

// VmRSS of `pid` in bytes (0 when unreadable).
uint64_t RssBytes(int pid) {
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoull(line.substr(6)) * 1024;
  }
  return 0;
}

BlockKey KeyOf(int client, int k) {
  BlockKey key;
  key.hash.lo = (static_cast<uint64_t>(client + 1) << 32) | static_cast<uint64_t>(k);
  key.hash.hi = 0x50a1c;
  return key;
}

TEST(SoakTest, SixtyFourClientsForAMinuteLoseNothingAndDaemonMemoryStaysFlat) {
  const std::filesystem::path ssd =
      std::filesystem::temp_directory_path() / ("kvstash-soak-" + std::to_string(::getpid()));
  std::filesystem::remove_all(ssd);
  // CPU tier: 512 blocks for 3072 keys, so most reads come from SSD by promotion.
  testing::Daemon daemon({"--block-bytes", "32KiB", "--cpu-bytes", "16MiB", "--ssd-dir",
                          ssd.string(), "--ssd-bytes", "256MiB"},
                         /*sizes=*/false);
  ASSERT_NE(daemon.port(), 0);
  const int pid = daemon.process().pid();

  auto worker = transport::ClientWorker::Create({});
  ASSERT_TRUE(worker.ok()) << worker.status().ToString();
  NodeClientOptions options;
  options.nodes = {NodeAddress{"127.0.0.1", daemon.port()}};
  options.key_namespace = "soak";
  options.worker = *worker;
  options.timeout = 20000ms;
  options.lookup_budget = options.timeout;  // every committed block must hit

  std::atomic<bool> stop{false};
  std::atomic<uint64_t> puts{0}, gets{0}, misses{0}, lookups{0}, errors{0}, mismatches{0};
  std::mutex mu;
  std::vector<std::string> failures;
  // committed[c][k]: client c's key k was stored (a put that returned OK).
  std::vector<std::vector<bool>> committed(kClients, std::vector<bool>(kKeysPerClient));
  auto fail = [&](std::string what) {
    errors.fetch_add(1);
    std::lock_guard lock(mu);
    if (failures.size() < 10) failures.push_back(std::move(what));
  };

  std::vector<std::thread> threads;
  for (int c = 0; c < kClients; ++c) {
    threads.emplace_back([&, c] {
      auto client = NodeClient::Create(options);
      if (!client.ok()) {
        fail(std::string(client.status().message()));
        return;
      }
      std::mt19937_64 random(c * 7919 + 1);
      std::vector<uint64_t> words(kBlock / 8);
      const std::span<std::byte> block = std::as_writable_bytes(std::span(words));
      while (!stop.load()) {
        const int k = static_cast<int>(random() % kKeysPerClient);
        const BlockKey key = KeyOf(c, k);
        const int op = static_cast<int>(random() % 10);
        if (op < 4) {  // store
          Fill(key.hash.lo, block);
          const transport::Bytes bytes = block;
          const Status s = (*client)->Put(std::span(&key, 1), std::span(&bytes, 1));
          if (!s.ok()) {
            fail("put " + key.ToString() + ": " + s.ToString());
            continue;
          }
          committed[c][k] = true;
          puts.fetch_add(1);
        } else if (op < 8) {  // read back one of this client's blocks
          auto got = (*client)->Get(key, block);
          if (!got.ok()) {
            if (got.status().code() != StatusCode::kNotFound) {
              fail("get " + key.ToString() + ": " + got.status().ToString());
            } else if (committed[c][k]) {
              fail("committed block " + key.ToString() + " is gone (the SSD tier holds all)");
            } else {
              misses.fetch_add(1);
            }
            continue;
          }
          if (*got != kBlock || !Matches(key.hash.lo, block)) mismatches.fetch_add(1);
          gets.fetch_add(1);
        } else {  // lookups: per key and the prefix of the client's first keys
          std::vector<BlockKey> keys;
          for (int j = 0; j < 8; ++j) keys.push_back(KeyOf(c, j));
          const std::vector<LookupResult> states = (*client)->Lookup(keys);
          for (int j = 0; j < 8; ++j) {
            if (committed[c][j] && states[j] == LookupResult::kMiss) {
              fail("lookup: committed block " + keys[j].ToString() + " missed");
            }
          }
          (void)(*client)->LookupPrefix(keys);
          lookups.fetch_add(1);
        }
      }
      // At the end: every block this client committed reads back with its content.
      for (int k = 0; k < kKeysPerClient; ++k) {
        if (!committed[c][k]) continue;
        const BlockKey key = KeyOf(c, k);
        auto got = (*client)->Get(key, block);
        if (!got.ok()) {
          fail("final read of " + key.ToString() + ": " + got.status().ToString());
        } else if (*got != kBlock || !Matches(key.hash.lo, block)) {
          mismatches.fetch_add(1);
        }
      }
    });
  }

  std::vector<uint64_t> rss;  // one sample per second
  const auto start = Clock::now();
  while (Clock::now() - start < kRun) {
    std::this_thread::sleep_for(1s);
    rss.push_back(RssBytes(pid));
  }
  stop = true;
  for (std::thread& t : threads) t.join();

  for (const std::string& f : failures) ADD_FAILURE() << f;
  EXPECT_EQ(errors.load(), 0u);
  EXPECT_EQ(mismatches.load(), 0u);
  // Every kind of traffic ran, in volume.
  EXPECT_GT(puts.load(), 1000u);
  EXPECT_GT(gets.load(), 1000u);
  EXPECT_GT(lookups.load(), 500u);
  std::cout << "puts " << puts << ", gets " << gets << " (" << misses << " never stored), lookups "
            << lookups << "\n";

  // Memory: the largest sample after the warm-up is within 24 MiB (and 15%) of the sample
  // at its end. The CPU tier (16 MiB) and RocksDB's buffers are in use by then.
  const size_t warm = static_cast<size_t>(std::chrono::seconds(kWarmUp).count()) - 1;
  ASSERT_GT(rss.size(), warm + 10);
  const uint64_t base = rss[warm];
  const uint64_t peak = *std::max_element(rss.begin() + warm, rss.end());
  std::cout << "daemon RSS after warm-up " << base / 1024 << " KiB, peak after " << peak / 1024
            << " KiB, last " << rss.back() / 1024 << " KiB\n";
  EXPECT_GT(base, 0u);
  EXPECT_LE(peak, base + std::max<uint64_t>(24 << 20, base * 15 / 100))
      << "daemon memory grew under steady load";

  // The daemon still answers, then stops cleanly with SIGTERM.
  auto client = NodeClient::Create(options);
  ASSERT_TRUE(client.ok());
  EXPECT_TRUE((*client)->Stats((*client)->nodes()[0]).ok());
  client->reset();
  EXPECT_EQ(daemon.process().Kill(SIGTERM), 0);
  EXPECT_EQ(daemon.process().Wait(), 0);
  std::filesystem::remove_all(ssd);
}

}  // namespace
}  // namespace kvstash::connector
