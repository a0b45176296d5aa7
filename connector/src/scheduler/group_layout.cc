#include "scheduler/group_layout.h"

#include <algorithm>
#include <utility>

namespace kvstash::connector {

Result<std::unique_ptr<GroupLayout>> GroupLayout::Create(
    std::span<const OffloadGroupConfig> configs, uint32_t hash_block_size) {
  std::vector<OffloadGroupInfo> groups;
  for (size_t g = 0; g < configs.size(); ++g) {
    const OffloadGroupConfig& config = configs[g];
    if (config.gpu_block_size == 0 || config.block_size_factor == 0) {
      return InvalidArgumentError("group {}: GPU block size {} and block size factor {}", g,
                                  config.gpu_block_size, config.block_size_factor);
    }
    OffloadGroupInfo info;
    info.config = config;
    info.offloaded_block_size = config.gpu_block_size * config.block_size_factor;
    if (info.offloaded_block_size % hash_block_size != 0) {
      return InvalidArgumentError(
          "group {}: offloaded block of {} tokens is not a multiple of the hash block of {}", g,
          info.offloaded_block_size, hash_block_size);
    }
    info.hashes_per_block = info.offloaded_block_size / hash_block_size;
    switch (config.kind) {
      case OffloadGroupKind::kFull:
        break;
      case OffloadGroupKind::kSlidingWindow:
      case OffloadGroupKind::kChunkedLocal:
        if (config.window == 0) return InvalidArgumentError("group {}: window of 0 tokens", g);
        info.window_blocks = static_cast<uint32_t>(
            (size_t{config.window} + info.offloaded_block_size - 1) / info.offloaded_block_size);
        break;
      case OffloadGroupKind::kState:
        info.window_blocks = 1;  // the state at the end of the hit is all a state layer reads
        break;
    }
    groups.push_back(info);
  }
  return std::unique_ptr<GroupLayout>(new GroupLayout(std::move(groups)));
}

GroupLayout::GroupLayout(std::vector<OffloadGroupInfo> groups) : groups_(std::move(groups)) {
  for (uint32_t g = 0; g < groups_.size(); ++g) {
    (IsWindow(g) ? window_groups_ : lookup_order_).push_back(g);
  }
  // Widest window first: a narrower window rarely shortens a hit a wider one allowed, so the
  // fixed point is usually reached in one pass. Stable, so equal windows keep group order.
  std::stable_sort(window_groups_.begin(), window_groups_.end(), [&](uint32_t a, uint32_t b) {
    return *groups_[a].window_blocks > *groups_[b].window_blocks;
  });
  lookup_order_.insert(lookup_order_.end(), window_groups_.begin(), window_groups_.end());
}

}  // namespace kvstash::connector
