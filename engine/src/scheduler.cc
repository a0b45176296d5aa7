#include "kvstash/engine/scheduler.h"

#include <algorithm>

namespace kvstash::engine {

Scheduler::Scheduler(SchedulerOptions options, KvCacheManager* kv_cache)
    : options_(options), kv_cache_(kv_cache) {
  options_.max_num_batched_tokens = std::max<size_t>(options_.max_num_batched_tokens, 1);
  options_.max_num_seqs = std::max<size_t>(options_.max_num_seqs, 1);
}

void Scheduler::Add(std::unique_ptr<Request> request) {
  if (!request->hasher) {
    request->hasher = std::make_unique<RequestHasher>(kv_cache_->hash_block_size());
  }
  request->state = Request::State::kWaiting;
  waiting_.push_back(request.get());
  const RequestId id = request->id;
  requests_[id] = std::move(request);
}

Request* Scheduler::Find(RequestId id) {
  auto it = requests_.find(id);
  return it == requests_.end() ? nullptr : it->second.get();
}

std::unique_ptr<Request> Scheduler::Take(RequestId id) {
  auto it = requests_.find(id);
  if (it == requests_.end()) return nullptr;
  std::unique_ptr<Request> r = std::move(it->second);
  requests_.erase(it);
  return r;
}

void Scheduler::Preempt(Request* request) {
  kv_cache_->Free(request->id);
  request->num_computed_tokens = 0;
  request->state = Request::State::kWaiting;
  ++request->num_preemptions;
  waiting_.push_front(request);
}

SchedulerOutput Scheduler::Schedule() {
  SchedulerOutput out;
  size_t budget = options_.max_num_batched_tokens;
  auto schedule = [&](Request* r, size_t start, size_t n) {
    out.seqs.push_back({r, start, n});
    out.num_tokens += n;
    budget -= n;
  };

  // Running requests, oldest first; the newest gives way when the pool runs out.
  for (size_t i = 0; i < running_.size() && budget > 0;) {
    Request* r = running_[i];
    const size_t n = std::min(r->tokens.size() - r->num_computed_tokens, budget);
    r->hasher->Update(r->tokens);
    bool allocated = false;
    while (!allocated) {
      allocated = kv_cache_->AllocateSlots(r->id, r->hasher->hashes(), r->tokens.size(),
                                           r->num_computed_tokens, n);
      if (allocated) break;
      Request* victim = running_.back();
      running_.pop_back();
      out.preempted.push_back(victim->id);
      // A preempted request that was scheduled earlier in this step loses its slot in `out`.
      std::erase_if(out.seqs, [&](const ScheduledSeq& s) {
        if (s.request != victim) return false;
        out.num_tokens -= s.num_tokens;
        budget += s.num_tokens;
        return true;
      });
      if (victim == r && running_.empty() && i == 0) {
        // Alone and still out of blocks: it can never fit this pool.
        kv_cache_->Free(r->id);
        r->state = Request::State::kFailed;
        r->error = ResourceExhaustedError(
            "request {} needs more KV-cache blocks than the pool's {} (at {} of its {} tokens)",
            r->id, kv_cache_->pool().num_blocks() - 1, r->num_computed_tokens, r->tokens.size());
        out.failed.push_back(r->id);
        out.preempted.pop_back();
        break;
      }
      Preempt(victim);
      if (victim == r) break;
    }
    if (!allocated) break;
    schedule(r, r->num_computed_tokens, n);
    ++i;
  }

  // Waiting requests, in order, unless this step had to preempt.
  while (out.preempted.empty() && !waiting_.empty() && budget > 0 &&
         running_.size() < options_.max_num_seqs) {
    Request* r = waiting_.front();
    r->hasher->Update(r->tokens);
    ComputedBlocks hit = kv_cache_->GetComputedBlocks(r->hasher->hashes(), r->tokens.size());
    const size_t n = std::min(r->tokens.size() - hit.tokens, budget);
    if (!kv_cache_->AllocateSlots(r->id, r->hasher->hashes(), r->tokens.size(), 0, n, &hit)) {
      if (running_.empty() && out.seqs.empty()) {
        r->state = Request::State::kFailed;
        r->error = ResourceExhaustedError(
            "request {} needs more KV-cache blocks than the pool's {} for its first {} tokens",
            r->id, kv_cache_->pool().num_blocks() - 1, hit.tokens + n);
        out.failed.push_back(r->id);
        waiting_.pop_front();
        continue;
      }
      break;
    }
    waiting_.pop_front();
    r->num_computed_tokens = hit.tokens;
    if (!r->scheduled_once) {
      r->num_cached_tokens = hit.tokens;
      r->scheduled_once = true;
    }
    r->state = Request::State::kRunning;
    running_.push_back(r);
    schedule(r, hit.tokens, n);
  }
  return out;
}

std::vector<RequestId> Scheduler::Update(const SchedulerOutput& out,
                                         std::span<const uint32_t> sampled) {
  std::vector<RequestId> finished;
  for (size_t i = 0; i < out.seqs.size(); ++i) {
    const ScheduledSeq& s = out.seqs[i];
    Request* r = s.request;
    const size_t end = s.start + s.num_tokens;
    if (s.start < r->num_prompt_tokens)
      r->num_computed_prompt_tokens += std::min(end, r->num_prompt_tokens) - s.start;
    r->num_computed_tokens = end;
    if (end < r->tokens.size()) continue;  // a prefill chunk: nothing to sample yet
    r->tokens.push_back(sampled[i]);
    if (r->num_output_tokens() >= r->max_new_tokens) {
      kv_cache_->Free(r->id);
      r->state = Request::State::kFinished;
      std::erase(running_, r);
      finished.push_back(r->id);
    }
  }
  return finished;
}

}  // namespace kvstash::engine
