#include "kvstash/engine/engine.h"

#include <algorithm>

namespace kvstash::engine {

Result<std::unique_ptr<Engine>> Engine::Create(ModelConfig config, EngineOptions options) {
  KVSTASH_RETURN_IF_ERROR(config.Validate());
  KVSTASH_ASSIGN_OR_RETURN(KvLayout layout, KvLayout::Build(config, options.block_size,
                                                            options.attn_pack, options.swa_ring));
  if (options.num_blocks < 2)
    return InvalidArgumentError("the pool needs at least 2 blocks (block 0 is the null block)");
  ModelWeights weights;
  if (!options.weights_path.empty()) {
    KVSTASH_ASSIGN_OR_RETURN(weights, ModelWeights::FromSafetensors(config, options.weights_path));
  } else {
    weights = ModelWeights::FromSeed(config, options.seed.value_or(config.seed));
  }
  KvCacheManagerOptions kv;
  kv.groups = layout.groups;
  kv.num_blocks = options.num_blocks;
  kv.prefix_caching = options.prefix_caching;
  ModelRunner runner(std::move(config), std::move(weights), std::move(layout), options.num_blocks);
  return std::unique_ptr<Engine>(new Engine(std::move(runner), std::move(kv), options.scheduler));
}

Engine::Engine(ModelRunner runner, KvCacheManagerOptions kv_options, SchedulerOptions sched)
    : runner_(std::move(runner)), kv_cache_(std::move(kv_options)), scheduler_(sched, &kv_cache_) {}

Result<RequestId> Engine::AddRequest(std::vector<uint32_t> prompt, size_t max_new_tokens) {
  if (prompt.empty()) return InvalidArgumentError("empty prompt");
  if (max_new_tokens == 0) return InvalidArgumentError("max_new_tokens must be at least 1");
  for (size_t i = 0; i < prompt.size(); ++i) {
    if (prompt[i] >= config().vocab_size)
      return InvalidArgumentError("prompt token {} at position {} is outside the vocabulary of {}",
                                  prompt[i], i, config().vocab_size);
  }
  auto r = std::make_unique<Request>();
  r->id = next_id_++;
  r->num_prompt_tokens = prompt.size();
  r->tokens = std::move(prompt);
  r->max_new_tokens = max_new_tokens;
  const RequestId id = r->id;
  scheduler_.Add(std::move(r));
  return id;
}

std::vector<RequestId> Engine::Step() {
  SchedulerOutput out = scheduler_.Schedule();
  counters_.preemptions += out.preempted.size();
  // Their rings go back now: a preempted request recomputes, from its prefix-cache hit.
  for (RequestId id : out.preempted) runner_.ReleaseRequest(id);
  for (RequestId id : out.failed) runner_.ReleaseRequest(id);
  std::vector<RequestId> done = out.failed;
  if (out.seqs.empty()) return done;
  ++counters_.steps;
  inputs_.clear();
  for (const ScheduledSeq& s : out.seqs) {
    SeqInput in;
    in.tokens = std::span<const uint32_t>(s.request->tokens).subspan(s.start, s.num_tokens);
    in.start_pos = s.start;
    in.tables = &kv_cache_.BlockTables(s.request->id);
    in.request = s.request->id;
    inputs_.push_back(in);
    if (s.request->num_output_tokens() == 0) {
      counters_.prefill_tokens += s.num_tokens;
    } else {
      counters_.decode_tokens += s.num_tokens;
    }
  }
  runner_.Forward(inputs_, logits_);
  const size_t vocab = config().vocab_size;
  sampled_.resize(out.seqs.size());
  for (size_t i = 0; i < out.seqs.size(); ++i) {
    const float* row = logits_.data() + i * vocab;
    // Greedy; the lowest id wins a tie, so equal logits give equal tokens everywhere.
    sampled_[i] = static_cast<uint32_t>(std::max_element(row, row + vocab) - row);
  }
  std::vector<RequestId> finished = scheduler_.Update(out, sampled_);
  for (RequestId id : finished) runner_.ReleaseRequest(id);
  done.insert(done.end(), finished.begin(), finished.end());
  return done;
}

Result<std::vector<std::unique_ptr<Request>>> Engine::Generate(
    const std::vector<std::vector<uint32_t>>& prompts, size_t max_new_tokens) {
  std::vector<RequestId> ids;
  for (const auto& p : prompts) {
    KVSTASH_ASSIGN_OR_RETURN(RequestId id, AddRequest(p, max_new_tokens));
    ids.push_back(id);
  }
  while (HasUnfinished()) Step();
  std::vector<std::unique_ptr<Request>> results;
  for (RequestId id : ids) {
    std::unique_ptr<Request> r = TakeResult(id);
    if (r->state == Request::State::kFailed) return r->error;
    results.push_back(std::move(r));
  }
  return results;
}

}  // namespace kvstash::engine
