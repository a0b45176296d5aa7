#pragma once

// Attention over a paged KV cache, per layer type (full causal, sliding window, chunked local),
// the KV writes that fill it, and the state layer's gated linear recurrence. CPU, float32.
//
// The cache is one pool of pages (`num_blocks` pages of `page_floats` floats); a request's
// block table maps its block index (position / block_size) to a page. Block 0 is the null
// block: a table entry of 0 marks KV the layer no longer needs (outside its window or chunk),
// and no kernel ever reads or writes page 0 for such a position.
//
// A layer's block inside a page starts `layer_offset` floats in: first the keys of its
// block_size tokens, [block_size][num_kv_heads][head_dim], then the values, same shape.
// Several layers may share a page at different offsets (packed layers).
//
// Functions are thread-safe for disjoint outputs; none allocates.

#include <cstddef>
#include <cstdint>
#include <span>

namespace kvstash::kernels {

struct PagedLayer {
  float* pool = nullptr;
  size_t page_floats = 0;   // floats per page
  size_t layer_offset = 0;  // floats from a page's start to this layer's keys
  uint32_t block_size = 0;  // tokens per block
  uint32_t num_kv_heads = 0;
  uint32_t head_dim = 0;

  float* KeyAt(uint32_t block, size_t pos) const {
    return pool + block * page_floats + layer_offset +
           (pos % block_size) * size_t{num_kv_heads} * head_dim;
  }
  float* ValueAt(uint32_t block, size_t pos) const {
    return KeyAt(block, pos) + size_t{block_size} * num_kv_heads * head_dim;
  }
};

// Which keys a query at position p attends to: [FirstKey(p), p].
struct AttentionMask {
  enum class Kind : uint8_t { kCausal, kSlidingWindow, kChunkedLocal };
  Kind kind = Kind::kCausal;
  uint32_t window = 0;  // kSlidingWindow: the query and the window - 1 keys before it
  uint32_t chunk = 0;   // kChunkedLocal: keys of the query's own chunk only

  size_t FirstKey(size_t p) const {
    switch (kind) {
      case Kind::kSlidingWindow:
        return p + 1 >= window ? p + 1 - window : 0;
      case Kind::kChunkedLocal:
        return p / chunk * chunk;
      case Kind::kCausal:
        break;
    }
    return 0;
  }
};

// Writes the keys and values of positions [start_pos, start_pos + n) of one request into its
// blocks. k and v rows ([num_kv_heads][head_dim] each) are `stride` floats apart.
void WriteKv(const PagedLayer& layer, std::span<const uint32_t> block_table, size_t start_pos,
             size_t n, const float* k, const float* v, size_t stride);

// Attention of the n queries at positions [start_pos, start_pos + n) of one request, whose keys
// and values (up to start_pos + n - 1) are in the cache. q rows hold num_heads heads of
// head_dim (`q_stride` floats apart); query head h reads KV head h / (num_heads / num_kv_heads).
// out rows get num_heads * head_dim floats (`out_stride` apart): softmax(q·k * scale) · v over
// the keys the mask allows. head_dim is at most kMaxHeadDim.
inline constexpr uint32_t kMaxHeadDim = 256;
void PagedAttention(const PagedLayer& layer, std::span<const uint32_t> block_table, const float* q,
                    size_t q_stride, size_t n, size_t start_pos, uint32_t num_heads,
                    const AttentionMask& mask, float scale, float* out, size_t out_stride);

// The state layer: per head a matrix S of [head_dim][head_dim] (key dim by value dim), and for
// each of the n tokens in order
//   g = sigmoid(gate[h]);  S = g * S + k_h v_h^T;  out_h = S^T q_h
// q, k, v rows hold num_heads heads of head_dim (`stride` floats apart), gate rows num_heads
// logits (`gate_stride` apart); out rows num_heads * head_dim (`out_stride` apart). `state`
// ([num_heads][head_dim][head_dim]) is updated in place. head_dim is at most kMaxHeadDim.
void StateScan(float* state, const float* q, const float* k, const float* v, size_t stride,
               const float* gate, size_t gate_stride, size_t n, uint32_t num_heads,
               uint32_t head_dim, float* out, size_t out_stride);

}  // namespace kvstash::kernels
