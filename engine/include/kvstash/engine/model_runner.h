#pragma once

// Runs a model over the paged KV cache: the layout of layers onto KV-cache groups and pages,
// and the forward pass of one engine step (several requests, each a run of new tokens after
// its computed ones).

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "kvstash/common/status.h"
#include "kvstash/engine/cache_hit.h"
#include "kvstash/engine/model.h"
#include "kvstash/kernels/paged_attention.h"

namespace kvstash::engine {

// How a model's layers map onto KV-cache groups and pages. Every block of every group is one
// page of `page_floats` floats (one block pool, one page size):
//   - a state layer is a group of its own; a block holds the state snapshot at the block's end,
//     and the state fills (at most) one page;
//   - full-attention layers form groups of `attn_pack` layers that share a page, each layer
//     block_size / attn_pack tokens of it;
//   - a sliding-window or chunked-local layer is a group of its own with block_size tokens;
//   - a KV-sharing layer reads its target layer's group and place.
// block_size (tokens of one attention layer per page) defaults to what makes one layer's page
// as large as a state (16 for the built-ins), or 16 without state layers. State groups snapshot
// at every block boundary of the full-attention groups (block_size / attn_pack).
struct KvLayout {
  struct LayerPlace {
    int32_t group = -1;  // -1: the layer keeps no KV (state layers use their group)
    size_t offset = 0;   // floats from a page's start to the layer's keys (or state)
  };
  uint32_t block_size = 0;
  uint32_t attn_pack = 1;
  size_t page_floats = 0;
  std::vector<AttentionSpec> groups;
  std::vector<LayerPlace> layers;

  // InvalidArgument when block_size is not a multiple of attn_pack, or its page cannot hold a
  // state (the message gives the smallest block size that can).
  static Result<KvLayout> Build(const ModelConfig& config, uint32_t block_size, uint32_t attn_pack);
  size_t page_bytes() const { return page_floats * sizeof(float); }
};

// One request's share of a step: `tokens` are its tokens at positions [start_pos, start_pos +
// tokens.size()); `tables` its block table per group, covering them.
struct SeqInput {
  std::span<const uint32_t> tokens;
  size_t start_pos = 0;
  const std::vector<std::vector<BlockId>>* tables = nullptr;
};

// Owns the weights and the paged KV pool. Not thread-safe: one step at a time.
class ModelRunner {
 public:
  ModelRunner(ModelConfig config, ModelWeights weights, KvLayout layout, size_t num_blocks);

  const ModelConfig& config() const { return config_; }
  const KvLayout& layout() const { return layout_; }
  size_t num_blocks() const { return num_blocks_; }
  // The pool: num_blocks pages of layout().page_floats floats (for block movement).
  std::span<float> pool() { return pool_; }

  // Runs one step. `logits` receives vocab_size floats per sequence for its last token, or,
  // with all_positions, for each of its tokens (sequence after sequence).
  void Forward(std::span<const SeqInput> seqs, std::vector<float>& logits,
               bool all_positions = false);

 private:
  void AttentionLayer(size_t l, std::span<const SeqInput> seqs);
  void StateLayer(size_t l, std::span<const SeqInput> seqs);
  kernels::PagedLayer PagedFor(size_t l) const;

  ModelConfig config_;
  ModelWeights weights_;
  KvLayout layout_;
  size_t num_blocks_;
  std::vector<float> pool_;
  // Scratch, grown to the largest step seen: no allocation per token.
  std::vector<float> x_, h_, qkv_, attn_, ff_gate_, ff_up_, state_;
  std::vector<uint32_t> positions_;
};

}  // namespace kvstash::engine
