#include "kv_event_pump.h"

#include <map>
#include <unordered_map>
#include <utility>
#include <vector>

#include "kvstash/common/logging.h"

namespace kvstash::node {
namespace {

// The most block hashes one batch carries; a round with more sends several.
constexpr size_t kMaxHashesPerBatch = 8192;

}  // namespace

// A round's events, folded: each key's last event in each tier wins (a key stored and evicted
// within the round is published as removed, one evicted and stored again as stored), so that
// a round's removed and stored keys are disjoint sets and may go in any order. Per namespace,
// then per (tier, group), in the order they first came.
class KvEventRound {
 public:
  enum Medium : uint8_t { kCpu = 0, kSsd = 1 };
  static constexpr std::string_view kMediumNames[] = {events::kMediumCpu, events::kMediumSsd};

  // Folds a tier's drained events in; true when the tier lost some (then only the events after
  // its last kLost mark count: what came before is cleared anyway). Each block stored takes its
  // put's metadata out of `metas` when given.
  bool Add(const store::OffloadEventLog& drained, Medium medium, BlockMetaTable* metas = nullptr) {
    // A kLost run is always first (the manager drops everything before it).
    bool lost = false;
    size_t at = 0;
    for (const auto& [kind, count] : drained.runs) {
      if (kind == store::OffloadEvent::Kind::kLost) {
        lost = true;
        Clear(medium);
        continue;
      }
      const bool stored = kind == store::OffloadEvent::Kind::kStored;
      for (size_t i = at; i < at + count; ++i) {
        const BlockKey& key = drained.keys[i];
        std::optional<BlockMeta> meta;
        if (stored && metas != nullptr) meta = metas->Take(key);
        Note(key, medium, stored, meta);
      }
      at += count;
    }
    return lost;
  }

  bool empty() const { return lists_.empty(); }
  // Empties it, keeping the tables' memory for the next round.
  void Reset() {
    lists_.clear();
    last_[kCpu].clear();
    last_[kSsd].clear();
  }
  std::vector<NamespaceId> namespaces() const {
    std::vector<NamespaceId> out;
    for (const auto& [ns, lists] : lists_) out.push_back(ns);
    return out;
  }

  // Namespace `ns`'s runs (live entries only), removed before stored in each list; `hashes`
  // holds their hashes.
  void Runs(NamespaceId ns, std::vector<events::BlockRun>* runs,
            std::vector<Hash128>* hashes) const {
    auto it = lists_.find(ns);
    if (it == lists_.end()) return;
    // Two passes: hashes first (so that its storage is final), then spans into it.
    std::vector<Span> spans;
    for (const List& list : it->second) {
      const size_t begin = hashes->size();
      for (const Entry& e : list.entries) {
        if (e.live && !e.stored) hashes->push_back(e.hash);
      }
      if (hashes->size() > begin) {
        spans.push_back({events::BlockRun::Kind::kRemoved, list.medium, list.group, begin,
                         hashes->size(), std::nullopt, 0});
      }
      StoredSpans(list, &spans, hashes);
    }
    for (const Span& sp : spans) {
      runs->push_back({sp.kind, kMediumNames[sp.medium], sp.group,
                       std::span<const Hash128>(hashes->data() + sp.begin, sp.end - sp.begin),
                       sp.parent, sp.tokens});
    }
  }

 private:
  struct Entry {
    Hash128 hash;
    Hash128 parent;   // with has_parent
    uint32_t tokens;  // 0: no metadata (then no parent)
    bool has_parent;
    bool stored;
    bool live;
  };
  struct List {
    Medium medium;
    uint32_t group;
    std::vector<Entry> entries;
  };
  struct Where {
    size_t list;
    size_t entry;
  };

  struct Span {
    events::BlockRun::Kind kind;
    Medium medium;
    uint32_t group;
    size_t begin, end;
    std::optional<Hash128> parent;
    uint32_t tokens;
  };

