// The device<->host transfer mapping against docs/semantics.md §12.H (W1-W7), its invariants, its
// errors, and the host executor moving exactly the mapped sub-blocks.

#include "kvstash/kernels/transfer_plan.h"

#include <gtest/gtest.h>

#include <cstddef>
#include <random>
#include <string>
#include <vector>

namespace kvstash::kernels {
namespace {

constexpr size_t kPage = 64;

// "tensor t: device block G -> host block C sub-block s" in the notation of docs/semantics.md
// §12.H.
struct Op {
  uint32_t tensor, device_block, host_block, sub;
};

struct Vector {
  std::string id;
  TransferDirection dir;
  uint32_t factor;
  std::vector<uint32_t> group_sizes, block_indices, device_blocks, host_blocks;
  std::vector<std::vector<uint32_t>> refs;
  std::vector<Op> ops;
};

const TransferDirection G2C = TransferDirection::kDeviceToHost;
const TransferDirection C2G = TransferDirection::kHostToDevice;

std::vector<Vector> Vectors() {
  return {
      {"W1",
       G2C,
       1,
       {3},
       {0},
       {5, 7, 9},
       {0, 1, 2},
       {{0}},
       {{0, 5, 0, 0}, {0, 7, 1, 0}, {0, 9, 2, 0}}},
      {"W2",
       G2C,
       3,
       {6},
       {0},
       {10, 11, 12, 13, 14, 15},
       {4, 8},
       {{0}},
       {{0, 10, 4, 0}, {0, 11, 4, 1}, {0, 12, 4, 2}, {0, 13, 8, 0}, {0, 14, 8, 1}, {0, 15, 8, 2}}},
      {"W3",
       G2C,
       3,
       {4},
       {2},
       {10, 11, 12, 13},
       {4, 8},
       {{0}},
       {{0, 10, 4, 2}, {0, 11, 8, 0}, {0, 12, 8, 1}, {0, 13, 8, 2}}},
      {"W4",
       C2G,
       3,
       {4},
       {2},
       {20, 21, 22, 23},
       {4, 8},
       {{0}},
       {{0, 20, 4, 2}, {0, 21, 8, 0}, {0, 22, 8, 1}, {0, 23, 8, 2}}},
      {"W5",
       G2C,
       3,
       {5},
       {0},
       {10, 11, 12, 13, 14},
       {4, 8},
       {{0}},
       {{0, 10, 4, 0}, {0, 11, 4, 1}, {0, 12, 4, 2}, {0, 13, 8, 0}, {0, 14, 8, 1}}},
      {"W6",
       G2C,
       2,
       {2, 0, 3},
       {0, 0, 4},
       {30, 31, 40, 41, 42},
       {1, 2, 3},
       {{0, 1}, {2}, {3}},
       {{0, 30, 1, 0},
        {0, 31, 1, 1},
        {1, 30, 1, 0},
        {1, 31, 1, 1},
        {3, 40, 2, 0},
        {3, 41, 2, 1},
        {3, 42, 3, 0}}},
      {"W7",
       C2G,
       2,
       {2, 0, 3},
       {0, 0, 5},
       {30, 31, 40, 41, 42},
       {1, 2, 3},
       {{0}, {1}, {2}},
       {{0, 30, 1, 0}, {0, 31, 1, 1}, {2, 40, 2, 1}, {2, 41, 3, 0}, {2, 42, 3, 1}}},
  };
}

TransferSpec SpecOf(const Vector& v) {
  TransferSpec s;
  s.direction = v.dir;
  s.factor = v.factor;
  s.group_sizes = v.group_sizes;
  s.block_indices = v.block_indices;
  s.device_blocks = v.device_blocks;
  s.host_blocks = v.host_blocks;
  s.refs = v.refs;
  return s;
}

// Tensor t's page is kPage * (t + 1) bytes, so a wrong tensor shows in the offsets and sizes.
std::vector<TransferTensor> Tensors(uint32_t factor, size_t n = 4) {
  std::vector<TransferTensor> t;
  for (size_t i = 0; i < n; ++i) {
    const size_t page = kPage * (i + 1);
    t.push_back({page, page + 16, page * factor + 32});
  }
  return t;
}

TEST(TransferPlanTest, ReferenceVectors) {
  for (const Vector& v : Vectors()) {
    SCOPED_TRACE(v.id);
    const std::vector<TransferTensor> tensors = Tensors(v.factor);
    auto plan = PlanTransfer(SpecOf(v), tensors);
    ASSERT_TRUE(plan.ok()) << plan.status().ToString();
    EXPECT_EQ(plan->direction, v.dir);
    std::vector<CopyOp> want;
    uint64_t bytes = 0;
    for (const Op& o : v.ops) {
      const TransferTensor& x = tensors[o.tensor];
      want.push_back({o.tensor, uint64_t{o.device_block} * x.device_row_stride,
                      uint64_t{o.host_block} * x.host_row_stride + uint64_t{o.sub} * x.page_bytes,
                      x.page_bytes});
      bytes += x.page_bytes;
    }
    EXPECT_EQ(plan->ops, want);
    // transfer_size = sum over groups of size * the group's page bytes.
    EXPECT_EQ(plan->transfer_bytes, bytes);
    uint64_t by_invariant = 0;
    for (size_t g = 0; g < v.group_sizes.size(); ++g) {
      for (uint32_t t : v.refs[g]) {
        by_invariant += uint64_t{v.group_sizes[g]} * tensors[t].page_bytes;
      }
    }
    EXPECT_EQ(plan->transfer_bytes, by_invariant);
  }
}

TEST(TransferPlanTest, BlocksNotConsumedExactlyAreRefused) {
  Vector v = Vectors()[2];  // W3: 4 device blocks into 2 host blocks
  TransferSpec extra_host = SpecOf(v);
  extra_host.host_blocks.push_back(12);
  EXPECT_EQ(PlanTransfer(extra_host, Tensors(3)).status().code(), StatusCode::kInvalidArgument);
  TransferSpec short_host = SpecOf(v);
  short_host.host_blocks.pop_back();
  EXPECT_EQ(PlanTransfer(short_host, Tensors(3)).status().code(), StatusCode::kInvalidArgument);
  TransferSpec extra_device = SpecOf(v);
  extra_device.device_blocks.push_back(99);
  const auto r = PlanTransfer(extra_device, Tensors(3));
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("5 device blocks"), std::string::npos)
      << r.status().ToString();
  TransferSpec bad_tensor = SpecOf(v);
  bad_tensor.refs[0] = {7};
  EXPECT_EQ(PlanTransfer(bad_tensor, Tensors(3)).status().code(), StatusCode::kInvalidArgument);
  TransferSpec lists = SpecOf(v);
  lists.block_indices.push_back(0);
  EXPECT_EQ(PlanTransfer(lists, Tensors(3)).status().code(), StatusCode::kInvalidArgument);
  TransferSpec zero = SpecOf(v);
  zero.factor = 0;
  EXPECT_EQ(PlanTransfer(zero, Tensors(3)).status().code(), StatusCode::kInvalidArgument);
  std::vector<TransferTensor> narrow = Tensors(3);
  narrow[0].host_row_stride = narrow[0].page_bytes * 2;  // three sub-blocks do not fit
  EXPECT_EQ(PlanTransfer(SpecOf(v), narrow).status().code(), StatusCode::kInvalidArgument);
}

// Random bytes on both sides, a plan of W6's shape with random blocks: after the transfer the
// destination's mapped sub-blocks hold the source's bytes and every other byte is unchanged.
TEST(TransferPlanTest, HostExecutorMovesExactlyTheMappedSubBlocks) {
  std::mt19937_64 rng(std::random_device{}());
  for (TransferDirection dir : {G2C, C2G}) {
    const uint32_t factor = 2;
    const std::vector<TransferTensor> tensors = Tensors(factor);
    TransferSpec s = SpecOf(Vectors()[5]);
    s.direction = dir;
    const size_t device_blocks = 64, host_blocks = 16;
    std::vector<std::vector<std::byte>> device(tensors.size()), host(tensors.size());
    std::vector<std::byte*> dptr, hptr;
    for (size_t t = 0; t < tensors.size(); ++t) {
      device[t].resize(device_blocks * tensors[t].device_row_stride);
      host[t].resize(host_blocks * tensors[t].host_row_stride);
      for (auto& b : device[t]) b = std::byte(rng());
      for (auto& b : host[t]) b = std::byte(rng());
      dptr.push_back(device[t].data());
      hptr.push_back(host[t].data());
    }
    const auto before_device = device;
    const auto before_host = host;
    auto plan = PlanTransfer(s, tensors);
    ASSERT_TRUE(plan.ok()) << plan.status().ToString();
    ExecuteTransferOnHost(*plan, dptr, hptr);
    auto& dst = dir == G2C ? host : device;
    const auto& dst_before = dir == G2C ? before_host : before_device;
    const auto& src_before = dir == G2C ? before_device : before_host;
    std::vector<std::vector<bool>> written(tensors.size());
    for (size_t t = 0; t < tensors.size(); ++t) written[t].assign(dst[t].size(), false);
    for (const CopyOp& op : plan->ops) {
      const uint64_t d = dir == G2C ? op.host_offset : op.device_offset;
      const uint64_t src = dir == G2C ? op.device_offset : op.host_offset;
      for (uint64_t i = 0; i < op.bytes; ++i) {
        ASSERT_EQ(dst[op.tensor][d + i], src_before[op.tensor][src + i]);
        written[op.tensor][d + i] = true;
      }
    }
    for (size_t t = 0; t < tensors.size(); ++t) {
      for (size_t i = 0; i < dst[t].size(); ++i) {
        if (!written[t][i]) {
          ASSERT_EQ(dst[t][i], dst_before[t][i]) << "tensor " << t << " byte " << i;
        }
      }
    }
    // The source side is never written.
    EXPECT_EQ(dir == G2C ? device : host, dir == G2C ? before_device : before_host);
  }
}

}  // namespace
}  // namespace kvstash::kernels
