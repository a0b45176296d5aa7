#include "kvstash/kernels/transfer_plan.h"

#include <cstring>

namespace kvstash::kernels {

Result<TransferPlan> PlanTransfer(const TransferSpec& spec,
                                  std::span<const TransferTensor> tensors) {
  const size_t groups = spec.group_sizes.size();
  if (spec.factor == 0) return InvalidArgumentError("transfer: block size factor 0");
  if (spec.block_indices.size() != groups || spec.refs.size() != groups) {
    return InvalidArgumentError("transfer: {} group sizes but {} block indices and {} tensor lists",
                                groups, spec.block_indices.size(), spec.refs.size());
  }
  for (size_t t = 0; t < tensors.size(); ++t) {
    const TransferTensor& x = tensors[t];
    if (x.page_bytes == 0 || x.device_row_stride < x.page_bytes ||
        x.host_row_stride < x.page_bytes * spec.factor) {
      return InvalidArgumentError(
          "transfer: tensor {} has page {} B, device stride {} B, host stride {} B (need a page, "
          "a device stride of at least a page and a host stride of at least {} pages)",
          t, x.page_bytes, x.device_row_stride, x.host_row_stride, spec.factor);
    }
  }
  TransferPlan plan;
  plan.direction = spec.direction;
  size_t next_device = 0, next_host = 0;
  for (size_t g = 0; g < groups; ++g) {
    const uint32_t size = spec.group_sizes[g];
    if (size == 0) continue;
    const uint32_t skip = spec.block_indices[g] % spec.factor;
    const size_t host_count = (size + skip + spec.factor - 1) / spec.factor;
    if (next_device + size > spec.device_blocks.size() ||
        next_host + host_count > spec.host_blocks.size()) {
      return InvalidArgumentError(
          "transfer: group {} needs {} device and {} host blocks past the {} and {} taken, but "
          "there are {} and {}",
          g, size, host_count, next_device, next_host, spec.device_blocks.size(),
          spec.host_blocks.size());
    }
    for (uint32_t t : spec.refs[g]) {
      if (t >= tensors.size()) {
        return InvalidArgumentError("transfer: group {} names tensor {} of {}", g, t,
                                    tensors.size());
      }
      const TransferTensor& x = tensors[t];
      for (uint32_t i = 0; i < size; ++i) {
        const uint32_t sub = skip + i;
        CopyOp op;
        op.tensor = t;
        op.device_offset = uint64_t{spec.device_blocks[next_device + i]} * x.device_row_stride;
        op.host_offset =
            uint64_t{spec.host_blocks[next_host + sub / spec.factor]} * x.host_row_stride +
            uint64_t{sub % spec.factor} * x.page_bytes;
        op.bytes = x.page_bytes;
        plan.ops.push_back(op);
        plan.transfer_bytes += x.page_bytes;
      }
    }
    next_device += size;
    next_host += host_count;
  }
  if (next_device != spec.device_blocks.size() || next_host != spec.host_blocks.size()) {
    return InvalidArgumentError(
        "transfer: the groups use {} of {} device blocks and {} of {} host blocks", next_device,
        spec.device_blocks.size(), next_host, spec.host_blocks.size());
  }
  return plan;
}

void ExecuteTransferOnHost(const TransferPlan& plan, std::span<std::byte* const> device,
                           std::span<std::byte* const> host) {
  for (const CopyOp& op : plan.ops) {
    std::byte* d = device[op.tensor] + op.device_offset;
    std::byte* h = host[op.tensor] + op.host_offset;
    if (plan.direction == TransferDirection::kDeviceToHost) {
      std::memcpy(h, d, op.bytes);
    } else {
      std::memcpy(d, h, op.bytes);
    }
  }
}

}  // namespace kvstash::kernels
