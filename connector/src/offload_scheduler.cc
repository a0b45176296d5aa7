#include "kvstash/connector/offload_scheduler.h"

#include <algorithm>
#include <unordered_set>
#include <utility>

#include "kvstash/common/logging.h"
#include "scheduler/group_layout.h"
#include "scheduler/hit_finder.h"
#include "scheduler/job_ledger.h"
#include "scheduler/tracked_requests.h"

namespace kvstash::connector {

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
  KVSTASH_ASSIGN_OR_RETURN(std::unique_ptr<GroupLayout> groups,
                           GroupLayout::Create(options.groups, options.hash_block_size));
  return std::unique_ptr<OffloadScheduler>(
      new OffloadScheduler(std::move(options), std::move(manager), std::move(groups)));
}

OffloadScheduler::OffloadScheduler(OffloadSchedulerOptions options,
                                   std::unique_ptr<OffloadManager> manager,
                                   std::unique_ptr<GroupLayout> groups)
    : options_(std::move(options)),
      manager_(std::move(manager)),
      groups_(std::move(groups)),
      jobs_(std::make_unique<JobLedger>(options_.world_size, options_.prefix_caching)),
      requests_(std::make_unique<TrackedRequests>(*groups_)),
      hits_(std::make_unique<HitFinder>(*groups_, *manager_, *jobs_, options_.prefix_caching)) {}

OffloadScheduler::~OffloadScheduler() = default;

std::optional<size_t> OffloadScheduler::GetNumNewMatchedTokens(const OffloadRequestView& request,
                                                               size_t num_computed_tokens) {
  bool created = false;
  TrackedRequest& state = requests_->Track(request.id, &created);
  // Blocks recorded before a preemption are no longer the request's.
  for (TrackedGroup& group : state.groups) group.block_ids.clear();
  // A preempted request's stores may still be in flight (flushed, not yet acknowledged); a load
  // now would need a second job, which the job bookkeeping does not allow. vLLM asserts here
  // in the vLLM version docs/semantics.md describes and defers in later ones; deferring is safe.
  if (!state.jobs.empty()) return std::nullopt;
  requests_->UpdateKeys(state, request.block_hashes);
  state.num_locally_computed_tokens = num_computed_tokens;
  state.num_tokens = request.num_tokens;

  std::optional<size_t> hits = hits_->Find(state);
  if (created) {
    for (size_t g = 0; g < groups_->size(); ++g) {
      state.groups[g].num_hit_blocks =
          (num_computed_tokens + hits.value_or(0)) / (*groups_)[g].offloaded_block_size;
    }
  }
  requests_->Touch(state, *manager_);
  return hits;
}

Status OffloadScheduler::UpdateStateAfterAlloc(const OffloadRequestView& request,
                                               std::span<const std::vector<GpuBlockId>> blocks,
                                               size_t num_external_tokens) {
  if (num_external_tokens == 0) return Status::OK();
  TrackedRequest* state = requests_->Find(request.id);
  if (state == nullptr) {
    return FailedPreconditionError("request {} was not looked up before its allocation",
                                   request.id);
  }
  if (blocks.size() != groups_->size()) {
    return InvalidArgumentError("request {}: {} block tables for {} groups", request.id,
                                blocks.size(), groups_->size());
  }
  if (!state->jobs.empty()) {
    return FailedPreconditionError("request {}: load while job {} is in flight", request.id,
                                   *state->jobs.begin());
  }
  TransferJob job;
  job.request = request.id;
  KVSTASH_RETURN_IF_ERROR(
      requests_->PlanLoad(*state, blocks, state->num_locally_computed_tokens + num_external_tokens,
                          request.do_remote_decode, &job, &batch_allocated_blocks_));
  job.id = jobs_->NextId();
  manager_->PrepareLoad(job.keys);
  LedgerJob record;
  record.request = request.id;
  record.keys = job.keys;
  jobs_->Add(job.id, std::move(record));
  state->jobs.insert(job.id);
  batch_load_jobs_.push_back(std::move(job));
  return Status::OK();
}

void OffloadScheduler::BuildStoreJob(const ScheduledRequestView& scheduled, TrackedRequest& state,
                                     std::vector<TransferJob>& store_jobs) {
  const RequestId id = scheduled.request.id;
  // With asynchronous scheduling the last scheduled tokens may not exist yet.
  const size_t offloadable = std::min(
      scheduled.num_computed_tokens + scheduled.num_scheduled_tokens, scheduled.request.num_tokens);
  const StoreCandidates candidates = requests_->CandidatesOf(state, offloadable);
  if (candidates.keys.empty()) {
    requests_->AdvanceStored(state, offloadable);
    return;
  }
  // One call for all groups, so the manager sees the request's blocks together.
  std::optional<std::vector<BlockKey>> to_store = manager_->PrepareStore(candidates.keys);
  if (!to_store.has_value()) {
    // Not advanced: the same blocks are offered again next step.
    KVSTASH_LOG_DEBUG("request {}: manager cannot store {} blocks now", id, candidates.keys.size());
    return;
  }
  if (to_store->empty()) {
    requests_->AdvanceStored(state, offloadable);
    return;
  }
  requests_->Touch(state, *manager_);

  TransferJob job;
  job.request = id;
  LedgerJob record;
  record.request = id;
  record.is_store = true;
  requests_->PlanStore(state, candidates,
                       std::unordered_set<BlockKey>(to_store->begin(), to_store->end()),
                       offloadable, &job, &record.full_blocks, &record.window_blocks);
  job.id = jobs_->NextId();
  record.keys = job.keys;
  jobs_->Add(job.id, std::move(record));
  state.jobs.insert(job.id);
  store_jobs.push_back(std::move(job));
}

