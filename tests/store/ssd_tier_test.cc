#include "kvstash/store/ssd_tier.h"

#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <vector>

#include "block_pattern.h"
#include "temp_dir.h"
#include "test_util.h"

namespace kvstash::store {
namespace {

using kvstash::testing::FillPattern;
using kvstash::testing::MatchesPattern;
using kvstash::testing::TempDir;
using testing::Key;
using testing::Keys;

constexpr size_t kBlock = 16384;

std::vector<std::byte> Pattern(uint64_t seed, size_t bytes = kBlock) {
  std::vector<std::byte> data(bytes);
  FillPattern(seed, data);
  return data;
}

class SsdTierTest : public ::testing::Test {
 protected:
  SsdTierOptions Options(size_t blocks, size_t block_bytes = kBlock) {
    SsdTierOptions o;
    o.dir = dir_.path() + "/ssd";
    o.block_bytes = block_bytes;
    o.capacity_bytes = blocks * ((block_bytes + 4095) / 4096 * 4096);
    return o;
  }
  std::unique_ptr<SsdTier> Open(const SsdTierOptions& options) {
    auto tier = SsdTier::Create(options);
    EXPECT_TRUE(tier.ok()) << tier.status().ToString();
    return tier.ok() ? std::move(tier).value() : nullptr;
  }
  // Expects key `k` to read back as Pattern(seed, bytes).
  void ExpectBlock(SsdTier& tier, uint64_t k, uint64_t seed, size_t bytes = kBlock) {
    std::vector<std::byte> out;
    Status s = tier.Get(Key(k), &out);
    ASSERT_TRUE(s.ok()) << "key " << k << ": " << s.ToString();
    EXPECT_EQ(out.size(), bytes);
    EXPECT_TRUE(MatchesPattern(seed, out)) << "key " << k;
  }
  StatusCode GetCode(SsdTier& tier, uint64_t k) {
    std::vector<std::byte> out;
    return tier.Get(Key(k), &out).code();
  }
  // Flips one byte of the file at `offset`.
  void FlipByte(const std::string& path, uint64_t offset) {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    ASSERT_TRUE(f.is_open()) << path;
    f.seekg(static_cast<std::streamoff>(offset));
    char c = 0;
    f.read(&c, 1);
    c = static_cast<char>(c ^ 0x5a);
    f.seekp(static_cast<std::streamoff>(offset));
    f.write(&c, 1);
  }

