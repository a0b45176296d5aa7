// The "cuda" Device (label gpu) against the CPU kernels it mirrors: every operation on random
// inputs (seeded from std::random_device, the seed printed on failure), its output poisoned
// before the call and checked untouched outside what the operation writes, the paged pool's
// null page NaN so that reading it shows; the memory operations, staging and the page copies
// of a connector. Skips itself where no CUDA device is present.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernel_test_util.h"
#include "kvstash/kernels/cpu_ops.h"
#include "kvstash/kernels/cuda_transfer.h"
#include "kvstash/kernels/device.h"
#include "kvstash/kernels/paged_attention.h"

namespace kvstash::kernels {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// Compares a device output buffer with the CPU's, both poisoned with kSentinel before the call:
// the elements `written` selects within `tolerance` (MaxRelativeError), every other one still
// the sentinel on both sides.
void ExpectOutputsMatch(const std::vector<float>& got, const std::vector<float>& want,
                        const std::function<bool(size_t)>& written, double tolerance) {
  ASSERT_EQ(got.size(), want.size());
  std::vector<float> got_written;
  std::vector<double> want_written;
  size_t touched = 0, first_touched = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (written(i)) {
      got_written.push_back(got[i]);
      want_written.push_back(want[i]);
      continue;
    }
    ASSERT_EQ(want[i], kSentinel) << "the CPU kernel wrote element " << i << " (test error)";
    if (got[i] != kSentinel && touched++ == 0) first_touched = i;
  }
  EXPECT_EQ(touched, 0u) << "elements outside the output changed, the first at " << first_touched
                         << ": " << got[first_touched];
  ASSERT_FALSE(want_written.empty());
  EXPECT_LE(MaxRelativeError(got_written, want_written), tolerance);
}

// Rows of `cols` written, `stride` apart.
std::function<bool(size_t)> RowsOf(size_t rows, size_t cols, size_t stride) {
  return [=](size_t i) { return i / stride < rows && i % stride < cols; };
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

class CudaDeviceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
    auto device = MakeDevice("cuda");
    ASSERT_TRUE(device.ok()) << device.status().ToString();
    device_ = std::move(device).value();
    seed_ = std::random_device{}();
    rng_.seed(seed_);
  }

  void TearDown() override {
    if (device_ == nullptr) return;
    EXPECT_TRUE(device_->Synchronize().ok());
    for (float* p : buffers_) device_->Free(p);
  }

  std::string Seed() const { return "seed " + std::to_string(seed_); }

  // Device memory freed at the end of the test.
  float* Alloc(size_t floats) {
    float* p = device_->Allocate(floats).value();
    buffers_.push_back(p);
    return p;
  }
  float* ToDevice(const std::vector<float>& host) {
    float* p = Alloc(host.size());
    device_->Upload(p, host.data(), host.size());
    return p;
  }
  std::vector<float> ToHost(const float* p, size_t floats) {
    std::vector<float> host(floats);
    device_->Download(host.data(), p, floats);
    return host;
  }
  std::vector<uint32_t> StagedToHost(const uint32_t* p, size_t count) {
    std::vector<uint32_t> host(count);
    device_->Download(reinterpret_cast<float*>(host.data()), reinterpret_cast<const float*>(p),
                      count);
    return host;
  }

  std::unique_ptr<Device> device_;
  unsigned seed_ = 0;
  std::mt19937 rng_;
  std::vector<float*> buffers_;
};

TEST_F(CudaDeviceTest, MakeDeviceGivesTheCudaDevice) {
  EXPECT_EQ(device_->name(), "cuda");
  EXPECT_FALSE(device_->HostAccessible());
  EXPECT_EQ(device_->Allocate(0).value(), nullptr);
  EXPECT_TRUE(device_->Synchronize().ok());
}

