// TieredStore: one offload node's store, a CPU tier in front of an optional SSD tier.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string_view>
#include <vector>

#include "kvstash/common/block_key.h"
#include "kvstash/common/mutex.h"
#include "kvstash/common/status.h"
#include "kvstash/store/block_manager.h"
#include "kvstash/store/block_slab.h"
#include "kvstash/store/ssd_tier.h"

namespace kvstash::store {

// When a committed block reaches the SSD tier.
enum class CascadeMode : uint8_t {
  kWriteThrough,  // as soon as it is committed in the CPU tier (vLLM's tiering)
  kWriteBack,     // only when the CPU tier evicts it (and at Flush)
};

struct TieredStoreOptions;
// Bytes of CPU-tier memory the options need (see TieredStoreOptions::cpu_memory).
Result<size_t> CpuMemoryBytes(const TieredStoreOptions& options);

// "write-through" or "write-back"; InvalidArgument otherwise.
Result<CascadeMode> ParseCascadeMode(std::string_view name);
std::string_view CascadeModeName(CascadeMode mode);

struct TieredStoreOptions {
  // Bytes of every block (the CPU slot size; the SSD tier's block size).
  size_t block_bytes = 0;
  size_t cpu_capacity_blocks = 0;
  EvictionPolicy cpu_policy = EvictionPolicy::kLru;
  // What the CPU tier stores (ApplyAdmission).
  Admission cpu_admission = Admission::kAll;
  // Per-namespace ceilings in the CPU tier (BlockManagerOptions::quotas), which every store and
  // promotion goes through. The SSD tier has none: it holds what the CPU tier cascades to it.
  NamespaceQuotas cpu_quotas;
  // Count the CPU tier's blocks per namespace even without quotas (cpu().NamespaceUsages()).
  bool count_namespaces = false;
  // Record both tiers' stored and removed blocks (cpu().TakeEvents(), ssd()->TakeEvents()),
  // each tier's undrained events naming at most max_pending_event_keys keys (then a kLost
  // event; BlockManagerOptions).
  bool enable_events = false;
  size_t max_pending_event_keys = size_t{1} << 20;
  bool prefault = true;
  // Back the CPU tier with transparent huge pages (BlockSlabOptions::huge_pages); the caller
  // advises memory it provides itself.
  bool huge_pages = false;
  // The CPU tier's memory, when the caller provides it (a node: memory its transport shares
  // with clients); at least CpuMemoryBytes(options), page-aligned, outliving the store.
  // Empty: the store maps its own.
  std::span<std::byte> cpu_memory;
  // The SSD tier; its block_bytes is set from the field above. None: CPU only.
  std::optional<SsdTierOptions> ssd;
  CascadeMode cascade = CascadeMode::kWriteThrough;
  // Threads that move blocks between the tiers.
  size_t io_threads = 2;
  // Blocks being promoted from SSD at once (their CPU slots are being written meanwhile); a
  // lookup past it answers RETRY without starting another. 0: a quarter of the CPU tier (at
  // least 64).
  size_t max_promotions_in_flight = 0;
  // Write-through: blocks being written to SSD at once (their CPU copies pinned meanwhile); a
  // block committed past it is written when the CPU tier evicts it (or at Flush), as under
  // write-back. 0: half the CPU tier (at least 64). Together with the promotions' cap, this
  // keeps a quarter of the tier for stores and reads however far behind the disk is.
  size_t max_cascades_in_flight = 0;
  // Write-back: blocks evicted from the CPU tier are copied to this many staging buffers and
  // written in the background; when all are busy they are written in the background straight
  // from their CPU slots, which the evicting store then may not write until that is done (its
  // SlotGate; a lookup's promotion into them follows the write in the same job). No caller
  // ever writes to the disk itself.
  size_t writeback_staging_blocks = 16;
  // Tests only: runs on the I/O thread before each background job.
  std::function<void()> before_job_for_testing;
};

// Opens once the background writes a store's evictions needed have read the CPU slots that
// store was given (write-back with every staging buffer busy); until then those slots must
// not be written. Thread-safe.
class SlotGate {
 public:
  bool open() const;
  // Runs `fn` once open: at once, on this thread, when open already; else on the I/O thread
  // that opens it.
  void WhenOpen(std::function<void()> fn);
  void Wait() const;
  // The store's: opens the gate and runs the waiting functions.
  void Open();

