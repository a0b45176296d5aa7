#include "kvstash/common/memory_warmer.h"

#include <pthread.h>
#include <sched.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>

namespace kvstash {

namespace {

// Per madvise call (2 MiB: 512 pages of 4 KiB, one huge page). MADV_POPULATE_WRITE holds the
// process's mmap lock for the whole call, and a thread that maps memory (malloc, a thread's
// stack, UCX registering a buffer) waits for it, with every page fault of the node's other
// threads queued behind that one: the lock must be let go often. With 32 MiB calls a fresh 2 GiB
// node stalled its progress threads past a client's 1 s probe (connections reset) and moved 0.54
// GB/s for 8 TCP clients of 256 KiB in its first 3 s, against 0.68 with 2 MiB calls (medians of
// 6 paired rounds, each node started after 15 s idle); the calls still cost nothing next to the
// faults.
constexpr size_t kChunkBytes = size_t{2} << 20;

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

bool AdviseHugePages(std::span<std::byte> memory, bool huge) {
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(memory.data()) + page - 1) & ~(page - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(memory.data()) + memory.size()) & ~(page - 1);
  if (memory.empty() || end <= begin) return true;  // no whole page to advise
  return madvise(reinterpret_cast<void*>(begin), end - begin,
                 huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE) == 0;
}

MemoryWarmer::MemoryWarmer(std::span<std::byte> memory, size_t threads) : memory_(memory) {
  if (memory_.empty()) return;
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
  // Only a core nothing else wants warms memory: a store or read faults in what it touches
  // itself anyway, and a warmer that competes for the core delays every one of them by a
  // scheduler slice. With one of two cores kept busy by another process, a fresh 2 GiB node
  // moved 0.02 GB/s for one TCP client of 256 KiB in its first 2 s with the warmer at normal
  // priority, 0.64 with it idle (medians of 3 paired rounds), and 8 shared-memory clients 0.32
  // against 1.40; on an idle machine, 0.95 against 0.85 (8 TCP clients, within the rounds'
  // spread). A machine never idle warms only what is touched; failure to switch is harmless.
  //
  // Known cost: with every core busy, a warmer preempted inside MADV_POPULATE_WRITE keeps the
  // process's mmap lock until it runs again, and every mmap of the node waits (UCX setting up a
  // connection): beside two processes keeping both cores busy, a fresh 1 GiB node answered a new
  // client's connect and stats in a median of 1,039 ms (38 to 1,304, 9 runs). Faulting page by
  // page instead (one atomic byte per page, no mmap lock across a range) cut that to 107 ms, but
  // cost fresh shared-memory throughput with one core busy (`bench peer --busy 1`, 2 paired
  // rounds: 256 KiB x 1 client 1.07 against 1.17 GB/s, below Redis's unix socket; 2 MiB x 1
  // 1.08-1.20 against 1.37-1.76), so it is not done; one core free keeps the lock short.
  sched_param idle{};
  pthread_setschedparam(pthread_self(), SCHED_IDLE, &idle);
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  for (size_t off = begin; off < end && !stop_.load(std::memory_order_relaxed);
       off += kChunkBytes) {
    const size_t bytes = std::min(kChunkBytes, end - off);
    Populate(memory_.data() + off, bytes, page);
    faulted_.fetch_add(bytes, std::memory_order_relaxed);
  }
}

ChunkPopulator::ChunkPopulator(std::span<std::byte> memory, size_t chunk_bytes) : memory_(memory) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  chunk_bytes_ = std::max(page, (chunk_bytes + page - 1) / page * page);
  chunks_ = (memory_.size() + chunk_bytes_ - 1) / chunk_bytes_;
  done_ = std::make_unique<std::atomic<uint64_t>[]>((chunks_ + 63) / 64);
}

size_t ChunkPopulator::Touch(size_t offset, size_t n) {
  if (n == 0 || offset >= memory_.size()) return 0;
  const size_t end = offset + std::min(n, memory_.size() - offset);
  size_t populated = 0;
  for (size_t chunk = offset / chunk_bytes_; chunk * chunk_bytes_ < end; ++chunk) {
    std::atomic<uint64_t>& word = done_[chunk / 64];
    const uint64_t bit = uint64_t{1} << (chunk % 64);
    if ((word.load(std::memory_order_acquire) & bit) != 0) continue;
    const size_t begin = chunk * chunk_bytes_;
    Populate(memory_.data() + begin, std::min(chunk_bytes_, memory_.size() - begin),
             static_cast<size_t>(sysconf(_SC_PAGESIZE)));
    if ((word.fetch_or(bit, std::memory_order_acq_rel) & bit) == 0) {
      populated_.fetch_add(1, std::memory_order_relaxed);
    }
    ++populated;
  }
  return populated;
}

}  // namespace kvstash
