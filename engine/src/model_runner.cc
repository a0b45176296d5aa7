#include "kvstash/engine/model_runner.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstring>

#include "kvstash/kernels/cpu_ops.h"

namespace kvstash::engine {
namespace {

using LKind = LayerConfig::Kind;
using SKind = AttentionSpec::Kind;

kernels::AttentionMask MaskOf(const LayerConfig& layer) {
  kernels::AttentionMask mask;
  if (layer.kind == LKind::kSlidingWindow) {
    mask.kind = kernels::AttentionMask::Kind::kSlidingWindow;
    mask.window = layer.window;
  } else if (layer.kind == LKind::kChunkedLocal) {
    mask.kind = kernels::AttentionMask::Kind::kChunkedLocal;
    mask.chunk = layer.chunk;
  }
  return mask;
}

template <typename T>
void Grow(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
}

}  // namespace

Result<KvLayout> KvLayout::Build(const ModelConfig& config, uint32_t block_size,
                                 uint32_t attn_pack) {
  KVSTASH_RETURN_IF_ERROR(config.Validate());
  if (attn_pack == 0) return InvalidArgumentError("attn-pack must be at least 1");
  const size_t kv_tok = config.KvFloatsPerToken();
  const bool has_state = config.HasStateLayers();
  const size_t state = config.StateFloats();
  // The smallest block size whose one-layer page holds a state, rounded up to the pack.
  const uint32_t min_for_state =
      has_state ? static_cast<uint32_t>((state + kv_tok - 1) / kv_tok) : 1;
  if (block_size == 0) {
    block_size = has_state ? (min_for_state + attn_pack - 1) / attn_pack * attn_pack : 16;
    block_size = std::max(block_size, attn_pack);
  }
  if (block_size % attn_pack != 0)
    return InvalidArgumentError("block size {} is not a multiple of attn-pack {}", block_size,
                                attn_pack);
  if (block_size < min_for_state)
    return InvalidArgumentError(
        "block size {} gives pages of {} floats, but a state of model '{}' needs {}: use a block "
        "size of at least {}",
        block_size, size_t{block_size} * kv_tok, config.name, state, min_for_state);
  KvLayout layout;
  layout.block_size = block_size;
  layout.attn_pack = attn_pack;
  layout.page_floats = std::max(size_t{block_size} * kv_tok, has_state ? state : 0);
  const uint32_t full_bs = block_size / attn_pack;
  bool has_full = false;
  for (const LayerConfig& l : config.layers) has_full |= l.kind == LKind::kFull;
  const uint32_t state_bs = has_full ? full_bs : block_size;

  int32_t open_full = -1;  // the full-attention group still taking layers
  uint32_t open_count = 0;
  for (const LayerConfig& l : config.layers) {
    LayerPlace place;
    auto new_group = [&](AttentionSpec spec) {
      layout.groups.push_back(spec);
      place.group = static_cast<int32_t>(layout.groups.size() - 1);
    };
    switch (l.kind) {
      case LKind::kFull:
        if (open_full >= 0 && open_count < attn_pack) {
          place.group = open_full;
          place.offset = size_t{open_count} * full_bs * kv_tok;
          ++open_count;
        } else {
          new_group({SKind::kFull, full_bs, 0, 0});
          open_full = place.group;
          open_count = 1;
        }
        break;
      case LKind::kSlidingWindow:
        new_group({SKind::kSlidingWindow, block_size, l.window, 0});
        break;
      case LKind::kChunkedLocal:
        if (l.chunk % block_size != 0)
          return InvalidArgumentError(
              "chunk {} of a chunked-local layer is not a multiple of the "
              "block size {}",
              l.chunk, block_size);
        new_group({SKind::kChunkedLocal, block_size, 0, l.chunk});
        break;
      case LKind::kState:
        new_group({SKind::kState, state_bs, 0, 0});
        break;
      case LKind::kKvShare:
        place = layout.layers[l.share_from];
        break;
    }
    layout.layers.push_back(place);
  }
  return layout;
}

ModelRunner::ModelRunner(ModelConfig config, ModelWeights weights, KvLayout layout,
                         size_t num_blocks)
    : config_(std::move(config)),
      weights_(std::move(weights)),
      layout_(std::move(layout)),
      num_blocks_(num_blocks),
      pool_(num_blocks * layout_.page_floats) {}

kernels::PagedLayer ModelRunner::PagedFor(size_t l) const {
  const KvLayout::LayerPlace& place = layout_.layers[l];
  kernels::PagedLayer paged;
  paged.pool = const_cast<float*>(pool_.data());
  paged.page_floats = layout_.page_floats;
  paged.layer_offset = place.offset;
  paged.block_size = layout_.groups[place.group].block_size;
  paged.num_kv_heads = config_.num_kv_heads;
  paged.head_dim = config_.head_dim;
  return paged;
}

void ModelRunner::Forward(std::span<const SeqInput> seqs, std::vector<float>& logits,
                          bool all_positions) {
  const size_t hidden = config_.hidden, vocab = config_.vocab_size;
  size_t total = 0;
  for (const SeqInput& s : seqs) total += s.tokens.size();
  const size_t qd = size_t{config_.num_heads} * config_.head_dim;
  Grow(x_, total * hidden);
  Grow(h_, total * std::max(hidden, qd));
  Grow(qkv_, total * (3 * qd + config_.num_heads));
  Grow(attn_, total * qd);
  Grow(ff_gate_, total * config_.intermediate);
  Grow(ff_up_, total * config_.intermediate);
  Grow(state_, config_.StateFloats());
  Grow(positions_, total);

  size_t row = 0;
  for (const SeqInput& s : seqs) {
    for (size_t i = 0; i < s.tokens.size(); ++i, ++row) {
      const uint32_t token = std::min<uint32_t>(s.tokens[i], config_.vocab_size - 1);
      std::memcpy(&x_[row * hidden], &weights_.embed[size_t{token} * hidden],
                  hidden * sizeof(float));
      positions_[row] = static_cast<uint32_t>(s.start_pos + i);
    }
  }
  for (size_t l = 0; l < config_.layers.size(); ++l) {
    const LayerWeights& w = weights_.layers[l];
    kernels::RmsNorm(x_.data(), w.attn_norm.data(), h_.data(), total, hidden, config_.rms_eps);
    if (config_.layers[l].kind == LKind::kState) {
      StateLayer(l, seqs);
    } else {
      AttentionLayer(l, seqs);
    }
    kernels::MatMul(attn_.data(), w.wo.data(), h_.data(), total, qd, hidden);
    kernels::AddInPlace(x_.data(), h_.data(), total * hidden);
    kernels::RmsNorm(x_.data(), w.mlp_norm.data(), h_.data(), total, hidden, config_.rms_eps);
    const size_t ff = config_.intermediate;
    kernels::MatMul(h_.data(), w.w_gate.data(), ff_gate_.data(), total, hidden, ff);
    kernels::MatMul(h_.data(), w.w_up.data(), ff_up_.data(), total, hidden, ff);
    kernels::SiluMul(ff_gate_.data(), ff_up_.data(), ff_gate_.data(), total * ff);
    kernels::MatMul(ff_gate_.data(), w.w_down.data(), h_.data(), total, ff, hidden);
    kernels::AddInPlace(x_.data(), h_.data(), total * hidden);
  }
  // The rows whose logits are wanted, normed into h_, then one projection.
  size_t out_rows = 0;
  row = 0;
  for (const SeqInput& s : seqs) {
    const size_t n = s.tokens.size();
    const size_t first = all_positions ? 0 : n - 1;
    for (size_t i = first; i < n; ++i)
      std::memcpy(&h_[out_rows++ * hidden], &x_[(row + i) * hidden], hidden * sizeof(float));
    row += n;
  }
  kernels::RmsNorm(h_.data(), weights_.final_norm.data(), h_.data(), out_rows, hidden,
                   config_.rms_eps);
  logits.resize(out_rows * vocab);
  kernels::MatMul(h_.data(), weights_.lm_head.data(), logits.data(), out_rows, hidden, vocab);
}

void ModelRunner::AttentionLayer(size_t l, std::span<const SeqInput> seqs) {
  const LayerWeights& w = weights_.layers[l];
  const LayerConfig& layer = config_.layers[l];
  const bool share = layer.kind == LKind::kKvShare;
  const size_t target = share ? static_cast<size_t>(layer.share_from) : l;
  const size_t hidden = config_.hidden, hd = config_.head_dim;
  const size_t qd = config_.num_heads * hd, kvd = config_.num_kv_heads * hd;
  const size_t stride = qd + 2 * kvd;
  size_t total = 0;
  for (const SeqInput& s : seqs) total += s.tokens.size();
  float* qkv = qkv_.data();
  kernels::MatMul(h_.data(), w.wq.data(), qkv, total, hidden, qd, 0, stride);
  kernels::ApplyRope(qkv, stride, total, config_.num_heads, hd, positions_.data(),
                     config_.rope_theta);
  if (!share) {
    kernels::MatMul(h_.data(), w.wk.data(), qkv + qd, total, hidden, kvd, 0, stride);
    kernels::MatMul(h_.data(), w.wv.data(), qkv + qd + kvd, total, hidden, kvd, 0, stride);
    kernels::ApplyRope(qkv + qd, stride, total, config_.num_kv_heads, hd, positions_.data(),
                       config_.rope_theta);
  }
  const kernels::PagedLayer paged = PagedFor(target);
  const kernels::AttentionMask mask = MaskOf(config_.layers[target]);
  const size_t group = static_cast<size_t>(layout_.layers[target].group);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  size_t row = 0;
  for (const SeqInput& s : seqs) {
    const std::vector<BlockId>& table = (*s.tables)[group];
    const size_t n = s.tokens.size();
    float* base = qkv + row * stride;
    if (!share) kernels::WriteKv(paged, table, s.start_pos, n, base + qd, base + qd + kvd, stride);
    kernels::PagedAttention(paged, table, base, stride, n, s.start_pos, config_.num_heads, mask,
                            scale, attn_.data() + row * qd, qd);
    row += n;
  }
}

void ModelRunner::StateLayer(size_t l, std::span<const SeqInput> seqs) {
  const LayerWeights& w = weights_.layers[l];
  const size_t hidden = config_.hidden, hd = config_.head_dim, heads = config_.num_heads;
  const size_t qd = heads * hd;
  const size_t stride = 3 * qd + heads;
  size_t total = 0;
  for (const SeqInput& s : seqs) total += s.tokens.size();
  float* qkv = qkv_.data();
  kernels::MatMul(h_.data(), w.wq.data(), qkv, total, hidden, qd, 0, stride);
  kernels::MatMul(h_.data(), w.wk.data(), qkv + qd, total, hidden, qd, 0, stride);
  kernels::MatMul(h_.data(), w.wv.data(), qkv + 2 * qd, total, hidden, qd, 0, stride);
  kernels::MatMul(h_.data(), w.wgate_state.data(), qkv + 3 * qd, total, hidden, heads, 0, stride);
  for (size_t r = 0; r < total; ++r)
    for (size_t h = 0; h < heads; ++h) qkv[r * stride + 3 * qd + h] += config_.state_gate_bias;

  const KvLayout::LayerPlace& place = layout_.layers[l];
  const size_t bs = layout_.groups[place.group].block_size;
  const size_t state_floats = config_.StateFloats();
  float* state = state_.data();
  size_t row = 0;
  for (const SeqInput& s : seqs) {
    const std::vector<BlockId>& table = (*s.tables)[place.group];
    const size_t n = s.tokens.size();
    // The state after start_pos tokens: the snapshot (or running state) in the block that
    // holds token start_pos - 1.
    if (s.start_pos == 0) {
      std::fill(state, state + state_floats, 0.0f);
    } else {
      const BlockId from = table[(s.start_pos - 1) / bs];
      assert(from != kNullBlock);
      std::memcpy(state, &pool_[from * layout_.page_floats + place.offset],
                  state_floats * sizeof(float));
    }
    // Scan block by block, leaving each block's end state in it: the snapshot a later request
    // starts from when this block is a prefix-cache hit.
    for (size_t t = s.start_pos; t < s.start_pos + n;) {
      const size_t end = std::min(s.start_pos + n, (t / bs + 1) * bs);
      float* base = qkv + (row + t - s.start_pos) * stride;
      kernels::StateScan(state, base, base + qd, base + 2 * qd, stride, base + 3 * qd, stride,
                         end - t, static_cast<uint32_t>(heads), static_cast<uint32_t>(hd),
                         attn_.data() + (row + t - s.start_pos) * qd, qd);
      const BlockId to = table[(end - 1) / bs];
      assert(to != kNullBlock);
      std::memcpy(&pool_[to * layout_.page_floats + place.offset], state,
                  state_floats * sizeof(float));
      t = end;
    }
    row += n;
  }
}

}  // namespace kvstash::engine
