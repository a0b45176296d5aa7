#include "kvstash/connector/kv_connector.h"

#include <chrono>
#include <unordered_map>
#include <unordered_set>

#include "kvstash/common/logging.h"

namespace kvstash::connector {

// The scheduler side's manager over the nodes. A node keeps its own recency and evicts on its
// own; a load's blocks are pinned on their nodes until it completes. Lookups are answered from one
// batched lookup of the request's keys (Prefetch), so the per-key scan of the scheduler side costs
// no round trip per key.
//
// Touches are what a node learns of use (docs/semantics.md §7.3, §7.6: touch after the lookup and
// after the store decision, the first key most recent). They are gathered per step and sent
// asynchronously by the transfer thread, never on a request's path (TakeStepTouches):
//   - the lookups' touches go before the step's stores: a hit moves up (ARC: to T2), and a key
//     the request is about to store again is a ghost hit that adapts ARC;
//   - the store decisions' touches go after the step's stores have ended, without the keys
//     offered for store in this step: a node inserts a new block as most recent itself (and
//     ARC keeps it in T1 until a second use), and counts the store of a block it already holds
//     as a touch. So the request's earlier blocks end more recent than its new ones, as in
//     vLLM, and LRU evicts a sequence from its tail.
// Called from the engine's thread only.
class NodeOffloadManager : public OffloadManager {
 public:
  explicit NodeOffloadManager(BlockStoreClient* client) : client_(client) {}

  void Prefetch(std::span<const BlockKey> keys) {
    known_.clear();
    if (keys.empty()) return;
    std::vector<LookupResult> states = client_->Lookup(keys);
    for (size_t i = 0; i < keys.size(); ++i) known_[keys[i]] = states[i];
  }

  LookupResult Lookup(const BlockKey& key) override {
    if (auto it = known_.find(key); it != known_.end()) return it->second;
    return client_->Lookup(std::span<const BlockKey>(&key, 1))[0];
  }
  // A load's keys are pinned on their nodes from the scheduler's decision until the load is
  // done (the engine's load reads them from the pins), as vLLM's manager pins them.
  void PrepareLoad(std::span<const BlockKey> keys) override {
    client_->Pin(keys);
    for (const BlockKey& key : keys) ++pinned_[key];
  }
  void CompleteLoad(std::span<const BlockKey> keys) override {
    client_->Unpin(keys);
    for (const BlockKey& key : keys) {
      if (auto it = pinned_.find(key); it != pinned_.end() && --it->second == 0) pinned_.erase(it);
    }
  }
  // Nodes skip a block they already hold without moving its bytes, so every key is offered.
  std::optional<std::vector<BlockKey>> PrepareStore(std::span<const BlockKey> keys) override {
    offered_.insert(keys.begin(), keys.end());
    return std::vector<BlockKey>(keys.begin(), keys.end());
  }
  void CompleteStore(std::span<const BlockKey>) override {}
  void Touch(std::span<const BlockKey> keys) override {
    if (keys.empty()) return;
    (deciding_stores_ ? store_touches_ : lookup_touches_).emplace_back(keys.begin(), keys.end());
  }
  // The scheduler forgets its jobs, whose loads will never complete: their pins go.
  void ResetCache() override {
    known_.clear();
    std::vector<BlockKey> pins;
    for (const auto& [key, count] : pinned_) pins.insert(pins.end(), count, key);
    client_->Unpin(pins);
    pinned_.clear();
  }

  // The scheduler decides the step's stores next: touches from here on are store touches.
  void BeginStoreDecisions() { deciding_stores_ = true; }

  struct StepTouches {
    std::vector<BlockKey> before_stores, after_stores;
  };
  // The step's touches, each list as one touch equivalent to the calls in order (the last
  // call's keys first, a key where it first appears), and starts the next step.
  StepTouches TakeStepTouches() {
    StepTouches out;
    out.before_stores = Merge(lookup_touches_, nullptr);
    out.after_stores = Merge(store_touches_, &offered_);
    lookup_touches_.clear();
    store_touches_.clear();
    offered_.clear();
    deciding_stores_ = false;
    return out;
  }

