#include "scheduler/job_ledger.h"

#include <algorithm>
#include <tuple>
#include <utility>

namespace kvstash::connector {

void JobLedger::Add(JobId id, LedgerJob job) {
  job.pending = world_size_;
  // A window group may free these blocks before the request ends; they are fenced now.
  for (const GpuBlockId block : job.window_blocks) Fence(block, id);
  if (!job.is_store && prefix_caching_) being_loaded_.insert(job.keys.begin(), job.keys.end());
  jobs_.emplace(id, std::move(job));
}

Status JobLedger::Check(const CompletedJobs& completed) const {
  for (const auto& [id, count] : completed) {
    if (count == 0) return InvalidArgumentError("job {} acknowledged 0 times", id);
    if (Stale(id)) continue;
    auto it = jobs_.find(id);
    if (it == jobs_.end()) return NotFoundError("acknowledged job {} is not in flight", id);
    if (count > it->second.pending) {
      return InvalidArgumentError("job {} acknowledged {} times with {} outstanding", id, count,
                                  it->second.pending);
    }
  }
  return Status::OK();
}

std::optional<LedgerJob> JobLedger::Acknowledge(JobId id, uint32_t count, bool request_finished) {
  auto it = jobs_.find(id);
  LedgerJob& job = it->second;
  job.pending -= count;
  if (job.pending > 0) return std::nullopt;
  if (!job.is_store) {
    for (const BlockKey& key : job.keys) being_loaded_.erase(key);
  }
  Unfence(job.window_blocks, id);
  if (request_finished) Unfence(job.full_blocks, id);
  LedgerJob done = std::move(job);
  jobs_.erase(it);
  return done;
}

void JobLedger::FenceFullBlocks(JobId id) {
  for (const GpuBlockId block : jobs_.at(id).full_blocks) Fence(block, id);
}

void JobLedger::FencesOf(GpuBlockId block, std::set<JobId>* out) const {
  auto it = fence_.find(block);
  if (it != fence_.end()) out->insert(it->second.begin(), it->second.end());
}

void JobLedger::AllJobs(std::set<JobId>* out) const {
  for (const auto& entry : jobs_) out->insert(entry.first);
}

void JobLedger::Unfence(std::span<const GpuBlockId> blocks, JobId job) {
  for (const GpuBlockId block : blocks) {
    auto it = fence_.find(block);
    if (it == fence_.end()) continue;
    it->second.erase(job);
    if (it->second.empty()) fence_.erase(it);
  }
}

void JobLedger::Reset() {
  stale_threshold_ = counter_;
  jobs_.clear();
  fence_.clear();
  being_loaded_.clear();
}

std::map<GpuBlockId, std::vector<JobId>> JobLedger::FenceIndex() const {
  std::map<GpuBlockId, std::vector<JobId>> index;
  for (const auto& [block, jobs] : fence_) index[block].assign(jobs.begin(), jobs.end());
  return index;
}

std::vector<BlockKey> JobLedger::BlocksBeingLoaded() const {
  std::vector<BlockKey> keys(being_loaded_.begin(), being_loaded_.end());
  std::sort(keys.begin(), keys.end(), [](const BlockKey& a, const BlockKey& b) {
    return std::tie(a.group, a.hash) < std::tie(b.group, b.hash);
  });
  return keys;
}

std::vector<InFlightJob> JobLedger::InFlightJobs() const {
  std::vector<InFlightJob> jobs;
  for (const auto& [id, job] : jobs_) {
    jobs.push_back(InFlightJob{id, job.request, job.is_store, job.pending, job.keys});
  }
  return jobs;
}

}  // namespace kvstash::connector
