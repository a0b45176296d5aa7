#include "kvstash/kernels/paged_attention.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <utility>
#include <vector>

#include "kernel_test_util.h"

namespace kvstash::kernels {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

AttentionMask Causal() { return {}; }
AttentionMask Window(uint32_t window) {
  return {.kind = AttentionMask::Kind::kSlidingWindow, .window = window};
}
AttentionMask Chunked(uint32_t chunk) {
  return {.kind = AttentionMask::Kind::kChunkedLocal, .chunk = chunk};
}

struct Shape {
  uint32_t block_size = 4;
  uint32_t num_heads = 4;
  uint32_t num_kv_heads = 2;
  uint32_t head_dim = 8;
};

// A pool of pages each holding two layers' blocks (layer 0 at an offset of 1 float, layer 1
// after it at an odd offset, so neither is aligned), every float NaN until written: a kernel
// that reads a slot nobody wrote, the null page included, turns its output NaN.
class Pool {
 public:
  Pool(const Shape& shape, size_t num_pages)
      : shape_(shape),
        layer_floats_(2 * size_t{shape.block_size} * shape.num_kv_heads * shape.head_dim),
        page_floats_(2 * layer_floats_ + 7),
        floats_(num_pages * page_floats_, kNaN) {}

  PagedLayer Layer(int which) {
    return {.pool = floats_.data(),
            .page_floats = page_floats_,
            .layer_offset = which == 0 ? 1 : layer_floats_ + 4,
            .block_size = shape_.block_size,
            .num_kv_heads = shape_.num_kv_heads,
            .head_dim = shape_.head_dim};
  }

  // Makes a page look reused by someone else: NaN again.
  void Scribble(uint32_t page) {
    std::fill_n(floats_.begin() + page * page_floats_, page_floats_, kNaN);
  }

  bool PageIsAllNaN(uint32_t page) const {
    return std::all_of(floats_.begin() + page * page_floats_,
                       floats_.begin() + (page + 1) * page_floats_,
                       [](float f) { return std::isnan(f); });
  }

  size_t num_pages() const { return floats_.size() / page_floats_; }