  // A list's stored blocks as spans. Those without metadata go in one span, as before clients
  // said any. Those with go in chains, as vLLM's BlockStored has one parent and one block size
  // for its blocks: a block follows the block its metadata names as parent when that one is
  // stored here too, with the same tokens, and no other block follows it already. Each chain is
  // a span from its first block (its parent as the client gave it), chains in the order their
  // first committed block came: a client may commit a request's blocks in any order (the cluster
  // client sends them last first). Whatever the metadata says (a cycle, two blocks naming one
  // parent), every block is published once.
  static void StoredSpans(const List& list, std::vector<Span>* spans,
                          std::vector<Hash128>* hashes) {
    std::vector<const Entry*> stored;  // live, in commit order
    bool chained = false;
    for (const Entry& e : list.entries) {
      if (!e.live || !e.stored) continue;
      stored.push_back(&e);
      chained = chained || e.tokens != 0;
    }
    if (stored.empty()) return;
    auto open = [&](const Entry& e) {
      spans->push_back({events::BlockRun::Kind::kStored, list.medium, list.group, hashes->size(),
                        hashes->size(),
                        e.has_parent ? std::optional<Hash128>(e.parent) : std::nullopt, e.tokens});
    };
    auto add = [&](const Entry& e) {
      hashes->push_back(e.hash);
      spans->back().end = hashes->size();
    };
    if (!chained) {
      open(*stored[0]);
      for (const Entry* e : stored) add(*e);
      return;
    }
    constexpr size_t kNone = SIZE_MAX;
    struct HashOf {
      size_t operator()(const Hash128& h) const { return Mix64(h.lo ^ Mix64(h.hi)); }
    };
    std::unordered_map<Hash128, size_t, HashOf> at;  // a block with metadata: its place
    for (size_t i = 0; i < stored.size(); ++i) {
      if (stored[i]->tokens != 0) at.emplace(stored[i]->hash, i);
    }
    // Links: each block at most one next and one previous, so chains are paths or cycles.
    std::vector<size_t> next(stored.size(), kNone), prev(stored.size(), kNone);
    for (size_t i = 0; i < stored.size(); ++i) {
      const Entry& e = *stored[i];
      if (e.tokens == 0 || !e.has_parent) continue;
      auto p = at.find(e.parent);
      if (p == at.end() || p->second == i || next[p->second] != kNone) continue;
      if (stored[p->second]->tokens != e.tokens) continue;
      next[p->second] = i;
      prev[i] = p->second;
    }
    std::vector<bool> done(stored.size(), false);
    bool plain_done = false;
    for (size_t i = 0; i < stored.size(); ++i) {
      if (done[i]) continue;
      if (stored[i]->tokens == 0) {
        if (plain_done) continue;
        plain_done = true;
        open(*stored[i]);
        for (size_t j = i; j < stored.size(); ++j) {
          if (stored[j]->tokens == 0) add(*stored[j]);
        }
        continue;
      }
      // Back to the chain's first block (in a cycle, round to this one), then along it.
      size_t first = i;
      while (prev[first] != kNone && prev[first] != i) first = prev[first];
      if (prev[first] == i) first = i;
      open(*stored[first]);
      for (size_t j = first; j != kNone && !done[j]; j = next[j]) {
        add(*stored[j]);
        done[j] = true;
      }
    }
  }

  void Note(const BlockKey& key, Medium medium, bool stored, const std::optional<BlockMeta>& meta) {
    std::vector<List>& lists = lists_[key.namespace_id];
    auto [it, fresh] = last_[medium].try_emplace(key, Where{});
    if (!fresh) lists[it->second.list].entries[it->second.entry].live = false;
    size_t l = 0;
    while (l < lists.size() && (lists[l].medium != medium || lists[l].group != key.group)) ++l;
    if (l == lists.size()) lists.push_back({medium, key.group, {}});
    Entry& e = lists[l].entries.emplace_back();
    e.hash = key.hash;
    e.parent = meta && meta->parent ? *meta->parent : Hash128{};
    e.tokens = meta ? meta->tokens : 0;
    e.has_parent = meta && meta->parent;
    e.stored = stored;
    e.live = true;
    it->second = Where{l, lists[l].entries.size() - 1};
  }

  void Clear(Medium medium) {
    last_[medium].clear();
    for (auto& [ns, lists] : lists_) {
      for (List& list : lists) {
        if (list.medium == medium) list.entries.clear();
      }
    }
  }

  std::map<NamespaceId, std::vector<List>> lists_;
  std::unordered_map<BlockKey, Where> last_[2];
};

Result<std::unique_ptr<KvEventPump>> KvEventPump::Create(const KvEventOptions& options,
                                                         store::TieredStore* store, NameOf name_of,
                                                         BlockMetaTable* metas) {
  KVSTASH_ASSIGN_OR_RETURN(std::unique_ptr<events::EventPublisher> publisher,
                           events::EventPublisher::Create(options.publisher));
  return std::unique_ptr<KvEventPump>(
      new KvEventPump(options, store, std::move(name_of), metas, std::move(publisher)));
}

KvEventPump::KvEventPump(const KvEventOptions& options, store::TieredStore* store, NameOf name_of,
                         BlockMetaTable* metas, std::unique_ptr<events::EventPublisher> publisher)
    : interval_(std::max(options.interval, std::chrono::milliseconds(1))),
      store_(store),
      name_of_(std::move(name_of)),
      metas_(metas),
      publisher_(std::move(publisher)),
      round_(std::make_unique<KvEventRound>()),
      thread_([this] { Run(); }) {}

KvEventPump::~KvEventPump() {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
    wake_.SignalAll();
  }
  thread_.join();
  publisher_->Flush();
}

