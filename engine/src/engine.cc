#include "kvstash/engine/engine.h"

#include <algorithm>
#include <chrono>
#include <new>
#include <thread>

#include "kvstash/common/hash.h"
#include "kvstash/common/logging.h"

namespace kvstash::engine {

Result<std::unique_ptr<Engine>> Engine::Create(ModelConfig config, EngineOptions options) {
  KVSTASH_RETURN_IF_ERROR(config.Validate());
  KVSTASH_ASSIGN_OR_RETURN(KvLayout layout, KvLayout::Build(config, options.block_size,
                                                            options.attn_pack, options.swa_ring));
  if (options.num_blocks < 2) {
    return InvalidArgumentError("the pool needs at least 2 blocks (block 0 is the null block)");
  }
  ModelWeights weights;
  try {
    if (!options.weights_path.empty()) {
      KVSTASH_ASSIGN_OR_RETURN(weights,
                               ModelWeights::FromSafetensors(config, options.weights_path));
    } else {
      weights = ModelWeights::FromSeed(config, options.seed.value_or(config.seed));
    }
  } catch (const std::bad_alloc&) {
    // The weights live in host memory first; a model larger than it is an error, not a crash.
    return ResourceExhaustedError("the weights of model '{}' do not fit in host memory",
                                  config.name);
  }
  // What a block's KV depends on besides its tokens: the model, its weights, the page layout.
  std::string identity = config.ToJson();
  identity += options.weights_path.empty()
                  ? " seed=" + std::to_string(options.seed.value_or(config.seed))
                  : " weights=" + options.weights_path;
  identity += " block_size=" + std::to_string(layout.block_size) +
              " pack=" + std::to_string(layout.attn_pack) +
              " page=" + std::to_string(layout.page_floats);
  const uint64_t fingerprint = Xxh3Hash64(std::as_bytes(std::span(identity)));
  const bool offload = static_cast<bool>(options.offload);
  if (offload && options.swa_ring) {
    return UnimplementedError("offload with --swa-ring is not supported yet");
  }
  KvCacheManagerOptions kv;
  kv.groups = layout.groups;
  kv.num_blocks = options.num_blocks;
  kv.prefix_caching = options.prefix_caching;
  kv.record_events = options.record_cache_events;
  SchedulerOptions sched = options.scheduler;
  // Another model's blocks then never share a hash (nor a node key) with this one's.
  sched.cache_salt = Engine::CacheSaltOf(fingerprint);
  KVSTASH_ASSIGN_OR_RETURN(std::unique_ptr<kernels::Device> device,
                           kernels::MakeDevice(options.device));
  KVSTASH_ASSIGN_OR_RETURN(
      ModelRunner runner,
      ModelRunner::Create(std::move(config), std::move(weights), std::move(layout),
                          options.num_blocks, std::move(device)));
  std::unique_ptr<Engine> engine(new Engine(std::move(runner), std::move(kv), sched));
  engine->fingerprint_ = fingerprint;
  if (offload) {
    OffloadContext context;
    context.layout = &engine->runner_.layout();
    ModelRunner* built = &engine->runner_;
    context.pool = built->host_pool();
    if (!built->host_pool_is_pool()) {
      context.pages_to_host = [built](std::span<const uint32_t> b) {
        return built->PagesToHost(b);
      };
      context.pages_to_device = [built](std::span<const uint32_t> b) {
        return built->PagesToDevice(b);
      };
    }
    context.kv_cache = &engine->kv_cache_;
    context.fingerprint = fingerprint;
    context.prefix_caching = options.prefix_caching;
    KVSTASH_ASSIGN_OR_RETURN(engine->offload_, options.offload(context));
    engine->scheduler_.SetExternalSource(engine->offload_.get());
  }
  return engine;
}

Engine::~Engine() { DrainOffload(); }

void Engine::DrainOffload() {
  if (offload_) offload_->Drain();
}

Engine::Engine(ModelRunner runner, KvCacheManagerOptions kv_options, SchedulerOptions sched)
    : runner_(std::move(runner)), kv_cache_(std::move(kv_options)), scheduler_(sched, &kv_cache_) {}

Result<RequestId> Engine::AddRequest(std::vector<uint32_t> prompt, size_t max_new_tokens,
                                     bool do_remote_decode) {
  if (!device_error_.ok()) return device_error_;
  if (prompt.empty()) return InvalidArgumentError("empty prompt");
  if (max_new_tokens == 0) return InvalidArgumentError("max_new_tokens must be at least 1");
  for (size_t i = 0; i < prompt.size(); ++i) {
    if (prompt[i] >= config().vocab_size) {
      return InvalidArgumentError("prompt token {} at position {} is outside the vocabulary of {}",
                                  prompt[i], i, config().vocab_size);
    }
  }
  auto r = std::make_unique<Request>();
  r->id = next_id_++;
  r->num_prompt_tokens = prompt.size();
  r->tokens = std::move(prompt);
  r->max_new_tokens = max_new_tokens;
  r->do_remote_decode = do_remote_decode;
  const RequestId id = r->id;
  scheduler_.Add(std::move(r));
  return id;
}

Status Engine::CheckFits(size_t num_prompt_tokens, size_t max_new_tokens) const {
  if (num_prompt_tokens == 0 || max_new_tokens == 0) return Status::OK();  // AddRequest refuses
  const size_t pool = kv_cache_.num_blocks() - 1;  // block 0 is the null block
  const size_t at_prompt = kv_cache_.MinBlocksHeldAt(num_prompt_tokens - 1);
  if (at_prompt > pool) {
    return OutOfRangeError(
        "a prompt of {} tokens needs {} KV-cache blocks of {} tokens at its last token, more "
        "than the pool's {}",
        num_prompt_tokens, at_prompt, layout().block_size, pool);
  }
  // The last generated token is sampled, never computed: the last computed position is the
  // one before it.
  const size_t peak =
      kv_cache_.MinBlocksToCompute(num_prompt_tokens - 1, num_prompt_tokens + max_new_tokens - 2);
  if (peak > pool) {
    return OutOfRangeError(
        "a prompt of {} tokens and {} new tokens need {} KV-cache blocks of {} tokens at their "
        "peak, more than the pool's {}",
        num_prompt_tokens, max_new_tokens, peak, layout().block_size, pool);
  }
  return Status::OK();
}

Status Engine::Abort(RequestId id) {
  std::unique_ptr<Request> r = scheduler_.Remove(id);
  if (r == nullptr) return NotFoundError("no request {} in the engine", id);
  if (r->state == Request::State::kFinished || r->state == Request::State::kFailed) {
    return Status::OK();  // its blocks and transfers were let go when it ended
  }
  runner_.ReleaseRequest(id);
  if (offload_) {
    offload_->RequestFinished(id);
    finished_since_step_.push_back(id);
  }
  return Status::OK();
}

std::vector<RequestId> Engine::Step() {
  SchedulerOutput out = scheduler_.Schedule();
  counters_.preemptions += out.preempted.size();
  // Their rings go back now: a preempted request recomputes, from its prefix-cache hit.
  for (RequestId id : out.preempted) runner_.ReleaseRequest(id);
  for (RequestId id : out.failed) runner_.ReleaseRequest(id);
  std::vector<RequestId> done = out.failed;
  // Offload: this step's flushes and loads go out before the forward pass, so the loads run
  // while it computes; its stores go out after it, once their pages hold the step's KV.
  std::vector<std::pair<RequestId, KvOffload::JobId>> loads;
  if (offload_) {
    for (RequestId id : out.failed) offload_->RequestFinished(id);
    loads = offload_->BeginStep(out, finished_since_step_);
    finished_since_step_.clear();
  }
  if (!out.seqs.empty()) {
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
    if (Status s = runner_.Forward(inputs_, logits_); !s.ok()) {
      // A device fault leaves nothing on it to trust: every request fails, and so does every
      // later one. Transfers in flight end in Drain.
      KVSTASH_LOG_ERROR("engine: the {} device failed: {}", runner_.device().name(), s.ToString());
      device_error_ = s;
      for (RequestId id : scheduler_.FailAll(s)) {
        runner_.ReleaseRequest(id);
        if (offload_) offload_->RequestFinished(id);
        done.push_back(id);
      }
      return done;
    }
    const size_t vocab = config().vocab_size;
    sampled_.resize(out.seqs.size());
    for (size_t i = 0; i < out.seqs.size(); ++i) {
      const float* row = logits_.data() + i * vocab;
      // Greedy; the lowest id wins a tie, so equal logits give equal tokens everywhere.
      sampled_[i] = static_cast<uint32_t>(std::max_element(row, row + vocab) - row);
    }
  }
  if (offload_) offload_->EndStep();
  if (!out.seqs.empty()) {
    std::vector<RequestId> finished = scheduler_.Update(out, sampled_);
    for (RequestId id : finished) {
      runner_.ReleaseRequest(id);
      if (offload_) {
        offload_->RequestFinished(id);
        finished_since_step_.push_back(id);
      }
    }
    done.insert(done.end(), finished.begin(), finished.end());
  }
  // Nothing ran and nothing loads: every waiting request was told to ask again. Give the
  // nodes a moment instead of spinning.
  if (out.seqs.empty() && out.loading.empty() && scheduler_.HasUnfinished()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  // Requests whose load was submitted in this step wait for it here, then run next step: from
  // what arrived, or (a node down, late, or a bad block) from their local hit.
  if (!out.loading.empty()) {
    std::vector<KvOffload::JobId> jobs;
    for (const auto& [request, job] : loads) jobs.push_back(job);
    const std::unordered_map<KvOffload::JobId, bool> ok = offload_->FinishLoads(jobs);
    for (Request* r : out.loading) {
      bool arrived = false;
      for (const auto& [request, job] : loads) {
        if (request == r->id) arrived = ok.contains(job) && ok.at(job);
      }
      if (!arrived) ++counters_.load_failures;
      scheduler_.LoadFinished(r, arrived);
    }
  }
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
