// BlockSlab: the CPU tier's block memory.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

#include "kvstash/common/status.h"
#include "kvstash/store/block_manager.h"

namespace kvstash::store {

struct BlockSlabOptions {
  // Bytes of one block slot (the largest block it holds); 1 byte to 1 GiB.
  size_t slot_bytes = 0;
  size_t slot_count = 0;
  // Slot starts are aligned to this many bytes (a power of two, 64 to 1 GiB). The default, a
  // page, keeps every slot usable for O_DIRECT I/O and page-granular memory registration.
  size_t slot_alignment = 4096;
  // Touch every page at creation, so the first write to a slot does not fault and
  // registration with a transport (which pins pages) costs no page faults later.
  bool prefault = true;
  // Transparent huge pages (fewer TLB misses once faulted in) or 4 KiB pages only, whatever the
  // system's default; advisory. Off: a fresh huge page can cost several times its 4 KiB pages
  // to fault in (AdviseHugePages, common/memory_warmer.h).
  bool huge_pages = false;
  // Memory to carve the slots from instead of a mapping of the slab's own (a node hands it
  // memory its transport can share with clients). Owned by the caller and must outlive the
  // slab; at least RequiredBytes(options), starting on a slot_alignment boundary. Prefault
  // applies to it too; huge_pages does not.
  std::span<std::byte> memory{};
};

// Fixed-size block slots carved from one page-aligned anonymous mapping, ready to be registered
// with a transport in one piece (region()). Owns the mapping; move-only.
//
// Thread-compatible: concurrent access to distinct slots is safe; the caller (the block
// manager's two-phase protocol) makes sure nobody reads a slot while it is written.
class BlockSlab {
 public:
  // InvalidArgument for a size, count or alignment outside the documented ranges or a total
  // that overflows; ResourceExhausted when the mapping fails (ENOMEM).
  static Result<std::unique_ptr<BlockSlab>> Create(const BlockSlabOptions& options);
  // Bytes the slab maps (or needs in options.memory): slot_count slot strides, rounded up to
  // a page. The same errors as Create for bad options.
  static Result<size_t> RequiredBytes(const BlockSlabOptions& options);
  ~BlockSlab();
  BlockSlab(const BlockSlab&) = delete;
  BlockSlab& operator=(const BlockSlab&) = delete;

  size_t slot_bytes() const { return slot_bytes_; }
  size_t slot_count() const { return slot_count_; }
  // Distance between the starts of consecutive slots (slot_bytes rounded up to the alignment).
  size_t slot_stride() const { return slot_stride_; }

  // The whole slot. Precondition: slot < slot_count().
  std::span<std::byte> Slot(SlotId slot) {
    return {base_ + static_cast<size_t>(slot) * slot_stride_, slot_bytes_};
  }
  std::span<const std::byte> Slot(SlotId slot) const {
    return {base_ + static_cast<size_t>(slot) * slot_stride_, slot_bytes_};
  }

  // Copies `block` to the start of `slot`. OutOfRange for a slot past the end; InvalidArgument
  // for a block larger than a slot ("block of N bytes exceeds slot size M"). Nothing is written
  // on error.
  Status Write(SlotId slot, std::span<const std::byte> block);
  // Copies the first `out.size()` bytes of `slot` into `out`; the same errors as Write.
  Status Read(SlotId slot, std::span<std::byte> out) const;

  // The mapping as one region, for memory registration.
  std::span<std::byte> region() { return {base_, mapped_bytes_}; }

 private:
  BlockSlab(std::byte* base, size_t mapped_bytes, bool owns_mapping, size_t slot_bytes,
            size_t slot_count, size_t slot_stride);
  Status Check(SlotId slot, size_t bytes) const;

  std::byte* const base_;
  const size_t mapped_bytes_;
  const bool owns_mapping_;
  const size_t slot_bytes_;
  const size_t slot_count_;
  const size_t slot_stride_;
};

}  // namespace kvstash::store
