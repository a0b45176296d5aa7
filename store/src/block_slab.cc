#include "kvstash/store/block_slab.h"

#include <sys/mman.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <cstring>

#include "kvstash/common/memory_warmer.h"

namespace kvstash::store {

namespace {
constexpr size_t kMaxSlotBytes = size_t{1} << 30;
}  // namespace

Result<size_t> BlockSlab::RequiredBytes(const BlockSlabOptions& options) {
  if (options.slot_bytes == 0 || options.slot_bytes > kMaxSlotBytes) {
    return InvalidArgumentError("slot size of {} bytes is outside [1, {}]", options.slot_bytes,
                                kMaxSlotBytes);
  }
  if (options.slot_count == 0 || options.slot_count > (size_t{1} << 31)) {
    return InvalidArgumentError("slot count {} is outside [1, 2^31]", options.slot_count);
  }
  if (!std::has_single_bit(options.slot_alignment) || options.slot_alignment < 64 ||
      options.slot_alignment > kMaxSlotBytes) {
    return InvalidArgumentError("slot alignment {} is not a power of two in [64, {}]",
                                options.slot_alignment, kMaxSlotBytes);
  }
  const size_t stride =
      (options.slot_bytes + options.slot_alignment - 1) & ~(options.slot_alignment - 1);
  if (options.slot_count > SIZE_MAX / stride) {
    return InvalidArgumentError("{} slots of {} bytes overflow the address space",
                                options.slot_count, stride);
  }
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return (options.slot_count * stride + page - 1) / page * page;
}

Result<std::unique_ptr<BlockSlab>> BlockSlab::Create(const BlockSlabOptions& options) {
  KVSTASH_ASSIGN_OR_RETURN(const size_t bytes, RequiredBytes(options));
  const size_t stride =
      (options.slot_bytes + options.slot_alignment - 1) & ~(options.slot_alignment - 1);
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  void* base = nullptr;
  const bool external = options.memory.data() != nullptr;
  if (external) {
    if (options.memory.size() < bytes) {
      return InvalidArgumentError("{} bytes of memory for a slab that needs {}",
                                  options.memory.size(), bytes);
    }
    if (reinterpret_cast<uintptr_t>(options.memory.data()) % options.slot_alignment != 0) {
      return InvalidArgumentError("slab memory at {} is not aligned to {} bytes",
                                  static_cast<const void*>(options.memory.data()),
                                  options.slot_alignment);
    }
    base = options.memory.data();
  } else {
    base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) {
      return FromErrno(errno, fmt::format("mapping a block slab of {} bytes", bytes));
    }
    AdviseHugePages({static_cast<std::byte*>(base), bytes}, options.huge_pages);  // advisory
  }
  if (options.prefault) {
    // Fault every page in now by writing one byte per page, after the huge-page advice (with
    // MAP_POPULATE the pages would be faulted in before the advice could apply).
    auto* p = static_cast<volatile std::byte*>(base);
    for (size_t off = 0; off < bytes; off += page) p[off] = std::byte{0};
  }
  return std::unique_ptr<BlockSlab>(new BlockSlab(static_cast<std::byte*>(base), bytes, !external,
                                                  options.slot_bytes, options.slot_count, stride));
}

BlockSlab::BlockSlab(std::byte* base, size_t mapped_bytes, bool owns_mapping, size_t slot_bytes,
                     size_t slot_count, size_t slot_stride)
    : base_(base),
      mapped_bytes_(mapped_bytes),
      owns_mapping_(owns_mapping),
      slot_bytes_(slot_bytes),
      slot_count_(slot_count),
      slot_stride_(slot_stride) {}

BlockSlab::~BlockSlab() {
  if (owns_mapping_) munmap(base_, mapped_bytes_);
}

Status BlockSlab::Check(SlotId slot, size_t bytes) const {
  if (slot >= slot_count_) {
    return OutOfRangeError("slot {} is past the end of a slab of {} slots", slot, slot_count_);
  }
  if (bytes > slot_bytes_) {
    return InvalidArgumentError("block of {} bytes exceeds slot size {}", bytes, slot_bytes_);
  }
  return Status::OK();
}

Status BlockSlab::Write(SlotId slot, std::span<const std::byte> block) {
  KVSTASH_RETURN_IF_ERROR(Check(slot, block.size()));
  std::memcpy(Slot(slot).data(), block.data(), block.size());
  return Status::OK();
}

Status BlockSlab::Read(SlotId slot, std::span<std::byte> out) const {
  KVSTASH_RETURN_IF_ERROR(Check(slot, out.size()));
  std::memcpy(out.data(), Slot(slot).data(), out.size());
  return Status::OK();
}

}  // namespace kvstash::store
