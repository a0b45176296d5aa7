#include "kvstash/engine/model_runner.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstring>

#include "kvstash/common/logging.h"

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

// Grows with NaN: a read of ring or step-buffer memory never written shows up in the logits
// instead of passing as zeros.
Status GrowPoisoned(kernels::DeviceBuffer& v, size_t n) { return v.Grow(n, std::nanf("")); }

}  // namespace

Result<KvLayout> KvLayout::Build(const ModelConfig& config, uint32_t block_size, uint32_t attn_pack,
                                 bool swa_ring) {
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
  if (block_size % attn_pack != 0) {
    return InvalidArgumentError("block size {} is not a multiple of attn-pack {}", block_size,
                                attn_pack);
  }
  if (block_size < min_for_state) {
    return InvalidArgumentError(
        "block size {} gives pages of {} floats, but a state of model '{}' needs {}: use a block "
        "size of at least {}",
        block_size, size_t{block_size} * kv_tok, config.name, state, min_for_state);
  }
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
        new_group({SKind::kSlidingWindow, block_size, l.window, 0, swa_ring});
        break;
      case LKind::kChunkedLocal:
        if (l.chunk % block_size != 0) {
          return InvalidArgumentError(
              "chunk {} of a chunked-local layer is not a multiple of the "
              "block size {}",
              l.chunk, block_size);
        }
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

Result<ModelRunner> ModelRunner::Create(ModelConfig config, ModelWeights weights, KvLayout layout,
                                        size_t num_blocks,
                                        std::shared_ptr<kernels::Device> device) {
  if (device == nullptr) {
    KVSTASH_ASSIGN_OR_RETURN(device, kernels::MakeDevice("cpu"));
  }
  ModelRunner runner(std::move(config), std::move(weights), std::move(layout), num_blocks,
                     std::move(device));
  KVSTASH_RETURN_IF_ERROR(runner.Init());
  return runner;
}

ModelRunner::ModelRunner(ModelConfig config, ModelWeights weights, KvLayout layout,
                         size_t num_blocks, std::shared_ptr<kernels::Device> device)
    : device_(std::move(device)),
      config_(std::move(config)),
      weights_(std::move(weights)),
      layout_(std::move(layout)),
      num_blocks_(num_blocks) {}

Status ModelRunner::Init() {
  kernels::Device* d = device_.get();
  for (kernels::DeviceBuffer* b : {&pool_, &x_, &h_, &qkv_, &attn_, &ff_gate_, &ff_up_, &state_,
                                   &logits_, &ring_arena_, &step_pages_}) {
    *b = kernels::DeviceBuffer(d);
  }
  // In device memory apart from the host, NaN: a page read before anything wrote it (a load
  // that did not reach the device) shows up in the logits instead of passing as zeros.
  KVSTASH_RETURN_IF_ERROR(
      pool_.Grow(num_blocks_ * layout_.page_floats, d->HostAccessible() ? 0.0f : std::nanf("")));
  if (d->HostAccessible()) {
    host_pool_ = pool_.data();
  } else {
    const size_t n = num_blocks_ * layout_.page_floats;
    KVSTASH_ASSIGN_OR_RETURN(float* mirror, d->AllocateHost(n));
    host_mirror_ = {mirror, [device = device_](float* p) { device->FreeHost(p); }};
    host_pool_ = host_mirror_.get();
    std::fill(host_pool_, host_pool_ + n, std::nanf(""));  // so is a store of a stale page
    auto upload = [&](const std::vector<float>& v) -> Status {
      if (v.empty()) return Status::OK();
      kernels::DeviceBuffer b(d);
      KVSTASH_RETURN_IF_ERROR(b.Grow(v.size()));
      d->Upload(b.data(), v.data(), v.size());
      device_weight_[v.data()] = b.data();
      weight_buffers_.push_back(std::move(b));
      return Status::OK();
    };
    KVSTASH_RETURN_IF_ERROR(upload(weights_.embed));
    KVSTASH_RETURN_IF_ERROR(upload(weights_.final_norm));
    KVSTASH_RETURN_IF_ERROR(upload(weights_.lm_head));
    for (const LayerWeights& w : weights_.layers) {
      for (const std::vector<float>* v : {&w.attn_norm, &w.wq, &w.wk, &w.wv, &w.wgate_state, &w.wo,
                                          &w.mlp_norm, &w.w_gate, &w.w_up, &w.w_down}) {
        KVSTASH_RETURN_IF_ERROR(upload(*v));
      }
    }
  }
  const size_t kvd = size_t{config_.num_kv_heads} * config_.head_dim;
  ring_of_layer_.assign(config_.layers.size(), -1);
  for (size_t l = 0; l < config_.layers.size(); ++l) {
    const LayerConfig& layer = config_.layers[l];
    const int32_t group = layout_.layers[l].group;
    if (group < 0 || !layout_.groups[group].ring) continue;
    if (layer.kind == LKind::kKvShare) {
      ring_of_layer_[l] = ring_of_layer_[layer.share_from];
      continue;
    }
    ring_of_layer_[l] = static_cast<int32_t>(ring_layers_.size());
    ring_layers_.push_back({l, layer.window, ring_slot_floats_});
    ring_slot_floats_ += 2 * size_t{layer.window} * kvd;
    step_page_floats_ = 2 * size_t{layout_.groups[group].block_size} * kvd;
  }
  return Status::OK();
}

const float* ModelRunner::W(const std::vector<float>& host) const {
  if (device_weight_.empty()) return host.data();
  auto it = device_weight_.find(host.data());
  assert(it != device_weight_.end());
  return it->second;
}

Status ModelRunner::PagesToHost(std::span<const uint32_t> blocks) {
  if (host_pool_is_pool() || blocks.empty()) return Status::OK();
  for (uint32_t b : blocks) {
    if (b >= num_blocks_) return InvalidArgumentError("block {} of a pool of {}", b, num_blocks_);
  }
  return device_->PagesToHost(pool_.data(), host_pool_, layout_.page_floats, blocks);
}

Status ModelRunner::PagesToDevice(std::span<const uint32_t> blocks) {
  if (host_pool_is_pool() || blocks.empty()) return Status::OK();
  for (uint32_t b : blocks) {
    if (b >= num_blocks_) return InvalidArgumentError("block {} of a pool of {}", b, num_blocks_);
  }
  return device_->PagesToDevice(pool_.data(), host_pool_, layout_.page_floats, blocks);
}

void ModelRunner::ReleaseRequest(RequestId id) {
  auto it = ring_slot_of_.find(id);
  if (it == ring_slot_of_.end()) return;
  free_ring_slots_.push_back(it->second);
  ring_slot_of_.erase(it);
}

Status ModelRunner::PrepareRings(std::span<const SeqInput> seqs) {
  step_slot_.resize(seqs.size());
  step_fresh_.resize(seqs.size());
  for (size_t i = 0; i < seqs.size(); ++i) {
    auto [it, fresh] = ring_slot_of_.try_emplace(seqs[i].request, 0);
    if (fresh) {
      if (free_ring_slots_.empty()) {
        it->second = num_ring_slots_++;
        KVSTASH_RETURN_IF_ERROR(GrowPoisoned(ring_arena_, num_ring_slots_ * ring_slot_floats_));
      } else {
        it->second = free_ring_slots_.back();
        free_ring_slots_.pop_back();
      }
    }
    step_slot_[i] = it->second;
    step_fresh_[i] = fresh;
  }
  // Each (ring layer, sequence) gets pages for the blocks of [first key of s, s + n); the
  // entries before are null and never read (the mask starts at the window).
  step_tables_.clear();
  step_table_at_.clear();
  uint32_t next_page = 1;
  for (const RingLayer& ring : ring_layers_) {
    const size_t bs = layout_.groups[layout_.layers[ring.layer].group].block_size;
    const kernels::AttentionMask mask = MaskOf(config_.layers[ring.layer]);
    for (const SeqInput& s : seqs) {
      step_table_at_.push_back(step_tables_.size());
      const size_t end = s.start_pos + s.tokens.size();
      const size_t first_block = mask.FirstKey(s.start_pos) / bs;
      const size_t blocks = (end + bs - 1) / bs;
      step_tables_.resize(step_tables_.size() + first_block, 0);
      for (size_t b = first_block; b < blocks; ++b) step_tables_.push_back(next_page++);
    }
  }
  step_table_at_.push_back(step_tables_.size());
  staged_step_tables_ = device_->Stage(step_tables_);
  return GrowPoisoned(step_pages_, next_page * step_page_floats_);
}

kernels::PagedLayer ModelRunner::StepBufferLayer() const {
  kernels::PagedLayer paged;
  paged.pool = step_pages_.data();
  paged.page_floats = step_page_floats_;
  paged.layer_offset = 0;
  paged.block_size = static_cast<uint32_t>(step_page_floats_ / config_.KvFloatsPerToken());
  paged.num_kv_heads = config_.num_kv_heads;
  paged.head_dim = config_.head_dim;
  return paged;
}

std::span<const uint32_t> ModelRunner::StepTable(size_t ring, size_t seq) const {
  const size_t at = ring * step_slot_.size() + seq;
  return std::span<const uint32_t>(step_tables_)
      .subspan(step_table_at_[at], step_table_at_[at + 1] - step_table_at_[at]);
}

const uint32_t* ModelRunner::StagedStepTable(size_t ring, size_t seq) const {
  return staged_step_tables_ + step_table_at_[ring * step_slot_.size() + seq];
}

kernels::PagedLayer ModelRunner::PagedFor(size_t l) const {
  const KvLayout::LayerPlace& place = layout_.layers[l];
  kernels::PagedLayer paged;
  paged.pool = pool_.data();
  paged.page_floats = layout_.page_floats;
  paged.layer_offset = place.offset;
  paged.block_size = layout_.groups[place.group].block_size;
  paged.num_kv_heads = config_.num_kv_heads;
  paged.head_dim = config_.head_dim;
  return paged;
}

Status ModelRunner::Forward(std::span<const SeqInput> seqs, std::vector<float>& logits,
                            bool all_positions) {
  kernels::Device& d = *device_;
  d.BeginStep();
  const size_t hidden = config_.hidden, vocab = config_.vocab_size;
  size_t total = 0;
  for (const SeqInput& s : seqs) total += s.tokens.size();
  const size_t qd = size_t{config_.num_heads} * config_.head_dim;
  KVSTASH_RETURN_IF_ERROR(x_.Grow(total * hidden));
  KVSTASH_RETURN_IF_ERROR(h_.Grow(total * std::max(hidden, qd)));
  KVSTASH_RETURN_IF_ERROR(qkv_.Grow(total * (3 * qd + config_.num_heads)));
  KVSTASH_RETURN_IF_ERROR(attn_.Grow(total * qd));
  KVSTASH_RETURN_IF_ERROR(ff_gate_.Grow(total * config_.intermediate));
  KVSTASH_RETURN_IF_ERROR(ff_up_.Grow(total * config_.intermediate));
  KVSTASH_RETURN_IF_ERROR(state_.Grow(config_.StateFloats()));
  positions_.resize(total);
  tokens_.resize(total);

  // This step's index arrays, on the device once.
  const size_t groups = layout_.groups.size();
  staged_tables_.assign(seqs.size() * groups, nullptr);
  size_t row = 0;
  for (size_t i = 0; i < seqs.size(); ++i) {
    const SeqInput& s = seqs[i];
    for (size_t t = 0; t < s.tokens.size(); ++t, ++row) {
      tokens_[row] = s.tokens[t];
      positions_[row] = static_cast<uint32_t>(s.start_pos + t);
    }
    for (size_t g = 0; g < groups && g < s.tables->size(); ++g) {
      staged_tables_[i * groups + g] = d.Stage((*s.tables)[g]);
    }
  }
  staged_positions_ = d.Stage(positions_);
  const uint32_t* staged_tokens = d.Stage(tokens_);
  if (!ring_layers_.empty()) KVSTASH_RETURN_IF_ERROR(PrepareRings(seqs));

  d.Embed(W(weights_.embed), vocab, hidden, staged_tokens, total, x_.data());
  float* x = x_.data();
  float* h = h_.data();
  for (size_t l = 0; l < config_.layers.size(); ++l) {
    const LayerWeights& w = weights_.layers[l];
    d.RmsNorm(x, W(w.attn_norm), h, total, hidden, config_.rms_eps);
    if (config_.layers[l].kind == LKind::kState) {
      StateLayer(l, seqs);
    } else {
      AttentionLayer(l, seqs);
    }
    d.MatMul(attn_.data(), W(w.wo), h, total, qd, hidden);
    d.AddInPlace(x, h, total * hidden);
    d.RmsNorm(x, W(w.mlp_norm), h, total, hidden, config_.rms_eps);
    const size_t ff = config_.intermediate;
    d.MatMul(h, W(w.w_gate), ff_gate_.data(), total, hidden, ff);
    d.MatMul(h, W(w.w_up), ff_up_.data(), total, hidden, ff);
    d.SiluMul(ff_gate_.data(), ff_up_.data(), ff_gate_.data(), total * ff);
    d.MatMul(ff_gate_.data(), W(w.w_down), h, total, ff, hidden);
    d.AddInPlace(x, h, total * hidden);
  }
  // The rows whose logits are wanted, normed into h_, then one projection.
  size_t out_rows = 0;
  row = 0;
  for (const SeqInput& s : seqs) {
    const size_t n = s.tokens.size();
    const size_t first = all_positions ? 0 : n - 1;
    d.Copy(h + out_rows * hidden, x + (row + first) * hidden, (n - first) * hidden);
    out_rows += n - first;
    row += n;
  }
  d.RmsNorm(h, W(weights_.final_norm), h, out_rows, hidden, config_.rms_eps);
  logits.resize(out_rows * vocab);
  if (d.HostAccessible()) {
    d.MatMul(h, W(weights_.lm_head), logits.data(), out_rows, hidden, vocab);
  } else {
    KVSTASH_RETURN_IF_ERROR(logits_.Grow(out_rows * vocab));
    d.MatMul(h, W(weights_.lm_head), logits_.data(), out_rows, hidden, vocab);
    d.Download(logits.data(), logits_.data(), out_rows * vocab);
  }
  return d.Synchronize();
}

void ModelRunner::AttentionLayer(size_t l, std::span<const SeqInput> seqs) {
  kernels::Device& d = *device_;
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
  d.MatMul(h_.data(), W(w.wq), qkv, total, hidden, qd, 0, stride);
  d.ApplyRope(qkv, stride, total, config_.num_heads, hd, staged_positions_, config_.rope_theta);
  if (!share) {
    d.MatMul(h_.data(), W(w.wk), qkv + qd, total, hidden, kvd, 0, stride);
    d.MatMul(h_.data(), W(w.wv), qkv + qd + kvd, total, hidden, kvd, 0, stride);
    d.ApplyRope(qkv + qd, stride, total, config_.num_kv_heads, hd, staged_positions_,
                config_.rope_theta);
  }
  if (ring_of_layer_[l] >= 0) {
    RingAttentionLayer(l, static_cast<size_t>(ring_of_layer_[l]), seqs);
    return;
  }
  const kernels::PagedLayer paged = PagedFor(target);
  const kernels::AttentionMask mask = MaskOf(config_.layers[target]);
  const size_t group = static_cast<size_t>(layout_.layers[target].group);
  const size_t groups = layout_.groups.size();
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  size_t row = 0;
  for (size_t i = 0; i < seqs.size(); ++i) {
    const SeqInput& s = seqs[i];
    const uint32_t* table = staged_tables_[i * groups + group];
    const size_t table_len = (*s.tables)[group].size();
    const size_t n = s.tokens.size();
    float* base = qkv + row * stride;
    if (!share) {
      d.WriteKv(paged, table, table_len, s.start_pos, n, base + qd, base + qd + kvd, stride);
    }
    d.PagedAttention(paged, table, table_len, base, stride, n, s.start_pos, config_.num_heads, mask,
                     scale, attn_.data() + row * qd, qd);
    row += n;
  }
}

void ModelRunner::RingAttentionLayer(size_t l, size_t ring, std::span<const SeqInput> seqs) {
  kernels::Device& d = *device_;
  const LayerConfig& layer = config_.layers[l];
  const bool share = layer.kind == LKind::kKvShare;
  const RingLayer& rl = ring_layers_[ring];
  const size_t hd = config_.head_dim;
  const size_t qd = config_.num_heads * hd, kvd = config_.num_kv_heads * hd;
  const size_t stride = qd + 2 * kvd;
  const size_t window = rl.window;
  const kernels::PagedLayer pool = PagedFor(rl.layer);
  const kernels::PagedLayer buffer = StepBufferLayer();
  const kernels::AttentionMask mask = MaskOf(config_.layers[rl.layer]);
  const size_t group = static_cast<size_t>(layout_.layers[rl.layer].group);
  const size_t bs = buffer.block_size;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  float* qkv = qkv_.data();
  size_t row = 0;
  for (size_t i = 0; i < seqs.size(); ++i) {
    const SeqInput& s = seqs[i];
    const size_t n = s.tokens.size(), start = s.start_pos, end = start + n;
    const size_t first = mask.FirstKey(start);
    const std::span<const uint32_t> step_table = StepTable(ring, i);
    const uint32_t* staged_step_table = StagedStepTable(ring, i);
    float* base = qkv + row * stride;
    if (!share) {
      float* ring_keys = ring_arena_.data() + step_slot_[i] * ring_slot_floats_ + rl.offset;
      float* ring_values = ring_keys + window * kvd;
      const std::vector<BlockId>& table = (*s.tables)[group];
      if (step_fresh_[i]) {
        // A request's first step after a prefix-cache hit: the hit holds the window's blocks.
        for (size_t p = first; p < start; ++p) {
          const BlockId block = table[p / bs];
          assert(block != kNullBlock);
          d.Copy(ring_keys + p % window * kvd, pool.KeyAt(block, p), kvd);
          d.Copy(ring_values + p % window * kvd, pool.ValueAt(block, p), kvd);
        }
      }
      for (size_t p = first; p < start; ++p) {
        const uint32_t page = step_table[p / bs];
        d.Copy(buffer.KeyAt(page, p), ring_keys + p % window * kvd, kvd);
        d.Copy(buffer.ValueAt(page, p), ring_values + p % window * kvd, kvd);
      }
      d.WriteKv(buffer, staged_step_table, step_table.size(), start, n, base + qd, base + qd + kvd,
                stride);
      // The new positions that stay in the window (the last W of the step's).
      for (size_t p = std::max(start, end > window ? end - window : 0); p < end; ++p) {
        const uint32_t page = step_table[p / bs];
        d.Copy(ring_keys + p % window * kvd, buffer.KeyAt(page, p), kvd);
        d.Copy(ring_values + p % window * kvd, buffer.ValueAt(page, p), kvd);
      }
      // Blocks completed in this step that the manager caches: the pool's layout, so that a
      // hit reads them as a sliding window kept in the pool. Positions before the window (a
      // window shorter than a block) are not there and are never read.
      for (size_t b = start / bs; b < end / bs; ++b) {
        if (table[b] == kNullBlock) continue;
        const size_t from = std::max(b * bs, first);
        const size_t rows = (b + 1) * bs - from;
        d.Copy(pool.KeyAt(table[b], from), buffer.KeyAt(step_table[b], from), rows * kvd);
        d.Copy(pool.ValueAt(table[b], from), buffer.ValueAt(step_table[b], from), rows * kvd);
      }
    }
    d.PagedAttention(buffer, staged_step_table, step_table.size(), base, stride, n, start,
                     config_.num_heads, mask, scale, attn_.data() + row * qd, qd);
    row += n;
  }
}

void ModelRunner::StateLayer(size_t l, std::span<const SeqInput> seqs) {
  kernels::Device& d = *device_;
  const LayerWeights& w = weights_.layers[l];
  const size_t hidden = config_.hidden, hd = config_.head_dim, heads = config_.num_heads;
  const size_t qd = heads * hd;
  const size_t stride = 3 * qd + heads;
  size_t total = 0;
  for (const SeqInput& s : seqs) total += s.tokens.size();
  float* qkv = qkv_.data();
  d.MatMul(h_.data(), W(w.wq), qkv, total, hidden, qd, 0, stride);
  d.MatMul(h_.data(), W(w.wk), qkv + qd, total, hidden, qd, 0, stride);
  d.MatMul(h_.data(), W(w.wv), qkv + 2 * qd, total, hidden, qd, 0, stride);
  d.MatMul(h_.data(), W(w.wgate_state), qkv + 3 * qd, total, hidden, heads, 0, stride);
  d.AddConstant(qkv + 3 * qd, stride, total, heads, config_.state_gate_bias);

  const KvLayout::LayerPlace& place = layout_.layers[l];
  const size_t bs = layout_.groups[place.group].block_size;
  const size_t state_floats = config_.StateFloats();
  float* state = state_.data();
  float* pool = pool_.data();
  size_t row = 0;
  for (const SeqInput& s : seqs) {
    const std::vector<BlockId>& table = (*s.tables)[place.group];
    const size_t n = s.tokens.size();
    // The state after start_pos tokens: the snapshot (or running state) in the block that
    // holds token start_pos - 1.
    if (s.start_pos == 0) {
      d.Fill(state, state_floats, 0.0f);
    } else {
      const BlockId from = table[(s.start_pos - 1) / bs];
      assert(from != kNullBlock);
      d.Copy(state, pool + from * layout_.page_floats + place.offset, state_floats);
    }
    // Scan block by block, leaving each block's end state in it: the snapshot a later request
    // starts from when this block is a prefix-cache hit.
    for (size_t t = s.start_pos; t < s.start_pos + n;) {
      const size_t end = std::min(s.start_pos + n, (t / bs + 1) * bs);
      float* base = qkv + (row + t - s.start_pos) * stride;
      d.StateScan(state, base, base + qd, base + 2 * qd, stride, base + 3 * qd, stride, end - t,
                  static_cast<uint32_t>(heads), static_cast<uint32_t>(hd),
                  attn_.data() + (row + t - s.start_pos) * qd, qd);
      const BlockId to = table[(end - 1) / bs];
      assert(to != kNullBlock);
      d.Copy(pool + to * layout_.page_floats + place.offset, state, state_floats);
      t = end;
    }
    row += n;
  }
}

}  // namespace kvstash::engine
