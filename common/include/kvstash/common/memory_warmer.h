#pragma once

// MemoryWarmer: faults memory in on background threads while its owner already uses it. A node
// warms its CPU tier this way, so that a node of any size listens at once (touching the pages
// first would take seconds per GiB, a page fault per 4 KiB page, during which the node could
// neither serve nor stop). A same-host client does not warm its mapping of the node's tier
// whole (that cost every connection the whole tier's page tables): it faults in the chunks its
// copies reach (ChunkPopulator, below).
//
// Pages are populated without changing their content (MADV_POPULATE_WRITE; where the kernel
// lacks it, an atomic OR of 0 into one byte per page), so a client writing a block into a slot
// at the same time loses nothing. A slot not faulted in yet is still usable: its first write
// faults its pages on the writer's thread, so no store ever waits for the warmer or fails
// because of it. The page size is the owner's choice, made before (AdviseHugePages). The
// threads run at the lowest priority there is (SCHED_IDLE): they use only cores nothing else
// wants, and they take the process's mmap lock 2 MiB at a time.
//
// ChunkPopulator: faults memory in where it is first used, a chunk at a time, instead of all of
// it ahead (see below).

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <thread>
#include <vector>

namespace kvstash {

// Advises the kernel to back `memory` with transparent huge pages (`huge`) or with 4 KiB pages
// only (MADV_HUGEPAGE, MADV_NOHUGEPAGE over the whole pages it spans), whatever the system's
// default. Call it before the memory is touched: pages faulted in already keep their size.
// Advisory: false when the kernel refused the advice, which changes nothing else.
//
// A store's large memory takes 4 KiB pages unless asked (kvstashd --huge-pages): faulting in a
// huge page the kernel has to get back from a hypervisor costs several times what 4 KiB pages
// do. On this project's 2-core VM (free pages returned to the host), 1 GiB first touched in a
// fresh process took 3.1 to 4.2 s in huge pages against 0.72 s in 4 KiB pages, and a fresh node
// over TCP spent 42 % of the machine's CPU in page clearing; 8 TCP clients of 256 KiB moved
// 0.54 to 0.65 GB/s against 1.14 to 1.33 with 4 KiB pages (paired runs, bench peer).
bool AdviseHugePages(std::span<std::byte> memory, bool huge);

class MemoryWarmer {
 public:
  // Starts `threads` threads (at least 1) faulting `memory` in, each its share, in chunks. The
  // memory must outlive the warmer.
  MemoryWarmer(std::span<std::byte> memory, size_t threads);
  // Stops the threads (each within one chunk) and joins them.
  ~MemoryWarmer();
  MemoryWarmer(const MemoryWarmer&) = delete;
  MemoryWarmer& operator=(const MemoryWarmer&) = delete;

  // Bytes faulted in so far, and in all. Thread-safe.
  size_t faulted_bytes() const { return faulted_.load(std::memory_order_relaxed); }
  size_t total_bytes() const { return memory_.size(); }
  bool done() const { return faulted_bytes() == total_bytes(); }

 private:
  void Run(size_t begin, size_t end);

  std::span<std::byte> memory_;
  std::atomic<size_t> faulted_{0};
  std::atomic<bool> stop_{false};
  std::vector<std::thread> threads_;
};

// Faults memory in where it is first used: the first Touch of a chunk populates the whole chunk
// in one system call (as MemoryWarmer does, without changing a byte) instead of the page fault
// per 4 KiB page that a copy into it would take; a later Touch of it costs an atomic load. A
// same-host client populates its mapping of a node's tier this way: it pays page tables and
// population only for the part of the tier its copies reach, and nothing when it connects.
//
// Thread-safety: Touch from any number of threads at once (two threads first touching one
// chunk both populate it, harmlessly). The memory must outlive the populator.
class ChunkPopulator {
 public:
  static constexpr size_t kDefaultChunkBytes = size_t{2} << 20;  // 512 pages of 4 KiB

  // `chunk_bytes` is rounded up to a whole number of pages. `memory` starts on a page boundary.
  explicit ChunkPopulator(std::span<std::byte> memory, size_t chunk_bytes = kDefaultChunkBytes);
  ChunkPopulator(const ChunkPopulator&) = delete;
  ChunkPopulator& operator=(const ChunkPopulator&) = delete;

  // Populates each chunk that [offset, offset + n) overlaps and no Touch populated yet;
  // returns how many this call populated. A range beyond the memory is clipped to it.
  size_t Touch(size_t offset, size_t n);

  size_t chunk_bytes() const { return chunk_bytes_; }
  // Chunks populated so far, and in all. Thread-safe.
  size_t populated_chunks() const { return populated_.load(std::memory_order_relaxed); }
  size_t chunk_count() const { return chunks_; }

 private:
  std::span<std::byte> memory_;
  size_t chunk_bytes_;
  size_t chunks_;
  std::unique_ptr<std::atomic<uint64_t>[]> done_;  // one bit per chunk: populated
  std::atomic<size_t> populated_{0};
};

}  // namespace kvstash