 private:
  mutable Mutex mu_;
  mutable CondVar cv_;
  bool open_ GUARDED_BY(mu_) = false;
  std::vector<std::function<void()>> waiting_ GUARDED_BY(mu_);
};

// Counters since Create. Monotonic.
struct TieredStoreStats {
  uint64_t promotions_started = 0;  // blocks
  uint64_t promotions_done = 0;
  uint64_t promotion_failures = 0;  // unreadable on SSD: dropped, a miss
  // Lookups of SSD-only blocks answered RETRY without a promotion: max_promotions_in_flight
  // was reached, or the CPU tier had no slot to promote into.
  uint64_t promotions_deferred = 0;
  // Write-through: committed blocks whose cascade waited for their eviction, the disk being
  // behind by max_cascades_in_flight blocks.
  uint64_t cascades_deferred = 0;
  uint64_t cascades_done = 0;      // blocks written to SSD after a commit or an eviction
  uint64_t cascade_failures = 0;   // blocks the SSD tier could not take (full, no space)
  uint64_t writebacks_staged = 0;  // write-back blocks copied to staging
  // Write-back blocks written from their CPU slots (all staging busy): the store that evicted
  // them waited for the write (its SlotGate) before writing its bytes there.
  uint64_t writebacks_unstaged = 0;
  // Blocks the CPU tier evicted to make room for stores and promotions (under write-back they
  // go to SSD; the SSD tier counts its own evictions in SsdTierStats).
  uint64_t cpu_evictions = 0;
  // New blocks refused because their namespace was at its CPU quota with too few of its own
  // blocks idle to evict (stores, and promotions, which then answer RETRY).
  uint64_t quota_refusals = 0;
};

// The store of one offload node, with the tiering of docs/semantics.md §5 adapted to one node:
//   - stores land in the CPU tier (PrepareStore, write the slot, CompleteStore);
//   - a committed block reaches SSD at once (write-through; when evicted if the disk is
//     max_cascades_in_flight blocks behind) or when evicted (write-back);
//   - a lookup that finds a block only on SSD answers RETRY and starts promoting it to the
//     CPU tier in the background, one job per lookup call; once the promotion is done,
//     lookups answer HIT (at most max_promotions_in_flight at once, and only into a CPU slot
//     free to take: past the cap, or with no slot, a lookup answers RETRY and a later one
//     starts the promotion; a block held is never answered MISS for want of room);
//   - a block read by a promotion (its SSD copy) or a cascade (its CPU copy) is pinned, and a
//     promotion's CPU slot is being written, so neither can be evicted under the I/O.
// Loads (PrepareLoad .. CompleteLoad) read CPU-resident blocks only.
//
// Thread-safe. Tier decisions take one lock; block I/O runs on the store's I/O threads (or the
// calling thread for inline write-backs), outside it.
class TieredStore {
 public:
  // InvalidArgument for bad options; the SSD tier's error when it cannot open.
  static Result<std::unique_ptr<TieredStore>> Create(const TieredStoreOptions& options);
  // Waits for background work, then stops the I/O threads. Does not Flush.
  ~TieredStore();
  TieredStore(const TieredStore&) = delete;
  TieredStore& operator=(const TieredStore&) = delete;

  LookupResult Lookup(const BlockKey& key);
  // Per-key lookups in order; every SSD-only key found starts one batched promotion.
  void Lookup(std::span<const BlockKey> keys, std::span<LookupResult> results);
  ScanResult LookupPrefix(std::span<const BlockKey> keys);
  ScanResult LookupWindow(std::span<const BlockKey> keys, size_t window);

  // Pins CPU-resident keys and sets `blocks` to their bytes, in key order (BlockManager's
  // errors: FailedPrecondition if a key is not readable in the CPU tier).
  Status PrepareLoad(std::span<const BlockKey> keys,
                     std::vector<std::span<const std::byte>>* blocks);
  Status CompleteLoad(std::span<const BlockKey> keys);
  // Recency for both tiers, the first key most recent.
  void Touch(std::span<const BlockKey> keys, TouchKind kind = TouchKind::kUse);

  // Reserves CPU slots (BlockManager::PrepareStore); write each key's bytes to
  // CpuSlot(plan->slots[i]), then CompleteStore. With `gate`, never waits for a disk: *gate is
  // set when the slots may be written only once it opens (null: at once). Without, waits for
  // such a gate itself. A store aborted (CompleteStore false) before its gate opened frees its
  // slots when it opens. `hints`: none, or one per key (StoreHint).
  Status PrepareStore(std::span<const BlockKey> keys, StorePlan* plan,
                      std::shared_ptr<SlotGate>* gate = nullptr,
                      std::span<const StoreHint> hints = {});
  std::span<std::byte> CpuSlot(SlotId slot) { return slab_->Slot(slot); }
  // Publishes (or on failure drops) the keys; under write-through, starts their cascade.
  void CompleteStore(std::span<const BlockKey> keys, bool success);

