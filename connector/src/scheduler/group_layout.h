#pragma once

// The KV-cache groups as the offload scheduler uses them (docs/semantics.md §7.1).

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "kvstash/common/status.h"
#include "kvstash/connector/offload_scheduler.h"

namespace kvstash::connector {

// Each group's offloaded block and hit window, derived once from its configuration, and the
// order a lookup visits the groups in: full attention first, then the groups with a window,
// widest first. Immutable once made; thread-safe.
class GroupLayout {
 public:
  // InvalidArgument for a zero GPU block size or factor, an offloaded block size that is not a
  // multiple of `hash_block_size`, or a window group with no window. Preconditions: `configs`
  // is not empty and `hash_block_size` is not 0 (OffloadScheduler::Create checks them first).
  static Result<std::unique_ptr<GroupLayout>> Create(std::span<const OffloadGroupConfig> configs,
                                                     uint32_t hash_block_size);

  size_t size() const { return groups_.size(); }
  const OffloadGroupInfo& operator[](size_t g) const { return groups_[g]; }
  std::span<const OffloadGroupInfo> groups() const { return groups_; }
  std::span<const uint32_t> lookup_order() const { return lookup_order_; }
  // The groups with a window (sliding, chunked-local, state), in lookup order.
  std::span<const uint32_t> window_groups() const { return window_groups_; }
  bool IsWindow(size_t g) const { return groups_[g].window_blocks.has_value(); }

 private:
  explicit GroupLayout(std::vector<OffloadGroupInfo> groups);

  const std::vector<OffloadGroupInfo> groups_;  // the index is the group id (BlockKey::group)
  std::vector<uint32_t> lookup_order_;
  std::vector<uint32_t> window_groups_;
};

}  // namespace kvstash::connector
