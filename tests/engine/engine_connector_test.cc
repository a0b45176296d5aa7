// The connector scenarios of vLLM's offloading-connector tests (docs/semantics.md §12.J) on this
// engine: the real Engine, the real connector (KvConnector, BlockTransfer, the engine's adapter
// in engine_offload) and, in place of the nodes, an in-memory store; the scheduler side's
// manager is either the nodes' own or a recording one whose answers a test scripts. Blocks are
// 16 tokens (block_size_factor 1), decoding is greedy, and every scenario also checks the
// invariant that matters most: the tokens equal those of the same engine without offload.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <ostream>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "builtin_models.h"
#include "fake_node_store.h"
#include "kvstash/common/hash.h"
#include "kvstash/connector/block_store_client.h"
#include "kvstash/connector/block_transfer.h"
#include "kvstash/connector/offload_scheduler.h"
#include "kvstash/engine/engine.h"
#include "kvstash/engine/node_offload.h"

namespace kvstash::connector {
// gtest prints keys by name, not by their padding bytes.
void PrintTo(const BlockKey& key, std::ostream* os) { *os << key.ToString(); }
}  // namespace kvstash::connector

namespace kvstash::engine {
namespace {
using ::testing::IsEmpty;

constexpr size_t kBlock = 16;  // tokens per block of every built-in's groups

std::vector<uint32_t> Tokens(size_t n, uint64_t seed) {
  std::vector<uint32_t> t(n);
  for (size_t i = 0; i < n; ++i) t[i] = static_cast<uint32_t>(Mix64(seed * 7919 + i) % 256);
  return t;
}

std::vector<uint32_t> Concat(std::vector<uint32_t> a, const std::vector<uint32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

using fakes::BlockIndexOf;
using fakes::FakeNodeStore;
using fakes::FakeStoreClient;
using fakes::KeySet;
using fakes::KeysOf;

// A scheduler-side manager that records every call (as FakeManager of the connector's own
// tests). Lookups answer from `lookup` when set, else from the store's contents; PrepareStore
// answers from `prepare_store` when set, else accepts every key. Owned by the test and outlives
// the engines (they hold a forwarding ManagerProxy); engine thread only.
class RecordingManager {
 public:
  using StorePolicy =
      std::function<std::optional<std::vector<BlockKey>>(std::span<const BlockKey>)>;
  explicit RecordingManager(const FakeNodeStore* store) : store_(store) {}

  LookupResult Lookup(const BlockKey& key) {
    lookups.push_back(key);
    if (lookup) return lookup(key);
    return store_->Holds(key) ? LookupResult::kHit : LookupResult::kMiss;
  }
  void PrepareLoad(std::span<const BlockKey> keys) {
    prepare_loads.emplace_back(keys.begin(), keys.end());
  }
  void CompleteLoad(std::span<const BlockKey> keys) {
    complete_loads.emplace_back(keys.begin(), keys.end());
  }
  std::optional<std::vector<BlockKey>> PrepareStore(std::span<const BlockKey> keys) {
    prepare_stores.emplace_back(keys.begin(), keys.end());
    std::optional<std::vector<BlockKey>> out =
        prepare_store ? prepare_store(keys) : std::vector<BlockKey>(keys.begin(), keys.end());
    if (out) accepted.insert(out->begin(), out->end());
    return out;
  }
  void CompleteStore(std::span<const BlockKey> keys) {
    complete_stores.emplace_back(keys.begin(), keys.end());
  }
  void Touch(std::span<const BlockKey> keys) { touches.emplace_back(keys.begin(), keys.end()); }
  void ResetCache() {}

  void ClearLog() {
    lookups.clear();
    touches.clear();
    prepare_stores.clear();
    complete_stores.clear();
    prepare_loads.clear();
    complete_loads.clear();
  }

  std::function<LookupResult(const BlockKey&)> lookup;
  StorePolicy prepare_store;
  std::vector<BlockKey> lookups;
  std::vector<std::vector<BlockKey>> touches, prepare_stores, complete_stores;
  std::vector<std::vector<BlockKey>> prepare_loads, complete_loads;
  KeySet accepted;  // every key PrepareStore returned

 private:
  const FakeNodeStore* store_;
};

class ManagerProxy : public connector::OffloadManager {
 public:
  explicit ManagerProxy(RecordingManager* m) : m_(m) {}
  LookupResult Lookup(const BlockKey& key) override { return m_->Lookup(key); }
  void PrepareLoad(std::span<const BlockKey> keys) override { m_->PrepareLoad(keys); }
  void CompleteLoad(std::span<const BlockKey> keys) override { m_->CompleteLoad(keys); }
  std::optional<std::vector<BlockKey>> PrepareStore(std::span<const BlockKey> keys) override {
    return m_->PrepareStore(keys);
  }
  void CompleteStore(std::span<const BlockKey> keys) override { m_->CompleteStore(keys); }
  void Touch(std::span<const BlockKey> keys) override { m_->Touch(keys); }
  void ResetCache() override { m_->ResetCache(); }

 private:
  RecordingManager* m_;
};

struct Outcome {
  RequestId id = 0;
  std::vector<uint32_t> tokens;  // generated
  std::vector<BlockHash> hashes;
  size_t external = 0, cached = 0, computed_prompt = 0;
};

Outcome OutcomeOf(const Request& r) {
  Outcome o;
  o.id = r.id;
  o.tokens.assign(r.output().begin(), r.output().end());
  o.hashes = r.hasher->hashes();
  o.external = r.num_external_tokens;
  o.cached = r.num_cached_tokens;
  o.computed_prompt = r.num_computed_prompt_tokens;
  return o;
}

std::unique_ptr<Engine> MakeEngine(const std::string& model, FakeNodeStore* store,
                                   RecordingManager* manager, EngineOptions o = {}) {
  auto config = ModelConfig::Load("builtin:" + model);
  EXPECT_TRUE(config.ok());
  if (store != nullptr) {
    o.offload = NodeOffload([store, manager](const OffloadContext& c) -> Result<ConnectorParts> {
      store->set_block_bytes(connector::OffloadedBlockBytes(1, c.layout->page_bytes()));
      ConnectorParts parts;
      parts.client = std::make_unique<FakeStoreClient>(store);
      if (manager != nullptr) parts.manager = std::make_unique<ManagerProxy>(manager);
      return parts;
    });
  }
  auto e = Engine::Create(*config, std::move(o));
  EXPECT_TRUE(e.ok()) << e.status().ToString();
  return std::move(e).value();
}

// The tokens the same engine gives without offload.
std::vector<uint32_t> Reference(const std::string& model, const std::vector<uint32_t>& prompt,
                                size_t max_new) {
  std::unique_ptr<Engine> e = MakeEngine(model, nullptr, nullptr);
  auto r = e->Generate({prompt}, max_new);
  EXPECT_TRUE(r.ok());
  return std::vector<uint32_t>((*r)[0]->output().begin(), (*r)[0]->output().end());
}

// Runs one request to its end; `after_step` runs after every step.
Outcome RunRequest(Engine& e, const std::vector<uint32_t>& prompt, size_t max_new,
                   bool do_remote_decode = false,
                   const std::function<void(RequestId)>& after_step = {}) {
  auto id = e.AddRequest(prompt, max_new, do_remote_decode);
  EXPECT_TRUE(id.ok());
  while (e.HasUnfinished()) {
    e.Step();
    if (after_step) after_step(*id);
  }
  e.DrainOffload();
  std::unique_ptr<Request> r = e.TakeResult(*id);
  EXPECT_NE(r->state, Request::State::kFailed) << r->error.ToString();
  return OutcomeOf(*r);
}

// Fills `store` with the blocks of `prompt` through an engine of its own (the nodes then hold
// them, this engine's prefix cache does not).
// Returns the prompt's block hashes (the same in every engine of the model).
std::vector<BlockHash> Prime(const std::string& model, FakeNodeStore* store,
                             const std::vector<uint32_t>& prompt) {
  std::unique_ptr<Engine> e = MakeEngine(model, store, nullptr);
  Outcome o = RunRequest(*e, prompt, 1);
  EXPECT_EQ(o.tokens, Reference(model, prompt, 1));
  e->DrainOffload();
  store->ClearLog();
  return o.hashes;
}

size_t NumGroups(const Engine& e) { return e.layout().groups.size(); }

// The keys of touch calls [from, from + count) (the connector touches each group apart).
KeySet Touched(const RecordingManager& m, size_t from, size_t count) {
  KeySet out;
  for (size_t i = from; i < from + count && i < m.touches.size(); ++i) {
    out.insert(m.touches[i].begin(), m.touches[i].end());
  }
  return out;
}

// --- J1 (test_offloading_connector) ---------------------------------------------------------

// J1 rows 1-6 on tiny-full (4 full-attention groups): stores only ever cover full blocks; a
// PrepareStore that answers nullopt is offered the same blocks next step, one that answers []
// moves past them; a store that goes ahead touches every key of the request.
TEST(EngineConnectorTest, J1StoresFullBlocksRetriesRefusedStoresAndTouchesAll) {
  const std::string model = "tiny-full";
  FakeNodeStore store;
  RecordingManager m(&store);
  int calls = 0;
  m.prepare_store = [&](std::span<const BlockKey> keys) -> std::optional<std::vector<BlockKey>> {
    ++calls;
    if (calls == 1) {  // only the middle of the prompt's three blocks
      std::vector<BlockHash> order;
      for (const BlockKey& k : keys) {
        if (std::find(order.begin(), order.end(), k.hash) == order.end()) order.push_back(k.hash);
      }
      std::vector<BlockKey> out;
      for (const BlockKey& k : keys) {
        if (order.size() == 3 && k.hash == order[1]) out.push_back(k);
      }
      return out;
    }
    if (calls == 2) return std::nullopt;
    if (calls == 3) return std::vector<BlockKey>{};
    return std::vector<BlockKey>(keys.begin(), keys.end());
  };
  std::unique_ptr<Engine> e = MakeEngine(model, &store, &m);
  const size_t groups = NumGroups(*e);
  ASSERT_EQ(groups, 4u);
  const std::vector<uint32_t> prompt = Tokens(3 * kBlock, 1);  // 48 tokens: 3 blocks
  // Per PrepareStore call: the request's computed tokens after that step.
  std::vector<size_t> computed_at_call;
  Outcome o = RunRequest(*e, prompt, 40, false, [&](RequestId id) {
    const Request* r = e->Find(id);
    while (computed_at_call.size() < m.prepare_stores.size()) {
      computed_at_call.push_back(r ? r->num_computed_tokens : prompt.size() + 40);
    }
  });
  EXPECT_EQ(o.tokens, Reference(model, prompt, 40));
  // 88 tokens, 87 computed: blocks 0-4 are full.
  ASSERT_EQ(m.prepare_stores.size(), 4u);
  EXPECT_EQ(KeySet(m.prepare_stores[0].begin(), m.prepare_stores[0].end()),
            KeysOf(o.hashes, groups, 0, 3));
  EXPECT_EQ(KeySet(m.prepare_stores[1].begin(), m.prepare_stores[1].end()),
            KeysOf(o.hashes, groups, 3, 4));
  // nullopt: the same block offered again (the very next step); []: moved past it.
  EXPECT_EQ(m.prepare_stores[2], m.prepare_stores[1]);
  EXPECT_EQ(computed_at_call[2], computed_at_call[1] + 1);
  EXPECT_EQ(KeySet(m.prepare_stores[3].begin(), m.prepare_stores[3].end()),
            KeysOf(o.hashes, groups, 4, 5));
  // Only full blocks are offered: block i once the request has computed its 16 tokens.
  for (size_t c = 0; c < m.prepare_stores.size(); ++c) {
    for (const BlockKey& k : m.prepare_stores[c]) {
      const int i = BlockIndexOf(o.hashes, k);
      ASSERT_GE(i, 0);
      EXPECT_LE((i + 1) * kBlock, computed_at_call[c]) << "call " << c << " block " << i;
    }
  }
  // What reached the nodes: the middle block, then block 4; never 0, 2 or 3.
  const std::vector<BlockKey> put = store.put_keys();
  KeySet want = KeysOf(o.hashes, groups, 1, 2);
  want.merge(KeysOf(o.hashes, groups, 4, 5));
  EXPECT_EQ(KeySet(put.begin(), put.end()), want);
  EXPECT_EQ(put.size(), want.size());
  // Touches, one call per group: at the lookup (every key of the prompt) and after each store
  // that went ahead (every key of the request), none after nullopt or [].
  ASSERT_EQ(m.touches.size(), 3 * groups);
  EXPECT_EQ(Touched(m, 0, groups), KeysOf(o.hashes, groups, 0, 3));
  EXPECT_EQ(Touched(m, groups, groups), KeysOf(o.hashes, groups, 0, 3));
  EXPECT_EQ(Touched(m, 2 * groups, groups), KeysOf(o.hashes, groups, 0, 5));
}

// J1 row 7: a request sharing the first blocks of an earlier one touches its keys: the shared
// ones are the earlier request's, the last one differs; only the block past the GPU prefix
// hit is looked up.
TEST(EngineConnectorTest, J1ARequestSharingAPrefixTouchesTheSharedKeys) {
  const std::string model = "tiny-full";
  FakeNodeStore store;
  RecordingManager m(&store);
  std::unique_ptr<Engine> e = MakeEngine(model, &store, &m);
  const size_t groups = NumGroups(*e);
  const std::vector<uint32_t> prompt = Tokens(3 * kBlock, 2);
  const Outcome first = RunRequest(*e, prompt, 40);
  EXPECT_EQ(first.tokens, Reference(model, prompt, 40));
  // The first request's 80 first tokens with the last one changed: 5 blocks, the 5th differs.
  std::vector<uint32_t> second = Concat(prompt, first.tokens);
  second.resize(5 * kBlock);
  second.back() = (second.back() + 1) % 256;
  m.ClearLog();
  const Outcome o = RunRequest(*e, second, 8);
  EXPECT_EQ(o.tokens, Reference(model, second, 8));
  EXPECT_EQ(o.cached, 4 * kBlock);  // the GPU prefix cache hits the 4 shared blocks
  ASSERT_GE(m.touches.size(), groups);
  EXPECT_EQ(Touched(m, 0, groups), KeysOf(o.hashes, groups, 0, 5));
  EXPECT_EQ(KeysOf(o.hashes, groups, 0, 4), KeysOf(first.hashes, groups, 0, 4));
  for (const BlockKey& k : KeysOf(o.hashes, groups, 4, 5)) {
    EXPECT_EQ(BlockIndexOf(first.hashes, k), -1);
  }
  // Looked up: block 4 of the first group only (a miss ends the lookup).
  ASSERT_EQ(m.lookups.size(), 1u);
  EXPECT_EQ(BlockIndexOf(o.hashes, m.lookups[0]), 4);
}

// J1 rows 8-9: fewer than a block of new full-block tokens past the GPU prefix hit is never
// looked up; a block of them is, once.
TEST(EngineConnectorTest, J1LookupNeedsAFullBlockOfNewTokens) {
  const std::string model = "tiny-full";
  FakeNodeStore store;
  RecordingManager m(&store);
  std::unique_ptr<Engine> e = MakeEngine(model, &store, &m);
  const std::vector<uint32_t> base = Tokens(4 * kBlock + 4, 3);
  EXPECT_EQ(RunRequest(*e, base, 2).tokens, Reference(model, base, 2));

  // The 4 blocks of `base` hit the GPU cache; 10 more tokens are less than a block.
  std::vector<uint32_t> p(base.begin(), base.begin() + 4 * kBlock);
  p = Concat(p, Tokens(10, 4));
  m.ClearLog();
  EXPECT_EQ(RunRequest(*e, p, 2).tokens, Reference(model, p, 2));
  EXPECT_THAT(m.lookups, IsEmpty());

  const std::vector<uint32_t> short_prompt = Tokens(12, 5);  // no full block at all
  m.ClearLog();
  EXPECT_EQ(RunRequest(*e, short_prompt, 2).tokens, Reference(model, short_prompt, 2));
  EXPECT_THAT(m.lookups, IsEmpty());

  const std::vector<uint32_t> one_block = Tokens(kBlock + 1, 6);
  m.ClearLog();
  EXPECT_EQ(RunRequest(*e, one_block, 2).tokens, Reference(model, one_block, 2));
  EXPECT_EQ(m.lookups.size(), 1u);
}

// J1 rows 10-11: a hit loads the blocks past the GPU prefix hit, not those the engine holds.
TEST(EngineConnectorTest, J1ALookupHitLoadsOnlyPastTheLocalPrefixHit) {
  const std::string model = "tiny-full";
  FakeNodeStore store;
  const std::vector<uint32_t> prompt = Tokens(5 * kBlock + 3, 7);  // 83 tokens, 5 blocks
  Prime(model, &store, prompt);

  // A fresh engine (vLLM's reset_prefix_cache) that computed the first block itself.
  RecordingManager m(&store);
  std::unique_ptr<Engine> e = MakeEngine(model, &store, &m);
  const size_t groups = NumGroups(*e);
  std::vector<uint32_t> head(prompt.begin(), prompt.begin() + kBlock);
  head = Concat(head, Tokens(5, 8));
  m.lookup = [](const BlockKey&) { return LookupResult::kMiss; };
  EXPECT_EQ(RunRequest(*e, head, 2).tokens, Reference(model, head, 2));
  EXPECT_EQ(store.get_calls(), 0u);

  m.lookup = nullptr;
  store.ClearLog();
  m.ClearLog();
  const Outcome o = RunRequest(*e, prompt, 6);
  EXPECT_EQ(o.tokens, Reference(model, prompt, 6));
  EXPECT_EQ(o.cached, kBlock);
  EXPECT_EQ(o.external, 4 * kBlock);
  EXPECT_EQ(o.computed_prompt, 3u);
  const std::vector<BlockKey> got = store.get_keys();
  EXPECT_EQ(KeySet(got.begin(), got.end()), KeysOf(o.hashes, groups, 1, 5));
  EXPECT_EQ(got.size(), 4 * groups);
  ASSERT_EQ(m.prepare_loads.size(), 1u);
  EXPECT_EQ(KeySet(m.prepare_loads[0].begin(), m.prepare_loads[0].end()),
            KeysOf(o.hashes, groups, 1, 5));
  // The loaded prefix is not stored again.
  for (const auto& call : m.prepare_stores) {
    for (const BlockKey& k : call) EXPECT_GE(BlockIndexOf(o.hashes, k), 5);
  }
}

// The connector's own manager pins a load's blocks on the node from the scheduler's decision
// until the load is done (vLLM's prepare_load / complete_load), so the node cannot evict them
// between the lookup and the transfer; every pin is released once the load is done.
TEST(EngineConnectorTest, ALoadPinsItsBlocksOnTheNodeUntilItIsDone) {
  const std::string model = "tiny-hybrid";
  FakeNodeStore store;
  const std::vector<uint32_t> prompt = Tokens(5 * kBlock + 3, 11);
  Prime(model, &store, prompt);
  std::unique_ptr<Engine> e = MakeEngine(model, &store, nullptr);  // the connector's manager
  const Outcome o = RunRequest(*e, prompt, 4);
  EXPECT_EQ(o.tokens, Reference(model, prompt, 4));
  EXPECT_GT(o.external, 0u);
  const std::vector<BlockKey> got = store.get_keys();
  ASSERT_FALSE(got.empty());
  EXPECT_EQ(store.pinned_gets(), got.size());  // every block was read under its load's pin
  EXPECT_THAT(store.pins(), ::testing::IsEmpty());
}

// --- J2 (test_request_preemption) -----------------------------------------------------------

// A pool too small for two requests preempts one; its stores in flight are waited for (flushed)
// in the step that preempts it, before its blocks can be handed out again. What reached the
// nodes is each request's own KV: a fresh engine loading it gives the same tokens.
TEST(EngineConnectorTest, J2PreemptionFlushesTheStoresOfThePreemptedRequest) {
  const std::string model = "tiny-full";
  FakeNodeStore store;
  store.set_put_delay(std::chrono::milliseconds(3));  // stores stay in flight across steps
  RecordingManager m(&store);
  EngineOptions o;
  o.num_blocks = 41;  // 40 pages: 4 groups x 10 blocks; two requests of 88 tokens need 48
  std::unique_ptr<Engine> e = MakeEngine(model, &store, &m, std::move(o));
  const std::vector<uint32_t> a = Tokens(3 * kBlock, 9), b = Tokens(3 * kBlock, 10);
  const RequestId ia = *e->AddRequest(a, 40), ib = *e->AddRequest(b, 40);
  size_t flushed_checks = 0;
  while (e->HasUnfinished()) {
    std::map<RequestId, uint32_t> before;
    for (RequestId id : {ia, ib}) {
      if (const Request* r = e->Find(id)) before[id] = r->num_preemptions;
    }
    e->Step();
    for (RequestId id : {ia, ib}) {
      const Request* r = e->Find(id);
      if (r == nullptr || r->num_preemptions == before[id]) continue;
      // Preempted in this step: every block of it that a store accepted is on the node.
      for (const BlockKey& k : m.accepted) {
        if (BlockIndexOf(r->hasher->hashes(), k) < 0) continue;
        EXPECT_TRUE(store.Holds(k)) << "request " << id << " block " << k.ToString();
        ++flushed_checks;
      }
    }
  }
  EXPECT_GT(e->counters().preemptions, 0u);
  EXPECT_GT(flushed_checks, 0u);
  const Outcome oa = OutcomeOf(*e->TakeResult(ia)), ob = OutcomeOf(*e->TakeResult(ib));
  EXPECT_EQ(oa.tokens, Reference(model, a, 40));
  EXPECT_EQ(ob.tokens, Reference(model, b, 40));
  e->DrainOffload();

  // A fresh engine loads what the nodes hold of each sequence and continues it identically.
  std::unique_ptr<Engine> fresh = MakeEngine(model, &store, nullptr);
  for (const auto& [prompt, out] : {std::pair{a, oa}, std::pair{b, ob}}) {
    std::vector<uint32_t> seq = Concat(prompt, out.tokens);
    seq.resize(5 * kBlock + 1);
    const Outcome again = RunRequest(*fresh, seq, 4);
    EXPECT_EQ(again.tokens, Reference(model, seq, 4));
    EXPECT_EQ(again.external, 5 * kBlock);
  }
}

// --- J3 (test_concurrent_lookups_of_the_same_prefix) ----------------------------------------

// Two requests with the same prefix at once: one load moves the shared blocks; the other waits
// for it and then hits them in the GPU prefix cache.
TEST(EngineConnectorTest, J3ConcurrentRequestsWithTheSamePrefixLoadItOnce) {
  const std::string model = "tiny-full";
  FakeNodeStore store;
  const std::vector<uint32_t> prefix = Tokens(4 * kBlock, 11);
  Prime(model, &store, prefix);
  std::unique_ptr<Engine> e = MakeEngine(model, &store, nullptr);  // the nodes' own manager
  const size_t groups = NumGroups(*e);
  const std::vector<uint32_t> a = Concat(prefix, Tokens(6, 12)), b = Concat(prefix, Tokens(7, 13));
  const RequestId ia = *e->AddRequest(a, 4), ib = *e->AddRequest(b, 4);
  while (e->HasUnfinished()) e->Step();
  e->DrainOffload();
  const Outcome oa = OutcomeOf(*e->TakeResult(ia)), ob = OutcomeOf(*e->TakeResult(ib));
  EXPECT_EQ(oa.tokens, Reference(model, a, 4));
  EXPECT_EQ(ob.tokens, Reference(model, b, 4));
  EXPECT_EQ(store.get_calls(), 1u);
  const std::vector<BlockKey> got = store.get_keys();
  EXPECT_EQ(got.size(), 4 * groups);
  EXPECT_EQ(KeySet(got.begin(), got.end()), KeysOf(oa.hashes, groups, 0, 4));
  EXPECT_EQ(oa.external + ob.external, 4 * kBlock);
  EXPECT_EQ(std::max(oa.cached, ob.cached), 4 * kBlock);
}

// The nodes' own manager tells them of every use (docs/semantics.md §7.3, §7.6), once per step and
// off the request's path: the lookups' touches go before the step's stores, each call a whole
// request's keys with the first most recent, and the store decisions' touches after the stores
// have landed, without the keys just offered (a node inserts those itself, newest last).
TEST(EngineConnectorTest, NodesAreToldOfEveryUseLookupsBeforeStoresAndStoresAfter) {
  const std::string model = "tiny-full";
  FakeNodeStore store;
  const std::vector<uint32_t> prefix = Tokens(4 * kBlock, 21);
  Prime(model, &store, prefix);
  std::unique_ptr<Engine> e = MakeEngine(model, &store, nullptr);
  const size_t groups = NumGroups(*e);
  const std::vector<uint32_t> prompt = Concat(prefix, Tokens(2 * kBlock + 5, 22));
  const Outcome o = RunRequest(*e, prompt, 1);
  EXPECT_EQ(o.tokens, Reference(model, prompt, 1));
  EXPECT_EQ(o.external, 4 * kBlock);
  const KeySet hits = KeysOf(o.hashes, groups, 0, 4), fresh = KeysOf(o.hashes, groups, 4, 6);
  const auto touches = store.touches();
  ASSERT_FALSE(touches.empty());
  // The lookup's touch came first, before any store of this engine: every key of the request,
  // each group's blocks in prefix order (the first most recent).
  const auto& lookup = touches.front();
  EXPECT_EQ(lookup.blocks_held, 4 * groups);
  EXPECT_EQ(KeySet(lookup.keys.begin(), lookup.keys.end()), KeysOf(o.hashes, groups, 0, 6));
  for (uint32_t g = 0; g < groups; ++g) {
    std::vector<int> order;
    for (const BlockKey& k : lookup.keys) {
      if (k.group == g) order.push_back(BlockIndexOf(o.hashes, k));
    }
    EXPECT_TRUE(std::is_sorted(order.begin(), order.end())) << "group " << g;
  }
  bool after_stores = false;
  for (const auto& t : touches) {
    EXPECT_EQ(KeySet(t.keys.begin(), t.keys.end()).size(), t.keys.size()) << "a key twice";
    if (t.blocks_held < 6 * groups) continue;
    // After the new blocks landed: the hits, never the blocks just stored.
    for (const BlockKey& k : t.keys) EXPECT_FALSE(fresh.contains(k)) << k.ToString();
    after_stores = after_stores || KeySet(t.keys.begin(), t.keys.end()) == hits;
  }
  EXPECT_TRUE(after_stores);
}

// --- J5 (test_two_groups_full_and_sliding_window) -------------------------------------------

// Per group, the block indices a load read (sorted, without repeats).
std::map<uint32_t, std::set<int>> ReadsByGroup(const FakeNodeStore& store,
                                               const std::vector<BlockHash>& hashes) {
  std::map<uint32_t, std::set<int>> out;
  for (const BlockKey& k : store.get_keys()) out[k.group].insert(BlockIndexOf(hashes, k));
  return out;
}

// Sliding-window groups need only the blocks of the window (32 tokens: 2 blocks) before the
// hit's end: the nodes may have evicted the others, the hit still counts, and only the window is
// loaded and touched; full-attention groups load and touch the whole prefix.
TEST(EngineConnectorTest, J5SlidingWindowGroupsLoadOnlyTheirWindow) {
  for (const std::string model : {"tiny-swa", "tiny-hybrid"}) {
    SCOPED_TRACE(model);
    FakeNodeStore store;
    const std::vector<uint32_t> prompt = Tokens(6 * kBlock + 4, 14);  // 100 tokens, 6 blocks
    const std::vector<BlockHash> hashes = Prime(model, &store, prompt);
    RecordingManager m(&store);
    std::unique_ptr<Engine> e = MakeEngine(model, &store, &m);
    const auto& groups = e->layout().groups;
    for (uint32_t g = 0; g < groups.size(); ++g) {
      if (groups[g].kind != AttentionSpec::Kind::kSlidingWindow) continue;
      for (size_t i = 0; i < 4; ++i) store.Erase(BlockKey{hashes[i], g});
    }
    const Outcome o = RunRequest(*e, prompt, 6);
    EXPECT_EQ(o.tokens, Reference(model, prompt, 6));
    EXPECT_EQ(o.external, 6 * kBlock);
    const auto reads = ReadsByGroup(store, o.hashes);
    // The lookup's touches, one call per group.
    std::map<uint32_t, std::set<int>> touched;
    ASSERT_GE(m.touches.size(), groups.size());
    for (size_t c = 0; c < groups.size(); ++c) {
      for (const BlockKey& k : m.touches[c]) touched[k.group].insert(BlockIndexOf(o.hashes, k));
    }
    size_t windowed = 0;
    for (uint32_t g = 0; g < groups.size(); ++g) {
      SCOPED_TRACE("group " + std::to_string(g));
      const std::set<int> got = reads.contains(g) ? reads.at(g) : std::set<int>{};
      switch (groups[g].kind) {
        case AttentionSpec::Kind::kFull:
          EXPECT_EQ(got, (std::set<int>{0, 1, 2, 3, 4, 5}));
          EXPECT_EQ(touched[g], (std::set<int>{0, 1, 2, 3, 4, 5}));
          break;
        case AttentionSpec::Kind::kSlidingWindow:
          EXPECT_EQ(got, (std::set<int>{4, 5}));
          EXPECT_EQ(touched[g], (std::set<int>{4, 5}));
          ++windowed;
          break;
        default:
          // A chunk of 64 tokens: looked up as a window of 4 blocks; what the engine reads of
          // it is the chunk of the tokens after the hit (64..127).
          EXPECT_EQ(got, (std::set<int>{4, 5}));
          EXPECT_EQ(touched[g], (std::set<int>{2, 3, 4, 5}));
          break;
      }
    }
    EXPECT_GT(windowed, 0u);
  }
}

// --- J7 (test_do_remote_decode_stores_all_blocks) -------------------------------------------

// A prefill worker's request (do_remote_decode) stores the prefix it loaded, so the decode
// worker finds every block on the nodes; any other request does not store it again.
TEST(EngineConnectorTest, J7RemoteDecodeStoresTheLoadedPrefixAgain) {
  const std::string model = "tiny-full";
  const std::vector<uint32_t> prefix = Tokens(4 * kBlock, 15);
  const std::vector<uint32_t> prompt = Concat(prefix, Tokens(6, 16));
  const std::vector<uint32_t> want = Reference(model, prompt, 4);
  for (bool remote : {true, false}) {
    SCOPED_TRACE(remote ? "do_remote_decode" : "local");
    FakeNodeStore store;
    Prime(model, &store, prefix);
    RecordingManager m(&store);
    std::unique_ptr<Engine> e = MakeEngine(model, &store, &m);
    const size_t groups = NumGroups(*e);
    const Outcome o = RunRequest(*e, prompt, 4, remote);
    EXPECT_EQ(o.tokens, want);
    EXPECT_EQ(o.external, 4 * kBlock);
    const std::vector<BlockKey> put = store.put_keys();
    const KeySet stored(put.begin(), put.end());
    KeySet offered;
    for (const auto& call : m.prepare_stores) offered.insert(call.begin(), call.end());
    for (const BlockKey& k : KeysOf(o.hashes, groups, 0, 4)) {
      EXPECT_EQ(stored.contains(k), remote) << k.ToString();
      EXPECT_EQ(offered.contains(k), remote) << k.ToString();
    }
  }
}

// --- Failures -------------------------------------------------------------------------------

class EngineConnectorFailureTest : public ::testing::TestWithParam<std::string> {};

// A node that fails reads or returns a corrupt block: the engine recomputes and its tokens are
// those without offload; the rejected KV never enters its prefix cache. A served load gives the
// same tokens computing only the rest.
TEST_P(EngineConnectorFailureTest, BadLoadsAreRecomputedServedLoadsAreUsed) {
  const std::string model = GetParam();
  const std::vector<uint32_t> prompt = Tokens(150, 17);
  const std::vector<uint32_t> want = Reference(model, prompt, 6);
  for (auto fault : {FakeNodeStore::Fault::kNone, FakeNodeStore::Fault::kGetFails,
                     FakeNodeStore::Fault::kGetCorrupt}) {
    SCOPED_TRACE(static_cast<int>(fault));
    FakeNodeStore store;
    Prime(model, &store, prompt);
    store.set_fault(fault);
    std::unique_ptr<Engine> e = MakeEngine(model, &store, nullptr);
    const Outcome o = RunRequest(*e, prompt, 6);
    EXPECT_EQ(o.tokens, want);
    EXPECT_GT(store.get_calls(), 0u);
    if (fault == FakeNodeStore::Fault::kNone) {
      EXPECT_GT(o.external, 0u);
      EXPECT_EQ(o.computed_prompt, prompt.size() - o.external);
      EXPECT_EQ(e->counters().load_failures, 0u);
    } else {
      EXPECT_EQ(o.external, 0u);
      EXPECT_EQ(o.computed_prompt, prompt.size());
      EXPECT_EQ(e->counters().load_failures, 1u);
      EXPECT_GT(e->offload()->stats().blocks_load_failed, 0u);
    }
    // Again on that engine: its own prefix cache, which must not hold a rejected block.
    const Outcome again = RunRequest(*e, prompt, 6);
    EXPECT_EQ(again.tokens, want);
    EXPECT_GT(again.cached, 0u);
  }
}

INSTANTIATE_TEST_SUITE_P(Builtins, EngineConnectorFailureTest, BuiltinModels(), BuiltinModelName);

// --- A pool apart from the host pages (a GPU's) -----------------------------------------------

class EngineConnectorStagedTest : public ::testing::TestWithParam<std::string> {};

// With the pool in device memory the connector moves a host mirror: stores must copy their
// pages to it after the compute, loads copy theirs back before the request computes. The
// "cpu-staged" device keeps the pool apart as a GPU does, so a missing or misordered copy
// stores or computes from stale pages. Each direction is checked against a plain CPU engine on
// the other side: blocks pushed from a staged engine serve a CPU engine, and blocks pushed from
// a CPU engine serve a staged one, with the tokens of no offload.
TEST_P(EngineConnectorStagedTest, BlocksCrossTheHostMirrorBothWays) {
  const std::string model = GetParam();
  const std::vector<uint32_t> prompt = Tokens(150, 23);
  const std::vector<uint32_t> want = Reference(model, prompt, 6);
  EngineOptions staged;
  staged.device = "cpu-staged";
  for (bool staged_pushes : {true, false}) {
    SCOPED_TRACE(staged_pushes ? "staged pushes, cpu pulls" : "cpu pushes, staged pulls");
    FakeNodeStore store;
    {
      std::unique_ptr<Engine> pusher =
          MakeEngine(model, &store, nullptr, staged_pushes ? staged : EngineOptions{});
      EXPECT_EQ(pusher->runner().host_pool_is_pool(), !staged_pushes);
      EXPECT_EQ(RunRequest(*pusher, prompt, 1).tokens, Reference(model, prompt, 1));
    }
    std::unique_ptr<Engine> puller =
        MakeEngine(model, &store, nullptr, staged_pushes ? EngineOptions{} : staged);
    const Outcome o = RunRequest(*puller, prompt, 6);
    EXPECT_EQ(o.tokens, want);
    EXPECT_GT(o.external, 0u);
    EXPECT_EQ(o.computed_prompt, prompt.size() - o.external);
    EXPECT_EQ(puller->counters().load_failures, 0u);
  }
}

INSTANTIATE_TEST_SUITE_P(Builtins, EngineConnectorStagedTest, BuiltinModels(), BuiltinModelName);

}  // namespace
}  // namespace kvstash::engine