TEST_F(CudaDeviceTest, UploadDownloadCopyFill) {
  SCOPED_TRACE(Seed());
  // Below and above the size uploads are staged at, each from a buffer overwritten at once
  // (the host may be reused once Upload returns), pageable and pinned.
  for (size_t floats : {size_t{1}, size_t{1000}, size_t{16384}, size_t{16385}, size_t{300000}}) {
    for (bool pinned : {false, true}) {
      SCOPED_TRACE(testing::Message() << floats << " floats, pinned " << pinned);
      const std::vector<float> data = RandomFloats(floats, rng_);
      float* host = pinned ? device_->AllocateHost(floats).value() : new float[floats];
      std::copy(data.begin(), data.end(), host);
      float* p = Alloc(floats);
      device_->Upload(p, host, floats);
      std::fill_n(host, floats, kNaN);
      EXPECT_TRUE(SameBits(ToHost(p, floats), data));
      if (pinned) {
        device_->FreeHost(host);
      } else {
        delete[] host;
      }
    }
  }

  const size_t count = 1000;
  const std::vector<float> src = RandomFloats(count, rng_);
  float* a = ToDevice(src);
  float* b = ToDevice(std::vector<float>(count, kSentinel));
  device_->Copy(b + 10, a + 20, 500);
  device_->Fill(b + 600, 7, 2.5f);
  std::vector<float> want(count, kSentinel);
  std::copy_n(src.begin() + 20, 500, want.begin() + 10);
  std::fill_n(want.begin() + 600, 7, 2.5f);
  EXPECT_TRUE(SameBits(ToHost(b, count), want));
  EXPECT_TRUE(SameBits(ToHost(a, count), src));
  EXPECT_TRUE(device_->Synchronize().ok());
}

TEST_F(CudaDeviceTest, StagedArraysStayValidUntilTheNextStep) {
  SCOPED_TRACE(Seed());
  std::uniform_int_distribution<uint32_t> any;
  for (int step = 0; step < 3; ++step) {
    device_->BeginStep();
    // Small arrays, then one larger than the first staging chunk (the arena grows), then small
    // ones again; every one read back after all were staged, the host copies overwritten.
    std::vector<std::vector<uint32_t>> arrays;
    for (size_t size : {size_t{1}, size_t{7}, size_t{64}, size_t{300000}, size_t{3}, size_t{100000},
                        size_t{0}, size_t{5}}) {
      std::vector<uint32_t> v(size);
      for (uint32_t& x : v) x = any(rng_);
      arrays.push_back(std::move(v));
    }
    std::vector<const uint32_t*> staged;
    for (std::vector<uint32_t>& v : arrays) {
      staged.push_back(device_->Stage(v));
      EXPECT_NE(staged.back(), nullptr);
    }
    std::vector<std::vector<uint32_t>> want = arrays;
    for (std::vector<uint32_t>& v : arrays) std::fill(v.begin(), v.end(), 0xdeadbeefu);
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_EQ(StagedToHost(staged[i], want[i].size()), want[i])
          << "step " << step << " array " << i;
    }
  }
  EXPECT_TRUE(device_->Synchronize().ok());
}

struct MatMulCase {
  size_t n, in, out, x_stride, y_stride;
};

TEST_F(CudaDeviceTest, MatMulMatchesTheCpuOnOddShapesAndStrides) {
  SCOPED_TRACE(Seed());
  // Both kernels (up to 16 rows, and more), partial tiles on every side, strides and none, no
  // input at all.
  const MatMulCase cases[] = {{1, 67, 33, 0, 0},      {3, 129, 70, 131, 75}, {8, 16, 16, 0, 0},
                              {9, 300, 65, 0, 70},    {16, 100, 129, 0, 0},  {17, 31, 64, 33, 0},
                              {37, 300, 130, 301, 0}, {64, 64, 64, 0, 0},    {70, 17, 200, 20, 203},
                              {130, 513, 97, 0, 0},   {5, 0, 9, 0, 0},       {1, 2048, 1, 0, 0}};
  for (const MatMulCase& c : cases) {
    SCOPED_TRACE(testing::Message() << "n=" << c.n << " in=" << c.in << " out=" << c.out
                                    << " x_stride=" << c.x_stride << " y_stride=" << c.y_stride);
    const size_t xs = c.x_stride == 0 ? c.in : c.x_stride;
    const size_t ys = c.y_stride == 0 ? c.out : c.y_stride;
    const std::vector<float> x = RandomFloats(c.n * xs, rng_);
    const std::vector<float> w = RandomFloats(c.in * c.out, rng_);
    std::vector<float> want(c.n * ys + 5, kSentinel);
    MatMul(x.data(), w.data(), want.data(), c.n, c.in, c.out, c.x_stride, c.y_stride);
    float* y = ToDevice(std::vector<float>(want.size(), kSentinel));
    device_->MatMul(ToDevice(x), ToDevice(w), y, c.n, c.in, c.out, c.x_stride, c.y_stride);
    ExpectOutputsMatch(ToHost(y, want.size()), want, RowsOf(c.n, c.out, ys), 1e-4);
  }
}