 private:
  using KeySet = std::unordered_set<BlockKey>;

  // touch(c1); ...; touch(cn) leaves the same order as one touch of cn ++ c(n-1) ++ ... ++ c1
  // with each key kept where it first appears: a touch makes its first key the most recent.
  static std::vector<BlockKey> Merge(const std::vector<std::vector<BlockKey>>& calls,
                                     const KeySet* without) {
    std::vector<BlockKey> out;
    KeySet seen;
    for (auto call = calls.rbegin(); call != calls.rend(); ++call) {
      for (const BlockKey& key : *call) {
        if (without != nullptr && without->contains(key)) continue;
        if (seen.insert(key).second) out.push_back(key);
      }
    }
    return out;
  }

  BlockStoreClient* client_;
  std::unordered_map<BlockKey, LookupResult> known_;
  bool deciding_stores_ = false;
  std::vector<std::vector<BlockKey>> lookup_touches_, store_touches_;
  KeySet offered_;                                 // keys offered for store in this step
  std::unordered_map<BlockKey, uint32_t> pinned_;  // keys of loads not completed: their pins
};

namespace {

Status CheckBlockSizeFactors(const OffloadSchedulerOptions& options) {
  for (const OffloadGroupConfig& g : options.groups) {
    if (g.block_size_factor != 1) {
      return UnimplementedError("offloaded blocks of {} engine blocks: only 1 is supported",
                                g.block_size_factor);
    }
  }
  return Status::OK();
}

}  // namespace

Result<std::unique_ptr<KvConnector>> KvConnector::Create(KvConnectorOptions options) {
  KVSTASH_RETURN_IF_ERROR(CheckBlockSizeFactors(options.scheduler));
  // A node of another block size that joins later is refused at membership, never used (one
  // that answers at start fails Create, in BlockTransfer::Create).
  if (options.client.block_bytes == 0 && options.pool.page_bytes != 0) {
    options.client.block_bytes = OffloadedBlockBytes(1, options.pool.page_bytes);
  }
  KVSTASH_ASSIGN_OR_RETURN(std::unique_ptr<NodeClient> client, NodeClient::Create(options.client));
  return Create(std::move(options), std::move(client), nullptr);
}

Result<std::unique_ptr<KvConnector>> KvConnector::Create(KvConnectorOptions options,
                                                         std::unique_ptr<BlockStoreClient> client,
                                                         std::unique_ptr<OffloadManager> manager) {
  KVSTASH_RETURN_IF_ERROR(CheckBlockSizeFactors(options.scheduler));
  if (client == nullptr) return InvalidArgumentError("the connector needs a block store client");
  BlockTransferOptions t;
  t.client = client.get();
  t.pool = options.pool;
  t.pages_per_block = 1;
  t.fingerprint = options.fingerprint;
  KVSTASH_ASSIGN_OR_RETURN(std::unique_ptr<BlockTransfer> transfer, BlockTransfer::Create(t));
  NodeOffloadManager* node_manager = nullptr;
  if (manager == nullptr) {
    auto own = std::make_unique<NodeOffloadManager>(client.get());
    node_manager = own.get();
    manager = std::move(own);
  }
  KVSTASH_ASSIGN_OR_RETURN(std::unique_ptr<OffloadScheduler> scheduler,
                           OffloadScheduler::Create(options.scheduler, std::move(manager)));
  auto connector = std::unique_ptr<KvConnector>(
      new KvConnector(std::move(client), std::move(scheduler), std::move(transfer), node_manager));
  connector->pages_to_host_ = std::move(options.pages_to_host);
  connector->pages_to_device_ = std::move(options.pages_to_device);
  return connector;
}

KvConnector::KvConnector(std::unique_ptr<BlockStoreClient> client,
                         std::unique_ptr<OffloadScheduler> scheduler,
                         std::unique_ptr<BlockTransfer> transfer, NodeOffloadManager* manager)
    : client_(std::move(client)),
      scheduler_(std::move(scheduler)),
      transfer_(std::move(transfer)),
      manager_(manager) {}

KvConnector::~KvConnector() {
  if (transfer_) transfer_->WaitAll();
}

std::optional<size_t> KvConnector::GetNumNewMatchedTokens(const OffloadRequestView& request,
                                                          size_t num_computed_tokens) {
  // Another manager answers lookups itself.
  if (manager_ == nullptr) return scheduler_->GetNumNewMatchedTokens(request, num_computed_tokens);
  std::vector<BlockKey> keys;
  const auto groups = scheduler_->groups();
  for (uint32_t g = 0; g < groups.size(); ++g) {
    const size_t f = groups[g].hashes_per_block;
    for (size_t i = 0; (i + 1) * f <= request.block_hashes.size(); ++i) {
      keys.push_back(BlockKey{request.block_hashes[i * f + f - 1], g});
    }
  }
  manager_->Prefetch(keys);
  return scheduler_->GetNumNewMatchedTokens(request, num_computed_tokens);
}

Status KvConnector::UpdateStateAfterAlloc(const OffloadRequestView& request,
                                          std::span<const std::vector<GpuBlockId>> blocks,
                                          size_t num_external_tokens) {
  return scheduler_->UpdateStateAfterAlloc(request, blocks, num_external_tokens);
}

Status KvConnector::Submit(const TransferJob& job, BlockJob::Kind kind) {
  if (job.keys.size() != job.gpu_blocks.size()) {
    return InternalError("job {}: {} keys for {} engine blocks", job.id, job.keys.size(),
                         job.gpu_blocks.size());
  }
  BlockJob b;
  b.id = job.id;
  b.kind = kind;
  b.keys = job.keys;
  b.metas = job.metas;
  for (GpuBlockId block : job.gpu_blocks) b.pages.push_back({block});
  return transfer_->Submit(std::move(b));
}

Result<std::vector<std::pair<RequestId, JobId>>> KvConnector::BeginStep(
    const SchedulerStepView& step) {
  Collect();
  if (manager_ != nullptr) manager_->BeginStoreDecisions();
  KVSTASH_ASSIGN_OR_RETURN(ConnectorMeta meta, scheduler_->BuildConnectorMeta(step));
  // Stores copy their pages when submitted, so a flush only has to wait for the job to end.
  transfer_->Wait(meta.jobs_to_flush);
  Collect();
  std::vector<std::pair<RequestId, JobId>> loads;
  for (const TransferJob& job : meta.load_jobs) {
    ++stats_.load_jobs;
    KVSTASH_RETURN_IF_ERROR(Submit(job, BlockJob::Kind::kLoad));
    if (pages_to_device_) load_pages_[job.id] = job.gpu_blocks;
    loads.emplace_back(job.request, job.id);
  }
  pending_stores_ = std::move(meta.store_jobs);
  return loads;
}

void KvConnector::SubmitTouches(bool before_stores) {
  if (manager_ == nullptr) return;
  if (!before_stores) {
    transfer_->SubmitTouch(std::exchange(after_store_touches_, {}), /*after_store=*/true);
    return;
  }
  NodeOffloadManager::StepTouches touches = manager_->TakeStepTouches();
  transfer_->SubmitTouch(std::move(touches.before_stores));
  after_store_touches_ = std::move(touches.after_stores);
}

Status KvConnector::EndStep() {
  // The step's lookup touches go before its stores, its store touches after them.
  SubmitTouches(/*before_stores=*/true);
  Status first = EndStepStores();
  SubmitTouches(/*before_stores=*/false);
  return first;
}

Status KvConnector::EndStepStores() {
  Status first;
  if (pages_to_host_ && !pending_stores_.empty()) {
    std::vector<uint32_t> pages;
    for (const TransferJob& job : pending_stores_) {
      pages.insert(pages.end(), job.gpu_blocks.begin(), job.gpu_blocks.end());
    }
    if (Status s = pages_to_host_(pages); !s.ok()) {
      // Never store what the mirror held before: the stores are dropped (acknowledged, so
      // nothing waits for them) and their blocks recomputed by whoever misses them.
      CompletedJobs dropped;
      for (const TransferJob& job : pending_stores_) {
        dropped[job.id] = 1;
        stats_.blocks_store_failed += job.gpu_blocks.size();
      }
      pending_stores_.clear();
      if (Status a = scheduler_->UpdateConnectorOutput(dropped); !a.ok()) {
        KVSTASH_LOG_ERROR("connector: dropping stores: {}", a.ToString());
      }
      return InternalError("stores dropped: their pages did not reach the host: {}", s.ToString());
    }
  }
  for (const TransferJob& job : pending_stores_) {
    ++stats_.store_jobs;
    Status s = Submit(job, BlockJob::Kind::kStore);
    if (!s.ok() && first.ok()) first = s;
  }
  pending_stores_.clear();
  Collect();
  return first;
}

void KvConnector::Collect() {
  CompletedJobs done;
  for (BlockJobResult& r : transfer_->Poll()) {
    done[r.id] = 1;
    if (!r.status.ok()) NoteFailure(r);
    const size_t ok = r.num_ok();
    if (r.kind == BlockJob::Kind::kLoad) {
      stats_.blocks_loaded += ok;
      stats_.blocks_load_failed += r.ok.size() - ok;
      stats_.bytes_loaded += r.bytes;
      load_outcomes_[r.id] = ok == r.ok.size();
    } else {
      stats_.blocks_stored += ok;
      stats_.blocks_store_failed += r.ok.size() - ok;
      stats_.bytes_stored += r.bytes;
    }
  }
  if (!done.empty()) {
    // Every job is the scheduler's own and acknowledged once: an error here is a bug.
    if (Status s = scheduler_->UpdateConnectorOutput(done); !s.ok()) {
      KVSTASH_LOG_ERROR("connector: acknowledging transfers: {}", s.ToString());
    }
  }
}

std::unordered_map<JobId, bool> KvConnector::FinishLoads(std::span<const JobId> jobs) {
  const auto start = std::chrono::steady_clock::now();
  transfer_->Wait(jobs);
  stats_.load_seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  Collect();
  std::unordered_map<JobId, bool> out;
  for (JobId id : jobs) {
    auto it = load_outcomes_.find(id);
    bool ok = it != load_outcomes_.end() && it->second;
    if (it != load_outcomes_.end()) load_outcomes_.erase(it);
    if (auto pages = load_pages_.find(id); pages != load_pages_.end()) {
      if (ok) {
        if (Status s = pages_to_device_(pages->second); !s.ok()) {
          KVSTASH_LOG_WARN("connector: load {} arrived but did not reach the device: {}", id,
                           s.ToString());
          ok = false;
        }
      }
      load_pages_.erase(pages);
    }
    out[id] = ok;
  }
  return out;
}

void KvConnector::NoteFailure(const BlockJobResult& r) {
  // Counted per block in the stats; logged once per kind of job and error code, as a node
  // that fails once usually fails the same way for every block.
  const bool load = r.kind == BlockJob::Kind::kLoad;
  if (!logged_failures_.insert({load, static_cast<int>(r.status.code())}).second) return;
  KVSTASH_LOG_WARN(
      "connector: {} job {}: {} of {} block(s) failed, first: {} ({}; logged once per error "
      "code, counted in blocks_{}_failed)",
      load ? "load" : "store", r.id, r.ok.size() - r.num_ok(), r.ok.size(), r.status.ToString(),
      load ? "the engine recomputes them" : "they are not offloaded", load ? "load" : "store");
}

KvConnectorStats KvConnector::stats() const {
  KvConnectorStats s = stats_;
  s.client = client_->counters();
  s.live_nodes = client_->nodes().size();
  return s;
}

void KvConnector::RequestFinished(RequestId id) { scheduler_->RequestFinished(id); }

void KvConnector::Drain() {
  // Touches of lookups not followed by a step still go out.
  if (manager_ != nullptr) {
    SubmitTouches(/*before_stores=*/true);
    SubmitTouches(/*before_stores=*/false);
  }
  transfer_->WaitAll();
  Collect();
}

}  // namespace kvstash::connector