KvEventPumpStats KvEventPump::stats() const {
  KvEventPumpStats s;
  s.publisher = publisher_->stats();
  MutexLock lock(&mu_);
  s.rounds_lost = rounds_lost_;
  s.block_metas_dropped = metas_ != nullptr ? metas_->dropped() : 0;
  return s;
}

void KvEventPump::PublishNow() {
  Pump();
  publisher_->Flush();
}

void KvEventPump::Run() {
  // The blocks the SSD tier found at start: each namespace's topic begins with them.
  if (store::SsdTier* ssd = store_->ssd()) {
    MutexLock lock(&pump_mu_);
    KvEventRound held;
    store::OffloadEventLog log;
    log.keys = ssd->ResidentKeys();
    log.runs.push_back({store::OffloadEvent::Kind::kStored, log.keys.size()});
    held.Add(log, KvEventRound::kSsd);
    for (NamespaceId ns : held.namespaces()) {
      std::optional<std::string> name = name_of_(ns);
      if (!name) continue;
      announced_.insert(ns);
      Publish(ns, *name, held, /*clear=*/true);
    }
  }
  while (true) {
    bool stopping;
    {
      MutexLock lock(&mu_);
      if (!stopping_) wake_.WaitFor(&mu_, interval_);
      stopping = stopping_;
    }
    Pump();
    if (stopping) return;
  }
}

void KvEventPump::Pump() {
  MutexLock pump_lock(&pump_mu_);
  KvEventRound& round = *round_;
  round.Reset();
  store_->cpu().TakeEvents(&cpu_log_);
  // Puts record their metadata before their stores commit, so that what this drain holds is in
  // the table by now; a table found empty (clients that send none) costs no lookups.
  bool lost = round.Add(cpu_log_, KvEventRound::kCpu,
                        metas_ != nullptr && !metas_->empty() ? metas_ : nullptr);
  if (store::SsdTier* tier = store_->ssd()) {
    tier->TakeEvents(&ssd_log_);
    lost = round.Add(ssd_log_, KvEventRound::kSsd) || lost;
  }
  if (lost) {
    MutexLock lock(&mu_);
    if (std::has_single_bit(++rounds_lost_)) {
      KVSTASH_LOG_WARN(
          "KV events: the store dropped events nobody drained in time ({} time(s)); "
          "every topic starts over with AllBlocksCleared",
          rounds_lost_);
    }
  }
  // Every namespace with events, and on a loss every one announced before.
  std::set<NamespaceId> namespaces = lost ? announced_ : dropped_;
  for (NamespaceId ns : round.namespaces()) namespaces.insert(ns);
  for (NamespaceId ns : namespaces) {
    std::optional<std::string> name = name_of_(ns);
    if (!name) continue;  // an id the table does not name: no client can hold its blocks
    const bool restart = lost || dropped_.erase(ns) > 0;
    const bool clear = announced_.insert(ns).second || restart;
    Publish(ns, *name, round, clear);
  }
}

void KvEventPump::Publish(NamespaceId ns, const std::string& topic, const KvEventRound& round,
                          bool clear) {
  std::vector<events::BlockRun> runs;
  std::vector<Hash128> hashes;
  if (clear) runs.push_back({events::BlockRun::Kind::kAllCleared, {}, 0, {}, std::nullopt, 0});
  round.Runs(ns, &runs, &hashes);
  // Batches of at most kMaxHashesPerBatch hashes, a run split where it must.
  std::vector<events::BlockRun> batch;
  size_t in_batch = 0;
  auto send = [&] {
    pump_mu_.AssertHeld();  // the caller's
    if (batch.empty()) return;
    if (!publisher_->PublishEncoded(topic, events::EncodeRuns(events::NowSeconds(), batch))) {
      dropped_.insert(ns);
    }
    batch.clear();
    in_batch = 0;
  };
  for (events::BlockRun run : runs) {
    do {
      events::BlockRun part = run;
      const size_t room = kMaxHashesPerBatch - in_batch;
      if (part.hashes.size() > room) part.hashes = part.hashes.first(room);
      run.hashes = run.hashes.subspan(part.hashes.size());
      // The rest of a chain hangs from the part's last block.
      if (run.block_size != 0 && !part.hashes.empty()) run.parent = part.hashes.back();
      batch.push_back(part);
      in_batch += part.hashes.size();
      if (in_batch >= kMaxHashesPerBatch) send();
    } while (!run.hashes.empty());
  }
  send();
}

}  // namespace kvstash::node