  // Blocks until no background job is queued or running.
  void WaitIdle();
  // WaitIdle, then under write-back writes every CPU block the SSD tier lacks (shutdown).
  Status Flush();

  size_t block_bytes() const { return block_bytes_; }
  CascadeMode cascade() const { return cascade_; }
  BlockManager& cpu() { return *cpu_; }
  SsdTier* ssd() { return ssd_.get(); }
  TieredStoreStats stats() const;

 private:
  class IoPool;
  struct Counters;
  // Blocks moving between the tiers, by key: SSD slot, CPU slot.
  struct Transfer {
    std::vector<BlockKey> keys;
    std::vector<SlotId> cpu_slots;
    std::vector<SlotId> ssd_slots;
  };
  // Work decided under the lock and carried out after it is released.
  struct Deferred {
    Transfer promotion;                 // SSD -> CPU: SSD copies pinned, CPU slots being written
    std::vector<BlockKey> evicted;      // write-back: blocks the CPU tier just evicted ...
    std::vector<SlotId> evicted_slots;  // ... whose bytes are still in these slots
    Transfer write_back;                // CPU -> SSD of evicted blocks: SSD slots reserved
  };

  TieredStore(const TieredStoreOptions& options, std::unique_ptr<BlockManager> cpu,
              std::unique_ptr<BlockSlab> slab, std::unique_ptr<SsdTier> ssd);

  LookupResult LookupLocked(const BlockKey& key, Deferred* deferred) REQUIRES(mu_);
  // Reserves SSD slots for the evicted blocks it lacks.
  void PlanWriteBackLocked(Deferred* deferred) REQUIRES(mu_);
  // Copies the evicted blocks to staging or has them written from their CPU slots in the
  // background (before those slots are reused), and starts the promotion. Returns the gate of
  // the slots `stored` (the keys being stored into them) when they wait for a write, else null.
  // Called without the lock.
  std::shared_ptr<SlotGate> Execute(Deferred deferred, std::span<const BlockKey> stored = {});
  void RunPromotion(const Transfer& promotion);
  // Writes blocks to their reserved SSD slots from `sources`, then commits or aborts them.
  void WriteToSsd(const Transfer& transfer, std::span<const std::span<const std::byte>> sources);
  // Write-through: the CPU copies of `keys` are pinned; writes them to SSD and unpins.
  void RunCascade(const Transfer& cascade);
  // Under write-through, starts the cascade of committed `keys` the SSD tier lacks; `bounded`:
  // past max_cascades_in_flight the rest are deferred to their eviction.
  void StartCascadeLocked(std::span<const BlockKey> keys, Transfer* cascade, bool bounded)
      REQUIRES(mu_);
  // The blocks a CPU-tier eviction of `plan` must write to SSD first (write-back: all; write-
  // through: those whose cascade was deferred), into deferred->evicted.
  void NoteEvictedLocked(const StorePlan& plan, Deferred* deferred) REQUIRES(mu_);

  const size_t block_bytes_;
  const CascadeMode cascade_;
  const size_t staging_limit_;
  const size_t promotion_cap_;
  const size_t cascade_cap_;
  std::unique_ptr<BlockManager> cpu_;
  std::unique_ptr<BlockSlab> slab_;
  std::unique_ptr<SsdTier> ssd_;
  std::unique_ptr<Counters> counters_;
  // One lock for tier decisions: a key moves between the tiers' indexes atomically with respect
  // to lookups (it is never absent from both while in transit). Block I/O runs outside it.
  Mutex mu_;
  // Blocks being promoted (their CPU slots being written), blocks being cascaded (their CPU
  // copies pinned), and committed blocks whose cascade waits for their eviction.
  size_t promotions_in_flight_ GUARDED_BY(mu_) = 0;
  size_t cascades_in_flight_ GUARDED_BY(mu_) = 0;
  std::set<BlockKey> deferred_cascades_ GUARDED_BY(mu_);
  // Keys being stored into CPU slots a background write-back still reads, until it has; and
  // those of them already aborted (CompleteStore false), whose slots are freed then.
  std::map<BlockKey, std::shared_ptr<SlotGate>> gated_ GUARDED_BY(mu_);
  std::vector<BlockKey> aborted_while_gated_ GUARDED_BY(mu_);
  std::unique_ptr<IoPool> io_;  // last: its threads stop first
};

}  // namespace kvstash::store
