#include "scheduler/tracked_requests.h"

#include <algorithm>
#include <unordered_map>
#include <utility>

namespace kvstash::connector {
namespace {

constexpr size_t CeilDiv(size_t a, size_t b) { return (a + b - 1) / b; }

}  // namespace

TrackedRequest& TrackedRequests::Track(RequestId id, bool* created) {
  auto [it, inserted] = requests_.try_emplace(id);
  if (inserted) {
    it->second.id = id;
    it->second.groups.resize(groups_.size());
  }
  if (created != nullptr) *created = inserted;
  return it->second;
}

TrackedRequest* TrackedRequests::Find(RequestId id) {
  auto it = requests_.find(id);
  return it == requests_.end() ? nullptr : &it->second;
}

bool TrackedRequests::AllFinished() const {
  return std::all_of(requests_.begin(), requests_.end(),
                     [](const auto& entry) { return entry.second.finished; });
}

void TrackedRequests::UpdateKeys(TrackedRequest& state, std::span<const BlockHash> hashes) const {
  for (uint32_t g = 0; g < groups_.size(); ++g) {
    // An offloaded block's key is the chained hash of its last hash block: it commits to the
    // whole prefix, so one hash names the block (the GPU prefix cache concatenates them).
    const size_t f = groups_[g].hashes_per_block;
    std::vector<BlockKey>& keys = state.groups[g].keys;
    for (size_t i = keys.size() * f + f - 1; i < hashes.size(); i += f) {
      keys.push_back(BlockKey{hashes[i], g});
    }
  }
}

void TrackedRequests::Touch(const TrackedRequest& state, OffloadManager& manager) const {
  for (size_t g = 0; g < groups_.size(); ++g) {
    std::span<const BlockKey> keys = state.groups[g].keys;
    if (groups_.IsWindow(g)) {
      // Only what a new request with the original prompt needs to hit again (the window before
      // the original hit), plus what was computed since.
      const size_t window = *groups_[g].window_blocks;
      const size_t hit = state.groups[g].num_hit_blocks;
      keys = keys.subspan(std::min(keys.size(), hit > window ? hit - window : 0));
    }
    manager.Touch(keys);
  }
}

void TrackedRequests::ApplySchedule(std::span<const ScheduledRequestView> scheduled,
                                    std::set<GpuBlockId>* allocated) {
  // Per request given new blocks, the length of each window group's table before them.
  std::unordered_map<RequestId, std::vector<size_t>> old_lengths;
  for (const ScheduledRequestView& entry : scheduled) {
    TrackedRequest& state = Track(entry.request.id);
    UpdateKeys(state, entry.request.block_hashes);
    state.num_tokens = entry.request.num_tokens;
    if (entry.resumed_from_preemption) {
      for (TrackedGroup& group : state.groups) group.block_ids.clear();
    }
    if (entry.new_block_ids.empty()) continue;
    std::vector<size_t>& lengths = old_lengths[entry.request.id];
    for (const uint32_t g : groups_.window_groups()) {
      lengths.push_back(state.groups[g].block_ids.size());
    }
    for (size_t g = 0; g < groups_.size(); ++g) {
      const std::vector<GpuBlockId>& added = entry.new_block_ids[g];
      state.groups[g].block_ids.insert(state.groups[g].block_ids.end(), added.begin(), added.end());
      for (const GpuBlockId block : added) {
        if (block != kNullGpuBlock) allocated->insert(block);
      }
    }
  }
  if (groups_.window_groups().empty() || allocated->empty()) return;
  // A window group frees blocks while the request runs. A block it has not stored yet (its store
  // was refused) may have been freed and handed out again in this step; storing it then would
  // store someone else's KV. Forgetting it skips that block like a null one. (Not in the
  // vLLM version docs/semantics.md describes; later versions do this.)
  for (auto& [id, state] : requests_) {
    const auto lengths = old_lengths.find(id);
    for (size_t w = 0; w < groups_.window_groups().size(); ++w) {
      const uint32_t g = groups_.window_groups()[w];
      TrackedGroup& group = state.groups[g];
      const size_t begin = group.next_stored * groups_[g].config.block_size_factor;
      // This step's own new blocks are fresh; only the ones reported before can be stale.
      const size_t end = lengths != old_lengths.end() ? lengths->second[w] : group.block_ids.size();
      for (size_t i = begin; i < end; ++i) {
        if (allocated->contains(group.block_ids[i])) group.block_ids[i] = kNullGpuBlock;
      }
    }
  }
}

Status TrackedRequests::PlanLoad(TrackedRequest& state,
                                 std::span<const std::vector<GpuBlockId>> tables, size_t cached,
                                 bool store_loaded, TransferJob* job,
                                 std::set<GpuBlockId>* allocated) const {
  const size_t computed = state.num_locally_computed_tokens;
  for (size_t g = 0; g < groups_.size(); ++g) {
    const size_t num_gpu_blocks = CeilDiv(cached, groups_[g].config.gpu_block_size);
    if (tables[g].size() < num_gpu_blocks) {
      return InvalidArgumentError("request {}: group {} has {} blocks for {} cached tokens",
                                  state.id, g, tables[g].size(), cached);
    }
    if (state.groups[g].keys.size() < CeilDiv(cached, groups_[g].offloaded_block_size)) {
      return FailedPreconditionError("request {}: group {} has {} keys for {} cached tokens",
                                     state.id, g, state.groups[g].keys.size(), cached);
    }
  }
  for (size_t g = 0; g < groups_.size(); ++g) {
    const OffloadGroupInfo& group = groups_[g];
    TrackedGroup& group_state = state.groups[g];
    const std::span<const GpuBlockId> table = tables[g];
    const size_t num_gpu_blocks = CeilDiv(cached, group.config.gpu_block_size);
    // The first block to load is the first fresh one: the GPU hit's blocks come first, and a null
    // entry after them is a block the group skips (outside its window), as good as computed.
    size_t local = num_gpu_blocks;
    for (size_t i = std::min(computed / group.config.gpu_block_size, num_gpu_blocks);
         i < num_gpu_blocks; ++i) {
      if (table[i] != kNullGpuBlock) {
        local = i;
        break;
      }
    }
    const size_t num_blocks = CeilDiv(cached, group.offloaded_block_size);
    if (local < num_gpu_blocks) {
      const auto first = group_state.keys.begin() + local / group.config.block_size_factor;
      job->keys.insert(job->keys.end(), first, group_state.keys.begin() + num_blocks);
    }
    for (size_t i = local; i < num_gpu_blocks; ++i) {
      job->gpu_blocks.push_back(table[i]);
      // A fresh block may be one a finished request's store still reads from.
      allocated->insert(table[i]);
    }
    job->group_sizes.push_back(static_cast<uint32_t>(num_gpu_blocks - local));
    job->block_indices.push_back(static_cast<uint32_t>(local));
    // The hit prefix is stored already; a request whose KV also goes elsewhere stores it all.
    if (!store_loaded) group_state.next_stored = num_blocks;
  }
  return Status::OK();
}

size_t TrackedRequests::NumStorableBlocks(const TrackedRequest& state, size_t group,
                                          size_t offloadable) const {
  const TrackedGroup& group_state = state.groups[group];
  // Only blocks with a key and all their GPU blocks reported can be stored.
  return std::min({offloadable / groups_[group].offloaded_block_size, group_state.keys.size(),
                   group_state.block_ids.size() / groups_[group].config.block_size_factor});
}

void TrackedRequests::AdvanceStored(TrackedRequest& state, size_t offloadable) const {
  for (size_t g = 0; g < groups_.size(); ++g) {
    TrackedGroup& group_state = state.groups[g];
    group_state.next_stored =
        std::max(group_state.next_stored, NumStorableBlocks(state, g, offloadable));
  }
}

namespace {
BlockMeta::Kind MetaKind(OffloadGroupKind kind) {
  switch (kind) {
    case OffloadGroupKind::kSlidingWindow:
      return BlockMeta::Kind::kSlidingWindow;
    case OffloadGroupKind::kState:
      return BlockMeta::Kind::kState;
    case OffloadGroupKind::kChunkedLocal:
      return BlockMeta::Kind::kChunkedLocal;
    case OffloadGroupKind::kFull:
      break;
  }
  return BlockMeta::Kind::kFull;
}
}  // namespace

StoreCandidates TrackedRequests::CandidatesOf(const TrackedRequest& state,
                                              size_t offloadable) const {
  // The full offloaded blocks not stored yet, per group, but a block whose last GPU block is
  // null (the group skipped it: outside the window, before the state) has no KV.
  StoreCandidates candidates;
  candidates.blocks.resize(groups_.size());
  for (size_t g = 0; g < groups_.size(); ++g) {
    const TrackedGroup& group_state = state.groups[g];
    const size_t f = groups_[g].config.block_size_factor;
    const size_t end = NumStorableBlocks(state, g, offloadable);
    for (size_t i = group_state.next_stored; i < end; ++i) {
      if (group_state.block_ids[i * f + f - 1] == kNullGpuBlock) continue;
      candidates.blocks[g].push_back(i);
      candidates.keys.push_back(group_state.keys[i]);
    }
  }
  return candidates;
}

void TrackedRequests::PlanStore(TrackedRequest& state, const StoreCandidates& candidates,
                                const std::unordered_set<BlockKey>& chosen, size_t offloadable,
                                TransferJob* job, std::vector<GpuBlockId>* full,
                                std::vector<GpuBlockId>* window) const {
  for (size_t g = 0; g < groups_.size(); ++g) {
    const TrackedGroup& group_state = state.groups[g];
    const size_t f = groups_[g].config.block_size_factor;
    std::vector<GpuBlockId>* sources = groups_.IsWindow(g) ? window : full;
    std::optional<size_t> first_block;
    uint32_t group_size = 0;
    // The job's last block of the group: a later request's hit may end there, and so needs the
    // window blocks before it (docs/semantics.md §4b); the window and state blocks before those
    // are stored spare.
    size_t last = 0;
    for (const size_t i : candidates.blocks[g]) {
      if (chosen.contains(group_state.keys[i])) last = i;
    }
    const uint32_t window = groups_[g].window_blocks.value_or(0);
    for (const size_t i : candidates.blocks[g]) {
      if (!chosen.contains(group_state.keys[i])) continue;
      job->keys.push_back(group_state.keys[i]);
      BlockMeta& meta = job->metas.emplace_back();
      if (i > 0) meta.parent = group_state.keys[i - 1].hash;
      meta.tokens = groups_[g].offloaded_block_size;
      meta.kind = MetaKind(groups_[g].config.kind);
      meta.window_blocks = window;
      meta.at_hit_end = i + window > last;
      for (size_t j = i * f; j < i * f + f; ++j) {
        // Null blocks lead (the group skipped them); the worker places the first real one by
        // block_indices.
        const GpuBlockId block = group_state.block_ids[j];
        if (block == kNullGpuBlock) continue;
        if (!first_block.has_value()) first_block = j;
        job->gpu_blocks.push_back(block);
        ++group_size;
        sources->push_back(block);
      }
    }
    job->group_sizes.push_back(group_size);
    job->block_indices.push_back(static_cast<uint32_t>(first_block.value_or(0)));
  }
  AdvanceStored(state, offloadable);
}

void TrackedRequests::Reset() {
  for (auto it = requests_.begin(); it != requests_.end();) {
    TrackedRequest& state = it->second;
    // A finished request was kept only for its jobs, which are forgotten now.
    if (state.finished) {
      it = requests_.erase(it);
      continue;
    }
    for (TrackedGroup& group : state.groups) group.next_stored = 0;
    state.jobs.clear();
    ++it;
  }
}

std::optional<std::vector<size_t>> TrackedRequests::NextStoredBlocks(RequestId id) const {
  auto it = requests_.find(id);
  if (it == requests_.end()) return std::nullopt;
  std::vector<size_t> next;
  for (const TrackedGroup& group : it->second.groups) next.push_back(group.next_stored);
  return next;
}

}  // namespace kvstash::connector
