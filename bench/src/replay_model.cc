#include "replay_model.h"

#include <fmt/format.h>

#include <algorithm>
#include <memory>
#include <unordered_set>

#include "kvstash/common/hash.h"

namespace kvstash::bench {
namespace {

using Kind = LayoutGroup::Kind;

constexpr uint64_t kReplayTag = 0x6b76737265706c79ULL;  // "kvsreply"

LayoutGroup Full() { return {Kind::kFull, 0}; }
LayoutGroup Window(uint32_t tokens) { return {Kind::kWindow, tokens}; }
LayoutGroup State() { return {Kind::kState, 0}; }

// The built-in layouts, one group per page of equal bytes (vLLM groups a hybrid model's layers
// so that every group's page has the same size).
std::vector<Layout> Layouts() {
  std::vector<Layout> layouts;
  layouts.push_back({"full", {Full()}});
  // kvstash-engine's tiny models, one group per cached layer (a state is one page there):
  // tiny-hybrid's full, sliding-window (32) and chunked-local (64) layers (its sixth layer
  // shares another's KV and caches nothing); tiny-state-hybrid's 4 full and 3 state layers.
  layouts.push_back({"tiny-hybrid", {Full(), Window(32), Window(64), Full(), Window(32)}});
  layouts.push_back(
      {"tiny-state-hybrid", {Full(), State(), Full(), State(), Full(), State(), Full()}});
  // Gemma 3: five sliding-window layers (1,024 tokens) to one full-attention layer.
  layouts.push_back(
      {"gemma3-like",
       {Full(), Window(1024), Window(1024), Window(1024), Window(1024), Window(1024)}});
  // Qwen3-Next: three linear-attention (state) layers to one full-attention layer; a layer's
  // state is about the size of 512 tokens of an attention layer's KV.
  layouts.push_back({"qwen3-next-like", {Full(), State(), State(), State()}});
  return layouts;
}

// The blocks of `r` a connector stores: those input_length fills, or every one with
// store_partial.
size_t StoredBlocks(const TraceRequest& r, const ReplaySettings& settings) {
  if (settings.store_partial) return r.hash_ids.size();
  return static_cast<size_t>(
      std::min<uint64_t>(r.hash_ids.size(), r.input_length / settings.block_tokens));
}

}  // namespace

BlockKey ReplayKey(uint64_t id, uint32_t group) {
  BlockKey key{Hash128{id, kReplayTag}, 0};
  key.group = group;
  return key;
}

Result<Layout> ParseLayout(std::string_view name) {
  for (const Layout& layout : Layouts()) {
    if (layout.name == name) return layout;
  }
  return InvalidArgumentError("unknown layout '{}' (expected {})", name, LayoutNames());
}

std::string LayoutNames() {
  std::string names;
  for (const Layout& layout : Layouts()) {
    if (!names.empty()) names += ", ";
    names += layout.name;
  }
  return names;
}

std::string DescribeLayout(const Layout& layout) {
  std::string out;
  for (size_t i = 0; i < layout.groups.size();) {
    size_t same = 1;
    while (i + same < layout.groups.size() &&
           layout.groups[i + same].kind == layout.groups[i].kind &&
           layout.groups[i + same].window_tokens == layout.groups[i].window_tokens) {
      ++same;
    }
    const LayoutGroup& g = layout.groups[i];
    std::string kind = g.kind == Kind::kFull    ? "full"
                       : g.kind == Kind::kState ? "state"
                                                : fmt::format("window {}", g.window_tokens);
    if (!out.empty()) out += " + ";
    out += same > 1 ? fmt::format("{} x {}", same, kind) : kind;
    i += same;
  }
  return out;
}

RequestPlan::RequestPlan(const TraceRequest& request, const ReplaySettings& settings)
    : request_(request), settings_(settings), n_(request.hash_ids.size()) {
  const size_t groups = settings.layout.groups.size();
  lookup_.reserve(n_ * groups);
  for (size_t g = 0; g < groups; ++g) {
    for (uint64_t id : request.hash_ids) lookup_.push_back(ReplayKey(id, static_cast<uint32_t>(g)));
  }
}

size_t RequestPlan::WindowBlocks(const LayoutGroup& g) const {
  if (g.kind == Kind::kState) return 1;
  const uint64_t bt = settings_.block_tokens;
  return static_cast<size_t>(std::max<uint64_t>(1, (g.window_tokens + bt - 1) / bt));
}

void RequestPlan::Decide(std::span<const LookupResult> states) {
  const std::vector<LayoutGroup>& groups = settings_.layout.groups;
  const uint64_t bt = settings_.block_tokens;
  auto held = [&](size_t g, size_t p) { return states[g * n_ + p] == LookupResult::kHit; };
  // Each group's leading run of hits.
  std::vector<size_t> runs(groups.size(), 0);
  for (size_t g = 0; g < groups.size(); ++g) {
    while (runs[g] < n_ && held(g, runs[g])) ++runs[g];
    blocks_hit_ += runs[g];
  }
  // The hit. One full group: its leading run, as the trace counts it. Otherwise the longest
  // prefix every group accepts, never the last token (§7.4): every full group's blocks, a
  // window group's last window of blocks before the end (or all of them when the hit is
  // shorter than its window), a state group's block at the end.
  size_t prefix = n_;  // every full group's common run
  for (size_t g = 0; g < groups.size(); ++g) {
    if (groups[g].kind == Kind::kFull) prefix = std::min(prefix, runs[g]);
  }
  if (!settings_.layout.hybrid()) {
    hit_ = blind_ = prefix;
  } else {
    const size_t most = std::min<size_t>(
        n_, request_.input_length == 0 ? 0 : static_cast<size_t>((request_.input_length - 1) / bt));
    blind_ = std::min(runs[0], most);
    hit_ = 0;
    for (size_t length = std::min(prefix, most); length > 0 && hit_ == 0; --length) {
      bool accepted = true;
      for (size_t g = 0; g < groups.size() && accepted; ++g) {
        if (groups[g].kind == Kind::kFull) continue;
        const size_t w = WindowBlocks(groups[g]);
        for (size_t p = length > w ? length - w : 0; p < length && accepted; ++p) {
          accepted = held(g, p);
        }
      }
      if (accepted) hit_ = length;
    }
  }
  // Touch, store and refresh, group by group.
  const size_t stored = StoredBlocks(request_, settings_);
  // Where a later request's hit may end: after this request's last stored block, and where its
  // prefix left what the nodes held when that is beyond its own hit (a branch).
  std::vector<size_t> ends;
  if (stored > 0) ends.push_back(stored - 1);
  if (prefix > hit_ && prefix <= stored && prefix >= 1) ends.push_back(prefix - 1);
  for (size_t g = 0; g < groups.size(); ++g) {
    const auto group = static_cast<uint32_t>(g);
    const bool full = groups[g].kind == Kind::kFull;
    const size_t w = full ? 0 : WindowBlocks(groups[g]);
    const size_t from = full ? 0 : (hit_ > w ? hit_ - w : 0);
    for (size_t p = from; p < n_; ++p) touch_.push_back(ReplayKey(request_.hash_ids[p], group));
    for (size_t p = hit_; p < stored; ++p) {
      store_.push_back(ReplayKey(request_.hash_ids[p], group));
      store_ids_.push_back(request_.hash_ids[p]);
      if (settings_.group_blind || !settings_.layout.hybrid()) continue;
      BlockMeta meta;
      if (p > 0) meta.parent = ReplayKey(request_.hash_ids[p - 1], group).hash;
      meta.tokens = static_cast<uint32_t>(bt);
      meta.kind = full                             ? BlockMeta::Kind::kFull
                  : groups[g].kind == Kind::kState ? BlockMeta::Kind::kState
                                                   : BlockMeta::Kind::kSlidingWindow;
      meta.window_blocks = static_cast<uint32_t>(w);
      for (size_t end : ends) meta.at_hit_end = meta.at_hit_end || (p <= end && p + w > end);
      metas_.push_back(meta);
    }
    for (size_t p = from; p < hit_; ++p) {
      refresh_.push_back(ReplayKey(request_.hash_ids[p], group));
    }
  }
}

uint64_t RequestPlan::hit_tokens() const {
  return std::min<uint64_t>(request_.input_length, hit_ * settings_.block_tokens);
}

uint64_t RequestPlan::blind_tokens() const {
  return std::min<uint64_t>(request_.input_length, blind_ * settings_.block_tokens);
}

void ReplayCounts::Add(const RequestPlan& plan, uint64_t input_length) {
  ++requests;
  block_refs += plan.block_refs();
  blocks_hit += plan.blocks_hit();
  tokens += input_length;
  tokens_hit += plan.hit_tokens();
  blind_tokens_hit += plan.blind_tokens();
}

namespace {
double Ratio(uint64_t part, uint64_t whole) {
  return whole == 0 ? 0.0 : static_cast<double>(part) / static_cast<double>(whole);
}
}  // namespace

double ReplayCounts::block_hit_ratio() const { return Ratio(blocks_hit, block_refs); }
double ReplayCounts::token_hit_ratio() const { return Ratio(tokens_hit, tokens); }
double ReplayCounts::blind_token_hit_ratio() const { return Ratio(blind_tokens_hit, tokens); }

Result<ReplayCounts> ReplayModel(const std::vector<TraceRequest>& trace,
                                 std::span<const store::BlockManagerOptions> nodes,
                                 const Placement& place, const ReplaySettings& settings) {
  std::vector<std::unique_ptr<store::BlockManager>> managers;
  for (const store::BlockManagerOptions& options : nodes) {
    KVSTASH_ASSIGN_OR_RETURN(auto manager, store::BlockManager::Create(options));
    managers.push_back(std::move(manager));
  }
  std::vector<std::vector<BlockKey>> by_node(managers.size());
  std::vector<size_t> at;
  auto touch = [&](std::span<const BlockKey> keys, store::TouchKind kind) {
    for (auto& keys_of_node : by_node) keys_of_node.clear();
    for (const BlockKey& key : keys) {
      place(key, &at);
      for (size_t n : at) by_node[n].push_back(key);
    }
    for (size_t n = 0; n < managers.size(); ++n) {
      if (!by_node[n].empty()) managers[n]->Touch(by_node[n], kind);
    }
  };
  ReplayCounts counts;
  std::vector<LookupResult> states;
  for (const TraceRequest& r : trace) {
    RequestPlan plan(r, settings);
    states.assign(plan.lookup().size(), LookupResult::kMiss);
    for (size_t i = 0; i < states.size(); ++i) {
      place(plan.lookup()[i], &at);
      for (size_t n : at) {
        if (managers[n]->Lookup(plan.lookup()[i]) == LookupResult::kHit) {
          states[i] = LookupResult::kHit;
          break;
        }
      }
    }
    plan.Decide(states);
    counts.Add(plan, r.input_length);
    touch(plan.touch(), store::TouchKind::kUse);
    // Puts go last key first (NodeClient::Put), to every replica; each prepares one key.
    const std::vector<BlockKey>& keys = plan.store();
    for (size_t i = keys.size(); i-- > 0;) {
      place(keys[i], &at);
      const store::StoreHint hint = plan.hint(i);
      for (size_t n : at) {
        store::BlockManager& m = *managers[n];
        store::StorePlan prepared;
        if (!m.PrepareStore(std::span(&keys[i], 1), &prepared, std::span(&hint, 1)).ok()) continue;
        if (prepared.keys_to_store.empty()) {
          m.Touch(std::span(&keys[i], 1), store::TouchKind::kRefresh);  // the request's use
        } else {
          m.CompleteStore(std::span(&keys[i], 1), true);
        }
      }
    }
    touch(plan.refresh(), store::TouchKind::kRefresh);
  }
  return counts;
}

uint64_t WorkingSetBlocks(const std::vector<TraceRequest>& trace, const ReplaySettings& settings) {
  std::unordered_set<uint64_t> ids;
  for (const TraceRequest& r : trace) {
    const size_t stored = StoredBlocks(r, settings);
    ids.insert(r.hash_ids.begin(), r.hash_ids.begin() + static_cast<ptrdiff_t>(stored));
  }
  return ids.size() * settings.layout.groups.size();
}

}  // namespace kvstash::bench
