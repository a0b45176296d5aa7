// Multi-process: a writer process is killed with SIGKILL in the middle of a stream of stores;
// reopening the directory must give back every block it reported committed, intact, and
// nothing else but intact blocks.
#include <gtest/gtest.h>
#include <signal.h>

#include <string>
#include <vector>

#include "block_pattern.h"
#include "kvstash/store/ssd_tier.h"
#include "subprocess.h"
#include "temp_dir.h"
#include "test_util.h"

namespace kvstash::store {
namespace {

using kvstash::testing::ChildProcess;
using kvstash::testing::MatchesPattern;
using kvstash::testing::TempDir;
using testing::Key;

constexpr size_t kBlock = 256 * 1024;
constexpr size_t kCapacity = 24;  // blocks: slots are reused (evicted) while the writer runs

TEST(SsdCrashTest, KilledWriterLosesNothingCommitted) {
  TempDir dir;
  const std::string ssd_dir = dir / "ssd";
  SsdTierOptions options;
  options.dir = ssd_dir;
  options.block_bytes = kBlock;
  options.capacity_bytes = kCapacity * kBlock;
  // Kill points: before the tier is full, and after slots have been reused several times.
  const int kill_after[] = {7, 40, 61, 95};
  for (int round = 0; round < 4; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    const uint64_t first = uint64_t(round) * 1000000;
    auto writer =
        ::kvstash::testing::StartChild({KVSTASH_SSD_WRITER, ssd_dir, std::to_string(kBlock),
                                        std::to_string(kCapacity), std::to_string(first)});
    ASSERT_NE(writer, nullptr);
    ASSERT_GT(writer->pid(), 0);
    int64_t last = -1;
    for (int i = 0; i < kill_after[round]; ++i) {
      std::optional<std::string> line = writer->ReadLine(30000);
      ASSERT_TRUE(line.has_value()) << "the writer stopped after " << i << " blocks";
      ASSERT_EQ(line->rfind("committed ", 0), 0u) << *line;
      last = std::stoll(line->substr(10));
      ASSERT_TRUE(writer->WriteLine("next"));
    }
    // The writer is now inside the next Put (a 256 KiB direct write takes far longer than
    // this kill): it has committed at most one block more than it reported.
    EXPECT_EQ(writer->Kill(SIGKILL), 128 + SIGKILL);

    auto tier = SsdTier::Create(options);
    ASSERT_TRUE(tier.ok()) << tier.status().ToString();
    // The writer may have committed one more block than it reported. With LRU in write order,
    // the newest kCapacity committed blocks are resident: every reported block among the
    // newest kCapacity - 1 must be there.
    const int64_t reported = last - int64_t(first) + 1;
    const int64_t must_from = std::max<int64_t>(0, reported - int64_t(kCapacity) + 1);
    for (int64_t i = must_from; i < reported; ++i) {
      std::vector<std::byte> out;
      Status s = (*tier)->Get(Key(first + uint64_t(i)), &out);
      ASSERT_TRUE(s.ok()) << "block " << i << " of " << reported << ": " << s.ToString();
      EXPECT_TRUE(MatchesPattern(first + uint64_t(i), out)) << "block " << i;
    }
    // Whatever else is there (the unreported block, older rounds) is intact too.
    size_t resident = 0;
    for (int r = 0; r <= round; ++r) {
      for (uint64_t i = 0; i < uint64_t(reported) + 2; ++i) {
        const uint64_t k = uint64_t(r) * 1000000 + i;
        if ((*tier)->Lookup(Key(k)) != LookupResult::kHit) continue;
        std::vector<std::byte> out;
        Status s = (*tier)->Get(Key(k), &out);
        ASSERT_TRUE(s.ok()) << "key " << k << ": " << s.ToString();
        EXPECT_TRUE(MatchesPattern(k, out)) << "key " << k;
        ++resident;
      }
    }
    EXPECT_EQ((*tier)->stats().checksum_failures, 0u);
    EXPECT_LE(resident, kCapacity);
    EXPECT_GE(resident, size_t(std::min<int64_t>(reported, kCapacity - 1)));
  }
}

}  // namespace
}  // namespace kvstash::store
