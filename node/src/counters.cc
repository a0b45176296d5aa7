#include "counters.h"

namespace kvstash::node {
namespace {

using prometheus::MetricType;
using Snapshot = CounterSnapshot;
using Value = std::optional<uint64_t>;

Value Node(const Snapshot& s, NodeCounter counter) {
  if (s.node == nullptr) return std::nullopt;
  return s.node->Get(counter);
}

template <NodeCounter kCounter>
Value NodeValue(const Snapshot& s) {
  return Node(s, kCounter);
}

// A value of the store's side, when the snapshot has one.
#define KVSTASH_STORE(expr) \
  [](const Snapshot& s) -> Value { return s.store ? Value(s.store->expr) : std::nullopt; }
// ARC's lists, reported under ARC only.
#define KVSTASH_ARC(expr)                                                           \
  [](const Snapshot& s) -> Value {                                                  \
    return s.store && s.store->arc ? Value(s.store->arc_sizes.expr) : std::nullopt; \
  }
// AF-LRU's lists, reported under AF-LRU only.
#define KVSTASH_AFLRU(expr)                                                           \
  [](const Snapshot& s) -> Value {                                                    \
    return s.store && s.store->aflru ? Value(s.store->arc_sizes.expr) : std::nullopt; \
  }
#define KVSTASH_TRANSPORT(expr) \
  [](const Snapshot& s) -> Value { return s.transport ? Value(s.transport->expr) : std::nullopt; }
#define KVSTASH_MEMORY(expr) \
  [](const Snapshot& s) -> Value { return s.memory ? Value(s.memory->expr) : std::nullopt; }
#define KVSTASH_EVENTS(expr) \
  [](const Snapshot& s) -> Value { return s.events ? Value(s.events->expr) : std::nullopt; }

const MetricFamilyDef kBlocks{"kvstash_blocks", MetricType::Gauge, "Blocks held, by tier"};
const MetricFamilyDef kBytes{"kvstash_bytes", MetricType::Gauge,
                             "Bytes of the blocks held (blocks x block size), by tier"};
const MetricFamilyDef kCapacity{"kvstash_capacity_blocks", MetricType::Gauge,
                                "Block capacity, by tier"};
const MetricFamilyDef kBlockBytes{"kvstash_block_bytes", MetricType::Gauge, "Bytes of every block"};
const MetricFamilyDef kArcBlocks{
    "kvstash_cpu_arc_blocks", MetricType::Gauge,
    "ARC's lists in the CPU tier (0 under LRU): t1 holds blocks seen once, t2 blocks used again "
    "since they were stored"};
const MetricFamilyDef kAfLruBlocks{
    "kvstash_cpu_aflru_blocks", MetricType::Gauge,
    "AF-LRU's classes in the CPU tier (absent under LRU and ARC): blocks used by one, two, and "
    "three or more requests"};
const MetricFamilyDef kReuseFilter{
    "kvstash_cpu_reuse_filter_on", MetricType::Gauge,
    "1 while the CPU tier stores a block only on its second lookup (--cpu-admission filter, or "
    "adaptive in its filtering regime), else 0"};
const MetricFamilyDef kSpareBlocks{
    "kvstash_cpu_spare_blocks", MetricType::Gauge,
    "Blocks of the CPU tier stored spare (a hybrid model's window or state blocks that no "
    "expected hit end needs): evicted before any other block until a request uses them"};
const MetricFamilyDef kTouched{
    "kvstash_touched_keys_total", MetricType::Counter,
    "Keys clients marked used (touches, and stores of blocks the node held)"};
const MetricFamilyDef kPinned{"kvstash_pinned_keys_total", MetricType::Counter,
                              "Keys clients pinned against eviction until their load was done"};
const MetricFamilyDef kLookups{"kvstash_lookup_keys_total", MetricType::Counter,
                               "Keys looked up, by result"};
const MetricFamilyDef kStored{"kvstash_blocks_stored_total", MetricType::Counter,
                              "Blocks committed"};
const MetricFamilyDef kAborted{
    "kvstash_blocks_aborted_total", MetricType::Counter,
    "Block stores aborted (a failed transfer, a checksum mismatch or an ended session)"};
const MetricFamilyDef kNotAdmitted{
    "kvstash_blocks_not_admitted_total", MetricType::Counter,
    "Blocks offered that the CPU tier's reuse filter turned away (looked up too few times); "
    "their put is answered skipped"};
const MetricFamilyDef kLoaded{"kvstash_blocks_loaded_total", MetricType::Counter,
                              "Blocks sent to clients"};
const MetricFamilyDef kPayload{"kvstash_payload_bytes_total", MetricType::Counter,
                               "Block bytes moved, by direction"};
const MetricFamilyDef kChecksum{"kvstash_checksum_failures_total", MetricType::Counter,
                                "Blocks whose bytes did not match the client's checksum"};
const MetricFamilyDef kSsdChecksum{
    "kvstash_ssd_checksum_failures_total", MetricType::Counter,
    "SSD blocks whose bytes did not match their index record (read as misses and dropped)"};
const MetricFamilyDef kEvictions{
    "kvstash_evictions_total", MetricType::Counter,
    "Blocks evicted to make room, by tier (cpu: for stores and promotions; ssd: for cascades)"};
const MetricFamilyDef kPromotions{"kvstash_promotions_total", MetricType::Counter,
                                  "Blocks promoted from SSD to the CPU tier"};
const MetricFamilyDef kCascades{"kvstash_cascades_total", MetricType::Counter,
                                "Blocks written from the CPU tier to SSD"};
const MetricFamilyDef kSessionsClosed{"kvstash_sessions_closed_total", MetricType::Counter,
                                      "Client sessions that ended"};
const MetricFamilyDef kPinsOnClose{"kvstash_pins_released_on_close_total", MetricType::Counter,
                                   "Pins an ended session still held"};
const MetricFamilyDef kLeases{"kvstash_leases_expired_total", MetricType::Counter,
                              "Silent sessions whose pins and unfinished stores were undone"};
const MetricFamilyDef kConnections{"kvstash_connections", MetricType::Gauge,
                                   "Open client connections"};
const MetricFamilyDef kRequests{"kvstash_requests_total", MetricType::Counter,
                                "Requests dispatched"};
const MetricFamilyDef kRefusals{"kvstash_refusals_total", MetricType::Counter,
                                "Connections refused for a wrong token"};
const MetricFamilyDef kMemory{"kvstash_cpu_memory_bytes", MetricType::Gauge,
                              "The CPU tier's memory: all of it, and the part faulted in (a node "
                              "serves at once and faults its memory in in the background)"};
const MetricFamilyDef kMalformed{"kvstash_malformed_frames_total", MetricType::Counter,
                                 "Malformed frames received"};
const MetricFamilyDef kBadHellos{"kvstash_bad_hellos_total", MetricType::Counter,
                                 "Connections refused for a malformed hello (its bytes, or a UCX "
                                 "worker address this node's UCX cannot take)"};
const MetricFamilyDef kForeignFrames{"kvstash_foreign_frames_total", MetricType::Counter,
                                     "Frames refused for naming a connection other than the one "
                                     "bound to the endpoint they came on"};
const MetricFamilyDef kAcceptPauses{"kvstash_accept_pauses_total", MetricType::Counter,
                                    "Failed accepts (no file descriptors or memory) after which "
                                    "the node paused accepting"};

const MetricFamilyDef kEventBatches{"kvstash_kv_event_batches_total", MetricType::Counter,
                                    "KV event batches, by outcome: sent, dropped (the queue was "
                                    "full; their sequence numbers skipped) or replayed"};
const MetricFamilyDef kEventReplays{"kvstash_kv_event_replays_total", MetricType::Counter,
                                    "KV event replay requests, by outcome: served or refused "
                                    "(malformed)"};
const MetricFamilyDef kEventLosses{"kvstash_kv_event_losses_total", MetricType::Counter,
                                   "Times the store dropped undrained events, after which every "
                                   "topic started over with AllBlocksCleared"};
const MetricFamilyDef kEventMetasDropped{
    "kvstash_kv_event_block_metas_dropped_total", MetricType::Counter,
    "What puts said of their blocks (parent, tokens), pushed out of its bounded table by newer "
    "puts before the block's BlockStored was published (which then has no parent, block size 0)"};

using N = NodeCounter;

const std::vector<CounterDef>& Defs() {
  static const std::vector<CounterDef> defs = {
      // The tiers.
      {"cpu.resident_blocks", KVSTASH_STORE(cpu_resident), &kBlocks, {{"tier", "cpu"}}},
      {"ssd.resident_blocks", KVSTASH_STORE(ssd_resident), &kBlocks, {{"tier", "ssd"}}},
      {"cpu.resident_bytes",
       KVSTASH_STORE(cpu_resident * s.store->block_bytes),
       &kBytes,
       {{"tier", "cpu"}}},
      {"ssd.resident_bytes",
       KVSTASH_STORE(ssd_resident * s.store->block_bytes),
       &kBytes,
       {{"tier", "ssd"}}},
      {"cpu.capacity_blocks", KVSTASH_STORE(cpu_capacity), &kCapacity, {{"tier", "cpu"}}},
      {"ssd.capacity_blocks", KVSTASH_STORE(ssd_capacity), &kCapacity, {{"tier", "ssd"}}},
      {"cpu.block_bytes", KVSTASH_STORE(block_bytes), &kBlockBytes, {}},
      {"cpu.policy_arc", KVSTASH_STORE(arc ? 1u : 0u), nullptr, {}},
      {"cpu.policy_aflru", KVSTASH_STORE(aflru ? 1u : 0u), nullptr, {}},
      {"cpu.aflru_class1_blocks", KVSTASH_AFLRU(t1), &kAfLruBlocks, {{"class", "1"}}},
      {"cpu.aflru_class2_blocks", KVSTASH_AFLRU(t2), &kAfLruBlocks, {{"class", "2"}}},
      {"cpu.aflru_class3_blocks", KVSTASH_AFLRU(t3), &kAfLruBlocks, {{"class", "3"}}},
      {"cpu.aflru_ghosts", KVSTASH_AFLRU(b1), nullptr, {}},
      // The reuse filter (docs/semantics.md §2a): on or off, and under adaptive admission what
      // the sampled shadow tiers decide it by.
      {"cpu.reuse_filter_on", KVSTASH_STORE(admission.filter_on ? 1u : 0u), &kReuseFilter, {}},
      {"cpu.admission_adaptive", KVSTASH_STORE(admission.adaptive ? 1u : 0u), nullptr, {}},
      {"cpu.admission_switches", KVSTASH_STORE(admission.switches), nullptr, {}},
      {"cpu.admission_shadow_hits_filter",
       KVSTASH_STORE(admission.shadow_hits_filter),
       nullptr,
       {}},
      {"cpu.admission_shadow_hits_all", KVSTASH_STORE(admission.shadow_hits_all), nullptr, {}},
      // Blocks stored spare (docs/semantics.md §4b): evicted first until a request uses them.
      {"cpu.spare_blocks", KVSTASH_STORE(arc_sizes.spare), &kSpareBlocks, {}},
      // ARC's lists: T2 grows as blocks are used again (a touch, a store of a held block).
      {"cpu.arc_t1_blocks", KVSTASH_ARC(t1), &kArcBlocks, {{"list", "t1"}}},
      {"cpu.arc_t2_blocks", KVSTASH_ARC(t2), &kArcBlocks, {{"list", "t2"}}},
      {"cpu.arc_b1_ghosts", KVSTASH_ARC(b1), nullptr, {}},
      {"cpu.arc_b2_ghosts", KVSTASH_ARC(b2), nullptr, {}},
      {"cpu.arc_target_t1_blocks",
       [](const Snapshot& s) -> Value {
         if (!s.store || !s.store->arc) return std::nullopt;
         return static_cast<uint64_t>(s.store->arc_sizes.arc_target);
       },
       nullptr,
       {}},
      // What clients asked.
      {"node.touched_keys", NodeValue<N::kTouchedKeys>, &kTouched, {}},
      {"node.pinned_keys", NodeValue<N::kPinnedKeys>, &kPinned, {}},
      {"node.lookups", NodeValue<N::kLookups>, nullptr, {}},
      {"node.lookup_hits", NodeValue<N::kLookupHits>, &kLookups, {{"result", "hit"}}},
      {"node.lookup_misses", NodeValue<N::kLookupMisses>, &kLookups, {{"result", "miss"}}},
      {"node.lookup_retries", NodeValue<N::kLookupRetries>, &kLookups, {{"result", "retry"}}},
      {"node.blocks_stored", NodeValue<N::kBlocksStored>, &kStored, {}},
      {"node.blocks_aborted", NodeValue<N::kBlocksAborted>, &kAborted, {}},
      {"node.blocks_not_admitted", NodeValue<N::kBlocksNotAdmitted>, &kNotAdmitted, {}},
      {"node.blocks_loaded", NodeValue<N::kBlocksLoaded>, &kLoaded, {}},
      {"node.bytes_in", NodeValue<N::kBytesIn>, &kPayload, {{"direction", "in"}}},
      {"node.bytes_out", NodeValue<N::kBytesOut>, &kPayload, {{"direction", "out"}}},
      {"node.checksum_failures", NodeValue<N::kChecksumFailures>, &kChecksum, {}},
      {"ssd.checksum_failures", KVSTASH_STORE(ssd.checksum_failures), &kSsdChecksum, {}},
      // The store's movements.
      {"store.cpu_evictions", KVSTASH_STORE(tiers.cpu_evictions), &kEvictions, {{"tier", "cpu"}}},
      {"ssd.evictions", KVSTASH_STORE(ssd.evictions), &kEvictions, {{"tier", "ssd"}}},
      {"store.promotions_done", KVSTASH_STORE(tiers.promotions_done), &kPromotions, {}},
      {"store.promotion_failures", KVSTASH_STORE(tiers.promotion_failures), nullptr, {}},
      {"store.promotions_deferred", KVSTASH_STORE(tiers.promotions_deferred), nullptr, {}},
      {"store.cascades_done", KVSTASH_STORE(tiers.cascades_done), &kCascades, {}},
      {"store.cascades_deferred", KVSTASH_STORE(tiers.cascades_deferred), nullptr, {}},
      {"store.cascade_failures", KVSTASH_STORE(tiers.cascade_failures), nullptr, {}},
      {"store.writebacks_staged", KVSTASH_STORE(tiers.writebacks_staged), nullptr, {}},
      {"store.writebacks_unstaged", KVSTASH_STORE(tiers.writebacks_unstaged), nullptr, {}},
      {"store.quota_refusals", KVSTASH_STORE(tiers.quota_refusals), nullptr, {}},
      // Sessions.
      {"node.sessions_closed", NodeValue<N::kSessionsClosed>, &kSessionsClosed, {}},
      {"node.pins_released_on_close", NodeValue<N::kPinsReleasedOnClose>, &kPinsOnClose, {}},
      {"node.stores_aborted_on_close", NodeValue<N::kStoresAbortedOnClose>, nullptr, {}},
      {"node.leases_expired", NodeValue<N::kLeasesExpired>, &kLeases, {}},
      {"node.pins_released_on_expiry", NodeValue<N::kPinsReleasedOnExpiry>, nullptr, {}},
      // The transport.
      {"transport.connections", KVSTASH_TRANSPORT(connections), &kConnections, {}},
      {"transport.calls", KVSTASH_TRANSPORT(stats.calls), &kRequests, {}},
      {"transport.refused", KVSTASH_TRANSPORT(stats.refused), &kRefusals, {}},
      {"transport.malformed_frames", KVSTASH_TRANSPORT(stats.malformed_frames), &kMalformed, {}},
      {"transport.mapped_payloads", KVSTASH_TRANSPORT(stats.mapped_payloads), nullptr, {}},
      {"transport.bad_hellos", KVSTASH_TRANSPORT(stats.bad_hellos), &kBadHellos, {}},
      {"transport.foreign_frames", KVSTASH_TRANSPORT(stats.foreign_frames), &kForeignFrames, {}},
      {"transport.accept_pauses", KVSTASH_TRANSPORT(stats.accept_pauses), &kAcceptPauses, {}},
      // The CPU tier's memory.
      {"cpu.memory_bytes", KVSTASH_MEMORY(total), &kMemory, {{"state", "total"}}},
      {"cpu.faulted_bytes", KVSTASH_MEMORY(faulted), &kMemory, {{"state", "faulted"}}},
      // KV events.
      {"events.batches_sent", KVSTASH_EVENTS(batches_sent), &kEventBatches, {{"outcome", "sent"}}},
      {"events.batches_dropped",
       KVSTASH_EVENTS(batches_dropped),
       &kEventBatches,
       {{"outcome", "dropped"}}},
      {"events.batches_replayed",
       KVSTASH_EVENTS(batches_replayed),
       &kEventBatches,
       {{"outcome", "replayed"}}},
      {"events.replays_served",
       KVSTASH_EVENTS(replays_served),
       &kEventReplays,
       {{"outcome", "served"}}},
      {"events.replays_refused",
       KVSTASH_EVENTS(replays_refused),
       &kEventReplays,
       {{"outcome", "refused"}}},
      {"events.losses", KVSTASH_EVENTS(rounds_lost), &kEventLosses, {}},
      {"events.block_metas_dropped", KVSTASH_EVENTS(block_metas_dropped), &kEventMetasDropped, {}},
  };
  return defs;
}

#undef KVSTASH_STORE
#undef KVSTASH_ARC
#undef KVSTASH_TRANSPORT
#undef KVSTASH_MEMORY
#undef KVSTASH_EVENTS

}  // namespace

CounterSnapshot::Store SnapshotOf(store::TieredStore& store) {
  CounterSnapshot::Store s;
  s.tiers = store.stats();
  s.has_ssd = store.ssd() != nullptr;
  if (s.has_ssd) {
    s.ssd = store.ssd()->stats();
    s.ssd_capacity = store.ssd()->capacity_blocks();
    s.ssd_resident = store.ssd()->resident_blocks();
  }
  s.block_bytes = store.block_bytes();
  s.cpu_capacity = store.cpu().capacity();
  s.cpu_resident = store.cpu().resident_blocks();
  s.arc = store.cpu().policy() == store::EvictionPolicy::kArc;
  s.aflru = store.cpu().policy() == store::EvictionPolicy::kAfLru;
  s.arc_sizes = store.cpu().policy_sizes();
  s.admission = store.cpu().admission();
  return s;
}

std::map<std::string, uint64_t> ReadCounters(const CounterSnapshot& snapshot) {
  std::map<std::string, uint64_t> out;
  for (const CounterDef& def : Defs()) {
    if (const Value value = def.read(snapshot)) out.emplace(def.name, *value);
  }
  return out;
}

std::span<const CounterDef> CounterDefs() { return Defs(); }

}  // namespace kvstash::node
