// MemoryWarmer (memory_warmer.h): its threads fault a whole region in without changing a byte,
// and its destructor stops them part way. ChunkPopulator: the first touch of a chunk faults it in
// whole, once, without changing a byte; other chunks stay untouched. Page-table entries are read
// from /proc/self/pagemap (present bit), on shared memory as a same-host client maps a node's tier.

#include "kvstash/common/memory_warmer.h"

#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace kvstash {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

const size_t kPage = static_cast<size_t>(sysconf(_SC_PAGESIZE));
constexpr size_t kChunk = size_t{1} << 20;

// Shared memory whose pages exist (written through a file descriptor, as a node's tier is
// written by the node) but are not mapped here yet.
class SharedMemory {
 public:
  explicit SharedMemory(size_t bytes) : bytes_(bytes) {
    fd_ = memfd_create("chunk_populator_test", 0);
    if (fd_ < 0 || ftruncate(fd_, static_cast<off_t>(bytes)) != 0) return;
    std::vector<std::byte> pattern(bytes);
    for (size_t i = 0; i < bytes; ++i) pattern[i] = static_cast<std::byte>(i * 7 + i / kPage);
    if (pwrite(fd_, pattern.data(), bytes, 0) != static_cast<ssize_t>(bytes)) return;
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
    if (p != MAP_FAILED) data_ = static_cast<std::byte*>(p);
  }
  ~SharedMemory() {
    if (data_ != nullptr) munmap(data_, bytes_);
    if (fd_ >= 0) close(fd_);
  }
  std::span<std::byte> span() const { return {data_, bytes_}; }
  bool ok() const { return data_ != nullptr; }
  bool Intact() const {
    for (size_t i = 0; i < bytes_; ++i) {
      if (data_[i] != static_cast<std::byte>(i * 7 + i / kPage)) return false;
    }
    return true;
  }
  // How many of the pages of chunk `chunk` have a page-table entry in this process.
  size_t PresentPagesOfChunk(size_t chunk) const {
    const size_t first = chunk * kChunk / kPage;
    const size_t pages = (std::min(bytes_, (chunk + 1) * kChunk) - chunk * kChunk) / kPage;
    std::vector<uint64_t> entries(pages);
    const int fd = open("/proc/self/pagemap", O_RDONLY);
    if (fd < 0) return 0;
    const off_t at =
        static_cast<off_t>((reinterpret_cast<uintptr_t>(data_) / kPage + first) * sizeof(uint64_t));
    const ssize_t got = pread(fd, entries.data(), pages * sizeof(uint64_t), at);
    close(fd);
    size_t present = 0;
    for (size_t i = 0; got > 0 && i < pages; ++i) present += (entries[i] >> 63) & 1;
    return present;
  }

 private:
  size_t bytes_;
  int fd_ = -1;
  std::byte* data_ = nullptr;
};

TEST(ChunkPopulatorTest, FirstTouchFaultsInItsChunksWholeAndOnce) {
  const size_t bytes = 4 * kChunk + 2 * kPage;  // a short fifth chunk
  SharedMemory memory(bytes);
  ASSERT_TRUE(memory.ok());
  ChunkPopulator populator(memory.span(), kChunk);
  EXPECT_EQ(populator.chunk_count(), 5u);
  for (size_t chunk = 0; chunk < 5; ++chunk) ASSERT_EQ(memory.PresentPagesOfChunk(chunk), 0u);

  EXPECT_EQ(populator.Touch(kChunk + 100, 10), 1u);  // chunk 1
  EXPECT_EQ(memory.PresentPagesOfChunk(1), kChunk / kPage);
  EXPECT_EQ(memory.PresentPagesOfChunk(0), 0u);
  EXPECT_EQ(memory.PresentPagesOfChunk(2), 0u);
  EXPECT_EQ(populator.Touch(kChunk, kChunk), 0u) << "chunk 1 populated twice";
  EXPECT_EQ(populator.Touch(2 * kChunk - kPage, 2 * kPage), 1u);  // chunks 1 and 2: only 2
  EXPECT_EQ(memory.PresentPagesOfChunk(2), kChunk / kPage);
  EXPECT_EQ(populator.Touch(bytes - 1, 1), 1u);  // the short chunk 4
  EXPECT_EQ(memory.PresentPagesOfChunk(4), 2u);
  EXPECT_EQ(memory.PresentPagesOfChunk(3), 0u);
  EXPECT_EQ(populator.Touch(bytes, kChunk), 0u) << "beyond the memory";
  EXPECT_EQ(populator.Touch(0, 0), 0u);
  EXPECT_EQ(memory.PresentPagesOfChunk(0), 0u);
  EXPECT_EQ(populator.populated_chunks(), 3u);
  EXPECT_TRUE(memory.Intact()) << "populating changed the memory";
}

