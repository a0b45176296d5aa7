#include "kvstash/common/memory_warmer.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

namespace kvstash {

namespace {

// Per madvise call: small enough that a stop is seen at once, large enough that the calls cost
// nothing next to the faults (32 MiB: 8192 pages of 4 KiB, 16 huge pages).
constexpr size_t kChunkBytes = size_t{32} << 20;

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14
#endif

// Faults [p, p + bytes) in without changing a byte of it.
void Populate(std::byte* p, size_t bytes, size_t page) {
  if (madvise(p, bytes, MADV_POPULATE_WRITE) == 0) return;
  // Older kernels: one atomic read-modify-write of a byte per page writes what is there, so a
  // concurrent writer of that byte keeps its value.
  for (size_t off = 0; off < bytes; off += page) {
    __atomic_fetch_or(reinterpret_cast<unsigned char*>(p + off), 0, __ATOMIC_RELAXED);
  }
}

}  // namespace

MemoryWarmer::MemoryWarmer(std::span<std::byte> memory, size_t threads) : memory_(memory) {
  if (memory_.empty()) return;
  madvise(memory_.data(), memory_.size(), MADV_HUGEPAGE);  // advisory; failure is fine
  threads = std::max<size_t>(1, std::min(threads, memory_.size() / kChunkBytes + 1));
  const size_t share = (memory_.size() / threads + kChunkBytes - 1) / kChunkBytes * kChunkBytes;
  for (size_t t = 0; t < threads; ++t) {
    const size_t begin = std::min(memory_.size(), t * share);
    const size_t end = t + 1 == threads ? memory_.size() : std::min(memory_.size(), begin + share);
    threads_.emplace_back([this, begin, end] { Run(begin, end); });
  }
}

MemoryWarmer::~MemoryWarmer() {
  stop_.store(true, std::memory_order_relaxed);
  for (std::thread& t : threads_) t.join();
}

void MemoryWarmer::Run(size_t begin, size_t end) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  for (size_t off = begin; off < end && !stop_.load(std::memory_order_relaxed);
       off += kChunkBytes) {
    const size_t bytes = std::min(kChunkBytes, end - off);
    Populate(memory_.data() + off, bytes, page);
    faulted_.fetch_add(bytes, std::memory_order_relaxed);
  }
}

}  // namespace kvstash