// The engine's tokens may not depend on the batch a row came in: the same row alone (decode),
// in a few rows and in many gives the same bits.
TEST_F(CudaDeviceTest, MatMulRowsDoNotDependOnTheirBatch) {
  SCOPED_TRACE(Seed());
  const size_t n = 40, in = 333, out = 150;
  const std::vector<float> x = RandomFloats(n * in, rng_);
  const float* dx = ToDevice(x);
  const float* dw = ToDevice(RandomFloats(in * out, rng_));
  float* all = Alloc(n * out);
  device_->MatMul(dx, dw, all, n, in, out);
  const std::vector<float> want = ToHost(all, n * out);
  for (size_t rows : {size_t{1}, size_t{3}, size_t{17}}) {
    float* part = Alloc(n * out);
    for (size_t i = 0; i < n; i += rows) {
      const size_t r = std::min(rows, n - i);
      device_->MatMul(dx + i * in, dw, part + i * out, r, in, out);
    }
    EXPECT_TRUE(SameBits(ToHost(part, n * out), want)) << rows << " rows at a time";
  }
}

TEST_F(CudaDeviceTest, RmsNormMatchesTheCpuInPlaceAndNot) {
  SCOPED_TRACE(Seed());
  for (size_t dim : {size_t{1}, size_t{333}, size_t{2048}}) {
    SCOPED_TRACE(testing::Message() << "dim " << dim);
    const size_t n = 5;
    const float eps = 1e-5f;
    const std::vector<float> x = RandomFloats(n * dim, rng_, -3.0f, 3.0f);
    const std::vector<float> weight = RandomFloats(dim, rng_, 0.5f, 1.5f);
    std::vector<float> want(n * dim + 3, kSentinel);
    RmsNorm(x.data(), weight.data(), want.data(), n, dim, eps);
    const float* dx = ToDevice(x);
    const float* dweight = ToDevice(weight);
    float* y = ToDevice(std::vector<float>(want.size(), kSentinel));
    device_->RmsNorm(dx, dweight, y, n, dim, eps);
    ExpectOutputsMatch(ToHost(y, want.size()), want, RowsOf(n, dim, dim), 1e-5);

    std::vector<float> padded = x;
    padded.resize(want.size(), kSentinel);
    float* in_place = ToDevice(padded);
    device_->RmsNorm(in_place, dweight, in_place, n, dim, eps);
    ExpectOutputsMatch(ToHost(in_place, want.size()), want, RowsOf(n, dim, dim), 1e-5);
  }
}

TEST_F(CudaDeviceTest, ApplyRopeMatchesTheCpu) {
  SCOPED_TRACE(Seed());
  std::uniform_int_distribution<uint32_t> position(0, 100000);
  struct Case {
    size_t num_heads, head_dim;
    float theta;
  };
  // head_dim 300: more pairs than a block has threads.
  for (const Case& c : {Case{3, 64, 10000.0f}, Case{2, 300, 1e6f}, Case{5, 2, 10000.0f}}) {
    SCOPED_TRACE(testing::Message() << c.num_heads << " heads of " << c.head_dim);
    const size_t n = 6;
    const size_t stride = c.num_heads * c.head_dim + 5;
    std::vector<uint32_t> positions(n);
    for (uint32_t& p : positions) p = position(rng_);
    positions[0] = 0;
    // The padding past each row's heads is the sentinel: it must stay so.
    std::vector<float> x = RandomFloats(n * stride, rng_);
    for (size_t i = 0; i < x.size(); ++i) {
      if (i % stride >= c.num_heads * c.head_dim) x[i] = kSentinel;
    }
    std::vector<float> want = x;
    ApplyRope(want.data(), stride, n, c.num_heads, c.head_dim, positions.data(), c.theta);
    device_->BeginStep();
    float* dx = ToDevice(x);
    device_->ApplyRope(dx, stride, n, c.num_heads, c.head_dim, device_->Stage(positions), c.theta);
    ExpectOutputsMatch(ToHost(dx, x.size()), want, RowsOf(n, c.num_heads * c.head_dim, stride),
                       1e-5);
  }
}

