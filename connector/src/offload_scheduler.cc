#include "kvstash/connector/offload_scheduler.h"

#include <algorithm>
#include <tuple>
#include <utility>

#include "kvstash/common/logging.h"

namespace kvstash::connector {
namespace {

// Signed: the lookup compares differences of token counts that may go below zero.
using Tokens = int64_t;

constexpr Tokens CeilDiv(Tokens a, Tokens b) { return (a + b - 1) / b; }
constexpr size_t CeilDiv(size_t a, size_t b) { return (a + b - 1) / b; }

bool IsWindow(const OffloadGroupInfo& group) { return group.window_blocks.has_value(); }

}  // namespace

CompletedJobs AggregateCompletedJobs(std::span<const CompletedJobs> per_worker) {
  CompletedJobs total;
  for (const CompletedJobs& worker : per_worker) {
    for (const auto& [job, count] : worker) total[job] += count;
  }
  return total;
}

Result<std::unique_ptr<OffloadScheduler>> OffloadScheduler::Create(
    OffloadSchedulerOptions options, std::unique_ptr<OffloadManager> manager) {
  if (manager == nullptr) return InvalidArgumentError("offload scheduler needs a manager");
  if (options.groups.empty()) return InvalidArgumentError("offload scheduler needs a KV group");
  if (options.hash_block_size == 0) return InvalidArgumentError("hash block size is 0");
  if (options.world_size == 0) return InvalidArgumentError("world size is 0");
  std::vector<OffloadGroupInfo> groups;
  for (size_t g = 0; g < options.groups.size(); ++g) {
    const OffloadGroupConfig& config = options.groups[g];
    if (config.gpu_block_size == 0 || config.block_size_factor == 0) {
      return InvalidArgumentError("group {}: GPU block size {} and block size factor {}", g,
                                  config.gpu_block_size, config.block_size_factor);
    }
    OffloadGroupInfo info;
    info.config = config;
    info.offloaded_block_size = config.gpu_block_size * config.block_size_factor;
    if (info.offloaded_block_size % options.hash_block_size != 0) {
      return InvalidArgumentError(
          "group {}: offloaded block of {} tokens is not a multiple of the hash block of {}", g,
          info.offloaded_block_size, options.hash_block_size);
    }
    info.hashes_per_block = info.offloaded_block_size / options.hash_block_size;
    switch (config.kind) {
      case OffloadGroupKind::kFull:
        break;
      case OffloadGroupKind::kSlidingWindow:
      case OffloadGroupKind::kChunkedLocal:
        if (config.window == 0) return InvalidArgumentError("group {}: window of 0 tokens", g);
        info.window_blocks =
            static_cast<uint32_t>(CeilDiv(size_t{config.window}, info.offloaded_block_size));
        break;
      case OffloadGroupKind::kState:
        info.window_blocks = 1;  // the state at the end of the hit is all a state layer reads
        break;
    }
    groups.push_back(info);
  }
  return std::unique_ptr<OffloadScheduler>(
      new OffloadScheduler(std::move(options), std::move(manager), std::move(groups)));
}

OffloadScheduler::OffloadScheduler(OffloadSchedulerOptions options,
                                   std::unique_ptr<OffloadManager> manager,
                                   std::vector<OffloadGroupInfo> groups)
    : options_(std::move(options)), manager_(std::move(manager)), groups_(std::move(groups)) {
  for (uint32_t g = 0; g < groups_.size(); ++g) {
    (IsWindow(groups_[g]) ? window_groups_ : lookup_order_).push_back(g);
  }
  // Widest window first: a narrower window rarely shortens a hit a wider one allowed, so the
  // fixed point is usually reached in one pass. Stable, so equal windows keep group order.
  std::stable_sort(window_groups_.begin(), window_groups_.end(), [&](uint32_t a, uint32_t b) {
    return *groups_[a].window_blocks > *groups_[b].window_blocks;
  });
  lookup_order_.insert(lookup_order_.end(), window_groups_.begin(), window_groups_.end());
}

OffloadScheduler::~OffloadScheduler() = default;

OffloadScheduler::RequestState& OffloadScheduler::StateOf(const OffloadRequestView& request,
                                                          bool* created) {
  auto [it, inserted] = requests_.try_emplace(request.id);
  if (inserted) it->second.groups.resize(groups_.size());
  if (created != nullptr) *created = inserted;
  return it->second;
}

void OffloadScheduler::UpdateKeys(RequestState& state, std::span<const BlockHash> hashes) const {
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

void OffloadScheduler::Touch(const RequestState& state) {
  for (size_t g = 0; g < groups_.size(); ++g) {
    std::span<const BlockKey> keys = state.groups[g].keys;
    if (IsWindow(groups_[g])) {
      // Only what a new request with the original prompt needs to hit again (the window before
      // the original hit), plus what was computed since.
      const size_t window = *groups_[g].window_blocks;
      const size_t hit = state.groups[g].num_hit_blocks;
      keys = keys.subspan(std::min(keys.size(), hit > window ? hit - window : 0));
    }
    manager_->Touch(keys);
  }
}

std::optional<size_t> OffloadScheduler::GetNumNewMatchedTokens(const OffloadRequestView& request,
                                                               size_t num_computed_tokens) {
  bool created = false;
  RequestState& state = StateOf(request, &created);
  // Blocks recorded before a preemption are no longer the request's.
  for (GroupState& group : state.groups) group.block_ids.clear();
  // A preempted request's stores may still be in flight (flushed, not yet acknowledged); a load
  // now would need a second job, which the job bookkeeping does not allow. vLLM asserts here
  // in the vLLM version docs/semantics.md describes and defers in later ones; deferring is safe.
  if (!state.jobs.empty()) return std::nullopt;
  UpdateKeys(state, request.block_hashes);
  state.num_locally_computed_tokens = num_computed_tokens;
  state.num_tokens = request.num_tokens;

  std::optional<size_t> hits = Lookup(state);
  if (created) {
    for (size_t g = 0; g < groups_.size(); ++g) {
      state.groups[g].num_hit_blocks =
          (num_computed_tokens + hits.value_or(0)) / groups_[g].offloaded_block_size;
    }
  }
  Touch(state);
  return hits;
}

std::optional<size_t> OffloadScheduler::MaximalPrefixLookup(std::span<const BlockKey> keys) {
  // A kRetry counts as a hit so that the scan goes on and the manager starts its asynchronous
  // lookups for every block up to the first miss at once.
  return MaximalPrefix(keys.size(), [&](size_t i) { return manager_->Lookup(keys[i]); });
}

std::optional<size_t> OffloadScheduler::SlidingWindowLookup(std::span<const BlockKey> keys,
                                                            size_t window) {
  // A kRetry is not a hit yet; the scan goes on so the manager starts its other lookups. With no
  // full window, the hits from block 0 on, if any.
  return SlidingWindow(keys.size(), window, [&](size_t i) { return manager_->Lookup(keys[i]); });
}

std::optional<size_t> OffloadScheduler::Lookup(const RequestState& state) {
  const Tokens computed = static_cast<Tokens>(state.num_locally_computed_tokens);
  Tokens max_hit = static_cast<Tokens>(state.num_tokens);
  // With a window or state group the last prompt token must be computed (a window's KV cannot
  // yield its logits); taking it off here keeps the hit valid after the engine would.
  if (!window_groups_.empty()) max_hit -= 1;
  Tokens num_hit = 0;
  bool defer = false;
  // Each group can only shorten the hit; a shorter hit may undo what an earlier group accepted
  // (a window group's window moves), so passes repeat until the length holds for every group.
  std::span<const uint32_t> next_pass = lookup_order_;
  while (!next_pass.empty()) {
    const std::span<const uint32_t> pass = next_pass;
    next_pass = {};
    bool looked_up_window = false;
    for (const uint32_t g : pass) {
      const OffloadGroupInfo& group = groups_[g];
      const Tokens block = group.offloaded_block_size;
      const std::vector<BlockKey>& keys = state.groups[g].keys;
      max_hit = std::min(max_hit, static_cast<Tokens>(keys.size()) * block);
      if (max_hit - computed < block) return 0;  // less than a block to load: not worth it
      const size_t num_blocks = std::min(static_cast<size_t>(CeilDiv(max_hit, block)), keys.size());
      const size_t start = static_cast<size_t>(computed / block);
      const std::span<const BlockKey> slice = std::span(keys).subspan(start, num_blocks - start);
      const std::optional<size_t> found = IsWindow(group)
                                              ? SlidingWindowLookup(slice, *group.window_blocks)
                                              : MaximalPrefixLookup(slice);
      if (found.has_value() && *found == 0) return 0;
      if (!found.has_value()) {
        defer = true;
      } else {
        max_hit = std::min(max_hit, block * static_cast<Tokens>(start + *found));
      }
      const Tokens new_hit = max_hit - computed;
      if (new_hit < block) return 0;
      if (new_hit < num_hit) {
        if (defer) {
          // The deferring group may not matter at the shorter length: look at all again.
          defer = false;
          next_pass = lookup_order_;
        } else if (looked_up_window && next_pass.empty()) {
          // A window accepted earlier in this pass ended at the longer length.
          next_pass = window_groups_;
        }
      }
      looked_up_window |= IsWindow(group);
      num_hit = new_hit;
    }
  }
  if (defer) return std::nullopt;

  if (options_.prefix_caching && !blocks_being_loaded_.empty()) {
    // Another request is loading part of this hit: wait for it and hit its blocks in the GPU
    // prefix cache rather than load them twice.
    for (size_t g = 0; g < groups_.size(); ++g) {
      const Tokens block = groups_[g].offloaded_block_size;
      std::span<const BlockKey> keys = state.groups[g].keys;
      const size_t end =
          std::min(static_cast<size_t>(CeilDiv(computed + num_hit, block)), keys.size());
      const size_t start = std::min(static_cast<size_t>(computed / block), end);
      keys = keys.subspan(start, end - start);
      if (IsWindow(groups_[g])) {
        // Only the window at the end of the hit is loaded.
        keys = keys.last(std::min<size_t>(keys.size(), *groups_[g].window_blocks));
      }
      for (const BlockKey& key : keys) {
        if (blocks_being_loaded_.contains(key)) return std::nullopt;
      }
    }
  }
  return static_cast<size_t>(num_hit);
}

Status OffloadScheduler::UpdateStateAfterAlloc(const OffloadRequestView& request,
                                               std::span<const std::vector<GpuBlockId>> blocks,
                                               size_t num_external_tokens) {
  if (num_external_tokens == 0) return Status::OK();
  auto it = requests_.find(request.id);
  if (it == requests_.end()) {
    return FailedPreconditionError("request {} was not looked up before its allocation",
                                   request.id);
  }
  RequestState& state = it->second;
  if (blocks.size() != groups_.size()) {
    return InvalidArgumentError("request {}: {} block tables for {} groups", request.id,
                                blocks.size(), groups_.size());
  }
  if (!state.jobs.empty()) {
    return FailedPreconditionError("request {}: load while job {} is in flight", request.id,
                                   *state.jobs.begin());
  }
  const size_t computed = state.num_locally_computed_tokens;
  const size_t cached = computed + num_external_tokens;
  for (size_t g = 0; g < groups_.size(); ++g) {
    const size_t num_gpu_blocks = CeilDiv(cached, groups_[g].config.gpu_block_size);
    if (blocks[g].size() < num_gpu_blocks) {
      return InvalidArgumentError("request {}: group {} has {} blocks for {} cached tokens",
                                  request.id, g, blocks[g].size(), cached);
    }
    if (state.groups[g].keys.size() < CeilDiv(cached, groups_[g].offloaded_block_size)) {
      return FailedPreconditionError("request {}: group {} has {} keys for {} cached tokens",
                                     request.id, g, state.groups[g].keys.size(), cached);
    }
  }

  TransferJob job;
  job.id = job_counter_++;
  job.request = request.id;
  for (size_t g = 0; g < groups_.size(); ++g) {
    const OffloadGroupInfo& group = groups_[g];
    GroupState& group_state = state.groups[g];
    const std::span<const GpuBlockId> table = blocks[g];
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
      job.keys.insert(job.keys.end(), first, group_state.keys.begin() + num_blocks);
    }
    for (size_t i = local; i < num_gpu_blocks; ++i) {
      job.gpu_blocks.push_back(table[i]);
      // A fresh block may be one a finished request's store still reads from.
      batch_allocated_blocks_.insert(table[i]);
    }
    job.group_sizes.push_back(static_cast<uint32_t>(num_gpu_blocks - local));
    job.block_indices.push_back(static_cast<uint32_t>(local));
    // The hit prefix is stored already; a request whose KV also goes elsewhere stores it all.
    if (!request.do_remote_decode) group_state.next_stored = num_blocks;
  }

  manager_->PrepareLoad(job.keys);
  Job& status = jobs_[job.id];
  status.request = request.id;
  status.is_store = false;
  status.pending = options_.world_size;
  status.keys = job.keys;
  state.jobs.insert(job.id);
  if (options_.prefix_caching) blocks_being_loaded_.insert(job.keys.begin(), job.keys.end());
  batch_load_jobs_.push_back(std::move(job));
  return Status::OK();
}

size_t OffloadScheduler::NumStorableBlocks(const RequestState& state, size_t group,
                                           size_t num_offloadable_tokens) const {
  const GroupState& group_state = state.groups[group];
  // Only blocks with a key and all their GPU blocks reported can be stored.
  return std::min({num_offloadable_tokens / groups_[group].offloaded_block_size,
                   group_state.keys.size(),
                   group_state.block_ids.size() / groups_[group].config.block_size_factor});
}

void OffloadScheduler::AdvanceStored(RequestState& state, size_t num_offloadable_tokens) {
  for (size_t g = 0; g < groups_.size(); ++g) {
    GroupState& group_state = state.groups[g];
    group_state.next_stored =
        std::max(group_state.next_stored, NumStorableBlocks(state, g, num_offloadable_tokens));
  }
}

void OffloadScheduler::Fence(GpuBlockId block, JobId job) { fence_[block].insert(job); }

void OffloadScheduler::Unfence(std::span<const GpuBlockId> blocks, JobId job) {
  for (const GpuBlockId block : blocks) {
    auto it = fence_.find(block);
    if (it == fence_.end()) continue;
    it->second.erase(job);
    if (it->second.empty()) fence_.erase(it);
  }
}

void OffloadScheduler::ZeroReallocatedWindowBlocks(
    const std::unordered_map<RequestId, std::vector<size_t>>& old_lengths) {
  // A window group frees blocks while the request runs. A block it has not stored yet (its store
  // was refused) may have been freed and handed out again in this step; storing it then would
  // store someone else's KV. Forgetting it skips that block like a null one. (Not in the vLLM
  // vLLM version docs/semantics.md describes; later versions do this.)
  for (auto& [id, state] : requests_) {
    const auto lengths = old_lengths.find(id);
    for (size_t w = 0; w < window_groups_.size(); ++w) {
      const uint32_t g = window_groups_[w];
      GroupState& group_state = state.groups[g];
      const size_t begin = group_state.next_stored * groups_[g].config.block_size_factor;
      // This step's own new blocks are fresh; only the ones reported before can be stale.
      const size_t end =
          lengths != old_lengths.end() ? lengths->second[w] : group_state.block_ids.size();
      for (size_t i = begin; i < end; ++i) {
        if (batch_allocated_blocks_.contains(group_state.block_ids[i])) {
          group_state.block_ids[i] = kNullGpuBlock;
        }
      }
    }
  }
}

void OffloadScheduler::BuildStoreJob(const ScheduledRequestView& scheduled, RequestState& state,
                                     std::vector<TransferJob>& store_jobs) {
  const RequestId id = scheduled.request.id;
  // With asynchronous scheduling the last scheduled tokens may not exist yet.
  const size_t offloadable = std::min(
      scheduled.num_computed_tokens + scheduled.num_scheduled_tokens, scheduled.request.num_tokens);

  // Candidates: the full offloaded blocks not stored yet, per group, but a block whose last GPU
  // block is null (the group skipped it: outside the window, before the state) has no KV.
  std::vector<std::vector<size_t>> candidates(groups_.size());
  std::vector<BlockKey> candidate_keys;
  for (size_t g = 0; g < groups_.size(); ++g) {
    const GroupState& group_state = state.groups[g];
    const size_t f = groups_[g].config.block_size_factor;
    const size_t end = NumStorableBlocks(state, g, offloadable);
    for (size_t i = group_state.next_stored; i < end; ++i) {
      if (group_state.block_ids[i * f + f - 1] == kNullGpuBlock) continue;
      candidates[g].push_back(i);
      candidate_keys.push_back(group_state.keys[i]);
    }
  }
  if (candidate_keys.empty()) {
    AdvanceStored(state, offloadable);
    return;
  }
  // One call for all groups, so the manager sees the request's blocks together.
  std::optional<std::vector<BlockKey>> to_store = manager_->PrepareStore(candidate_keys);
  if (!to_store.has_value()) {
    // Not advanced: the same blocks are offered again next step.
    KVSTASH_LOG_DEBUG("request {}: manager cannot store {} blocks now", id, candidate_keys.size());
    return;
  }
  if (to_store->empty()) {
    AdvanceStored(state, offloadable);
    return;
  }
  Touch(state);

  const std::unordered_set<BlockKey> chosen(to_store->begin(), to_store->end());
  TransferJob job;
  job.id = job_counter_++;
  job.request = id;
  Job status;
  status.request = id;
  status.is_store = true;
  status.pending = options_.world_size;
  for (size_t g = 0; g < groups_.size(); ++g) {
    GroupState& group_state = state.groups[g];
    const size_t f = groups_[g].config.block_size_factor;
    const bool window = IsWindow(groups_[g]);
    std::optional<size_t> first_block;
    uint32_t group_size = 0;
    for (const size_t i : candidates[g]) {
      if (!chosen.contains(group_state.keys[i])) continue;
      job.keys.push_back(group_state.keys[i]);
      for (size_t j = i * f; j < i * f + f; ++j) {
        // Null blocks lead (the group skipped them); the worker places the first real one by
        // block_indices.
        const GpuBlockId block = group_state.block_ids[j];
        if (block == kNullGpuBlock) continue;
        if (!first_block.has_value()) first_block = j;
        job.gpu_blocks.push_back(block);
        ++group_size;
        (window ? status.window_blocks : status.full_blocks).push_back(block);
      }
    }
    job.group_sizes.push_back(group_size);
    job.block_indices.push_back(static_cast<uint32_t>(first_block.value_or(0)));
    group_state.next_stored =
        std::max(group_state.next_stored, NumStorableBlocks(state, g, offloadable));
  }
  // A window group may free these blocks before the request ends; fence them now.
  for (const GpuBlockId block : status.window_blocks) Fence(block, job.id);
  status.keys = job.keys;
  state.jobs.insert(job.id);
  jobs_.emplace(job.id, std::move(status));
  store_jobs.push_back(std::move(job));
}

Result<ConnectorMeta> OffloadScheduler::BuildConnectorMeta(const SchedulerStepView& step) {
  for (const ScheduledRequestView& scheduled : step.scheduled) {
    const RequestId id = scheduled.request.id;
    if (!scheduled.new_block_ids.empty() && scheduled.new_block_ids.size() != groups_.size()) {
      return InvalidArgumentError("request {}: new blocks for {} groups, not {}", id,
                                  scheduled.new_block_ids.size(), groups_.size());
    }
    auto it = requests_.find(id);
    if (it == requests_.end()) continue;
    for (const JobId job : it->second.jobs) {
      if (!jobs_.at(job).is_store) {
        return FailedPreconditionError("request {} is scheduled while its load job {} runs", id,
                                       job);
      }
    }
  }

  std::unordered_map<RequestId, std::vector<size_t>> old_lengths;
  for (const ScheduledRequestView& scheduled : step.scheduled) {
    RequestState& state = StateOf(scheduled.request, nullptr);
    UpdateKeys(state, scheduled.request.block_hashes);
    state.num_tokens = scheduled.request.num_tokens;
    if (scheduled.resumed_from_preemption) {
      for (GroupState& group : state.groups) group.block_ids.clear();
    }
    if (scheduled.new_block_ids.empty()) continue;
    std::vector<size_t>& lengths = old_lengths[scheduled.request.id];
    for (const uint32_t g : window_groups_) lengths.push_back(state.groups[g].block_ids.size());
    for (size_t g = 0; g < groups_.size(); ++g) {
      const std::vector<GpuBlockId>& added = scheduled.new_block_ids[g];
      state.groups[g].block_ids.insert(state.groups[g].block_ids.end(), added.begin(), added.end());
      for (const GpuBlockId block : added) {
        if (block != kNullGpuBlock) batch_allocated_blocks_.insert(block);
      }
    }
  }
  if (!window_groups_.empty() && !batch_allocated_blocks_.empty()) {
    ZeroReallocatedWindowBlocks(old_lengths);
  }

  // Finishing registers fences, so it comes before the fences are checked.
  for (const RequestId id : step.finished) RequestFinished(id);
  // A preempted request's blocks go back to the pool now; its stores must finish first.
  for (const RequestId id : step.preempted) {
    auto it = requests_.find(id);
    if (it != requests_.end()) {
      batch_jobs_to_flush_.insert(it->second.jobs.begin(), it->second.jobs.end());
    }
  }
  for (const GpuBlockId block : batch_allocated_blocks_) {
    auto it = fence_.find(block);
    if (it != fence_.end()) batch_jobs_to_flush_.insert(it->second.begin(), it->second.end());
  }

  ConnectorMeta meta;
  for (const ScheduledRequestView& scheduled : step.scheduled) {
    // A request reported both scheduled and finished stores nothing more.
    auto it = requests_.find(scheduled.request.id);
    if (it == requests_.end() || it->second.finished) continue;
    BuildStoreJob(scheduled, it->second, meta.store_jobs);
  }
  // Nothing runs any more: no later step would flush these, so the workers finish them now.
  const bool all_finished = std::all_of(requests_.begin(), requests_.end(),
                                        [](const auto& entry) { return entry.second.finished; });
  if (all_finished) {
    for (const auto& entry : jobs_) batch_jobs_to_flush_.insert(entry.first);
  }

  meta.load_jobs = std::move(batch_load_jobs_);
  meta.jobs_to_flush.assign(batch_jobs_to_flush_.begin(), batch_jobs_to_flush_.end());
  batch_load_jobs_.clear();
  batch_jobs_to_flush_.clear();
  batch_allocated_blocks_.clear();
  return meta;
}

Status OffloadScheduler::UpdateConnectorOutput(const CompletedJobs& completed) {
  for (const auto& [id, count] : completed) {
    if (count == 0) return InvalidArgumentError("job {} acknowledged 0 times", id);
    if (id < stale_job_threshold_) continue;
    auto it = jobs_.find(id);
    if (it == jobs_.end()) return NotFoundError("acknowledged job {} is not in flight", id);
    if (count > it->second.pending) {
      return InvalidArgumentError("job {} acknowledged {} times with {} outstanding", id, count,
                                  it->second.pending);
    }
  }
  for (const auto& [id, count] : completed) {
    if (id < stale_job_threshold_) continue;  // from before ResetCache
    auto it = jobs_.find(id);
    Job& job = it->second;
    job.pending -= count;
    if (job.pending > 0) continue;
    RequestState& state = requests_.at(job.request);
    if (job.is_store) {
      manager_->CompleteStore(job.keys);
    } else {
      manager_->CompleteLoad(job.keys);
      for (const BlockKey& key : job.keys) blocks_being_loaded_.erase(key);
    }
    Unfence(job.window_blocks, id);
    // Full-attention sources were fenced only if the request finished.
    if (state.finished) Unfence(job.full_blocks, id);
    const RequestId request = job.request;
    jobs_.erase(it);
    state.jobs.erase(id);
    if (state.finished && state.jobs.empty()) requests_.erase(request);
  }
  return Status::OK();
}

void OffloadScheduler::RequestFinished(RequestId id) {
  auto it = requests_.find(id);
  if (it == requests_.end()) return;
  RequestState& state = it->second;
  state.finished = true;
  if (state.jobs.empty()) {
    requests_.erase(it);
    return;
  }
  // The engine frees the blocks now and may hand them out in any later step; a step that does
  // flushes these stores first (BuildConnectorMeta). A load needs no fence: the engine keeps a
  // request whose load runs until the load completes.
  for (const JobId job : state.jobs) {
    for (const GpuBlockId block : jobs_.at(job).full_blocks) Fence(block, job);
  }
}

void OffloadScheduler::ResetCache() {
  for (const auto& entry : jobs_) batch_jobs_to_flush_.insert(entry.first);
  manager_->ResetCache();
  for (auto it = requests_.begin(); it != requests_.end();) {
    RequestState& state = it->second;
    // A finished request was kept only for its jobs, which are forgotten now.
    if (state.finished) {
      it = requests_.erase(it);
      continue;
    }
    for (GroupState& group : state.groups) group.next_stored = 0;
    state.jobs.clear();
    ++it;
  }
  stale_job_threshold_ = job_counter_;
  jobs_.clear();
  fence_.clear();
  blocks_being_loaded_.clear();
}

std::map<GpuBlockId, std::vector<JobId>> OffloadScheduler::FenceIndex() const {
  std::map<GpuBlockId, std::vector<JobId>> index;
  for (const auto& [block, jobs] : fence_) index[block].assign(jobs.begin(), jobs.end());
  return index;
}

std::vector<BlockKey> OffloadScheduler::BlocksBeingLoaded() const {
  std::vector<BlockKey> keys(blocks_being_loaded_.begin(), blocks_being_loaded_.end());
  std::sort(keys.begin(), keys.end(), [](const BlockKey& a, const BlockKey& b) {
    return std::tie(a.group, a.hash) < std::tie(b.group, b.hash);
  });
  return keys;
}

std::vector<InFlightJob> OffloadScheduler::InFlightJobs() const {
  std::vector<InFlightJob> jobs;
  for (const auto& [id, job] : jobs_) {
    jobs.push_back(InFlightJob{id, job.request, job.is_store, job.pending, job.keys});
  }
  return jobs;
}

std::optional<std::vector<size_t>> OffloadScheduler::NextStoredBlocks(RequestId id) const {
  auto it = requests_.find(id);
  if (it == requests_.end()) return std::nullopt;
  std::vector<size_t> next;
  for (const GroupState& group : it->second.groups) next.push_back(group.next_stored);
  return next;
}

}  // namespace kvstash::connector
