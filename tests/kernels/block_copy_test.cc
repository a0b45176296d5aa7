#include "kvstash/kernels/block_copy.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

namespace kvstash::kernels {
namespace {

constexpr size_t kPageBytes = 96;
constexpr size_t kPages = 8;

std::vector<std::byte> RandomBytes(size_t count, std::mt19937& rng) {
  std::vector<std::byte> v(count);
  for (std::byte& b : v) b = static_cast<std::byte>(rng() & 0xff);
  return v;
}

const std::byte* Page(const std::vector<std::byte>& pool, uint32_t page) {
  return pool.data() + page * kPageBytes;
}

TEST(BlockCopyTest, GatherThenScatterRoundTripsWholePages) {
  std::mt19937 rng(31);
  const std::vector<std::byte> pool = RandomBytes(kPages * kPageBytes, rng);
  const std::vector<uint32_t> blocks = {5, 2, 7, 1};

  std::vector<std::byte> packed(blocks.size() * kPageBytes);
  GatherBlocks(pool.data(), kPageBytes, blocks, packed.data());
  for (size_t i = 0; i < blocks.size(); ++i) {
    EXPECT_EQ(std::memcmp(packed.data() + i * kPageBytes, Page(pool, blocks[i]), kPageBytes), 0)
        << "block " << blocks[i];
  }

  std::vector<std::byte> other(kPages * kPageBytes, std::byte{0});
  ScatterBlocks(packed.data(), other.data(), kPageBytes, blocks);
  for (uint32_t page = 0; page < kPages; ++page) {
    const bool scattered = std::find(blocks.begin(), blocks.end(), page) != blocks.end();
    if (scattered) {
      EXPECT_EQ(std::memcmp(Page(other, page), Page(pool, page), kPageBytes), 0) << page;
    } else {
      const std::vector<std::byte> zeros(kPageBytes, std::byte{0});
      EXPECT_EQ(std::memcmp(Page(other, page), zeros.data(), kPageBytes), 0) << page;
    }
  }
}

TEST(BlockCopyTest, ByteRangeOfEachPageLeavesTheRestAlone) {
  // One layer of a page of packed layers: bytes [24, 64) of each page.
  std::mt19937 rng(32);
  const size_t offset = 24, len = 40;
  const std::vector<std::byte> pool = RandomBytes(kPages * kPageBytes, rng);
  const std::vector<uint32_t> blocks = {3, 6, 0};

  std::vector<std::byte> packed(blocks.size() * len);
  GatherBlocks(pool.data(), kPageBytes, blocks, packed.data(), offset, len);
  for (size_t i = 0; i < blocks.size(); ++i) {
    EXPECT_EQ(std::memcmp(packed.data() + i * len, Page(pool, blocks[i]) + offset, len), 0);
  }

  const std::vector<std::byte> incoming = RandomBytes(blocks.size() * len, rng);
  std::vector<std::byte> target = pool;
  ScatterBlocks(incoming.data(), target.data(), kPageBytes, blocks, offset, len);
  for (uint32_t page = 0; page < kPages; ++page) {
    const auto it = std::find(blocks.begin(), blocks.end(), page);
    for (size_t b = 0; b < kPageBytes; ++b) {
      const size_t at = page * kPageBytes + b;
      if (it != blocks.end() && b >= offset && b < offset + len) {
        ASSERT_EQ(target[at], incoming[(it - blocks.begin()) * len + b - offset]) << page;
      } else {
        ASSERT_EQ(target[at], pool[at]) << "page " << page << " byte " << b;
      }
    }
  }
}

TEST(BlockCopyTest, NoBlocksCopiesNothing) {
  std::vector<std::byte> pool(kPages * kPageBytes, std::byte{7});
  std::vector<std::byte> buffer(4, std::byte{9});
  GatherBlocks(pool.data(), kPageBytes, {}, buffer.data());
  ScatterBlocks(buffer.data(), pool.data(), kPageBytes, {}, 8, 4);
  EXPECT_EQ(buffer, std::vector<std::byte>(4, std::byte{9}));
  EXPECT_EQ(pool, std::vector<std::byte>(kPages * kPageBytes, std::byte{7}));
}

}  // namespace
}  // namespace kvstash::kernels
