#pragma once

// Runs a model over the paged KV cache: the layout of layers onto KV-cache groups and pages,
// and the forward pass of one engine step (several requests, each a run of new tokens after
// its computed ones).

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <unordered_map>
#include <vector>

#include "kvstash/common/status.h"
#include "kvstash/engine/cache_hit.h"
#include "kvstash/engine/model.h"
#include "kvstash/kernels/device.h"
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
//
// With swa_ring, a sliding-window layer keeps each request's KV in place, in a ring of its
// window's W tokens owned by the runner (as some accelerators require), not in the pool: its
// group is marked `ring` and its pool blocks only receive copies of the blocks the prefix cache
// keeps, in the layout above, so that hits work as for a sliding window kept in the pool.
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
  static Result<KvLayout> Build(const ModelConfig& config, uint32_t block_size, uint32_t attn_pack,
                                bool swa_ring = false);
  size_t page_bytes() const { return page_floats * sizeof(float); }
};

// One request's share of a step: `tokens` are its tokens at positions [start_pos, start_pos +
// tokens.size()); `tables` its block table per group, covering them. `request` keys its rings
// (swa_ring layouts; distinct among a step's sequences): a step of a request the runner holds
// no rings for starts fresh ones, filled from the table's blocks (a prefix-cache hit) when
// start_pos > 0.
struct SeqInput {
  std::span<const uint32_t> tokens;
  size_t start_pos = 0;
  const std::vector<std::vector<BlockId>>* tables = nullptr;
  RequestId request = 0;
};

// Owns the weights, the paged KV pool and the rings of ring layers (KvLayout's swa_ring), all in
// the memory of its device (kernels::Device: the CPU, or a GPU with "cuda"), where the forward
// pass runs. Not thread-safe: one step at a time.
//
// A connector reads and writes pages on the host: host_pool() is the pool itself on a device
// whose memory is host memory, else a host mirror (pinned) that PagesToHost and PagesToDevice
// keep in step with the pool, page by page, when asked.
//
// A ring layer's step, per request: a step buffer (runner-owned scratch) holds the positions
// [max(0, s - W + 1), s + n) in the pool's page layout behind a synthetic block table (null
// before the window): the old ones from the ring, the new ones written as to the pool; the
// paged attention kernel reads it as it would the pool (the same keys in the same order, so
// the same floats). A KV-sharing layer of a ring layer reads that buffer. Afterwards the new
// positions go to the ring, and each block completed in the step is copied to its pool block
// when its table entry is not null (a block the manager caches).
class ModelRunner {
 public:
  // `device` null: the CPU. The weights are copied to a device whose memory is not the host's.
  // ResourceExhausted when the device refuses the pool, its mirror or the weights.
  static Result<ModelRunner> Create(ModelConfig config, ModelWeights weights, KvLayout layout,
                                    size_t num_blocks,
                                    std::shared_ptr<kernels::Device> device = nullptr);

  const ModelConfig& config() const { return config_; }
  const KvLayout& layout() const { return layout_; }
  size_t num_blocks() const { return num_blocks_; }
  kernels::Device& device() { return *device_; }
  // The pool in device memory: num_blocks pages of layout().page_floats floats.
  float* device_pool() { return pool_.data(); }
  // The pages a connector moves (see the class comment), and whether they are the pool itself.
  std::span<float> host_pool() { return {host_pool_, num_blocks_ * layout_.page_floats}; }
  bool host_pool_is_pool() const { return host_pool_ == pool_.data(); }
  // Copies these pages pool -> host_pool() once the steps run so far wrote them, and returns
  // when they are there; host_pool() -> pool, before the next step reads them. No-ops when
  // host_pool() is the pool. Internal naming the device's error.
  Status PagesToHost(std::span<const uint32_t> blocks);
  Status PagesToDevice(std::span<const uint32_t> blocks);

  // Runs one step. `logits` receives vocab_size floats per sequence for its last token, or,
  // with all_positions, for each of its tokens (sequence after sequence). Internal naming the
  // device's error when the device failed (a GPU fault: nothing later on it can be trusted).
  Status Forward(std::span<const SeqInput> seqs, std::vector<float>& logits,
                 bool all_positions = false);