TEST(ChunkPopulatorTest, ThreadsTouchingAtOnceCountEachChunkOnce) {
  const size_t chunks = 64 + 3;  // the bitmap's second word
  SharedMemory memory(chunks * kChunk);
  ASSERT_TRUE(memory.ok());
  ChunkPopulator populator(memory.span(), kChunk);
  std::atomic<size_t> calls_that_populated{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 random(t);
      for (int i = 0; i < 200; ++i) {
        const size_t offset = random() % (chunks * kChunk);
        calls_that_populated.fetch_add(populator.Touch(offset, random() % (3 * kChunk)));
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_LE(populator.populated_chunks(), chunks);
  EXPECT_GE(calls_that_populated.load(), populator.populated_chunks());
  size_t whole = 0;
  for (size_t chunk = 0; chunk < chunks; ++chunk) {
    const size_t present = memory.PresentPagesOfChunk(chunk);
    EXPECT_TRUE(present == 0 || present == kChunk / kPage) << "chunk " << chunk << ": " << present;
    whole += present != 0 ? 1 : 0;
  }
  EXPECT_EQ(whole, populator.populated_chunks());
  EXPECT_TRUE(memory.Intact());
}

TEST(MemoryWarmerTest, FaultsTheWholeRegionInWithoutChangingAByte) {
  const size_t bytes = 9 * kChunk + 3 * kPage;  // not a whole number of the warmer's calls
  SharedMemory memory(bytes);
  ASSERT_TRUE(memory.ok());
  ASSERT_EQ(memory.PresentPagesOfChunk(0), 0u);
  MemoryWarmer warmer(memory.span(), 3);
  EXPECT_EQ(warmer.total_bytes(), bytes);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!warmer.done() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_TRUE(warmer.done()) << warmer.faulted_bytes() << " of " << bytes << " bytes";
  EXPECT_EQ(warmer.faulted_bytes(), bytes);
  for (size_t chunk = 0; chunk * kChunk < bytes; ++chunk) {
    const size_t pages = (std::min(bytes, (chunk + 1) * kChunk) - chunk * kChunk) / kPage;
    EXPECT_EQ(memory.PresentPagesOfChunk(chunk), pages) << "chunk " << chunk;
  }
  EXPECT_TRUE(memory.Intact()) << "warming changed the memory";
}

TEST(MemoryWarmerTest, DestroyedAtOnceStopsPartWayAndChangesNothing) {
  const size_t bytes = 64 * kChunk;
  SharedMemory memory(bytes);
  ASSERT_TRUE(memory.ok());
  size_t faulted = 0;
  {
    MemoryWarmer warmer(memory.span(), 2);
    faulted = warmer.faulted_bytes();
  }  // joins its threads, each within the call it is in
  EXPECT_LE(faulted, bytes);
  EXPECT_TRUE(memory.Intact());
}

// The advice flags (/proc/self/smaps VmFlags) of the mapping holding `address`, with a space
// on either side of each; "" when none holds it.
std::string AdviceOf(const void* address) {
  std::ifstream smaps("/proc/self/smaps");
  const uintptr_t at = reinterpret_cast<uintptr_t>(address);
  bool inside = false;
  for (std::string line; std::getline(smaps, line);) {
    uintptr_t begin = 0, end = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx ", &begin, &end) == 2 &&
        line.find(' ') < line.find(':')) {
      inside = begin <= at && at < end;
    } else if (inside && line.rfind("VmFlags:", 0) == 0) {
      return line.substr(8) + " ";
    }
  }
  return "";
}

// The advice covers the whole pages the span reaches into and no others, and says huge or not
// whatever it said before; a span of no whole page is advised of nothing.
TEST(AdviseHugePagesTest, AdvisesTheWholePagesOfTheSpanEitherWay) {
  const size_t bytes = 8 * kPage;
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(p, MAP_FAILED);
  auto* base = static_cast<std::byte*>(p);
  // Pages 2..4 whole; the span starts and ends inside pages 1 and 5.
  const std::span<std::byte> span(base + kPage + 100, 5 * kPage - 200);
  EXPECT_TRUE(AdviseHugePages(span, true));
  EXPECT_THAT(AdviceOf(base + 2 * kPage), HasSubstr(" hg "));
  EXPECT_THAT(AdviceOf(base + 4 * kPage), HasSubstr(" hg "));
  EXPECT_THAT(AdviceOf(base + kPage), Not(HasSubstr(" hg ")));
  EXPECT_THAT(AdviceOf(base + 5 * kPage), Not(HasSubstr(" hg ")));
  EXPECT_TRUE(AdviseHugePages(span, false));
  EXPECT_THAT(AdviceOf(base + 3 * kPage), HasSubstr(" nh "));
  EXPECT_THAT(AdviceOf(base + 3 * kPage), Not(HasSubstr(" hg ")));
  EXPECT_TRUE(AdviseHugePages({base + 7 * kPage + 1, kPage - 2}, true));  // no whole page
  EXPECT_THAT(AdviceOf(base + 7 * kPage), Not(HasSubstr(" hg ")));
  munmap(p, bytes);
}

TEST(ChunkPopulatorTest, ChunkSizeIsWholePages) {
  SharedMemory memory(4 * kPage);
  ASSERT_TRUE(memory.ok());
  EXPECT_EQ(ChunkPopulator(memory.span(), 1).chunk_bytes(), kPage);
  EXPECT_EQ(ChunkPopulator(memory.span(), kPage + 1).chunk_bytes(), 2 * kPage);
  EXPECT_EQ(ChunkPopulator(memory.span(), kPage + 1).chunk_count(), 2u);
}

}  // namespace
}  // namespace kvstash
