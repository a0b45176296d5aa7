#include "kvstash/store/block_slab.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

namespace kvstash::store {
namespace {

using ::testing::HasSubstr;

std::vector<std::byte> Pattern(size_t n, uint8_t seed) {
  std::vector<std::byte> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = std::byte(static_cast<uint8_t>(seed * 31 + i * 7));
  return v;
}

TEST(BlockSlabTest, SlotsAreAlignedDisjointAndHoldTheirBlocks) {
  auto slab = BlockSlab::Create({.slot_bytes = 5000, .slot_count = 7});
  ASSERT_TRUE(slab.ok()) << slab.status().ToString();
  BlockSlab& s = **slab;
  EXPECT_EQ(s.slot_stride(), 8192u);
  EXPECT_EQ(s.region().size(), 7u * 8192u);
  for (SlotId i = 0; i < 7; ++i) {
    EXPECT_EQ(reinterpret_cast<uintptr_t>(s.Slot(i).data()) % 4096, 0u);
    EXPECT_EQ(s.Slot(i).size(), 5000u);
    EXPECT_GE(s.Slot(i).data(), s.region().data());
    EXPECT_LE(s.Slot(i).data() + 5000, s.region().data() + s.region().size());
    ASSERT_TRUE(s.Write(i, Pattern(5000, static_cast<uint8_t>(i))).ok());
  }
  for (SlotId i = 0; i < 7; ++i) {
    std::vector<std::byte> out(5000);
    ASSERT_TRUE(s.Read(i, out).ok());
    EXPECT_EQ(out, Pattern(5000, static_cast<uint8_t>(i))) << "slot " << i;
  }
  // A shorter block lands at the start of the slot.
  ASSERT_TRUE(s.Write(3, Pattern(10, 99)).ok());
  std::vector<std::byte> head(10);
  ASSERT_TRUE(s.Read(3, head).ok());
  EXPECT_EQ(head, Pattern(10, 99));
}

TEST(BlockSlabTest, OversizedBlockAndBadSlotAreRefusedWithoutWriting) {
  auto slab = BlockSlab::Create({.slot_bytes = 2097152, .slot_count = 2, .prefault = false});
  ASSERT_TRUE(slab.ok());
  BlockSlab& s = **slab;
  ASSERT_TRUE(s.Write(0, Pattern(2097152, 1)).ok());
  Status too_big = s.Write(0, Pattern(3145728, 2));
  EXPECT_EQ(too_big.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(too_big.message(), "block of 3145728 bytes exceeds slot size 2097152");
  std::vector<std::byte> out(2097152);
  ASSERT_TRUE(s.Read(0, out).ok());
  EXPECT_EQ(out, Pattern(2097152, 1));
  Status past_end = s.Write(2, Pattern(1, 1));
  EXPECT_EQ(past_end.code(), StatusCode::kOutOfRange);
  EXPECT_THAT(std::string(past_end.message()), HasSubstr("slot 2 is past the end"));
  EXPECT_EQ(s.Read(5, out).code(), StatusCode::kOutOfRange);
}

TEST(BlockSlabTest, RejectsBadOptions) {
  EXPECT_EQ(BlockSlab::Create({.slot_bytes = 0, .slot_count = 1}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(BlockSlab::Create({.slot_bytes = 64, .slot_count = 0}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(
      BlockSlab::Create({.slot_bytes = 64, .slot_count = 1, .slot_alignment = 100}).status().code(),
      StatusCode::kInvalidArgument);
  EXPECT_EQ(BlockSlab::Create({.slot_bytes = size_t{1} << 30, .slot_count = size_t{1} << 31})
                .status()
                .code(),
            StatusCode::kResourceExhausted);  // 2^61 bytes: the mapping fails cleanly
}

TEST(BlockSlabTest, SmallAlignmentPacksSlots) {
  auto slab = BlockSlab::Create({.slot_bytes = 100, .slot_count = 3, .slot_alignment = 64});
  ASSERT_TRUE(slab.ok());
  EXPECT_EQ((*slab)->slot_stride(), 128u);
  EXPECT_EQ((*slab)->Slot(2).data() - (*slab)->Slot(0).data(), 256);
}

TEST(BlockSlabTest, CarvesSlotsFromCallerMemoryAndLeavesItMapped) {
  BlockSlabOptions options;
  options.slot_bytes = 1000;
  options.slot_count = 5;
  auto needed = BlockSlab::RequiredBytes(options);
  ASSERT_TRUE(needed.ok());
  EXPECT_EQ(*needed % 4096, 0u);
  EXPECT_GE(*needed, 5u * 4096);
  std::vector<std::byte> backing(*needed + 4096);
  // A page-aligned start inside the vector.
  auto* start = reinterpret_cast<std::byte*>((reinterpret_cast<uintptr_t>(backing.data()) + 4095) &
                                             ~uintptr_t{4095});
  options.memory = std::span<std::byte>(start, *needed);
  {
    auto slab = BlockSlab::Create(options);
    ASSERT_TRUE(slab.ok()) << slab.status().ToString();
    EXPECT_EQ((*slab)->region().data(), start);
    EXPECT_EQ((*slab)->Slot(3).data(), start + 3 * 4096);
    std::vector<std::byte> block(1000, std::byte{0x7e});
    ASSERT_TRUE((*slab)->Write(3, block).ok());
  }
  // The slab is gone; the caller's memory is still there with what was written.
  EXPECT_EQ(start[3 * 4096 + 999], std::byte{0x7e});
}

TEST(BlockSlabTest, RefusesCallerMemoryTooSmallOrMisaligned) {
  BlockSlabOptions options;
  options.slot_bytes = 4096;
  options.slot_count = 4;
  std::vector<std::byte> backing(8 * 4096);
  auto* start = reinterpret_cast<std::byte*>((reinterpret_cast<uintptr_t>(backing.data()) + 4095) &
                                             ~uintptr_t{4095});
  options.memory = std::span<std::byte>(start, 3 * 4096);
  auto small = BlockSlab::Create(options);
  EXPECT_EQ(small.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(small.status().message()), HasSubstr("needs 16384"));
  options.memory = std::span<std::byte>(start + 64, 4 * 4096);
  auto misaligned = BlockSlab::Create(options);
  EXPECT_EQ(misaligned.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(misaligned.status().message()), HasSubstr("aligned"));
}

}  // namespace
}  // namespace kvstash::store
