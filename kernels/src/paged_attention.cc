#include "kvstash/kernels/paged_attention.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstring>
#include <limits>

#include "simd.h"

namespace kvstash::kernels {
namespace {

// Query heads are taken in batches of consecutive heads, up to kMaxBatchHeads and
// kMaxBatchFloats floats of head_dim, so that each position's KV row (all KV heads, contiguous)
// is read once, in memory order, for the whole batch: walking the cache one KV head at a time
// touched one 4 KiB page per key with 8 KV heads of 128 and ran decode at 134 ns per key and
// head. Keys go kKeyChunk at a time (scores, then one softmax rescale per chunk rather than per
// key). All three bound the stack arrays.
constexpr uint32_t kMaxBatchHeads = 32;
constexpr size_t kMaxBatchFloats = 32 * 128;
constexpr size_t kKeyChunk = 64;
static_assert(kKeyChunk % 8 == 0, "softmax exponentials go eight scores at a time");
static_assert(kMaxBatchFloats >= kMaxHeadDim, "a batch holds at least one head");

// The KV rows of positions [first, last], walked in order through the block table. Only the
// entries of blocks holding such positions are read.
class KvWalker {
 public:
  KvWalker(const PagedLayer& layer, std::span<const uint32_t> block_table, size_t first)
      : layer_(layer),
        table_(block_table),
        row_floats_(size_t{layer.num_kv_heads} * layer.head_dim),
        block_(first / layer.block_size),
        in_block_(first % layer.block_size) {
    Enter();
  }

  // Keys (values) of all KV heads of the current position.
  const float* keys() const { return keys_; }
  const float* values() const { return values_; }

  void Next() {
    if (++in_block_ == layer_.block_size) {
      ++block_;
      in_block_ = 0;
      Enter();
    } else {
      keys_ += row_floats_;
      values_ += row_floats_;
    }
  }

 private:
  // The caller never steps past its last position, so a block is entered only when one of its
  // positions is needed.
  void Enter() {
    assert(block_ < table_.size() && "the block table is shorter than the positions attended");
    const uint32_t page = table_[block_];
    assert(page != 0 && "a position the mask needs maps to the null block");
    keys_ = layer_.KeyAt(page, in_block_);
    values_ = layer_.ValueAt(page, in_block_);
  }