TEST_F(CudaDeviceTest, SiluMulMatchesTheCpuWithAndWithoutAliasing) {
  SCOPED_TRACE(Seed());
  const size_t count = 1003;
  const std::vector<float> gate = RandomFloats(count, rng_, -8.0f, 8.0f);
  const std::vector<float> up = RandomFloats(count, rng_, -2.0f, 2.0f);
  std::vector<float> want(count + 5, kSentinel);
  SiluMul(gate.data(), up.data(), want.data(), count);
  const auto written = [count](size_t i) { return i < count; };

  float* out = ToDevice(std::vector<float>(want.size(), kSentinel));
  device_->SiluMul(ToDevice(gate), ToDevice(up), out, count);
  ExpectOutputsMatch(ToHost(out, want.size()), want, written, 1e-5);

  std::vector<float> padded_gate = gate, padded_up = up;
  padded_gate.resize(want.size(), kSentinel);
  padded_up.resize(want.size(), kSentinel);
  float* g = ToDevice(padded_gate);
  device_->SiluMul(g, ToDevice(up), g, count);
  ExpectOutputsMatch(ToHost(g, want.size()), want, written, 1e-5);
  float* u = ToDevice(padded_up);
  device_->SiluMul(ToDevice(gate), u, u, count);
  ExpectOutputsMatch(ToHost(u, want.size()), want, written, 1e-5);
}

TEST_F(CudaDeviceTest, AddInPlaceAndAddConstantMatchTheCpu) {
  SCOPED_TRACE(Seed());
  const size_t count = 1003;
  std::vector<float> x = RandomFloats(count, rng_);
  const std::vector<float> y = RandomFloats(count, rng_);
  x.resize(count + 5, kSentinel);
  std::vector<float> want = x;
  AddInPlace(want.data(), y.data(), count);
  float* dx = ToDevice(x);
  device_->AddInPlace(dx, ToDevice(y), count);
  ExpectOutputsMatch(
      ToHost(dx, x.size()), want, [count](size_t i) { return i < count; }, 0.0);

  // Rows of 30 of 37 floats: the last 7 of each row (sentinels) stay.
  const size_t stride = 37, rows = 5, cols = 30;
  std::vector<float> m = RandomFloats(rows * stride, rng_);
  for (size_t i = 0; i < m.size(); ++i) {
    if (i % stride >= cols) m[i] = kSentinel;
  }
  std::vector<float> want_m = m;
  for (size_t r = 0; r < rows; ++r) {
    for (size_t c = 0; c < cols; ++c) want_m[r * stride + c] += 0.75f;
  }
  float* dm = ToDevice(m);
  device_->AddConstant(dm, stride, rows, cols, 0.75f);
  ExpectOutputsMatch(ToHost(dm, m.size()), want_m, RowsOf(rows, cols, stride), 0.0);
}

TEST_F(CudaDeviceTest, EmbedCopiesRowsAndClampsTokensPastTheVocabulary) {
  SCOPED_TRACE(Seed());
  const size_t vocab = 50, dim = 19;
  const std::vector<float> table = RandomFloats(vocab * dim, rng_);
  std::uniform_int_distribution<uint32_t> token(0, vocab - 1);
  std::vector<uint32_t> tokens(12);
  for (uint32_t& t : tokens) t = token(rng_);
  tokens[3] = vocab;
  tokens[7] = 1000;
  tokens[9] = std::numeric_limits<uint32_t>::max();
  const size_t n = tokens.size();
  std::vector<float> want(n * dim + 4, kSentinel);
  for (size_t i = 0; i < n; ++i) {
    const size_t row = std::min<size_t>(tokens[i], vocab - 1);
    std::copy_n(table.begin() + row * dim, dim, want.begin() + i * dim);
  }
  device_->BeginStep();
  float* out = ToDevice(std::vector<float>(want.size(), kSentinel));
  device_->Embed(ToDevice(table), vocab, dim, device_->Stage(tokens), n, out);
  ExpectOutputsMatch(
      ToHost(out, want.size()), want, [&](size_t i) { return i < n * dim; }, 0.0);
}

