#include "kvstash/engine/scheduler.h"

#include <algorithm>

namespace kvstash::engine {

constexpr uint32_t kMaxDeferrals = 1000;

Scheduler::Scheduler(SchedulerOptions options, KvCacheManager* kv_cache)
    : options_(options), kv_cache_(kv_cache) {
  for (size_t g = 0; g < kv_cache_->num_groups(); ++g) {
    has_state_group_ |= kv_cache_->group_spec(g).kind == AttentionSpec::Kind::kState;
  }
  options_.max_num_batched_tokens = std::max<size_t>(options_.max_num_batched_tokens, 1);
  options_.max_num_seqs = std::max<size_t>(options_.max_num_seqs, 1);
}

void Scheduler::Add(std::unique_ptr<Request> request) {
  if (!request->hasher) {
    request->hasher =
        std::make_unique<RequestHasher>(kv_cache_->hash_block_size(), options_.cache_salt);
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

std::unique_ptr<Request> Scheduler::Remove(RequestId id) {
  auto it = requests_.find(id);
  if (it == requests_.end()) return nullptr;
  Request* r = it->second.get();
  if (r->state != Request::State::kFinished && r->state != Request::State::kFailed) {
    kv_cache_->Free(id);
    std::erase(waiting_, r);
    std::erase(running_, r);
  }
  std::unique_ptr<Request> removed = std::move(it->second);
  requests_.erase(it);
  return removed;
}

void Scheduler::Preempt(Request* request) {
  kv_cache_->Free(request->id);
  request->num_computed_tokens = 0;
  request->resumed = true;
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
    size_t n = std::min(r->tokens.size() - r->num_computed_tokens, budget);
    r->hasher->Update(r->tokens);
    bool allocated = false;
    while (!allocated) {
      allocated = kv_cache_->AllocateSlots(r->id, r->hasher->hashes(), r->tokens.size(),
                                           r->num_computed_tokens, n);
      if (allocated) break;
      // Alone, a shorter prefill chunk may fit where this one does not (a window frees only
      // behind what is computed): down to one token before giving up.
      if (running_.size() == 1 && n > 1) {
        n = (n + 1) / 2;
        continue;
      }
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

  // Waiting requests, in order, unless this step had to preempt. Those the external source
  // asks to come back later keep their place.
  std::vector<Request*> later;
  while (out.preempted.empty() && !waiting_.empty() && budget > 0 &&
         running_.size() < options_.max_num_seqs) {
    Request* r = waiting_.front();
    r->hasher->Update(r->tokens);
    if (r->state == Request::State::kLoaded) {
      // Its blocks are held; the last token is always computed (its logits are needed).
      r->num_computed_tokens = std::min(r->num_computed_tokens, r->tokens.size() - 1);
      const size_t n = std::min(r->tokens.size() - r->num_computed_tokens, budget);
      if (!kv_cache_->AllocateSlots(r->id, r->hasher->hashes(), r->tokens.size(),
                                    r->num_computed_tokens, n)) {
        break;
      }
      waiting_.pop_front();
      r->state = Request::State::kRunning;
      running_.push_back(r);
      schedule(r, r->num_computed_tokens, n);
      continue;
    }
    ComputedBlocks hit = kv_cache_->GetComputedBlocks(r->hasher->hashes(), r->tokens.size());
    size_t external = 0;
    if (external_ != nullptr && !r->skip_external) {
      std::optional<size_t> matched = external_->MatchedTokens(*r, hit.tokens);
      // "Ask again" (a block being written or promoted on a node, or being loaded for another
      // request) normally clears within a few steps; past kMaxDeferrals the request stops
      // waiting for it and computes.
      if (!matched.has_value() && ++r->num_deferrals <= kMaxDeferrals) {
        waiting_.pop_front();
        later.push_back(r);
        continue;
      }
      external = std::min(matched.value_or(0), r->tokens.size() - hit.tokens);
      // A state group's block holds the state at the block's end, so computing may only resume
      // on a block boundary: the connector's hit can end one token short of one (it always
      // leaves the last token to compute), and resuming there would apply that token twice.
      if (has_state_group_) {
        const size_t lcm = kv_cache_->lcm_block_size();
        const size_t end = (hit.tokens + external) / lcm * lcm;
        external = end > hit.tokens ? end - hit.tokens : 0;
      }
    }
    if (external > 0) {
      // Blocks for the hit and the external tokens now, which count as computed: positions a
      // group skips at hit + external tokens (outside a window, before a state's last block)
      // get the null block and are not loaded. Their hashes once the load is in.
      if (!kv_cache_->AllocateSlots(r->id, r->hasher->hashes(), r->tokens.size(), external, 0, &hit,
                                    /*delay_cache=*/true)) {
        break;
      }
      waiting_.pop_front();
      if (!r->scheduled_once) {
        r->num_cached_tokens = hit.tokens;
        r->scheduled_once = true;
      }
      r->num_computed_tokens = hit.tokens;
      if (external_->StartLoad(*r, kv_cache_->BlockTables(r->id), external).ok()) {
        r->state = Request::State::kLoading;
        r->pending_external_tokens = external;
        out.loading.push_back(r);
      } else {
        // Nothing will arrive, and the tables are shaped for tokens that would have: start
        // over from the local hit, without the external source.
        kv_cache_->Free(r->id);
        r->num_computed_tokens = 0;
        r->skip_external = true;
        r->state = Request::State::kWaiting;
        later.push_back(r);
      }
      continue;
    }
    size_t n = std::min(r->tokens.size() - hit.tokens, budget);
    bool allocated = false;
    while (!(allocated = kv_cache_->AllocateSlots(r->id, r->hasher->hashes(), r->tokens.size(), 0,
                                                  n, &hit)) &&
           running_.empty() && out.seqs.empty() && n > 1) {
      n = (n + 1) / 2;  // alone: a shorter first chunk may fit
    }
    if (!allocated) {
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
  waiting_.insert(waiting_.begin(), later.begin(), later.end());
  return out;
}

void Scheduler::LoadFinished(Request* r, bool ok) {
  if (ok) {
    r->num_computed_tokens += r->pending_external_tokens;
    r->num_external_tokens += r->pending_external_tokens;
    kv_cache_->CacheBlocks(r->id, r->hasher->hashes(), r->tokens.size(), r->num_computed_tokens);
    r->state = Request::State::kLoaded;
  } else {
    // Its tables were shaped for the loaded tokens (null where a window would have skipped
    // them), so computing them in place is not possible: start over, from the local prefix
    // cache only. Nothing of the load was cached.
    kv_cache_->Free(r->id);
    r->num_computed_tokens = 0;
    r->resumed = true;
    r->skip_external = true;
    r->state = Request::State::kWaiting;
  }
  r->pending_external_tokens = 0;
  waiting_.push_front(r);
}

std::vector<RequestId> Scheduler::FailAll(const Status& error) {
  std::vector<RequestId> failed;
  for (auto& [id, r] : requests_) {
    if (r->state == Request::State::kFinished || r->state == Request::State::kFailed) continue;
    kv_cache_->Free(id);
    r->state = Request::State::kFailed;
    r->error = error;
    failed.push_back(id);
  }
  waiting_.clear();
  running_.clear();
  return failed;
}

std::vector<RequestId> Scheduler::Update(const SchedulerOutput& out,
                                         std::span<const uint32_t> sampled) {
  std::vector<RequestId> finished;
  for (size_t i = 0; i < out.seqs.size(); ++i) {
    const ScheduledSeq& s = out.seqs[i];
    Request* r = s.request;
    const size_t end = s.start + s.num_tokens;
    if (s.start < r->num_prompt_tokens) {
      r->num_computed_prompt_tokens += std::min(end, r->num_prompt_tokens) - s.start;
    }
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
