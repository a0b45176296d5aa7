#pragma once

// Block movement between a paged cache and contiguous buffers (what the connector sends and
// receives): whole pages, or a byte range of each page. CPU memcpy per page; thread-safe for
// disjoint destinations; no allocation.

#include <cstddef>
#include <cstdint>
#include <span>

namespace kvstash::kernels {

// dst[i * len .. (i+1) * len) = bytes [offset, offset + len) of page blocks[i] of `pool`
// (pages of page_bytes). len == 0 means the whole page (offset must be 0).
void GatherBlocks(const std::byte* pool, size_t page_bytes, std::span<const uint32_t> blocks,
                  std::byte* dst, size_t offset = 0, size_t len = 0);

// The inverse: page blocks[i] bytes [offset, offset + len) = src[i * len .. (i+1) * len).
void ScatterBlocks(const std::byte* src, std::byte* pool, size_t page_bytes,
                   std::span<const uint32_t> blocks, size_t offset = 0, size_t len = 0);

}  // namespace kvstash::kernels