  const PagedLayer& layer_;
  std::span<const uint32_t> table_;
  size_t row_floats_;
  size_t block_;
  size_t in_block_;
  const float* keys_ = nullptr;
  const float* values_ = nullptr;
};

// Online softmax of query heads [h0, h0 + count) of one query row over the keys [first, last];
// q and out point at the row's head h0 (heads of head_dim floats, one after the other).
KVSTASH_KERNEL_INLINE void AttendHeads(const PagedLayer& layer,
                                       std::span<const uint32_t> block_table, uint32_t h0,
                                       uint32_t count, uint32_t group, const float* q, size_t first,
                                       size_t last, float scale, float* out) {
  const size_t hd = layer.head_dim;
  float qs[kMaxBatchFloats];
  float acc[kMaxBatchFloats];
  float scores[kMaxBatchHeads][kKeyChunk];
  float running_max[kMaxBatchHeads];
  float running_sum[kMaxBatchHeads];
  size_t kv_offset[kMaxBatchHeads];  // floats from a KV row's start to the head's KV head
  const float* values[kKeyChunk];
  for (uint32_t h = 0; h < count; ++h) {
    for (size_t d = 0; d < hd; ++d) qs[h * hd + d] = q[h * hd + d] * scale;
    running_max[h] = -std::numeric_limits<float>::infinity();
    running_sum[h] = 0.0f;
    kv_offset[h] = (h0 + h) / group * hd;
  }
  std::memset(acc, 0, count * hd * sizeof(float));

  KvWalker kv(layer, block_table, first);
  for (size_t t0 = first; t0 <= last; t0 += kKeyChunk) {
    const size_t len = last + 1 - t0 < kKeyChunk ? last + 1 - t0 : kKeyChunk;
    for (size_t t = 0; t < len; ++t) {
      if (t > 0) kv.Next();
      const float* keys = kv.keys();
      for (uint32_t h = 0; h < count; ++h) {
        scores[h][t] = internal::Dot(qs + h * hd, keys + kv_offset[h], hd);
      }
      values[t] = kv.values();
    }
    for (uint32_t h = 0; h < count; ++h) {
      for (size_t t = len; t % 8 != 0; ++t) scores[h][t] = 0.0f;
    }
    if (t0 + len <= last) kv.Next();  // step onto the next chunk's first key

    for (uint32_t h = 0; h < count; ++h) {
      float* s = scores[h];
      float chunk_max = s[0];
      for (size_t t = 1; t < len; ++t) chunk_max = s[t] > chunk_max ? s[t] : chunk_max;
      if (chunk_max > running_max[h]) {
        // exp(-inf) is 0: the first chunk scales the empty accumulator by zero.
        const float correction = std::exp(running_max[h] - chunk_max);
        running_sum[h] *= correction;
        float* __restrict a = acc + h * hd;
        for (size_t d = 0; d < hd; ++d) a[d] *= correction;
        running_max[h] = chunk_max;
      }
      const float m = running_max[h];
      // Whole vectors: the lanes past len hold zeros (set above) and are never summed or used.
      for (size_t t = 0; t < len; t += 8) {
        internal::Store8(s + t, internal::Exp8(internal::Load8(s + t) - m));
      }
      float sum = 0.0f;
      for (size_t t = 0; t < len; ++t) sum += s[t];
      running_sum[h] += sum;
    }
    for (size_t t = 0; t < len; ++t) {
      for (uint32_t h = 0; h < count; ++h) {
        const float p = scores[h][t];
        const float* __restrict v = values[t] + kv_offset[h];
        float* __restrict a = acc + h * hd;
        for (size_t d = 0; d < hd; ++d) a[d] += p * v[d];
      }
    }
  }

  for (uint32_t h = 0; h < count; ++h) {
    const float inv = 1.0f / running_sum[h];
    for (size_t d = 0; d < hd; ++d) out[h * hd + d] = acc[h * hd + d] * inv;
  }
}

}  // namespace

void WriteKv(const PagedLayer& layer, std::span<const uint32_t> block_table, size_t start_pos,
             size_t n, const float* k, const float* v, size_t stride) {
  const size_t row_bytes = size_t{layer.num_kv_heads} * layer.head_dim * sizeof(float);
  for (size_t i = 0; i < n; ++i) {
    const size_t pos = start_pos + i;
    assert(pos / layer.block_size < block_table.size());
    const uint32_t page = block_table[pos / layer.block_size];
    // A position whose block is null is one the layer no longer needs: the null page is never
    // written, so it stays whatever the pool made it.
    if (page == 0) continue;
    std::memcpy(layer.KeyAt(page, pos), k + i * stride, row_bytes);
    std::memcpy(layer.ValueAt(page, pos), v + i * stride, row_bytes);
  }
}

KVSTASH_KERNEL_CLONES
void PagedAttention(const PagedLayer& layer, std::span<const uint32_t> block_table, const float* q,
                    size_t q_stride, size_t n, size_t start_pos, uint32_t num_heads,
                    const AttentionMask& mask, float scale, float* out, size_t out_stride) {
  const uint32_t hd = layer.head_dim;
  assert(hd <= kMaxHeadDim);
  assert(layer.num_kv_heads > 0 && num_heads % layer.num_kv_heads == 0);
  assert(mask.kind != AttentionMask::Kind::kSlidingWindow || mask.window > 0);
  assert(mask.kind != AttentionMask::Kind::kChunkedLocal || mask.chunk > 0);
  if (n == 0 || hd == 0 || num_heads == 0) return;
  const uint32_t group = num_heads / layer.num_kv_heads;
  const uint32_t batch = std::min<uint32_t>(kMaxBatchHeads, kMaxBatchFloats / hd);
  for (size_t i = 0; i < n; ++i) {
    const size_t pos = start_pos + i;
    const size_t first = mask.FirstKey(pos);
    const float* q_row = q + i * q_stride;
    float* out_row = out + i * out_stride;
    if (first > pos) {  // a zero window: no key at all
      std::memset(out_row, 0, size_t{num_heads} * hd * sizeof(float));
      continue;
    }
    for (uint32_t h0 = 0; h0 < num_heads; h0 += batch) {
      const uint32_t count = num_heads - h0 < batch ? num_heads - h0 : batch;
      AttendHeads(layer, block_table, h0, count, group, q_row + size_t{h0} * hd, first, pos, scale,
                  out_row + size_t{h0} * hd);
    }
  }
}

KVSTASH_KERNEL_CLONES
void StateScan(float* state, const float* q, const float* k, const float* v, size_t stride,
               const float* gate, size_t gate_stride, size_t n, uint32_t num_heads,
               uint32_t head_dim, float* out, size_t out_stride) {
  assert(head_dim <= kMaxHeadDim);
  const size_t hd = head_dim;
  float o[kMaxHeadDim];
  for (size_t i = 0; i < n; ++i) {
    for (uint32_t h = 0; h < num_heads; ++h) {
      const float* __restrict qh = q + i * stride + h * hd;
      const float* __restrict kh = k + i * stride + h * hd;
      const float* __restrict vh = v + i * stride + h * hd;
      const float g = 1.0f / (1.0f + std::exp(-gate[i * gate_stride + h]));
      float* __restrict s = state + h * hd * hd;
      std::memset(o, 0, hd * sizeof(float));
      // One pass over S per token: row a of S decays and takes k[a] v, then adds q[a] times
      // itself into out (out = S^T q after the update).
      for (size_t a = 0; a < hd; ++a) {
        const float ka = kh[a], qa = qh[a];
        float* __restrict row = s + a * hd;
        for (size_t b = 0; b < hd; ++b) {
          const float updated = g * row[b] + ka * vh[b];
          row[b] = updated;
          o[b] += qa * updated;
        }
      }
      std::memcpy(out + i * out_stride + h * hd, o, hd * sizeof(float));
    }
  }
}

}  // namespace kvstash::kernels
