#include "kvstash/store/tiered_store.h"

#include <stdlib.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>

#include "kvstash/common/logging.h"
#include "kvstash/common/mutex.h"

namespace kvstash::store {

Result<CascadeMode> ParseCascadeMode(std::string_view name) {
  if (name == "write-through") return CascadeMode::kWriteThrough;
  if (name == "write-back") return CascadeMode::kWriteBack;
  return InvalidArgumentError("unknown cascade mode '{}' (expected write-through or write-back)",
                              name);
}

std::string_view CascadeModeName(CascadeMode mode) {
  return mode == CascadeMode::kWriteBack ? "write-back" : "write-through";
}

// A fixed set of threads running queued jobs, with a wait for "nothing queued or running".
// Thread-safe.
class TieredStore::IoPool {
 public:
  IoPool(size_t threads, std::function<void()> before_job) : before_job_(std::move(before_job)) {
    for (size_t i = 0; i < threads; ++i) threads_.emplace_back([this] { Run(); });
  }
  ~IoPool() {
    {
      MutexLock lock(&mu_);
      stopping_ = true;
    }
    work_.SignalAll();
    for (std::thread& t : threads_) t.join();
  }

  void Submit(std::function<void()> job) {
    {
      MutexLock lock(&mu_);
      queue_.push_back(std::move(job));
      ++unfinished_;
    }
    work_.Signal();
  }

  void WaitIdle() {
    MutexLock lock(&mu_);
    while (unfinished_ != 0) idle_.Wait(&mu_);
  }

 private:
  void Run() {
    for (;;) {
      std::function<void()> job;
      {
        MutexLock lock(&mu_);
        while (!stopping_ && queue_.empty()) work_.Wait(&mu_);
        if (queue_.empty()) return;  // stopping, nothing left
        job = std::move(queue_.front());
        queue_.pop_front();
      }
      if (before_job_) before_job_();
      job();
      {
        MutexLock lock(&mu_);
        if (--unfinished_ == 0) idle_.SignalAll();
      }
    }
  }

  const std::function<void()> before_job_;
  Mutex mu_;
  CondVar work_, idle_;
  std::deque<std::function<void()>> queue_ GUARDED_BY(mu_);
  size_t unfinished_ GUARDED_BY(mu_) = 0;
  bool stopping_ GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

struct TieredStore::Counters {
  std::atomic<uint64_t> promotions_started{0}, promotions_done{0}, promotion_failures{0},
      cascades_done{0}, cascade_failures{0}, writebacks_staged{0}, writebacks_unstaged{0},
      failed_cascade_calls{0}, cpu_evictions{0}, quota_refusals{0}, promotions_deferred{0},
      cascades_deferred{0};
  // Staging buffers for write-back, block_bytes each, reused.
  Mutex staging_mu;
  std::vector<std::byte*> staging_free GUARDED_BY(staging_mu);
  size_t staging_allocated GUARDED_BY(staging_mu) = 0;
  ~Counters() {
    MutexLock lock(&staging_mu);
    for (std::byte* p : staging_free) std::free(p);
  }