// --- Paged attention -------------------------------------------------------------------------

struct Shape {
  uint32_t block_size = 4;
  uint32_t num_heads = 4;
  uint32_t num_kv_heads = 2;
  uint32_t head_dim = 8;
};

AttentionMask Causal() { return {}; }
AttentionMask Window(uint32_t window) {
  return {.kind = AttentionMask::Kind::kSlidingWindow, .window = window};
}
AttentionMask Chunked(uint32_t chunk) {
  return {.kind = AttentionMask::Kind::kChunkedLocal, .chunk = chunk};
}

struct AttentionCase {
  Shape shape;
  AttentionMask mask;
  size_t start = 0;  // positions before it were written by earlier steps
  size_t n = 0;      // queries (and KV written) this step
};

std::string Describe(const AttentionCase& c) {
  const char* kinds[] = {"causal", "window", "chunked"};
  return fmt::format("{} window={} chunk={} block={} heads={}/{} head_dim={} start={} n={}",
                     kinds[static_cast<int>(c.mask.kind)], c.mask.window, c.mask.chunk,
                     c.shape.block_size, c.shape.num_heads, c.shape.num_kv_heads, c.shape.head_dim,
                     c.start, c.n);
}

// One step of a request against the CPU: a pool whose pages hold two layers (at odd offsets,
// the second one past the first), every float NaN until written, page 0 (the null page)
// included; a shuffled block table with the null block for blocks wholly before the first key
// any query of the step needs; KV of the earlier positions written by one WriteKv, the step's
// by another, on both layers (different KV); then attention of the step's queries on both
// layers. The pools must end bit for bit equal (WriteKv writes what the CPU writes, nothing
// else, never the null page), the outputs close, the padding of the output rows untouched.
TEST_F(CudaDeviceTest, WriteKvAndPagedAttentionMatchTheCpuForEveryMask) {
  SCOPED_TRACE(Seed());
  const Shape gqa{.block_size = 4, .num_heads = 4, .num_kv_heads = 2, .head_dim = 8};
  const Shape wide{.block_size = 16, .num_heads = 8, .num_kv_heads = 2, .head_dim = 72};
  const Shape largest{.block_size = 16, .num_heads = 2, .num_kv_heads = 1, .head_dim = 256};
  const Shape mha{.block_size = 8, .num_heads = 3, .num_kv_heads = 3, .head_dim = 128};
  const AttentionCase cases[] = {
      // Full causal: prefill from 0 and from a later position, decode.
      {gqa, Causal(), 0, 13},
      {gqa, Causal(), 9, 7},
      {gqa, Causal(), 40, 1},
      // Sliding window smaller than a block, and one that is not a multiple of the block.
      {gqa, Window(3), 5, 10},
      {gqa, Window(3), 30, 1},
      {gqa, Window(10), 0, 25},
      {gqa, Window(10), 17, 8},
      {gqa, Window(10), 41, 1},
      // Chunked local: within the first chunk, across chunk boundaries, decode.
      {gqa, Chunked(8), 0, 20},
      {gqa, Chunked(8), 13, 9},
      {gqa, Chunked(8), 33, 1},
      // More keys than a tile of the kernel, wider heads and groups, head_dim at its limit.
      {wide, Causal(), 0, 150},
      {wide, Causal(), 200, 1},
      {wide, Window(100), 150, 20},
      {wide, Chunked(64), 100, 60},
      {largest, Causal(), 70, 10},
      {largest, Window(33), 90, 1},
      {mha, Chunked(24), 50, 30},
  };
  for (const AttentionCase& c : cases) {
    SCOPED_TRACE(Describe(c));
    const Shape& s = c.shape;
    const size_t length = c.start + c.n;
    const size_t row = size_t{s.num_kv_heads} * s.head_dim;
    const size_t layer_floats = 2 * size_t{s.block_size} * row;
    const size_t page_floats = 2 * layer_floats + 7;
    const size_t blocks = (length + s.block_size - 1) / s.block_size;
    const size_t num_pages = blocks + 4;
    const size_t offsets[2] = {1, layer_floats + 4};

    std::vector<uint32_t> table(num_pages - 1);
    std::iota(table.begin(), table.end(), 1u);
    std::shuffle(table.begin(), table.end(), rng_);
    table.resize(blocks);
    const size_t first_needed = c.mask.FirstKey(c.start);
    for (size_t b = 0; b < blocks && (b + 1) * s.block_size <= first_needed; ++b) table[b] = 0;

    std::vector<float> want_pool(num_pages * page_floats, kNaN);
    float* pool = ToDevice(want_pool);
    device_->BeginStep();
    const uint32_t* staged_table = device_->Stage(table);

    const size_t q_stride = size_t{s.num_heads} * s.head_dim + 3;
    const size_t kv_stride = row + 2;
    const size_t out_cols = size_t{s.num_heads} * s.head_dim;
    const size_t out_stride = out_cols + 3;
    const float scale = 1.0f / std::sqrt(static_cast<float>(s.head_dim));
    std::vector<std::vector<float>> want_out(2), got_out(2);
    for (int l = 0; l < 2; ++l) {
      const PagedLayer cpu_layer{.pool = want_pool.data(),
                                 .page_floats = page_floats,
                                 .layer_offset = offsets[l],
                                 .block_size = s.block_size,
                                 .num_kv_heads = s.num_kv_heads,
                                 .head_dim = s.head_dim};
      PagedLayer gpu_layer = cpu_layer;
      gpu_layer.pool = pool;
      const std::vector<float> k = RandomFloats(length * kv_stride, rng_);
      const std::vector<float> v = RandomFloats(length * kv_stride, rng_);
      const std::vector<float> q = RandomFloats(c.n * q_stride, rng_);
      const float* dk = ToDevice(k);
      const float* dv = ToDevice(v);
      WriteKv(cpu_layer, table, 0, c.start, k.data(), v.data(), kv_stride);
      WriteKv(cpu_layer, table, c.start, c.n, k.data() + c.start * kv_stride,
              v.data() + c.start * kv_stride, kv_stride);
      device_->WriteKv(gpu_layer, staged_table, table.size(), 0, c.start, dk, dv, kv_stride);
      device_->WriteKv(gpu_layer, staged_table, table.size(), c.start, c.n,
                       dk + c.start * kv_stride, dv + c.start * kv_stride, kv_stride);

      want_out[l].assign(c.n * out_stride, kSentinel);
      PagedAttention(cpu_layer, table, q.data(), q_stride, c.n, c.start, s.num_heads, c.mask, scale,
                     want_out[l].data(), out_stride);
      float* out = ToDevice(std::vector<float>(want_out[l].size(), kSentinel));
      device_->PagedAttention(gpu_layer, staged_table, table.size(), ToDevice(q), q_stride, c.n,
                              c.start, s.num_heads, c.mask, scale, out, out_stride);
      got_out[l] = ToHost(out, want_out[l].size());
    }
    ASSERT_TRUE(device_->Synchronize().ok());
    const std::vector<float> got_pool = ToHost(pool, want_pool.size());
    EXPECT_TRUE(SameBits(got_pool, want_pool)) << "the pools differ after WriteKv";
    EXPECT_TRUE(std::all_of(got_pool.begin(), got_pool.begin() + page_floats, [](float f) {
      return std::isnan(f);
    })) << "the null page was written";
    for (int l = 0; l < 2; ++l) {
      SCOPED_TRACE(testing::Message() << "layer " << l);
      ExpectOutputsMatch(got_out[l], want_out[l], RowsOf(c.n, out_cols, out_stride), 1e-4);
    }
  }
}