Result<ConnectorMeta> OffloadScheduler::BuildConnectorMeta(const SchedulerStepView& step) {
  for (const ScheduledRequestView& scheduled : step.scheduled) {
    const RequestId id = scheduled.request.id;
    if (!scheduled.new_block_ids.empty() && scheduled.new_block_ids.size() != groups_->size()) {
      return InvalidArgumentError("request {}: new blocks for {} groups, not {}", id,
                                  scheduled.new_block_ids.size(), groups_->size());
    }
    const TrackedRequest* state = requests_->Find(id);
    if (state == nullptr) continue;
    for (const JobId job : state->jobs) {
      if (!jobs_->at(job).is_store) {
        return FailedPreconditionError("request {} is scheduled while its load job {} runs", id,
                                       job);
      }
    }
  }
  requests_->ApplySchedule(step.scheduled, &batch_allocated_blocks_);

  // Finishing registers fences, so it comes before the fences are checked.
  for (const RequestId id : step.finished) RequestFinished(id);
  // A preempted request's blocks go back to the pool now; its stores must finish first.
  for (const RequestId id : step.preempted) {
    if (const TrackedRequest* state = requests_->Find(id)) {
      batch_jobs_to_flush_.insert(state->jobs.begin(), state->jobs.end());
    }
  }
  for (const GpuBlockId block : batch_allocated_blocks_) {
    jobs_->FencesOf(block, &batch_jobs_to_flush_);
  }

  ConnectorMeta meta;
  for (const ScheduledRequestView& scheduled : step.scheduled) {
    // A request reported both scheduled and finished stores nothing more.
    TrackedRequest* state = requests_->Find(scheduled.request.id);
    if (state == nullptr || state->finished) continue;
    BuildStoreJob(scheduled, *state, meta.store_jobs);
  }
  // Nothing runs any more: no later step would flush these, so the workers finish them now.
  if (requests_->AllFinished()) jobs_->AllJobs(&batch_jobs_to_flush_);

  meta.load_jobs = std::move(batch_load_jobs_);
  meta.jobs_to_flush.assign(batch_jobs_to_flush_.begin(), batch_jobs_to_flush_.end());
  batch_load_jobs_.clear();
  batch_jobs_to_flush_.clear();
  batch_allocated_blocks_.clear();
  return meta;
}

Status OffloadScheduler::UpdateConnectorOutput(const CompletedJobs& completed) {
  KVSTASH_RETURN_IF_ERROR(jobs_->Check(completed));
  for (const auto& [id, count] : completed) {
    if (jobs_->Stale(id)) continue;  // from before ResetCache
    const RequestId request = jobs_->at(id).request;
    TrackedRequest& state = requests_->At(request);
    const std::optional<LedgerJob> done = jobs_->Acknowledge(id, count, state.finished);
    if (!done.has_value()) continue;
    if (done->is_store) {
      manager_->CompleteStore(done->keys);
    } else {
      manager_->CompleteLoad(done->keys);
    }
    state.jobs.erase(id);
    if (state.finished && state.jobs.empty()) requests_->Erase(request);
  }
  return Status::OK();
}

void OffloadScheduler::RequestFinished(RequestId id) {
  TrackedRequest* state = requests_->Find(id);
  if (state == nullptr) return;
  state->finished = true;
  if (state->jobs.empty()) {
    requests_->Erase(id);
    return;
  }
  // The engine frees the blocks now and may hand them out in any later step; a step that does
  // flushes these stores first (BuildConnectorMeta). A load needs no fence: the engine keeps a
  // request whose load runs until the load completes.
  for (const JobId job : state->jobs) jobs_->FenceFullBlocks(job);
}

void OffloadScheduler::ResetCache() {
  jobs_->AllJobs(&batch_jobs_to_flush_);
  manager_->ResetCache();
  requests_->Reset();
  jobs_->Reset();
}

std::span<const OffloadGroupInfo> OffloadScheduler::groups() const { return groups_->groups(); }
std::span<const uint32_t> OffloadScheduler::lookup_order() const { return groups_->lookup_order(); }
std::map<GpuBlockId, std::vector<JobId>> OffloadScheduler::FenceIndex() const {
  return jobs_->FenceIndex();
}
std::vector<BlockKey> OffloadScheduler::BlocksBeingLoaded() const {
  return jobs_->BlocksBeingLoaded();
}
std::vector<InFlightJob> OffloadScheduler::InFlightJobs() const { return jobs_->InFlightJobs(); }
std::optional<std::vector<size_t>> OffloadScheduler::NextStoredBlocks(RequestId id) const {
  return requests_->NextStoredBlocks(id);
}
bool OffloadScheduler::IsTracked(RequestId id) const { return requests_->contains(id); }
JobId OffloadScheduler::job_counter() const { return jobs_->counter(); }
JobId OffloadScheduler::stale_job_threshold() const { return jobs_->stale_threshold(); }

}  // namespace kvstash::connector
