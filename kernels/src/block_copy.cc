#include "kvstash/kernels/block_copy.h"

#include <cassert>
#include <cstring>

namespace kvstash::kernels {

void GatherBlocks(const std::byte* pool, size_t page_bytes, std::span<const uint32_t> blocks,
                  std::byte* dst, size_t offset, size_t len) {
  assert(len != 0 || offset == 0);
  if (len == 0) len = page_bytes;
  assert(offset + len <= page_bytes);
  for (size_t i = 0; i < blocks.size(); ++i) {
    std::memcpy(dst + i * len, pool + blocks[i] * page_bytes + offset, len);
  }
}

void ScatterBlocks(const std::byte* src, std::byte* pool, size_t page_bytes,
                   std::span<const uint32_t> blocks, size_t offset, size_t len) {
  assert(len != 0 || offset == 0);
  if (len == 0) len = page_bytes;
  assert(offset + len <= page_bytes);
  for (size_t i = 0; i < blocks.size(); ++i) {
    std::memcpy(pool + blocks[i] * page_bytes + offset, src + i * len, len);
  }
}

}  // namespace kvstash::kernels
