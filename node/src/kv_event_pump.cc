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
  // its last kLost mark count: what came before is cleared anyway).
  bool Add(const store::OffloadEventLog& drained, Medium medium) {
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
      for (size_t i = at; i < at + count; ++i) Note(drained.keys[i], medium, stored);
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
    struct Span {
      events::BlockRun::Kind kind;
      Medium medium;
      uint32_t group;
      size_t begin, end;
    };
    std::vector<Span> spans;
    for (const List& list : it->second) {
      for (const bool stored : {false, true}) {
        const size_t begin = hashes->size();
        for (const Entry& e : list.entries) {
          if (e.live && e.stored == stored) hashes->push_back(e.hash);
        }
        if (hashes->size() > begin) {
          spans.push_back(
              {stored ? events::BlockRun::Kind::kStored : events::BlockRun::Kind::kRemoved,
               list.medium, list.group, begin, hashes->size()});
        }
      }
    }
    for (const Span& sp : spans) {
      runs->push_back({sp.kind, kMediumNames[sp.medium], sp.group,
                       std::span<const Hash128>(hashes->data() + sp.begin, sp.end - sp.begin)});
    }
  }

 private:
  struct Entry {
    Hash128 hash;
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

  void Note(const BlockKey& key, Medium medium, bool stored) {
    std::vector<List>& lists = lists_[key.namespace_id];
    auto [it, fresh] = last_[medium].try_emplace(key, Where{});
    if (!fresh) lists[it->second.list].entries[it->second.entry].live = false;
    size_t l = 0;
    while (l < lists.size() && (lists[l].medium != medium || lists[l].group != key.group)) ++l;
    if (l == lists.size()) lists.push_back({medium, key.group, {}});
    lists[l].entries.push_back({key.hash, stored, true});
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
                                                         store::TieredStore* store,
                                                         NameOf name_of) {
  KVSTASH_ASSIGN_OR_RETURN(std::unique_ptr<events::EventPublisher> publisher,
                           events::EventPublisher::Create(options.publisher));
  return std::unique_ptr<KvEventPump>(
      new KvEventPump(options, store, std::move(name_of), std::move(publisher)));
}

KvEventPump::KvEventPump(const KvEventOptions& options, store::TieredStore* store, NameOf name_of,
                         std::unique_ptr<events::EventPublisher> publisher)
    : interval_(std::max(options.interval, std::chrono::milliseconds(1))),
      store_(store),
      name_of_(std::move(name_of)),
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
  bool lost = round.Add(cpu_log_, KvEventRound::kCpu);
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
  if (clear) runs.push_back({events::BlockRun::Kind::kAllCleared, {}, 0, {}});
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
      batch.push_back(part);
      in_batch += part.hashes.size();
      if (in_batch >= kMaxHashesPerBatch) send();
    } while (!run.hashes.empty());
  }
  send();
}

}  // namespace kvstash::node
