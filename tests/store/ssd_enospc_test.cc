// A full disk: the SSD tier lives on a small tmpfs mounted for this test in a private mount
// namespace. SSD stores must fail cleanly (nothing half-kept, counted) while the CPU tier keeps
// serving, committed SSD blocks stay readable, and stores succeed again once space is freed.
#include <gtest/gtest.h>
#include <sched.h>
#include <sys/mount.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <vector>

#include "block_pattern.h"
#include "kvstash/store/tiered_store.h"
#include "temp_dir.h"
#include "test_util.h"

namespace kvstash::store {
namespace {

using kvstash::testing::FillPattern;
using kvstash::testing::MatchesPattern;
using kvstash::testing::TempDir;
using testing::Key;

constexpr size_t kBlock = 64 * 1024;

// Mounts a tmpfs of `bytes` at `dir`, visible to this process only. False (with the reason in
// `why`) where the test may not create mount namespaces.
bool MountSmallFileSystem(const std::string& dir, size_t bytes, std::string* why) {
  if (unshare(CLONE_NEWNS) != 0) {
    // Not privileged: a user namespace makes us root in it (needs a single-threaded process).
    if (unshare(CLONE_NEWUSER | CLONE_NEWNS) != 0) {
      *why = std::string("cannot create a mount namespace: ") + std::strerror(errno);
      return false;
    }
  }
  if (mount("none", "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) {
    *why = std::string("cannot make mounts private: ") + std::strerror(errno);
    return false;
  }
  const std::string options = "size=" + std::to_string(bytes);
  if (mount("tmpfs", dir.c_str(), "tmpfs", 0, options.c_str()) != 0) {
    *why = std::string("cannot mount tmpfs: ") + std::strerror(errno);
    return false;
  }
  return true;
}

TEST(SsdEnospcTest, FullDiskFailsSsdStoresCleanlyAndCpuKeepsServing) {
  TempDir dir;
  const std::string mount_point = dir / "small";
  ASSERT_EQ(mkdir(mount_point.c_str(), 0755), 0);
  std::string why;
  // 3 MiB, 1 MiB of it taken by another file: about 25 blocks fit after the index's files;
  // the SSD tier is configured for 64.
  if (!MountSmallFileSystem(mount_point, 3 << 20, &why)) GTEST_SKIP() << why;
  const std::string ballast = mount_point + "/other-data";
  {
    std::vector<char> mib(1 << 20, 'x');
    FILE* f = std::fopen(ballast.c_str(), "w");
    ASSERT_NE(f, nullptr);
    ASSERT_EQ(std::fwrite(mib.data(), 1, mib.size(), f), mib.size());
    std::fclose(f);
  }

  TieredStoreOptions options;
  options.block_bytes = kBlock;
  options.cpu_capacity_blocks = 8;
  options.prefault = false;
  SsdTierOptions ssd;
  ssd.dir = mount_point + "/ssd";
  ssd.capacity_bytes = 64 * kBlock;
  options.ssd = ssd;
  auto opened = TieredStore::Create(options);
  ASSERT_TRUE(opened.ok()) << opened.status().ToString();
  TieredStore& store = **opened;

  constexpr uint64_t kBlocks = 48;
  for (uint64_t k = 0; k < kBlocks; ++k) {
    const std::vector<BlockKey> keys = {Key(k)};
    StorePlan plan;
    Status s = store.PrepareStore(keys, &plan);
    ASSERT_TRUE(s.ok()) << "CPU store of block " << k << ": " << s.ToString();
    FillPattern(k, store.CpuSlot(plan.slots[0]));
    store.CompleteStore(keys, true);
    store.WaitIdle();
  }
  const TieredStoreStats stats = store.stats();
  const SsdTierStats ssd_stats = store.ssd()->stats();
  EXPECT_GT(stats.cascade_failures, 0u) << "the small file system never filled up";
  EXPECT_GT(stats.cascades_done, 0u);
  EXPECT_EQ(stats.cascades_done + stats.cascade_failures, kBlocks);
  EXPECT_EQ(ssd_stats.write_failures, stats.cascade_failures);
  // Failed stores left nothing: only the committed blocks are in the SSD index.
  EXPECT_EQ(store.ssd()->resident_blocks(), stats.cascades_done);

  // The CPU tier still serves its newest 8 blocks.
  for (uint64_t k = kBlocks - 8; k < kBlocks; ++k) {
    const std::vector<BlockKey> keys = {Key(k)};
    std::vector<std::span<const std::byte>> blocks;
    ASSERT_TRUE(store.PrepareLoad(keys, &blocks).ok()) << "block " << k;
    EXPECT_TRUE(MatchesPattern(k, blocks[0])) << "block " << k;
    ASSERT_TRUE(store.CompleteLoad(keys).ok());
  }
  // Every block the SSD tier took reads back intact.
  std::vector<uint64_t> on_ssd;
  for (uint64_t k = 0; k < kBlocks; ++k) {
    if (store.ssd()->Lookup(Key(k)) != LookupResult::kHit) continue;
    std::vector<std::byte> out;
    Status s = store.ssd()->Get(Key(k), &out);
    ASSERT_TRUE(s.ok()) << "block " << k << ": " << s.ToString();
    EXPECT_TRUE(MatchesPattern(k, out)) << "block " << k;
    on_ssd.push_back(k);
  }
  EXPECT_EQ(on_ssd.size(), stats.cascades_done);

  // A direct store fails with a clear error and keeps nothing.
  std::vector<std::byte> bytes(kBlock);
  FillPattern(1000, bytes);
  Status full = store.ssd()->Put(Key(1000), bytes);
  EXPECT_EQ(full.code(), StatusCode::kResourceExhausted) << full.ToString();
  EXPECT_NE(full.message().find("No space left"), std::string::npos) << full.ToString();
  EXPECT_EQ(store.ssd()->Lookup(Key(1000)), LookupResult::kMiss);

  // Once space is freed on the disk (the operator removes other data), stores work again.
  ASSERT_EQ(std::remove(ballast.c_str()), 0);
  Status again = store.ssd()->Put(Key(1000), bytes);
  ASSERT_TRUE(again.ok()) << again.ToString();
  std::vector<std::byte> out;
  ASSERT_TRUE(store.ssd()->Get(Key(1000), &out).ok());
  EXPECT_TRUE(MatchesPattern(1000, out));
}

}  // namespace
}  // namespace kvstash::store
