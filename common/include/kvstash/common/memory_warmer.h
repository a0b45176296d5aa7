#pragma once

// MemoryWarmer: faults memory in on background threads while its owner already uses it. A node
// warms its CPU tier this way, so that a node of any size listens at once (touching the pages
// first would take seconds per GiB, a page fault per 4 KiB page, during which the node could
// neither serve nor stop); a same-host client warms its mapping of the node's tier, so that its
// copies into slots do not fault page by page.
//
// Pages are populated without changing their content (MADV_POPULATE_WRITE; where the kernel
// lacks it, an atomic OR of 0 into one byte per page), so a client writing a block into a slot
// at the same time loses nothing. A slot not faulted in yet is still usable: its first write
// faults its pages on the writer's thread, so no store ever waits for the warmer or fails
// because of it. Transparent huge pages are asked for first (advisory).

#include <atomic>
#include <cstddef>
#include <memory>
#include <span>
#include <thread>
#include <vector>

namespace kvstash {

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

}  // namespace kvstash