  // Gives back the request's rings (it finished, failed or was preempted): its next step, if
  // any, starts fresh ones. No-op for a request without rings.
  void ReleaseRequest(RequestId id);
  // Requests holding rings, and the floats of one request's rings (all ring layers).
  size_t num_rings() const { return ring_slot_of_.size(); }
  size_t ring_floats_per_request() const { return ring_slot_floats_; }

 private:
  struct RingLayer {
    size_t layer = 0;
    uint32_t window = 0;
    size_t offset = 0;  // floats from a request's ring slot to this layer's ring
  };
  ModelRunner(ModelConfig config, ModelWeights weights, KvLayout layout, size_t num_blocks,
              std::shared_ptr<kernels::Device> device);
  // The device memory: pool, host mirror, weights.
  Status Init();
  void AttentionLayer(size_t l, std::span<const SeqInput> seqs);
  void RingAttentionLayer(size_t l, size_t ring, std::span<const SeqInput> seqs);
  void StateLayer(size_t l, std::span<const SeqInput> seqs);
  kernels::PagedLayer PagedFor(size_t l) const;
  // Ring slots of this step's requests, and the step buffers' block tables.
  Status PrepareRings(std::span<const SeqInput> seqs);
  kernels::PagedLayer StepBufferLayer() const;
  // A ring's step-buffer table for one sequence: on the host, and staged on the device.
  std::span<const uint32_t> StepTable(size_t ring, size_t seq) const;
  const uint32_t* StagedStepTable(size_t ring, size_t seq) const;
  // A weight tensor in device memory.
  const float* W(const std::vector<float>& host) const;

  // First: the buffers below give their memory back to it.
  std::shared_ptr<kernels::Device> device_;
  ModelConfig config_;
  ModelWeights weights_;
  KvLayout layout_;
  size_t num_blocks_;
  // Weights copied to the device, by the host tensor's data (empty when the device's memory is
  // the host's).
  std::vector<kernels::DeviceBuffer> weight_buffers_;
  std::unordered_map<const float*, const float*> device_weight_;
  kernels::DeviceBuffer pool_;
  float* host_pool_ = nullptr;  // pool_.data(), or host_mirror_
  std::unique_ptr<float[], std::function<void(float*)>> host_mirror_;
  // Scratch, grown to the largest step seen: no allocation per token.
  kernels::DeviceBuffer x_, h_, qkv_, attn_, ff_gate_, ff_up_, state_, logits_;
  std::vector<uint32_t> positions_, tokens_;
  // This step's staged arrays: positions, tokens, and each sequence's table per group
  // ([seq * groups + group]).
  const uint32_t* staged_positions_ = nullptr;
  std::vector<const uint32_t*> staged_tables_;
  const uint32_t* staged_step_tables_ = nullptr;

  // Rings: one slot of ring_slot_floats_ per request, each ring layer's W keys then W values
  // at its offset (position p at row p % W). Slots are reused, so a request costs no
  // allocation past the arena's high-water mark.
  std::vector<RingLayer> ring_layers_;
  std::vector<int32_t> ring_of_layer_;  // per layer: its ring layer (a KV-sharing layer its
                                        // target's), or -1
  size_t ring_slot_floats_ = 0;
  kernels::DeviceBuffer ring_arena_;
  uint32_t num_ring_slots_ = 0;
  std::vector<uint32_t> free_ring_slots_;
  std::unordered_map<RequestId, uint32_t> ring_slot_of_;
  // This step: per sequence its slot and whether the slot is new; the step buffers (page 0
  // unused, so that a table entry 0 stays the null block) and their tables, ring-major.
  std::vector<uint32_t> step_slot_;
  std::vector<uint8_t> step_fresh_;
  size_t step_page_floats_ = 0;
  kernels::DeviceBuffer step_pages_;
  std::vector<uint32_t> step_tables_;
  std::vector<size_t> step_table_at_;  // [ring * seqs + seq], one past the end last
};

}  // namespace kvstash::engine
