#pragma once

// The copy operations of one block transfer between a paged device cache and host blocks,
// exactly as vLLM's offloading handler maps them (docs/semantics.md §6, vectors §12.H): a host
// block holds `factor` consecutive device blocks (sub-blocks) of each canonical tensor; group g
// moves group_sizes[g] device blocks, the first of which is sub-block block_indices[g] % factor of
// the group's first host block; every tensor the group references is copied, one operation per
// device block. The plan is plain data: a CPU executor (ExecuteTransferOnHost) and the CUDA one
// (kernels/cuda) carry it out.

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "kvstash/common/status.h"

namespace kvstash::kernels {

enum class TransferDirection : uint8_t { kDeviceToHost, kHostToDevice };

// One canonical tensor: its page (one device block of it), the distance between consecutive
// device blocks, and between consecutive host blocks (at least factor * page_bytes; more when
// the host rows interleave several tensors or workers).
struct TransferTensor {
  size_t page_bytes = 0;
  size_t device_row_stride = 0;
  size_t host_row_stride = 0;
};

struct TransferSpec {
  TransferDirection direction = TransferDirection::kDeviceToHost;
  uint32_t factor = 1;                      // device blocks per host block
  std::vector<uint32_t> group_sizes;        // device blocks moved, per group
  std::vector<uint32_t> block_indices;      // request-logical index of each group's first block
  std::vector<uint32_t> device_blocks;      // group by group
  std::vector<uint32_t> host_blocks;        // group by group
  std::vector<std::vector<uint32_t>> refs;  // the tensors of each group
};

// One copy: `bytes` between device tensor `tensor` at device_offset and host tensor `tensor` at
// host_offset (offsets from each tensor's base), in the spec's direction.
struct CopyOp {
  uint32_t tensor = 0;
  uint64_t device_offset = 0;
  uint64_t host_offset = 0;
  uint64_t bytes = 0;
  friend bool operator==(const CopyOp&, const CopyOp&) = default;
};

struct TransferPlan {
  TransferDirection direction = TransferDirection::kDeviceToHost;
  std::vector<CopyOp> ops;  // group by group, then ref by ref, then block by block
  uint64_t transfer_bytes = 0;
};

// InvalidArgument when the spec does not add up: sizes of the per-group lists, a factor of 0, a
// tensor index past `tensors`, a page larger than its stride, or device or host blocks not
// consumed exactly (vLLM asserts there; here the caller gets the reason).
Result<TransferPlan> PlanTransfer(const TransferSpec& spec,
                                  std::span<const TransferTensor> tensors);

// Carries the plan out with memcpy between host memory standing for both sides: device[t] and
// host[t] are tensor t's bases.
void ExecuteTransferOnHost(const TransferPlan& plan, std::span<std::byte* const> device,
                           std::span<std::byte* const> host);

}  // namespace kvstash::kernels
