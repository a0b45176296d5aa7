// GhostRing: AF-LRU's memory of evicted blocks, as key fingerprints with their frequency class.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvstash/common/block_key.h"

namespace kvstash::store {

// The blocks evicted by the last `capacity` pushes, each as a 30-bit fingerprint of its key and
// the frequency class (1 to 3) it had, in 4 bytes, with an open-addressing index over them
// (about 8 more bytes per ghost). A fingerprint is held once: pushing one that is held replaces
// the old ghost. Taking a ghost forgets it; its ring position stays empty until the ring wraps
// over it, so the ring holds what the last `capacity` pushes left. Not thread-safe.
class GhostRing {
 public:
  explicit GhostRing(size_t capacity);

  // A key's fingerprint: 30 bits of a hash of its block hash and group, never 0. Not of its
  // namespace, whose id a node gives in order of first appearance, so that an in-process model
  // of a node (`kvstash bench replay`) makes the same fingerprints, collisions included. Two
  // namespaces' blocks of one hash share a ghost: a block one of them lost starts a class
  // higher in the other, and nothing else passes between them.
  static uint32_t Fingerprint(const BlockKey& key) {
    const auto fp = static_cast<uint32_t>(NamespaceFreeHash(key) >> 34);
    return fp == 0 ? 1 : fp;
  }

  // Remembers `fingerprint` with `frequency_class` (1 to 3), forgetting the ghost the ring
  // position held and any older ghost of the same fingerprint.
  void Push(uint32_t fingerprint, uint32_t frequency_class);
  // The class remembered for `fingerprint`, forgetting it; 0 when there is none.
  uint32_t Take(uint32_t fingerprint);
  void Clear();

  size_t size() const { return size_; }
  // Appends the ghosts, oldest first, each as fingerprint << 2 | class. For state dumps.
  void AppendInOrder(std::vector<uint32_t>* ghosts) const;
  size_t MemoryBytes() const;

 private:
  size_t Bucket(uint32_t fingerprint) const { return (fingerprint * 0x9e3779b1u) >> shift_; }
  // The index slot that points at ring position `pos`, which holds `fingerprint`.
  size_t FindSlot(uint32_t fingerprint, uint32_t pos) const;
  // Empties index slot `slot`, moving later entries of its probe run back (linear probing's
  // deletion without tombstones).
  void EraseSlot(size_t slot);

  std::vector<uint32_t> ring_;   // fingerprint << 2 | class; 0: empty
  std::vector<uint32_t> index_;  // ring position + 1; 0: empty
  size_t mask_ = 0;
  unsigned shift_ = 0;
  size_t next_ = 0;  // the ring position the next push writes
  size_t size_ = 0;
};

}  // namespace kvstash::store
