// Benchmarks of the block manager and the CPU slab, each against the limit that matters:
//  - PrefixLookup: keys/s of maximal-prefix lookups over 1,000-key chains (goal >= 20 M/s).
//  - StoreEvict: ns per evicted block with the cache full, at 10^3..10^6 resident blocks; the
//    `pinned` variants keep a quarter of the blocks pinned at the old end, the `churn` variants
//    pin and release blocks just before they reach the old end. Flat across sizes = O(1).
//    meta_B_per_block: the manager's own bytes per resident block (goal <= 64 B).
//  - SlabCopy: copying a block into a slot vs plain memcpy of the same size, interleaved in the
//    same iterations; counters slab_GBps, memcpy_GBps and `ratio` = slab / memcpy (goal >= 0.9).
//  - MemoryRandomRead: this machine's cost of a cache line read at random from DRAM, dependent
//    (latency) and independent (throughput). Beyond the caches, StoreEvict pays about this
//    much per cold line a block touches (LRU ~3-4 lines, ARC ~12 with its ghost directory), so
//    its time rises from 10^3 to 10^6 blocks by that, while its work per block stays constant.
//
// Every figure goes through the benchmark harness (suite.h): medians over --rounds repetitions,
// the table or --json. `store_bench --smoke` runs every benchmark at tiny sizes (ctest does, so
// they cannot rot).
#include <benchmark/benchmark.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kvstash/store/block_manager.h"
#include "kvstash/store/block_slab.h"
#include "suite.h"

namespace kvstash::store {
namespace {

bool g_smoke = false;

// Keys as an engine makes them (random 128-bit hashes), from a generator cheap enough not to
// show in the timings.
class KeyGenerator {
 public:
  explicit KeyGenerator(uint64_t seed) : next_(seed << 32) {}
  BlockKey operator()() {
    ++next_;
    return BlockKey{BlockHash{Mix64(next_), Mix64(next_ ^ 0x5bd1e995)}, 0, 0};
  }