TEST_F(CudaDeviceTest, StateScanMatchesTheCpuOverSeveralCalls) {
  SCOPED_TRACE(Seed());
  // head_dim 130: more value columns than a block has threads.
  for (uint32_t head_dim : {8u, 64u, 130u, 256u}) {
    SCOPED_TRACE(testing::Message() << "head_dim " << head_dim);
    const uint32_t num_heads = 3;
    const size_t hd = head_dim;
    const size_t stride = num_heads * hd + 3;
    const size_t gate_stride = num_heads + 2;
    const size_t out_stride = num_heads * hd + 1;
    const size_t state_floats = num_heads * hd * hd;
    std::vector<float> want_state = RandomFloats(state_floats, rng_, -0.5f, 0.5f);
    want_state.resize(state_floats + 3, kSentinel);
    float* state = ToDevice(want_state);
    // A prefill of 7 tokens, then a decode token, each from the state the one before left.
    for (size_t n : {size_t{7}, size_t{1}}) {
      SCOPED_TRACE(testing::Message() << n << " tokens");
      const std::vector<float> q = RandomFloats(n * stride, rng_);
      const std::vector<float> k = RandomFloats(n * stride, rng_);
      const std::vector<float> v = RandomFloats(n * stride, rng_);
      const std::vector<float> gate = RandomFloats(n * gate_stride, rng_, -4.0f, 4.0f);
      std::vector<float> want_out(n * out_stride, kSentinel);
      StateScan(want_state.data(), q.data(), k.data(), v.data(), stride, gate.data(), gate_stride,
                n, num_heads, head_dim, want_out.data(), out_stride);
      float* out = ToDevice(std::vector<float>(want_out.size(), kSentinel));
      device_->StateScan(state, ToDevice(q), ToDevice(k), ToDevice(v), stride, ToDevice(gate),
                         gate_stride, n, num_heads, head_dim, out, out_stride);
      ExpectOutputsMatch(ToHost(out, want_out.size()), want_out,
                         RowsOf(n, num_heads * hd, out_stride), 1e-4);
      ExpectOutputsMatch(
          ToHost(state, want_state.size()), want_state,
          [state_floats](size_t i) { return i < state_floats; }, 1e-4);
    }
  }
}