  // A staging buffer, or nullptr when `limit` are in use.
  std::byte* AcquireStaging(size_t bytes, size_t limit) {
    MutexLock lock(&staging_mu);
    if (!staging_free.empty()) {
      std::byte* p = staging_free.back();
      staging_free.pop_back();
      return p;
    }
    if (staging_allocated >= limit) return nullptr;
    void* p = nullptr;
    if (posix_memalign(&p, 4096, (bytes + 4095) / 4096 * 4096) != 0) return nullptr;
    ++staging_allocated;
    return static_cast<std::byte*>(p);
  }
  void ReleaseStaging(std::byte* p) {
    MutexLock lock(&staging_mu);
    staging_free.push_back(p);
  }
};

Result<size_t> CpuMemoryBytes(const TieredStoreOptions& options) {
  BlockSlabOptions slab_options;
  slab_options.slot_bytes = options.block_bytes;
  slab_options.slot_count = options.cpu_capacity_blocks;
  return BlockSlab::RequiredBytes(slab_options);
}

Result<std::unique_ptr<TieredStore>> TieredStore::Create(const TieredStoreOptions& options) {
  if (options.block_bytes == 0) return InvalidArgumentError("the block size must be positive");
  if (options.io_threads == 0 && options.ssd) {
    return InvalidArgumentError("an SSD tier needs at least one I/O thread");
  }
  BlockManagerOptions cpu_options;
  cpu_options.capacity_blocks = options.cpu_capacity_blocks;
  cpu_options.policy = options.cpu_policy;
  ApplyAdmission(options.cpu_admission, &cpu_options);
  cpu_options.quotas = options.cpu_quotas;
  cpu_options.count_namespaces = options.count_namespaces;
  cpu_options.enable_events = options.enable_events;
  cpu_options.max_pending_event_keys = options.max_pending_event_keys;
  KVSTASH_ASSIGN_OR_RETURN(std::unique_ptr<BlockManager> cpu, BlockManager::Create(cpu_options));
  BlockSlabOptions slab_options;
  slab_options.slot_bytes = options.block_bytes;
  slab_options.slot_count = options.cpu_capacity_blocks;
  slab_options.prefault = options.prefault;
  slab_options.huge_pages = options.huge_pages;
  slab_options.memory = options.cpu_memory;
  KVSTASH_ASSIGN_OR_RETURN(std::unique_ptr<BlockSlab> slab, BlockSlab::Create(slab_options));
  std::unique_ptr<SsdTier> ssd;
  if (options.ssd) {
    SsdTierOptions ssd_options = *options.ssd;
    ssd_options.block_bytes = options.block_bytes;
    ssd_options.enable_events = options.enable_events;
    ssd_options.max_pending_event_keys = options.max_pending_event_keys;
    KVSTASH_ASSIGN_OR_RETURN(ssd, SsdTier::Create(ssd_options));
  }
  return std::unique_ptr<TieredStore>(
      new TieredStore(options, std::move(cpu), std::move(slab), std::move(ssd)));
}

TieredStore::TieredStore(const TieredStoreOptions& options, std::unique_ptr<BlockManager> cpu,
                         std::unique_ptr<BlockSlab> slab, std::unique_ptr<SsdTier> ssd)
    : block_bytes_(options.block_bytes),
      cascade_(options.cascade),
      staging_limit_(options.writeback_staging_blocks),
      promotion_cap_(options.max_promotions_in_flight != 0
                         ? options.max_promotions_in_flight
                         : std::max<size_t>(64, options.cpu_capacity_blocks / 4)),
      cascade_cap_(options.max_cascades_in_flight != 0
                       ? options.max_cascades_in_flight
                       : std::max<size_t>(64, options.cpu_capacity_blocks / 2)),
      cpu_(std::move(cpu)),
      slab_(std::move(slab)),
      ssd_(std::move(ssd)),
      counters_(std::make_unique<Counters>()),
      io_(std::make_unique<IoPool>(ssd_ ? options.io_threads : 0, options.before_job_for_testing)) {
}

TieredStore::~TieredStore() {
  io_->WaitIdle();
  io_.reset();
}

// --- Lookups and promotion -------------------------------------------------------------------

LookupResult TieredStore::LookupLocked(const BlockKey& key, Deferred* deferred) {
  const LookupResult cpu = cpu_->Lookup(key);
  if (cpu != LookupResult::kMiss || !ssd_) return cpu;
  // Evicted from the CPU tier by a promotion earlier in this lookup, its write-back not yet
  // planned (that comes after the last key): held, and on SSD shortly, so asked for again.
  if (std::find(deferred->evicted.begin(), deferred->evicted.end(), key) !=
      deferred->evicted.end()) {
    return LookupResult::kRetry;
  }
  const LookupResult ssd = ssd_->Lookup(key);
  if (ssd != LookupResult::kHit) return ssd;
  // Only on SSD. Promotions hold CPU slots until their read is done: past the cap, the block
  // is asked for again (RETRY) without starting one, so that lookups faster than the disk
  // never fill the CPU tier with slots being written and leave no room for stores.
  if (promotions_in_flight_ >= promotion_cap_) {
    counters_->promotions_deferred += 1;
    return LookupResult::kRetry;
  }
  // Reserve a CPU slot (the CPU tier now answers RETRY, so the block is promoted once however
  // often it is looked up) and pin the SSD copy.
  const BlockKey keys[] = {key};
  StorePlan plan;
  if (!cpu_->PrepareStore(keys, &plan).ok()) {
    // No CPU room now (every slot pinned, being written or promoted, or the namespace's quota
    // all pinned): the block is held, so it is asked for again rather than reported missing.
    counters_->quota_refusals += plan.quota_refused;
    counters_->promotions_deferred += 1;
    return LookupResult::kRetry;
  }
  counters_->cpu_evictions += plan.evicted.size();  // gone even if the promotion fails below
  NoteEvictedLocked(plan, deferred);                // written back whatever comes of this promotion
  std::vector<SlotId> ssd_slots;
  if (!ssd_->PrepareLoad(keys, &ssd_slots).ok()) {
    cpu_->CompleteStore(keys, false);
    return LookupResult::kMiss;
  }
  deferred->promotion.keys.push_back(key);
  deferred->promotion.cpu_slots.push_back(plan.slots[0]);
  deferred->promotion.ssd_slots.push_back(ssd_slots[0]);
  counters_->promotions_started += 1;
  promotions_in_flight_ += 1;
  return LookupResult::kRetry;
}

LookupResult TieredStore::Lookup(const BlockKey& key) {
  LookupResult result;
  std::span<LookupResult> results(&result, 1);
  Lookup({&key, 1}, results);
  return result;
}

void TieredStore::Lookup(std::span<const BlockKey> keys, std::span<LookupResult> results) {
  Deferred deferred;
  {
    MutexLock lock(&mu_);
    const size_t n = std::min(keys.size(), results.size());
    for (size_t i = 0; i < n; ++i) results[i] = LookupLocked(keys[i], &deferred);
    PlanWriteBackLocked(&deferred);
  }
  Execute(std::move(deferred));
}

ScanResult TieredStore::LookupPrefix(std::span<const BlockKey> keys) {
  Deferred deferred;
  ScanResult result;
  {
    MutexLock lock(&mu_);
    result = MaximalPrefix(keys.size(), [&](size_t i) {
      mu_.AssertHeld();  // the scan runs under this function's lock
      return LookupLocked(keys[i], &deferred);
    });
    PlanWriteBackLocked(&deferred);
  }
  Execute(std::move(deferred));
  return result;
}

ScanResult TieredStore::LookupWindow(std::span<const BlockKey> keys, size_t window) {
  Deferred deferred;
  ScanResult result;
  {
    MutexLock lock(&mu_);
    result = SlidingWindow(keys.size(), window, [&](size_t i) {
      mu_.AssertHeld();  // the scan runs under this function's lock
      return LookupLocked(keys[i], &deferred);
    });
    PlanWriteBackLocked(&deferred);
  }
  Execute(std::move(deferred));
  return result;
}

void TieredStore::RunPromotion(const Transfer& promotion) {
  std::vector<BlockKey> good, bad;
  for (size_t i = 0; i < promotion.keys.size(); ++i) {
    std::span<std::byte> slot = slab_->Slot(promotion.cpu_slots[i]);
    Result<size_t> n = ssd_->Read(promotion.keys[i], promotion.ssd_slots[i], slot);
    if (n.ok()) {
      // A block stored shorter than the tier's block size: the rest of the slot is zeros.
      if (*n < slot.size()) std::memset(slot.data() + *n, 0, slot.size() - *n);
      good.push_back(promotion.keys[i]);
    } else {
      KVSTASH_LOG_WARN("promotion of {} failed; it is dropped from SSD: {}",
                       promotion.keys[i].ToString(), n.status().ToString());
      bad.push_back(promotion.keys[i]);
    }
  }
  MutexLock lock(&mu_);
  ssd_->CompleteLoad(promotion.keys).IgnoreError();
  ssd_->Remove(bad);
  cpu_->CompleteStore(good, true);
  cpu_->CompleteStore(bad, false);
  counters_->promotions_done += good.size();
  promotions_in_flight_ -= promotion.keys.size();
  counters_->promotion_failures += bad.size();
}

// --- Write-back ------------------------------------------------------------------------------

bool SlotGate::open() const {
  MutexLock lock(&mu_);
  return open_;
}

void SlotGate::WhenOpen(std::function<void()> fn) {
  {
    MutexLock lock(&mu_);
    if (!open_) {
      waiting_.push_back(std::move(fn));
      return;
    }
  }
  fn();
}

void SlotGate::Wait() const {
  MutexLock lock(&mu_);
  while (!open_) cv_.Wait(&mu_);
}

void SlotGate::Open() {
  std::vector<std::function<void()>> waiting;
  {
    MutexLock lock(&mu_);
    open_ = true;
    waiting.swap(waiting_);
    cv_.SignalAll();
  }
  for (auto& fn : waiting) fn();
}

void TieredStore::NoteEvictedLocked(const StorePlan& plan, Deferred* deferred) {
  // Under write-back an evicted block goes to SSD now, before its slot is reused; under
  // write-through it is there already, unless its cascade was deferred (then it goes now).
  for (size_t i = 0; i < plan.evicted.size(); ++i) {
    if (cascade_ != CascadeMode::kWriteBack && deferred_cascades_.erase(plan.evicted[i]) == 0) {
      continue;
    }
    deferred->evicted.push_back(plan.evicted[i]);
    deferred->evicted_slots.push_back(plan.evicted_slots[i]);
  }
}

void TieredStore::PlanWriteBackLocked(Deferred* deferred) {
  if (deferred->evicted.empty()) return;
  std::vector<BlockKey> keys;
  std::vector<SlotId> cpu_slots;
  for (size_t i = 0; i < deferred->evicted.size(); ++i) {
    if (ssd_->Lookup(deferred->evicted[i]) != LookupResult::kMiss) continue;  // already there
    keys.push_back(deferred->evicted[i]);
    cpu_slots.push_back(deferred->evicted_slots[i]);
  }
  if (keys.empty()) return;
  StorePlan plan;
  Status s = ssd_->PrepareStore(keys, &plan);
  if (!s.ok()) {
    counters_->cascade_failures += keys.size();
    KVSTASH_LOG_WARN("write-back of {} evicted blocks dropped: {}", keys.size(), s.ToString());
    return;
  }
  // Evicted keys are distinct and absent from SSD, so the plan stores all of them in order.
  deferred->write_back.keys = std::move(plan.keys_to_store);
  deferred->write_back.cpu_slots = std::move(cpu_slots);
  deferred->write_back.ssd_slots = std::move(plan.slots);
}

std::shared_ptr<SlotGate> TieredStore::Execute(Deferred deferred,
                                               std::span<const BlockKey> stored) {
  Transfer& wb = deferred.write_back;
  std::shared_ptr<SlotGate> gate;
  if (!wb.keys.empty()) {
    // Copy what fits in staging and write it in the background; the rest is written in the
    // background straight from the CPU slots, which nobody writes until that is done (the
    // stores given them wait for the gate; a promotion into them runs after, in the same job).
    Transfer staged, unstaged;
    std::vector<std::byte*> buffers;
    std::vector<std::span<const std::byte>> unstaged_sources;
    for (size_t i = 0; i < wb.keys.size(); ++i) {
      const std::span<const std::byte> bytes = slab_->Slot(wb.cpu_slots[i]);
      std::byte* buffer = counters_->AcquireStaging(block_bytes_, staging_limit_);
      Transfer& to = buffer != nullptr ? staged : unstaged;
      to.keys.push_back(wb.keys[i]);
      to.ssd_slots.push_back(wb.ssd_slots[i]);
      if (buffer != nullptr) {
        std::memcpy(buffer, bytes.data(), bytes.size());
        buffers.push_back(buffer);
      } else {
        unstaged_sources.push_back(bytes);
      }
    }
    counters_->writebacks_staged += staged.keys.size();
    counters_->writebacks_unstaged += unstaged.keys.size();
    if (!staged.keys.empty()) {
      io_->Submit([this, staged = std::move(staged), buffers = std::move(buffers)] {
        std::vector<std::span<const std::byte>> sources;
        for (std::byte* b : buffers) sources.emplace_back(b, block_bytes_);
        WriteToSsd(staged, sources);
        for (std::byte* b : buffers) counters_->ReleaseStaging(b);
      });
    }
    if (!unstaged.keys.empty()) {
      gate = std::make_shared<SlotGate>();
      std::vector<BlockKey> gated(stored.begin(), stored.end());
      if (!gated.empty()) {
        MutexLock lock(&mu_);
        for (const BlockKey& key : gated) gated_[key] = gate;
      }
      io_->Submit([this, gate, gated = std::move(gated), unstaged = std::move(unstaged),
                   sources = std::move(unstaged_sources),
                   promotion = std::move(deferred.promotion)] {
        WriteToSsd(unstaged, sources);
        std::vector<BlockKey> aborted;
        {
          MutexLock lock(&mu_);
          for (const BlockKey& key : gated) {
            if (auto it = gated_.find(key); it != gated_.end() && it->second == gate) {
              gated_.erase(it);
            }
            if (auto it = std::find(aborted_while_gated_.begin(), aborted_while_gated_.end(), key);
                it != aborted_while_gated_.end()) {
              aborted_while_gated_.erase(it);
              aborted.push_back(key);
            }
          }
          if (!aborted.empty()) cpu_->CompleteStore(aborted, false);
        }
        gate->Open();
        if (!promotion.keys.empty()) RunPromotion(promotion);
      });
      return stored.empty() ? nullptr : gate;
    }
  }
  if (!deferred.promotion.keys.empty()) {
    io_->Submit([this, promotion = std::move(deferred.promotion)] { RunPromotion(promotion); });
  }
  return gate;
}

void TieredStore::WriteToSsd(const Transfer& transfer,
                             std::span<const std::span<const std::byte>> sources) {
  std::vector<SsdWrite> writes;
  writes.reserve(transfer.keys.size());
  for (size_t i = 0; i < transfer.keys.size(); ++i) {
    writes.push_back({transfer.keys[i], transfer.ssd_slots[i], sources[i]});
  }
  Status s = ssd_->WriteAndCommit(writes);
  if (s.ok()) {
    counters_->cascades_done += writes.size();
  } else {
    const uint64_t before = counters_->cascade_failures.fetch_add(writes.size());
    // A full disk fails every store: log the 1st, 2nd, 4th, 8th ... failed call, not all.
    const uint64_t calls = counters_->failed_cascade_calls.fetch_add(1) + 1;
    if (std::has_single_bit(calls)) {
      KVSTASH_LOG_WARN(
          "{} blocks not written to SSD (they stay in the CPU tier until evicted; {} blocks "
          "failed so far): {}",
          writes.size(), before + writes.size(), s.ToString());
    }
  }
}

// --- Loads and stores ------------------------------------------------------------------------

Status TieredStore::PrepareLoad(std::span<const BlockKey> keys,
                                std::vector<std::span<const std::byte>>* blocks) {
  std::vector<SlotId> slots;
  blocks->clear();
  KVSTASH_RETURN_IF_ERROR(cpu_->PrepareLoad(keys, &slots));
  for (SlotId slot : slots) blocks->push_back(slab_->Slot(slot));
  return Status::OK();
}

Status TieredStore::CompleteLoad(std::span<const BlockKey> keys) {
  return cpu_->CompleteLoad(keys);
}

void TieredStore::Touch(std::span<const BlockKey> keys, TouchKind kind) {
  cpu_->Touch(keys, kind);
  if (ssd_) ssd_->Touch(keys, kind);
}

Status TieredStore::PrepareStore(std::span<const BlockKey> keys, StorePlan* plan,
                                 std::shared_ptr<SlotGate>* gate,
                                 std::span<const StoreHint> hints) {
  Deferred deferred;
  {
    MutexLock lock(&mu_);
    if (Status s = cpu_->PrepareStore(keys, plan, hints); !s.ok()) {
      counters_->quota_refusals += plan->quota_refused;
      return s;
    }
    counters_->cpu_evictions += plan->evicted.size();
    if (ssd_) {
      NoteEvictedLocked(*plan, &deferred);
      PlanWriteBackLocked(&deferred);
    }
  }
  std::shared_ptr<SlotGate> closed = Execute(std::move(deferred), plan->keys_to_store);
  if (gate != nullptr) {
    *gate = std::move(closed);
  } else if (closed) {
    closed->Wait();
  }
  return Status::OK();
}

void TieredStore::StartCascadeLocked(std::span<const BlockKey> keys, Transfer* cascade,
                                     bool bounded) {
  std::vector<BlockKey> candidates;
  for (const BlockKey& key : keys) {
    if (cpu_->Lookup(key) != LookupResult::kHit || ssd_->Lookup(key) != LookupResult::kMiss) {
      continue;
    }
    if (std::find(candidates.begin(), candidates.end(), key) == candidates.end()) {
      candidates.push_back(key);
    }
  }
  // A cascade pins its CPU copies until the disk has them. Past the cap (a disk slower than the
  // stores) the rest wait for their eviction, as under write-back, instead of pinning the CPU
  // tier full and leaving no room for stores.
  if (bounded) {
    const size_t room = cascades_in_flight_ < cascade_cap_ ? cascade_cap_ - cascades_in_flight_ : 0;
    while (candidates.size() > room) {
      deferred_cascades_.insert(candidates.back());
      counters_->cascades_deferred += 1;
      candidates.pop_back();
    }
  }
  if (candidates.empty()) return;
  // A cascade that cannot start now leaves its blocks to their eviction, which writes them as
  // deferred ones (were they on no list, eviction would take them as on SSD already: lost).
  std::vector<SlotId> cpu_slots;
  if (!cpu_->PrepareLoad(candidates, &cpu_slots).ok()) {  // pin overflow
    deferred_cascades_.insert(candidates.begin(), candidates.end());
    return;
  }
  StorePlan plan;
  Status s = ssd_->PrepareStore(candidates, &plan);
  if (!s.ok()) {
    cpu_->CompleteLoad(candidates).IgnoreError();
    deferred_cascades_.insert(candidates.begin(), candidates.end());
    counters_->cascade_failures += candidates.size();
    KVSTASH_LOG_WARN("cascade of {} blocks to SSD deferred to their eviction: {}",
                     candidates.size(), s.ToString());
    return;
  }
  for (const BlockKey& key : candidates) deferred_cascades_.erase(key);
  cascades_in_flight_ += candidates.size();
  cascade->keys = std::move(candidates);
  cascade->cpu_slots = std::move(cpu_slots);
  cascade->ssd_slots = std::move(plan.slots);
}

void TieredStore::CompleteStore(std::span<const BlockKey> keys, bool success) {
  Transfer cascade;
  {
    MutexLock lock(&mu_);
    if (!success && !gated_.empty()) {
      // A slot a write-back still reads is freed when the write is done, not now: another
      // store would be given it and write it at once.
      std::vector<BlockKey> now;
      for (const BlockKey& key : keys) {
        if (gated_.contains(key)) {
          aborted_while_gated_.push_back(key);
        } else {
          now.push_back(key);
        }
      }
      cpu_->CompleteStore(now, false);
      return;
    }
    cpu_->CompleteStore(keys, success);
    if (success && ssd_ && cascade_ == CascadeMode::kWriteThrough) {
      StartCascadeLocked(keys, &cascade, /*bounded=*/true);
    }
  }
  if (!cascade.keys.empty()) {
    io_->Submit([this, cascade = std::move(cascade)] { RunCascade(cascade); });
  }
}

void TieredStore::RunCascade(const Transfer& cascade) {
  std::vector<std::span<const std::byte>> sources;
  for (SlotId slot : cascade.cpu_slots) sources.push_back(slab_->Slot(slot));
  WriteToSsd(cascade, sources);
  MutexLock lock(&mu_);
  cpu_->CompleteLoad(cascade.keys).IgnoreError();
  cascades_in_flight_ -= cascade.keys.size();
}

void TieredStore::WaitIdle() { io_->WaitIdle(); }

Status TieredStore::Flush() {
  WaitIdle();
  if (!ssd_) return Status::OK();
  if (cascade_ != CascadeMode::kWriteBack) {
    // Write-through: only the cascades deferred past the cap are left to write.
    MutexLock lock(&mu_);
    if (deferred_cascades_.empty()) return Status::OK();
  }
  const BlockManagerState state = cpu_->DebugState();
  std::vector<BlockKey> keys;
  for (const auto* list : {&state.lru, &state.t1, &state.t2}) {
    for (const BlockInfo& block : *list) {
      if (block.ref_count >= 0) keys.push_back(block.key);
    }
  }
  constexpr size_t kBatch = 64;
  const uint64_t failures_before = counters_->cascade_failures;
  for (size_t first = 0; first < keys.size(); first += kBatch) {
    const std::span<const BlockKey> batch =
        std::span<const BlockKey>(keys).subspan(first, std::min(kBatch, keys.size() - first));
    Transfer cascade;
    {
      MutexLock lock(&mu_);
      StartCascadeLocked(batch, &cascade, /*bounded=*/false);
    }
    if (!cascade.keys.empty()) RunCascade(cascade);
  }
  const uint64_t failed = counters_->cascade_failures - failures_before;
  if (failed > 0) {
    return UnavailableError("{} of {} CPU blocks could not be written to SSD", failed, keys.size());
  }
  return Status::OK();
}

TieredStoreStats TieredStore::stats() const {
  TieredStoreStats s;
  s.promotions_started = counters_->promotions_started;
  s.promotions_done = counters_->promotions_done;
  s.promotions_deferred = counters_->promotions_deferred;
  s.cascades_deferred = counters_->cascades_deferred;
  s.promotion_failures = counters_->promotion_failures;
  s.cascades_done = counters_->cascades_done;
  s.cascade_failures = counters_->cascade_failures;
  s.writebacks_staged = counters_->writebacks_staged;
  s.writebacks_unstaged = counters_->writebacks_unstaged;
  s.cpu_evictions = counters_->cpu_evictions;
  s.quota_refusals = counters_->quota_refusals;
  return s;
}

}  // namespace kvstash::store
