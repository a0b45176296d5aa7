#pragma once

// What `kvstash bench replay` does per request, shared by the live replay and its in-process
// model so that the two make the same calls: the keys of a request under a cache layout (one
// group of full attention, or a hybrid model's groups), the hit the engine would use from what
// the nodes hold, and the keys it touches and stores, as a connector does (docs/semantics.md
// §7.3, §7.4, §7.6). And the model itself: the trace replayed through block managers,
// sequentially.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvstash/common/block_key.h"
#include "kvstash/common/status.h"
#include "kvstash/store/block_manager.h"
#include "replay_trace.h"

namespace kvstash::bench {

// A replayed block's key: the block id, tagged so that it never meets an engine's keys, in the
// group of the layout it belongs to.
BlockKey ReplayKey(uint64_t id, uint32_t group = 0);

// One KV-cache group of a layout. Every group's block covers the trace's block of tokens and
// takes one node block (vLLM's hybrid allocator gives every group the same page size).
struct LayoutGroup {
  enum class Kind : uint8_t { kFull, kWindow, kState };
  Kind kind = Kind::kFull;
  uint32_t window_tokens = 0;  // kWindow: a sliding window's or a chunk's tokens
};

struct Layout {
  std::string name;
  std::vector<LayoutGroup> groups;

  bool hybrid() const { return groups.size() > 1 || groups[0].kind != LayoutGroup::Kind::kFull; }
};

// "full" (one full-attention group: the trace as it is), "tiny-hybrid", "tiny-state-hybrid",
// "gemma3-like" or "qwen3-next-like"; InvalidArgument naming the choices otherwise.
Result<Layout> ParseLayout(std::string_view name);
std::string LayoutNames();
// The layout's groups as one line ("full + 3 x state").
std::string DescribeLayout(const Layout& layout);

struct ReplaySettings {
  Layout layout;
  uint64_t block_tokens = 512;
  bool store_partial = false;
  // Send no block metadata with a hybrid layout's stores: what a connector that does not say
  // what its blocks are for does (every block stored alike).
  bool group_blind = false;
};

// One request's calls. Lookup() first; then, from the lookup's results, Decide().
class RequestPlan {
 public:
  RequestPlan(const TraceRequest& request, const ReplaySettings& settings);

  // Every key of every group, group by group, positions in order.
  const std::vector<BlockKey>& lookup() const { return lookup_; }

  // From the lookup's results (one per lookup() key; RETRY is not a hit): the hit, the touch,
  // the store and the touch after it.
  void Decide(std::span<const LookupResult> states);

  // The blocks of the hit (the leading run of hits with one full group; the longest hit every
  // group accepts otherwise, docs/semantics.md §7.4) and its tokens.
  size_t hit_blocks() const { return hit_; }
  uint64_t hit_tokens() const;
  // What a group-blind count says: the full-attention group's leading run, in tokens.
  uint64_t blind_tokens() const;
  // Block references and hits, every group's leading run counted: the per-key view.
  size_t block_refs() const { return lookup_.size(); }
  size_t blocks_hit() const { return blocks_hit_; }

  // The lookup's touch (uses): full groups every key, a window or state group its keys from the
  // hit's window on (§7.3), group by group.
  const std::vector<BlockKey>& touch() const { return touch_; }
  // The blocks to store, group by group, positions in order (the client sends them last
  // first), the id each one's content comes from, and what each is for (none with one full
  // group or group_blind; else one per block: its parent, tokens, group kind and window, and
  // whether a later hit is expected to end within its window) and how a node stores it so.
  const std::vector<BlockKey>& store() const { return store_; }
  const std::vector<uint64_t>& store_ids() const { return store_ids_; }
  const std::vector<BlockMeta>& metas() const { return metas_; }
  store::StoreHint hint(size_t i) const {
    return !metas_.empty() && metas_[i].spare() ? store::StoreHint::kSpare
                                                : store::StoreHint::kNormal;
  }
  // The touch after the stores (refreshes): the hit's blocks each group needs.
  const std::vector<BlockKey>& refresh() const { return refresh_; }

 private:
  size_t Position(size_t key_index) const { return key_index % n_; }
  size_t WindowBlocks(const LayoutGroup& g) const;

  const TraceRequest& request_;
  const ReplaySettings& settings_;
  size_t n_ = 0;  // blocks of the request (its hash ids)
  std::vector<BlockKey> lookup_;
  size_t hit_ = 0;
  size_t blind_ = 0;
  size_t blocks_hit_ = 0;
  std::vector<BlockKey> touch_, store_, refresh_;
  std::vector<uint64_t> store_ids_;
  std::vector<BlockMeta> metas_;
};

// What a replay adds up.
struct ReplayCounts {
  uint64_t requests = 0, block_refs = 0, blocks_hit = 0;
  uint64_t tokens = 0, tokens_hit = 0, blind_tokens_hit = 0;

  void Add(const RequestPlan& plan, uint64_t input_length);
  double block_hit_ratio() const;
  double token_hit_ratio() const;
  double blind_token_hit_ratio() const;
};

// Where a key is: the indices of the model's nodes that hold it (its replicas).
using Placement = std::function<void(const BlockKey& key, std::vector<size_t>* nodes)>;

// The trace replayed sequentially through one block manager per node (`nodes`: each one's
// options), with the calls of RequestPlan in the order a node applies them. An error for a
// manager that cannot be made.
Result<ReplayCounts> ReplayModel(const std::vector<TraceRequest>& trace,
                                 std::span<const store::BlockManagerOptions> nodes,
                                 const Placement& place, const ReplaySettings& settings);

// Blocks (keys of every group) the trace would store into a cache that never evicts: its
// working set, what the node sizes of a layout are given as a share of.
uint64_t WorkingSetBlocks(const std::vector<TraceRequest>& trace, const ReplaySettings& settings);

}  // namespace kvstash::bench