 private:
  uint64_t next_;
};

std::unique_ptr<BlockManager> NewManager(size_t capacity, EvictionPolicy policy) {
  BlockManagerOptions options;
  options.capacity_blocks = capacity;
  options.policy = policy;
  return std::move(BlockManager::Create(options)).value();
}

void StoreAll(BlockManager& m, const std::vector<BlockKey>& keys) {
  StorePlan plan;
  for (size_t i = 0; i < keys.size(); i += 1000) {
    std::span<const BlockKey> batch(keys.data() + i, std::min<size_t>(1000, keys.size() - i));
    if (!m.PrepareStore(batch, &plan).ok()) std::abort();
    m.CompleteStore(batch, true);
  }
}

// Args: resident blocks, policy (0 lru, 1 arc, 2 aflru).
void BM_PrefixLookup(benchmark::State& state) {
  const size_t resident = static_cast<size_t>(state.range(0));
  const auto policy = static_cast<EvictionPolicy>(state.range(1));
  constexpr size_t kChain = 1000;
  auto m = NewManager(resident, policy);
  std::mt19937_64 rng(1);
  KeyGenerator key_gen(1);
  std::vector<BlockKey> keys(resident);
  for (auto& k : keys) k = key_gen();
  StoreAll(*m, keys);
  const size_t chains = resident / kChain;
  std::vector<size_t> order(chains);
  for (size_t i = 0; i < chains; ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), rng);
  size_t next = 0;
  for (auto _ : state) {
    std::span<const BlockKey> chain(keys.data() + order[next] * kChain, kChain);
    ScanResult hit = m->LookupPrefix(chain);
    if (!hit || *hit != kChain) state.SkipWithError("chain did not hit in full");
    benchmark::DoNotOptimize(hit);
    next = next + 1 == chains ? 0 : next + 1;
  }
  state.SetItemsProcessed(static_cast<int64_t>(state.iterations() * kChain));
  state.counters["ns_per_key"] =
      benchmark::Counter(static_cast<double>(state.iterations() * kChain),
                         benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}

enum Variant { kPlain = 0, kPinned = 1, kChurn = 2 };

// Args: resident blocks, policy, variant. Each iteration stores a batch of 16 new blocks into a
// full cache (evicting 16) and commits it.
void BM_StoreEvict(benchmark::State& state) {
  const size_t resident = static_cast<size_t>(state.range(0));
  const auto policy = static_cast<EvictionPolicy>(state.range(1));
  const auto variant = static_cast<Variant>(state.range(2));
  constexpr size_t kBatch = 16;
  auto m = NewManager(resident, policy);
  KeyGenerator key_gen(2);
  // Keys in insertion order; the oldest resident key is keys[oldest].
  std::vector<BlockKey> keys(resident);
  for (auto& k : keys) k = key_gen();
  StoreAll(*m, keys);
  std::vector<SlotId> slots;
  if (variant == kPinned) {
    // A quarter of the cache pinned at the old end, for the whole run.
    std::span<const BlockKey> pinned(keys.data(), resident / 4);
    if (!m->PrepareLoad(pinned, &slots).ok()) std::abort();
  }
  // Ring of live keys, oldest first, for the churn variant.
  std::vector<BlockKey> ring = keys;
  size_t oldest = variant == kPinned ? resident / 4 : 0;
  std::vector<BlockKey> batch(kBatch);
  std::vector<BlockKey> pins;  // churn: keys pinned, released kChurnDelay iterations later
  constexpr size_t kChurnDelay = 64;
  size_t pin_head = 0;
  StorePlan plan;
  for (auto _ : state) {
    if (variant == kChurn && ring.size() > 4 * kBatch) {
      // Pin a block a little ahead of the old end; release the one pinned kChurnDelay ago.
      const BlockKey& k = ring[(oldest + 2 * kBatch) % ring.size()];
      if (m->PrepareLoad({&k, 1}, &slots).ok()) pins.push_back(k);
      if (pins.size() - pin_head > kChurnDelay) {
        if (!m->CompleteLoad({&pins[pin_head], 1}).ok()) std::abort();
        ++pin_head;
      }
    }
    for (auto& k : batch) k = key_gen();
    if (!m->PrepareStore(batch, &plan).ok()) {
      state.SkipWithError("store refused");
      break;
    }
    m->CompleteStore(batch, true);
    for (size_t i = 0; i < kBatch; ++i) ring[(oldest + i) % ring.size()] = batch[i];
    oldest = (oldest + kBatch) % ring.size();
    if (variant == kPinned && oldest < resident / 4) oldest = resident / 4;
  }
  state.SetItemsProcessed(static_cast<int64_t>(state.iterations() * kBatch));
  state.counters["ns_per_block"] =
      benchmark::Counter(static_cast<double>(state.iterations() * kBatch),
                         benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
  // At steady state (ARC's ghost lists have filled).
  state.counters["meta_B_per_block"] =
      static_cast<double>(m->MetadataBytes()) / static_cast<double>(m->resident_blocks());
}

// SlabCopy's figure, its limit and their ratio: counters of the case and the suite's ratio.
bench::RatioSpec SlabRatio() {
  return bench::RatioOf("ratio", "slab_GBps", "memcpy_GBps",
                        "SlabCopy: the slab's copy against plain memcpy", 0.9);
}

// Args: block bytes. Copies into every slot of a slab in turn, and memcpy into a same-sized,
// equally pre-faulted buffer, in alternating rounds.
void BM_SlabCopy(benchmark::State& state) {
  const size_t block = static_cast<size_t>(state.range(0));
  const size_t total = g_smoke ? (size_t{8} << 20) : (size_t{512} << 20);
  const size_t count = std::max<size_t>(4, total / block);
  BlockSlabOptions options;
  options.slot_bytes = block;
  options.slot_count = count;
  auto slab = std::move(BlockSlab::Create(options)).value();
  const size_t stride = slab->slot_stride();
  auto* baseline = static_cast<std::byte*>(std::aligned_alloc(4096, count * stride));
  std::memset(baseline, 1, count * stride);  // fault it in, like the slab
  std::vector<std::byte> source(block, std::byte{7});
  constexpr size_t kRound = 32;
  double slab_seconds = 0, memcpy_seconds = 0;
  size_t slot = 0, copies = 0;
  using Clock = std::chrono::steady_clock;
  for (auto _ : state) {
    auto t0 = Clock::now();
    for (size_t i = 0; i < kRound; ++i) {
      if (!slab->Write(static_cast<SlotId>((slot + i) % count), source).ok()) std::abort();
    }
    auto t1 = Clock::now();
    for (size_t i = 0; i < kRound; ++i) {
      std::memcpy(baseline + ((slot + i) % count) * stride, source.data(), block);
    }
    auto t2 = Clock::now();
    benchmark::ClobberMemory();
    slab_seconds += std::chrono::duration<double>(t1 - t0).count();
    memcpy_seconds += std::chrono::duration<double>(t2 - t1).count();
    state.SetIterationTime(std::chrono::duration<double>(t1 - t0).count());
    slot = (slot + kRound) % count;
    copies += kRound;
  }
  std::free(baseline);
  const double bytes = static_cast<double>(copies) * static_cast<double>(block);
  bench::SetRatioCounters(state, SlabRatio(), bytes / slab_seconds / 1e9,
                          bytes / memcpy_seconds / 1e9);
}

// The machine's own limits for the numbers above, in the same run: a cache line read at random
// from `bytes` of memory, either each read depending on the last (latency) or independent
// (throughput, limited by how many misses a core keeps in flight). A block operation that
// touches k cold lines costs about k x the independent figure.
void BM_MemoryRandomRead(benchmark::State& state) {
  const size_t bytes = static_cast<size_t>(state.range(0));
  const bool dependent = state.range(1) != 0;
  const size_t lines = bytes / 64;
  auto* buf = static_cast<uint64_t*>(std::aligned_alloc(size_t{2} << 20, lines * 64));
  madvise(buf, lines * 64, MADV_HUGEPAGE);
  // A random cyclic permutation of the lines (Sattolo), stored in each line's first word.
  std::vector<uint64_t> perm(lines);
  for (size_t i = 0; i < lines; ++i) perm[i] = i;
  std::mt19937_64 rng(3);
  for (size_t i = lines - 1; i > 0; --i) std::swap(perm[i], perm[rng() % i]);
  for (size_t i = 0; i < lines; ++i) buf[perm[i] * 8] = perm[(i + 1) % lines];
  constexpr size_t kReads = 4096;
  uint64_t p = perm[0], sum = 0, x = 1;
  for (auto _ : state) {
    if (dependent) {
      for (size_t i = 0; i < kReads; ++i) p = buf[p * 8];
    } else {
      for (size_t i = 0; i < kReads; ++i) {
        x = x * 6364136223846793005ULL + 1442695040888963407ULL;
        sum += buf[((x >> 20) % lines) * 8];
      }
    }
  }
  benchmark::DoNotOptimize(p + sum);
  std::free(buf);
  state.counters["ns_per_line"] =
      benchmark::Counter(static_cast<double>(state.iterations() * kReads),
                         benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}

void Register() {
  const std::vector<int64_t> lookup_sizes =
      g_smoke ? std::vector<int64_t>{2000} : std::vector<int64_t>{10000, 1000000};
  const std::vector<int64_t> evict_sizes =
      g_smoke ? std::vector<int64_t>{1000} : std::vector<int64_t>{1000, 100000, 1000000};
  // EvictionPolicy's values: lru, arc, aflru.
  for (int64_t policy : {0, 1, 2}) {
    const std::string policy_name(EvictionPolicyName(static_cast<EvictionPolicy>(policy)));
    for (int64_t n : lookup_sizes) {
      benchmark::RegisterBenchmark(("PrefixLookup/" + policy_name).c_str(), BM_PrefixLookup)
          ->Args({n, policy});
    }
  }
  for (int64_t variant : {kPlain, kPinned, kChurn}) {
    for (int64_t policy : {0, 1, 2}) {
      const std::string name =
          "StoreEvict/" + std::string(EvictionPolicyName(static_cast<EvictionPolicy>(policy))) +
          (variant == kPinned  ? "/pinned"
           : variant == kChurn ? "/churn"
                               : "");
      for (int64_t n : evict_sizes) {
        benchmark::RegisterBenchmark(name.c_str(), BM_StoreEvict)->Args({n, policy, variant});
      }
    }
  }
  const int64_t memory = g_smoke ? (int64_t{4} << 20) : (int64_t{256} << 20);
  benchmark::RegisterBenchmark("MemoryRandomRead/dependent", BM_MemoryRandomRead)
      ->Args({memory, 1});
  benchmark::RegisterBenchmark("MemoryRandomRead/independent", BM_MemoryRandomRead)
      ->Args({memory, 0});
  for (int64_t block : {int64_t{256} << 10, int64_t{2} << 20}) {
    benchmark::RegisterBenchmark("SlabCopy", BM_SlabCopy)->Arg(block)->UseManualTime();
  }
}

// `store_bench --evict-loop RESIDENT,CALLS,lru|arc|aflru`: fills a manager, then makes CALLS
// store+evict calls of 16 blocks with no timing at all. For counting instructions per evicted
// block, which does not depend on caches or noise:
//   valgrind --tool=callgrind store_bench --evict-loop 1000000,0,lru      (setup only)
//   valgrind --tool=callgrind store_bench --evict-loop 1000000,20000,lru
// (difference of the two totals) / (20000 * 16) = instructions per evicted block.
int EvictLoop(const std::string& spec) {
  size_t resident = 0, calls = 0;
  char policy[8] = {};
  if (std::sscanf(spec.c_str(), "%zu,%zu,%7s", &resident, &calls, policy) != 3 || resident == 0) {
    std::fprintf(stderr, "--evict-loop takes RESIDENT,CALLS,lru|arc|aflru, not '%s'\n",
                 spec.c_str());
    return 2;
  }
  auto parsed = ParseEvictionPolicy(policy);
  if (!parsed.ok()) {
    std::fprintf(stderr, "%s\n", parsed.status().ToString().c_str());
    return 2;
  }
  auto m = NewManager(resident, *parsed);
  KeyGenerator key_gen(4);
  std::vector<BlockKey> keys(resident);
  for (auto& k : keys) k = key_gen();
  StoreAll(*m, keys);
  std::vector<BlockKey> batch(16);
  StorePlan plan;
  for (size_t c = 0; c < calls; ++c) {
    for (auto& k : batch) k = key_gen();
    if (!m->PrepareStore(batch, &plan).ok()) return 1;
    m->CompleteStore(batch, true);
  }
  std::printf("%zu calls, %zu resident\n", calls, m->resident_blocks());
  return 0;
}

bench::SuiteSpec StoreSuite() {
  using bench::Better;
  bench::SuiteSpec spec;
  spec.name = "store_bench";
  spec.title = "the block manager and the CPU slab, against this machine's memcpy and DRAM";
  spec.usage =
      "Cases: PrefixLookup/<policy>/<resident> (maximal-prefix lookups over 1,000-key chains), "
      "StoreEvict/<policy>[/pinned|/churn]/<resident> (16 new blocks into a full cache per "
      "iteration; pinned keeps a quarter pinned at the old end, churn pins blocks just before "
      "they reach it; flat across sizes = O(1)), MemoryRandomRead/{dependent,independent} "
      "(this machine's cost of a random cache-line read from DRAM: the unit in which eviction "
      "time grows once the index outgrows the caches), SlabCopy/<block bytes> (a block into a "
      "slab slot vs plain memcpy of the same size, interleaved). store_bench --evict-loop "
      "RESIDENT,CALLS,lru|arc|aflru makes CALLS store+evict calls with no timing, for counting "
      "instructions under callgrind.";
  spec.counters = {
      {.counter = "ns_per_key",
       .figure = "",
       .unit = "ns",
       .better = Better::kLower,
       .scale = 1e9,
       .help = "PrefixLookup: time per key looked up (goal <= 50 ns, 20 M keys/s)"},
      {.counter = "ns_per_block",
       .figure = "",
       .unit = "ns",
       .better = Better::kLower,
       .scale = 1e9,
       .help = "StoreEvict: time per block stored into the full cache (and one evicted)"},
      {.counter = "meta_B_per_block",
       .figure = "",
       .unit = "B",
       .better = Better::kLower,
       .scale = 1,
       .help = "StoreEvict: the manager's own bytes per resident block at steady state (goal "
               "<= 64)"},
      {.counter = "items_per_second",
       .figure = "items_per_s",
       .unit = "items/s",
       .better = Better::kHigher,
       .scale = 1,
       .help = "keys looked up (PrefixLookup) or blocks stored (StoreEvict) per second"},
      {.counter = "ns_per_line",
       .figure = "",
       .unit = "ns",
       .better = Better::kLower,
       .scale = 1e9,
       .help = "MemoryRandomRead: one cache line read at random from DRAM, each read depending "
               "on the last (latency) or not (throughput); a block operation touching k cold "
               "lines costs about k x the independent figure"},
      {.counter = "slab_GBps",
       .figure = "",
       .unit = "GB/s",
       .better = Better::kHigher,
       .scale = 1,
       .help = "SlabCopy: blocks copied into slab slots (BlockSlab::Write)"},
      {.counter = "memcpy_GBps",
       .figure = "",
       .unit = "GB/s",
       .better = Better::kHigher,
       .scale = 1,
       .help = "SlabCopy, the limit: plain memcpy of the same blocks into a same-sized, equally "
               "prefaulted buffer, interleaved with the slab's copies in every iteration"},
  };
  spec.ratios = {SlabRatio()};
  return spec;
}

}  // namespace
}  // namespace kvstash::store

int main(int argc, char** argv) {
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::string(argv[i]) == "--evict-loop") return kvstash::store::EvictLoop(argv[i + 1]);
  }
  const kvstash::bench::SuiteSpec spec = kvstash::store::StoreSuite();
  kvstash::bench::SuiteOptions options;
  if (auto code = kvstash::bench::InitSuite(argc, argv, spec, &options)) return *code;
  kvstash::store::g_smoke = options.smoke;
  kvstash::store::Register();
  return kvstash::bench::RunSuite(spec, options);
}