// --- Page copies -----------------------------------------------------------------------------

// A random subset of the pages, in random order, with a run of consecutive pages in order.
std::vector<uint32_t> SomePages(uint32_t num_pages, std::mt19937& rng) {
  std::vector<uint32_t> all(num_pages);
  std::iota(all.begin(), all.end(), 0u);
  std::shuffle(all.begin(), all.end(), rng);
  std::vector<uint32_t> pages(all.begin(), all.begin() + num_pages / 3);
  pages.erase(
      std::remove_if(pages.begin(), pages.end(), [](uint32_t p) { return p >= 10 && p < 14; }),
      pages.end());
  pages.insert(pages.begin() + pages.size() / 2, {10, 11, 12, 13});
  return pages;
}

TEST_F(CudaDeviceTest, PagesToHostCopiesThePagesAfterTheQueuedWork) {
  SCOPED_TRACE(Seed());
  const uint32_t num_pages = 40;
  const size_t page_floats = 1003;
  const size_t floats = num_pages * page_floats;
  for (bool pinned : {false, true}) {
    SCOPED_TRACE(testing::Message() << "pinned host mirror " << pinned);
    const std::vector<float> data = RandomFloats(floats, rng_);
    float* pool = ToDevice(data);
    // Long work queued before the copy, then the write the copy must see: without the copy
    // stream waiting for the compute, the pages come to the host before the + 0.5.
    const size_t n = 512, in = 1024, out = 1024;
    float* y = Alloc(n * out);
    device_->MatMul(ToDevice(RandomFloats(n * in, rng_)), ToDevice(RandomFloats(in * out, rng_)), y,
                    n, in, out);
    device_->AddConstant(pool, floats, 1, floats, 0.5f);

    float* host = pinned ? device_->AllocateHost(floats).value() : new float[floats];
    std::fill_n(host, floats, kSentinel);
    const std::vector<uint32_t> pages = SomePages(num_pages, rng_);
    ASSERT_TRUE(device_->PagesToHost(pool, host, page_floats, pages).ok());
    std::vector<float> want(floats, kSentinel);
    for (uint32_t p : pages) {
      for (size_t i = p * page_floats; i < (p + 1) * page_floats; ++i) want[i] = data[i] + 0.5f;
    }
    EXPECT_EQ(std::memcmp(host, want.data(), floats * sizeof(float)), 0);
    EXPECT_TRUE(device_->PagesToHost(pool, host, page_floats, {}).ok());
    if (pinned) {
      device_->FreeHost(host);
    } else {
      delete[] host;
    }
  }
  EXPECT_TRUE(device_->Synchronize().ok());
}