 private:
  Shape shape_;
  size_t layer_floats_;
  size_t page_floats_;
  std::vector<float> floats_;
};

// One request's queries, keys and values, rows of q `q_stride` floats apart and rows of k and v
// `kv_stride` apart (both padded past their heads).
struct Sequence {
  size_t length = 0;
  size_t q_stride = 0;
  size_t kv_stride = 0;
  std::vector<float> q, k, v;
};

Sequence RandomSequence(const Shape& shape, size_t length, std::mt19937& rng,
                        float magnitude = 1.0f) {
  Sequence s;
  s.length = length;
  s.q_stride = size_t{shape.num_heads} * shape.head_dim + 3;
  s.kv_stride = size_t{shape.num_kv_heads} * shape.head_dim + 2;
  s.q = RandomFloats(length * s.q_stride, rng, -magnitude, magnitude);
  s.k = RandomFloats(length * s.kv_stride, rng, -magnitude, magnitude);
  s.v = RandomFloats(length * s.kv_stride, rng);
  return s;
}

// A block table for `length` positions over distinct pages in shuffled order (never page 0).
std::vector<uint32_t> ShuffledTable(size_t length, uint32_t block_size, size_t num_pages,
                                    std::mt19937& rng) {
  std::vector<uint32_t> pages(num_pages - 1);
  std::iota(pages.begin(), pages.end(), 1u);
  std::shuffle(pages.begin(), pages.end(), rng);
  pages.resize((length + block_size - 1) / block_size);
  return pages;
}

// Replaces by the null block every block entirely before position `first_needed`, as the
// KV-cache manager does for blocks a layer no longer needs.
void NullBlocksBefore(std::vector<uint32_t>& table, uint32_t block_size, size_t first_needed) {
  for (size_t b = 0; b < table.size() && (b + 1) * block_size <= first_needed; ++b) table[b] = 0;
}

// softmax(q·k * scale) · v in double over [mask.FirstKey(p), p] for the queries at
// [start, start + n): n rows of num_heads * head_dim.
std::vector<double> ReferenceAttention(const Shape& shape, const Sequence& s, size_t start,
                                       size_t n, const AttentionMask& mask, float scale) {
  const size_t hd = shape.head_dim;
  const uint32_t group = shape.num_heads / shape.num_kv_heads;
  std::vector<double> out;
  for (size_t p = start; p < start + n; ++p) {
    for (uint32_t h = 0; h < shape.num_heads; ++h) {
      const size_t kv_head = h / group;
      const float* q = s.q.data() + p * s.q_stride + h * hd;
      std::vector<double> scores;
      for (size_t t = mask.FirstKey(p); t <= p; ++t) {
        const float* k = s.k.data() + t * s.kv_stride + kv_head * hd;
        double dot = 0.0;
        for (size_t d = 0; d < hd; ++d) dot += double{q[d]} * k[d];
        scores.push_back(dot * scale);
      }
      const double max = *std::max_element(scores.begin(), scores.end());
      double sum = 0.0;
      for (double& x : scores) sum += (x = std::exp(x - max));
      for (size_t d = 0; d < hd; ++d) {
        double acc = 0.0;
        for (size_t i = 0; i < scores.size(); ++i) {
          const size_t t = mask.FirstKey(p) + i;
          acc += scores[i] * s.v[t * s.kv_stride + kv_head * hd + d];
        }
        out.push_back(acc / sum);
      }
    }
  }
  return out;
}

// Runs the kernel for queries [start, start + n) into rows padded with sentinels, checks the
// padding survived, and returns the rows without it.
std::vector<float> RunAttention(const PagedLayer& layer, const std::vector<uint32_t>& table,
                                const Shape& shape, const Sequence& s, size_t start, size_t n,
                                const AttentionMask& mask, float scale) {
  const size_t width = size_t{shape.num_heads} * shape.head_dim;
  const size_t out_stride = width + 5;
  std::vector<float> padded(n * out_stride, kSentinel);
  PagedAttention(layer, table, s.q.data() + start * s.q_stride, s.q_stride, n, start,
                 shape.num_heads, mask, scale, padded.data(), out_stride);
  std::vector<float> out;
  for (size_t i = 0; i < n; ++i) {
    out.insert(out.end(), padded.begin() + i * out_stride, padded.begin() + i * out_stride + width);
    for (size_t j = width; j < out_stride; ++j) {
      EXPECT_EQ(padded[i * out_stride + j], kSentinel) << "wrote past row " << i;
    }
  }
  return out;
}

float DefaultScale(const Shape& shape) { return 1.0f / std::sqrt(float(shape.head_dim)); }

// The common case: the queries [start, start + n) of a `length`-token request whose KV was all
// written (except to blocks the mask no longer needs, which are null), against the reference.
void ExpectMatchesReference(const Shape& shape, size_t length, size_t start,
                            const AttentionMask& mask, std::mt19937& rng) {
  Pool pool(shape, (length + shape.block_size - 1) / shape.block_size + 3);
  const Sequence s = RandomSequence(shape, length, rng);
  std::vector<uint32_t> table = ShuffledTable(length, shape.block_size, pool.num_pages(), rng);
  NullBlocksBefore(table, shape.block_size, mask.FirstKey(start));
  const PagedLayer layer = pool.Layer(0);
  WriteKv(layer, table, 0, length, s.k.data(), s.v.data(), s.kv_stride);
  ASSERT_TRUE(pool.PageIsAllNaN(0)) << "WriteKv wrote the null page";

  const size_t n = length - start;
  const std::vector<float> got =
      RunAttention(layer, table, shape, s, start, n, mask, DefaultScale(shape));
  EXPECT_LT(
      MaxRelativeError(got, ReferenceAttention(shape, s, start, n, mask, DefaultScale(shape))),
      1e-5);
}

TEST(PagedAttentionTest, CausalPrefillMatchesReferenceForBlockSizesAndGqa) {
  std::mt19937 rng(11);
  for (uint32_t block_size : {1, 4, 16}) {
    for (uint32_t kv_heads : {4, 2, 1}) {
      for (uint32_t head_dim : {8, 20}) {
        SCOPED_TRACE(testing::Message() << "block_size=" << block_size << " kv_heads=" << kv_heads
                                        << " head_dim=" << head_dim);
        const Shape shape{.block_size = block_size,
                          .num_heads = 4,
                          .num_kv_heads = kv_heads,
                          .head_dim = head_dim};
        ExpectMatchesReference(shape, 37, 0, Causal(), rng);
      }
    }
  }
}

TEST(PagedAttentionTest, LongContextWithLargeScoresMatchesReference) {
  // 300 keys cross the kernel's 64-key chunks; scores of tens make the running maximum jump
  // between chunks, which a wrong softmax rescale would show.
  std::mt19937 rng(12);
  const Shape shape{.block_size = 16, .num_heads = 8, .num_kv_heads = 2, .head_dim = 64};
  const size_t length = 300;
  Pool pool(shape, 24);
  const Sequence s = RandomSequence(shape, length, rng, 2.0f);
  const std::vector<uint32_t> table = ShuffledTable(length, 16, pool.num_pages(), rng);
  const PagedLayer layer = pool.Layer(1);
  WriteKv(layer, table, 0, length, s.k.data(), s.v.data(), s.kv_stride);
  const float scale = 0.5f;
  const std::vector<float> got = RunAttention(layer, table, shape, s, 0, length, Causal(), scale);
  EXPECT_LT(MaxRelativeError(got, ReferenceAttention(shape, s, 0, length, Causal(), scale)), 1e-5);
}

TEST(PagedAttentionTest, SlidingWindowNeverReadsBlocksOutsideTheWindow) {
  // Queries 24..39 of 40 tokens (a later prefill chunk): every block entirely before the first
  // query's window is null, and the null page is NaN.
  std::mt19937 rng(13);
  for (uint32_t block_size : {1, 4, 16}) {
    for (uint32_t window : {1, 3, 5, 17, 64}) {
      SCOPED_TRACE(testing::Message() << "block_size=" << block_size << " window=" << window);
      const Shape shape{.block_size = block_size, .num_heads = 4, .num_kv_heads = 2};
      ExpectMatchesReference(shape, 40, 24, Window(window), rng);
    }
  }
}

TEST(PagedAttentionTest, ChunkedLocalNeverReadsBlocksBeforeTheChunk) {
  std::mt19937 rng(14);
  for (uint32_t block_size : {1, 4, 16}) {
    for (uint32_t chunk : {4, 6, 16, 32}) {
      for (size_t start : {0, 26, 39}) {
        SCOPED_TRACE(testing::Message()
                     << "block_size=" << block_size << " chunk=" << chunk << " start=" << start);
        const Shape shape{.block_size = block_size, .num_heads = 4, .num_kv_heads = 1};
        ExpectMatchesReference(shape, 40, start, Chunked(chunk), rng);
      }
    }
  }
}

TEST(PagedAttentionTest, WideGroupsAndHeadDimsThatAreNotMultiplesOfEight) {
  // Groups of 16, 12 and 10 query heads per KV head (the kernel takes 8 at a time), head_dim
  // tails, and the largest head_dim.
  std::mt19937 rng(15);
  const std::pair<uint32_t, uint32_t> heads[] = {{16, 1}, {12, 1}, {20, 2}};
  for (const auto& [num_heads, kv_heads] : heads) {
    for (uint32_t head_dim : {1u, 12u, 36u, kMaxHeadDim}) {
      SCOPED_TRACE(testing::Message() << "num_heads=" << num_heads << " kv_heads=" << kv_heads
                                      << " head_dim=" << head_dim);
      const Shape shape{
          .block_size = 4, .num_heads = num_heads, .num_kv_heads = kv_heads, .head_dim = head_dim};
      ExpectMatchesReference(shape, 21, 0, Causal(), rng);
    }
  }
}

TEST(PagedAttentionTest, PackedLayersInOnePageKeepTheirOwnKv) {
  std::mt19937 rng(16);
  const Shape shape{.block_size = 4, .num_heads = 4, .num_kv_heads = 2, .head_dim = 16};
  const size_t length = 30;
  Pool pool(shape, 12);
  const std::vector<uint32_t> table = ShuffledTable(length, 4, pool.num_pages(), rng);
  const Sequence s0 = RandomSequence(shape, length, rng);
  const Sequence s1 = RandomSequence(shape, length, rng);
  const PagedLayer layer0 = pool.Layer(0), layer1 = pool.Layer(1);
  WriteKv(layer0, table, 0, length, s0.k.data(), s0.v.data(), s0.kv_stride);
  WriteKv(layer1, table, 0, length, s1.k.data(), s1.v.data(), s1.kv_stride);

  // The slots hold what was written, where the header says.
  for (size_t p = 0; p < length; ++p) {
    const uint32_t page = table[p / 4];
    for (size_t j = 0; j < size_t{2} * 16; ++j) {
      ASSERT_EQ(layer0.KeyAt(page, p)[j], s0.k[p * s0.kv_stride + j]);
      ASSERT_EQ(layer0.ValueAt(page, p)[j], s0.v[p * s0.kv_stride + j]);
      ASSERT_EQ(layer1.KeyAt(page, p)[j], s1.k[p * s1.kv_stride + j]);
      ASSERT_EQ(layer1.ValueAt(page, p)[j], s1.v[p * s1.kv_stride + j]);
    }
  }
  const float scale = DefaultScale(shape);
  EXPECT_LT(MaxRelativeError(RunAttention(layer0, table, shape, s0, 0, length, Causal(), scale),
                             ReferenceAttention(shape, s0, 0, length, Causal(), scale)),
            1e-5);
  EXPECT_LT(MaxRelativeError(RunAttention(layer1, table, shape, s1, 0, length, Window(6), scale),
                             ReferenceAttention(shape, s1, 0, length, Window(6), scale)),
            1e-5);
}

TEST(PagedAttentionTest, IncrementalDecodeEqualsTheRowsOfAFullPrefill) {
  std::mt19937 rng(17);
  const Shape shape{.block_size = 4, .num_heads = 4, .num_kv_heads = 2, .head_dim = 16};
  const size_t length = 40, prompt = 10;
  const float scale = DefaultScale(shape);
  for (const AttentionMask& mask : {Causal(), Window(7), Chunked(8)}) {
    SCOPED_TRACE(testing::Message() << "mask kind " << int(mask.kind));
    const Sequence s = RandomSequence(shape, length, rng);

    Pool full_pool(shape, 14);
    const std::vector<uint32_t> full_table = ShuffledTable(length, 4, full_pool.num_pages(), rng);
    WriteKv(full_pool.Layer(0), full_table, 0, length, s.k.data(), s.v.data(), s.kv_stride);
    const std::vector<float> prefill =
        RunAttention(full_pool.Layer(0), full_table, shape, s, 0, length, mask, scale);
    ASSERT_LT(MaxRelativeError(prefill, ReferenceAttention(shape, s, 0, length, mask, scale)),
              1e-5);

    // The prompt, then one token at a time; blocks the layer stops needing are nulled and their
    // pages scribbled over, as if freed and reused.
    Pool pool(shape, 14);
    std::vector<uint32_t> table = ShuffledTable(length, 4, pool.num_pages(), rng);
    const PagedLayer layer = pool.Layer(0);
    WriteKv(layer, table, 0, prompt, s.k.data(), s.v.data(), s.kv_stride);
    RunAttention(layer, table, shape, s, 0, prompt, mask, scale);
    const size_t width = size_t{shape.num_heads} * shape.head_dim;
    for (size_t p = prompt; p < length; ++p) {
      for (size_t b = 0; b < table.size() && (b + 1) * 4 <= mask.FirstKey(p); ++b) {
        if (table[b] != 0) pool.Scribble(std::exchange(table[b], 0));
      }
      WriteKv(layer, table, p, 1, s.k.data() + p * s.kv_stride, s.v.data() + p * s.kv_stride,
              s.kv_stride);
      const std::vector<float> row = RunAttention(layer, table, shape, s, p, 1, mask, scale);
      for (size_t j = 0; j < width; ++j) {
        ASSERT_NEAR(row[j], prefill[p * width + j], 1e-6) << "position " << p << " float " << j;
      }
    }
  }
}

TEST(WriteKvTest, SkipsPositionsWhoseBlockIsNull) {
  std::mt19937 rng(18);
  const Shape shape{.block_size = 4, .num_heads = 2, .num_kv_heads = 2, .head_dim = 8};
  Pool pool(shape, 4);
  const Sequence s = RandomSequence(shape, 12, rng);
  const std::vector<uint32_t> table = {0, 3, 0};
  WriteKv(pool.Layer(0), table, 0, 12, s.k.data(), s.v.data(), s.kv_stride);
  EXPECT_TRUE(pool.PageIsAllNaN(0));
  EXPECT_FALSE(pool.PageIsAllNaN(3));
  EXPECT_EQ(pool.Layer(0).KeyAt(3, 5)[0], s.k[5 * s.kv_stride]);
}

// S = sigmoid(gate) * S + k v^T; out = S^T q, in double, per head; `state` is updated.
std::vector<double> ReferenceStateScan(std::vector<double>& state, const std::vector<float>& q,
                                       const std::vector<float>& k, const std::vector<float>& v,
                                       size_t stride, const std::vector<float>& gate,
                                       size_t gate_stride, size_t n, uint32_t num_heads,
                                       uint32_t hd) {
  std::vector<double> out;
  for (size_t i = 0; i < n; ++i) {
    for (uint32_t h = 0; h < num_heads; ++h) {
      const double g = 1.0 / (1.0 + std::exp(-double{gate[i * gate_stride + h]}));
      double* s = state.data() + size_t{h} * hd * hd;
      const size_t base = i * stride + size_t{h} * hd;
      for (size_t a = 0; a < hd; ++a) {
        for (size_t b = 0; b < hd; ++b) {
          s[a * hd + b] = g * s[a * hd + b] + double{k[base + a]} * v[base + b];
        }
      }
      for (size_t b = 0; b < hd; ++b) {
        double o = 0.0;
        for (size_t a = 0; a < hd; ++a) o += s[a * hd + b] * q[base + a];
        out.push_back(o);
      }
    }
  }
  return out;
}

struct StateInputs {
  size_t stride, gate_stride, out_stride;
  std::vector<float> q, k, v, gate, state;
};

StateInputs RandomStateInputs(size_t n, uint32_t num_heads, uint32_t hd, std::mt19937& rng) {
  StateInputs in;
  in.stride = size_t{num_heads} * hd + 2;
  in.gate_stride = num_heads + 1;
  in.out_stride = size_t{num_heads} * hd + 3;
  in.q = RandomFloats(n * in.stride, rng);
  in.k = RandomFloats(n * in.stride, rng);
  in.v = RandomFloats(n * in.stride, rng);
  in.gate = RandomFloats(n * in.gate_stride, rng, -3.0f, 3.0f);
  in.state = RandomFloats(size_t{num_heads} * hd * hd, rng);
  return in;
}

TEST(StateScanTest, MatchesDoubleRecurrence) {
  std::mt19937 rng(21);
  const uint32_t num_heads = 3;
  const size_t n = 25;
  for (uint32_t hd : {1, 12, 16, 64}) {
    SCOPED_TRACE(testing::Message() << "head_dim=" << hd);
    StateInputs in = RandomStateInputs(n, num_heads, hd, rng);
    std::vector<double> want_state(in.state.begin(), in.state.end());
    const std::vector<double> want = ReferenceStateScan(want_state, in.q, in.k, in.v, in.stride,
                                                        in.gate, in.gate_stride, n, num_heads, hd);

    std::vector<float> padded(n * in.out_stride, kSentinel);
    StateScan(in.state.data(), in.q.data(), in.k.data(), in.v.data(), in.stride, in.gate.data(),
              in.gate_stride, n, num_heads, hd, padded.data(), in.out_stride);
    std::vector<float> got;
    const size_t width = size_t{num_heads} * hd;
    for (size_t i = 0; i < n; ++i) {
      got.insert(got.end(), padded.begin() + i * in.out_stride,
                 padded.begin() + i * in.out_stride + width);
      for (size_t j = width; j < in.out_stride; ++j) {
        EXPECT_EQ(padded[i * in.out_stride + j], kSentinel);
      }
    }
    EXPECT_LT(MaxRelativeError(got, want), 1e-5);
    EXPECT_LT(MaxRelativeError(in.state, want_state), 1e-5);
  }
}

TEST(StateScanTest, SplittingASequenceIntoCallsGivesTheSameResult) {
  std::mt19937 rng(22);
  const uint32_t num_heads = 2, hd = 16;
  const size_t n = 20;
  const StateInputs in = RandomStateInputs(n, num_heads, hd, rng);
  const size_t width = size_t{num_heads} * hd;

  std::vector<float> one_state = in.state;
  std::vector<float> one_out(n * width);
  StateScan(one_state.data(), in.q.data(), in.k.data(), in.v.data(), in.stride, in.gate.data(),
            in.gate_stride, n, num_heads, hd, one_out.data(), width);

  for (size_t split : {1, 7, 19}) {
    SCOPED_TRACE(testing::Message() << "split at " << split);
    std::vector<float> state = in.state;
    std::vector<float> out(n * width);
    StateScan(state.data(), in.q.data(), in.k.data(), in.v.data(), in.stride, in.gate.data(),
              in.gate_stride, split, num_heads, hd, out.data(), width);
    const size_t o = split * in.stride;
    StateScan(state.data(), in.q.data() + o, in.k.data() + o, in.v.data() + o, in.stride,
              in.gate.data() + split * in.gate_stride, in.gate_stride, n - split, num_heads, hd,
              out.data() + split * width, width);
    for (size_t i = 0; i < out.size(); ++i) ASSERT_NEAR(out[i], one_out[i], 1e-6) << i;
    for (size_t i = 0; i < state.size(); ++i) ASSERT_NEAR(state[i], one_state[i], 1e-6) << i;
  }
}

}  // namespace
}  // namespace kvstash::kernels