  TempDir dir_;
};

TEST_F(SsdTierTest, RejectsBadOptions) {
  SsdTierOptions o = Options(4);
  o.block_bytes = 0;
  EXPECT_EQ(SsdTier::Create(o).status().code(), StatusCode::kInvalidArgument);
  o = Options(4);
  o.capacity_bytes = kBlock - 1;
  EXPECT_EQ(SsdTier::Create(o).status().code(), StatusCode::kInvalidArgument);
  o = Options(4);
  o.dir.clear();
  EXPECT_EQ(SsdTier::Create(o).status().code(), StatusCode::kInvalidArgument);
}

TEST_F(SsdTierTest, PutGetDeleteRoundTrip) {
  auto tier = Open(Options(8));
  ASSERT_NE(tier, nullptr);
  EXPECT_EQ(tier->capacity_blocks(), 8u);
  // Full blocks, a short one and an unaligned length.
  ASSERT_TRUE(tier->Put(Key(1), Pattern(1)).ok());
  ASSERT_TRUE(tier->Put(Key(2), Pattern(2, 100)).ok());
  ASSERT_TRUE(tier->Put(Key(3), Pattern(3, 5000)).ok());
  ExpectBlock(*tier, 1, 1);
  ExpectBlock(*tier, 2, 2, 100);
  ExpectBlock(*tier, 3, 3, 5000);
  EXPECT_EQ(tier->Lookup(Key(1)), LookupResult::kHit);
  EXPECT_EQ(GetCode(*tier, 9), StatusCode::kNotFound);
  // A second put of a stored key keeps the first bytes (blocks are content-addressed).
  ASSERT_TRUE(tier->Put(Key(1), Pattern(7)).ok());
  ExpectBlock(*tier, 1, 1);
  ASSERT_TRUE(tier->Delete(Key(1)).ok());
  EXPECT_EQ(tier->Delete(Key(1)).code(), StatusCode::kNotFound);
  EXPECT_EQ(GetCode(*tier, 1), StatusCode::kNotFound);
  EXPECT_EQ(tier->resident_blocks(), 2u);
  const SsdTierStats stats = tier->stats();
  EXPECT_EQ(stats.blocks_written, 3u);
  EXPECT_EQ(stats.bytes_written, kBlock + 100 + 5000);
}

TEST_F(SsdTierTest, OversizedBlockIsRefusedAndKeepsNothing) {
  auto tier = Open(Options(4));
  EXPECT_EQ(tier->Put(Key(1), Pattern(1, kBlock + 1)).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(tier->Lookup(Key(1)), LookupResult::kMiss);
  EXPECT_EQ(tier->resident_blocks(), 0u);
}

TEST_F(SsdTierTest, BlockSizeNotAPageMultipleUsesWholeSlots) {
  auto tier = Open(Options(4, 6000));
  EXPECT_EQ(tier->slot_stride(), 8192u);
  for (uint64_t k = 0; k < 4; ++k) ASSERT_TRUE(tier->Put(Key(k), Pattern(k, 6000)).ok());
  for (uint64_t k = 0; k < 4; ++k) ExpectBlock(*tier, k, k, 6000);
}

TEST_F(SsdTierTest, EvictsLeastRecentWhenFull) {
  auto tier = Open(Options(4));
  for (uint64_t k = 0; k < 4; ++k) ASSERT_TRUE(tier->Put(Key(k), Pattern(k)).ok());
  tier->Touch(Keys({0}));
  ASSERT_TRUE(tier->Put(Key(4), Pattern(4)).ok());
  EXPECT_EQ(GetCode(*tier, 1), StatusCode::kNotFound);
  for (uint64_t k : {0, 2, 3, 4}) ExpectBlock(*tier, k, k);
  EXPECT_EQ(tier->stats().evictions, 1u);
}

TEST_F(SsdTierTest, TwoPhaseStoreAnswersRetryUntilCommitted) {
  auto tier = Open(Options(4));
  StorePlan plan;
  ASSERT_TRUE(tier->PrepareStore(Keys({1, 2}), &plan).ok());
  ASSERT_EQ(plan.slots.size(), 2u);
  EXPECT_EQ(tier->Lookup(Key(1)), LookupResult::kRetry);
  EXPECT_EQ(GetCode(*tier, 1), StatusCode::kUnavailable);
  EXPECT_EQ(tier->Put(Key(1), Pattern(1)).code(), StatusCode::kUnavailable);
  EXPECT_EQ(tier->Delete(Key(1)).code(), StatusCode::kFailedPrecondition);
  const std::vector<std::byte> a = Pattern(1), b = Pattern(2);
  const SsdWrite writes[] = {{Key(1), plan.slots[0], a}, {Key(2), plan.slots[1], b}};
  ASSERT_TRUE(tier->WriteAndCommit(writes).ok());
  ExpectBlock(*tier, 1, 1);
  ExpectBlock(*tier, 2, 2);
}

TEST_F(SsdTierTest, FailedWriteLeavesNothing) {
  auto tier = Open(Options(4));
  StorePlan plan;
  ASSERT_TRUE(tier->PrepareStore(Keys({1, 2}), &plan).ok());
  const std::vector<std::byte> a = Pattern(1), too_big = Pattern(2, kBlock + 1);
  const SsdWrite writes[] = {{Key(1), plan.slots[0], a}, {Key(2), plan.slots[1], too_big}};
  EXPECT_EQ(tier->WriteAndCommit(writes).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(tier->Lookup(Key(1)), LookupResult::kMiss);
  EXPECT_EQ(tier->Lookup(Key(2)), LookupResult::kMiss);
  EXPECT_EQ(tier->resident_blocks(), 0u);
  EXPECT_EQ(tier->stats().write_failures, 2u);
  tier.reset();
  tier = Open(Options(4));
  EXPECT_EQ(tier->resident_blocks(), 0u);
}

TEST_F(SsdTierTest, PinnedBlockCannotBeDeletedOrEvicted) {
  auto tier = Open(Options(2));
  ASSERT_TRUE(tier->Put(Key(1), Pattern(1)).ok());
  ASSERT_TRUE(tier->Put(Key(2), Pattern(2)).ok());
  std::vector<SlotId> slots;
  ASSERT_TRUE(tier->PrepareLoad(Keys({1}), &slots).ok());
  EXPECT_EQ(tier->Delete(Key(1)).code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(tier->Put(Key(3), Pattern(3)).ok());  // evicts 2, not the pinned 1
  EXPECT_EQ(tier->Lookup(Key(2)), LookupResult::kMiss);
  std::vector<SlotId> slots3;
  ASSERT_TRUE(tier->PrepareLoad(Keys({3}), &slots3).ok());
  EXPECT_EQ(tier->Put(Key(4), Pattern(4)).code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(tier->Lookup(Key(4)), LookupResult::kMiss);
  ASSERT_TRUE(tier->CompleteLoad(Keys({3})).ok());
  std::vector<std::byte> out(kBlock);
  ASSERT_TRUE(tier->Read(Key(1), slots[0], out).ok());
  EXPECT_TRUE(MatchesPattern(1, out));
  ASSERT_TRUE(tier->CompleteLoad(Keys({1})).ok());
  ASSERT_TRUE(tier->Put(Key(4), Pattern(4)).ok());
}

TEST_F(SsdTierTest, ReopenRestoresBlocksAndWriteOrder) {
  {
    auto tier = Open(Options(4));
    for (uint64_t k = 0; k < 4; ++k) ASSERT_TRUE(tier->Put(Key(k), Pattern(k)).ok());
    ASSERT_TRUE(tier->Delete(Key(2)).ok());
  }
  auto tier = Open(Options(4));
  EXPECT_EQ(tier->stats().restored_blocks, 3u);
  EXPECT_EQ(tier->resident_blocks(), 3u);
  for (uint64_t k : {0, 1, 3}) ExpectBlock(*tier, k, k);
  EXPECT_EQ(GetCode(*tier, 2), StatusCode::kNotFound);
  // The freed slot, then the least recently written block (0) makes room.
  ASSERT_TRUE(tier->Put(Key(10), Pattern(10)).ok());
  ASSERT_TRUE(tier->Put(Key(11), Pattern(11)).ok());
  EXPECT_EQ(GetCode(*tier, 0), StatusCode::kNotFound);
  for (uint64_t k : {1, 3, 10, 11}) ExpectBlock(*tier, k, k);
}

TEST_F(SsdTierTest, ReusedSlotServesOnlyTheNewBlockAfterReopen) {
  {
    auto tier = Open(Options(1));
    ASSERT_TRUE(tier->Put(Key(1), Pattern(1)).ok());
    ASSERT_TRUE(tier->Put(Key(2), Pattern(2)).ok());  // evicts 1, same slot
  }
  auto tier = Open(Options(1));
  EXPECT_EQ(GetCode(*tier, 1), StatusCode::kNotFound);
  ExpectBlock(*tier, 2, 2);
}

TEST_F(SsdTierTest, ReopenWithAnotherBlockSizeIsRefused) {
  { ASSERT_NE(Open(Options(4)), nullptr); }
  auto reopened = SsdTier::Create(Options(4, kBlock * 2));
  ASSERT_FALSE(reopened.ok());
  EXPECT_EQ(reopened.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(reopened.status().message(), ::testing::HasSubstr("holds blocks of 16384 bytes"));
}

TEST_F(SsdTierTest, ReopenSmallerDropsBlocksBeyondCapacity) {
  {
    auto tier = Open(Options(6));
    for (uint64_t k = 0; k < 6; ++k) ASSERT_TRUE(tier->Put(Key(k), Pattern(k)).ok());
  }
  auto tier = Open(Options(3));
  EXPECT_EQ(tier->resident_blocks(), 3u);
  EXPECT_EQ(tier->stats().dropped_records, 3u);
  for (uint64_t k = 0; k < 3; ++k) ExpectBlock(*tier, k, k);
  for (uint64_t k = 3; k < 6; ++k) EXPECT_EQ(GetCode(*tier, k), StatusCode::kNotFound);
  EXPECT_LE(std::filesystem::file_size(Options(3).dir + "/blocks.dat"), 3 * kBlock);
}

TEST_F(SsdTierTest, CorruptBlockIsAMissRemovedAndCounted) {
  const SsdTierOptions options = Options(4);
  {
    auto tier = Open(options);
    for (uint64_t k = 0; k < 4; ++k) ASSERT_TRUE(tier->Put(Key(k), Pattern(k)).ok());
  }
  // Slots are handed out in order: key k is in slot k.
  FlipByte(options.dir + "/blocks.dat", 1 * kBlock + 1234);
  FlipByte(options.dir + "/blocks.dat", 3 * kBlock + kBlock - 1);
  auto tier = Open(options);
  EXPECT_EQ(GetCode(*tier, 1), StatusCode::kDataLoss);
  EXPECT_EQ(GetCode(*tier, 3), StatusCode::kDataLoss);
  EXPECT_EQ(tier->stats().checksum_failures, 2u);
  EXPECT_EQ(GetCode(*tier, 1), StatusCode::kNotFound);
  EXPECT_EQ(tier->Lookup(Key(3)), LookupResult::kMiss);
  ExpectBlock(*tier, 0, 0);
  ExpectBlock(*tier, 2, 2);
  // The records are gone for good.
  tier.reset();
  tier = Open(options);
  EXPECT_EQ(tier->resident_blocks(), 2u);
}

TEST_F(SsdTierTest, TruncatedFileIsAMissNotACrash) {
  for (bool preallocate : {false, true}) {
    SCOPED_TRACE(preallocate ? "preallocated" : "sparse");
    SsdTierOptions options = Options(4);
    options.dir = dir_ / (preallocate ? "pre" : "sparse");
    options.preallocate = preallocate;
    {
      auto tier = Open(options);
      for (uint64_t k = 0; k < 4; ++k) ASSERT_TRUE(tier->Put(Key(k), Pattern(k)).ok());
    }
    std::filesystem::resize_file(options.dir + "/blocks.dat", 2 * kBlock + 100);
    // Sparse: the reads of slots 2 and 3 come back short. Preallocated: reopening extends the
    // file again, with zeros, which do not match the checksums. Either way: a miss.
    auto tier = Open(options);
    ExpectBlock(*tier, 0, 0);
    ExpectBlock(*tier, 1, 1);
    const StatusCode expected = preallocate ? StatusCode::kDataLoss : StatusCode::kUnavailable;
    EXPECT_EQ(GetCode(*tier, 2), expected);
    EXPECT_EQ(GetCode(*tier, 3), expected);
    EXPECT_EQ(tier->stats().read_errors + tier->stats().checksum_failures, 2u);
    EXPECT_EQ(tier->Lookup(Key(2)), LookupResult::kMiss);
    // The tier keeps working: the freed slots take new blocks.
    ASSERT_TRUE(tier->Put(Key(5), Pattern(5)).ok());
    ExpectBlock(*tier, 5, 5);
  }
}

TEST_F(SsdTierTest, PreallocationReservesTheCapacity) {
  SsdTierOptions options = Options(8);
  options.preallocate = true;
  auto tier = Open(options);
  struct stat st {};
  ASSERT_EQ(stat((options.dir + "/blocks.dat").c_str(), &st), 0);
  EXPECT_EQ(static_cast<uint64_t>(st.st_size), 8 * kBlock);
  EXPECT_GE(static_cast<uint64_t>(st.st_blocks) * 512, 8 * kBlock);
}

TEST_F(SsdTierTest, DamagedIndexNeverServesWrongBytes) {
  const SsdTierOptions options = Options(16);
  {
    auto tier = Open(options);
    for (uint64_t k = 0; k < 16; ++k) ASSERT_TRUE(tier->Put(Key(k), Pattern(k)).ok());
  }
  // Flip bytes all over every index file (log, tables, manifest).
  size_t damaged = 0;
  for (const auto& entry : std::filesystem::directory_iterator(options.dir + "/index")) {
    if (!entry.is_regular_file() || entry.file_size() == 0) continue;
    const std::string name = entry.path().filename();
    if (name == "LOCK" || name == "IDENTITY" || name.rfind("LOG", 0) == 0) continue;
    for (uint64_t off = 7; off < entry.file_size(); off += 61) FlipByte(entry.path(), off);
    ++damaged;
  }
  ASSERT_GT(damaged, 0u);
  auto tier = SsdTier::Create(options);
  if (!tier.ok()) {
    // Refusing to start is acceptable; serving wrong bytes is not.
    EXPECT_NE(tier.status().code(), StatusCode::kOk);
    return;
  }
  for (uint64_t k = 0; k < 16; ++k) {
    std::vector<std::byte> out;
    Status s = (*tier)->Get(Key(k), &out);
    if (s.ok()) {
      EXPECT_TRUE(MatchesPattern(k, out)) << "key " << k << " served wrong bytes";
    } else {
      EXPECT_THAT(s.code(), ::testing::AnyOf(StatusCode::kNotFound, StatusCode::kDataLoss,
                                             StatusCode::kUnavailable));
    }
  }
}

}  // namespace
}  // namespace kvstash::store