TEST_F(CudaDeviceTest, PagesToDeviceIsOrderedWithTheComputeOnBothSides) {
  SCOPED_TRACE(Seed());
  const uint32_t num_pages = 40;
  const size_t page_floats = 1003;
  const size_t floats = num_pages * page_floats;
  for (bool pinned : {false, true}) {
    SCOPED_TRACE(testing::Message() << "pinned host mirror " << pinned);
    const std::vector<float> data = RandomFloats(floats, rng_);
    float* host = pinned ? device_->AllocateHost(floats).value() : new float[floats];
    std::copy(data.begin(), data.end(), host);
    // Long work queued before, then a write of the pool the copies must come after: without
    // the copy stream waiting for the compute, the Fill lands on the copied pages.
    const size_t n = 512, in = 1024, out = 1024;
    float* y = Alloc(n * out);
    device_->MatMul(ToDevice(RandomFloats(n * in, rng_)), ToDevice(RandomFloats(in * out, rng_)), y,
                    n, in, out);
    float* pool = Alloc(floats);
    device_->Fill(pool, floats, kSentinel);
    const std::vector<uint32_t> pages = SomePages(num_pages, rng_);
    ASSERT_TRUE(device_->PagesToDevice(pool, host, page_floats, pages).ok());
    // The host pages are free on return; the work queued after reads the copied pages.
    std::fill_n(host, floats, kNaN);
    float* copy = Alloc(floats);
    device_->Copy(copy, pool, floats);
    std::vector<float> want(floats, kSentinel);
    for (uint32_t p : pages) {
      std::copy_n(data.begin() + p * page_floats, page_floats, want.begin() + p * page_floats);
    }
    EXPECT_TRUE(SameBits(ToHost(copy, floats), want));
    EXPECT_TRUE(device_->PagesToDevice(pool, host, page_floats, {}).ok());
    if (pinned) {
      device_->FreeHost(host);
    } else {
      delete[] host;
    }
  }
  EXPECT_TRUE(device_->Synchronize().ok());
}

// A kernel the device cannot run (head_dim past kMaxHeadDim) fails the device: Synchronize
// and the page copies answer Internal naming the operation from then on.
TEST(CudaDeviceErrorTest, AFailedLaunchIsReportedBySynchronize) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  auto made = MakeDevice("cuda");
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  std::unique_ptr<Device> device = std::move(made).value();
  float* buffer = device->Allocate(1024).value();
  const PagedLayer layer{.pool = buffer,
                         .page_floats = 512,
                         .layer_offset = 0,
                         .block_size = 1,
                         .num_kv_heads = 1,
                         .head_dim = kMaxHeadDim + 2};
  device->BeginStep();
  const std::vector<uint32_t> table = {1};
  device->PagedAttention(layer, device->Stage(table), 1, buffer, 0, 1, 0, 1, AttentionMask{}, 1.0f,
                         buffer, 0);
  const Status status = device->Synchronize();
  EXPECT_EQ(status.code(), StatusCode::kInternal);
  EXPECT_NE(status.message().find("PagedAttention"), std::string::npos) << status.ToString();
  const std::vector<uint32_t> pages = {0};
  std::vector<float> host(512);
  EXPECT_EQ(device->PagesToHost(buffer, host.data(), 512, pages).code(), StatusCode::kInternal);
  device->Free(buffer);
}

// Without a usable device (no driver, a driver older than the runtime, none visible) the
// device is refused with the reason, never aborting.
TEST(CudaDeviceErrorTest, WithoutADeviceMakeDeviceSaysWhy) {
  if (cuda::DeviceCount() > 0) GTEST_SKIP() << "a CUDA device is present";
  auto made = MakeDevice("cuda");
  ASSERT_FALSE(made.ok());
  EXPECT_EQ(made.status().code(), StatusCode::kFailedPrecondition) << made.status().ToString();
  EXPECT_NE(made.status().message().find("CUDA"), std::string::npos) << made.status().ToString();
}

}  // namespace
}  // namespace kvstash::kernels
