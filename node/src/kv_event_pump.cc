#include "kv_event_pump.h"

#include <map>
#include <utility>
#include <vector>

#include "kvstash/common/logging.h"

namespace kvstash::node {
namespace {

// The most block hashes one batch carries; a round with more sends several.
constexpr size_t kMaxHashesPerBatch = 8192;

double Now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// The key as its client gave it: a 64-bit hash as an integer, a wider one as 16 bytes,
// big-endian.
events::ExternalHash ExternalOf(const BlockHash& hash) {
  if (hash.hi == 0) return hash.lo;
  std::string bytes(16, '\0');
  for (int i = 0; i < 8; ++i) {
    bytes[i] = static_cast<char>((hash.hi >> (56 - 8 * i)) & 0xff);
    bytes[8 + i] = static_cast<char>((hash.lo >> (56 - 8 * i)) & 0xff);
  }
  return bytes;
}

// One namespace's events of a round, in order, and how many hashes they name.
struct Pending {
  std::vector<events::KvEvent> events;
  size_t hashes = 0;
};

// Appends `event`'s keys to the namespaces' lists: one vLLM event per run of keys of one
// namespace and group.
void Convert(const store::OffloadEvent& event, std::string_view medium,
             std::map<NamespaceId, Pending>* out) {
  const auto& keys = event.keys;
  for (size_t begin = 0; begin < keys.size();) {
    size_t end = begin + 1;
    while (end < keys.size() && keys[end].namespace_id == keys[begin].namespace_id &&
           keys[end].group == keys[begin].group) {
      ++end;
    }
    std::vector<events::ExternalHash> hashes;
    hashes.reserve(end - begin);
    for (size_t i = begin; i < end; ++i) hashes.push_back(ExternalOf(keys[i].hash));
    Pending& p = (*out)[keys[begin].namespace_id];
    p.hashes += hashes.size();
    const int64_t group = keys[begin].group;
    if (event.kind == store::OffloadEvent::Kind::kStored) {
      events::BlockStored e;
      e.block_hashes = std::move(hashes);
      e.medium = std::string(medium);
      e.group_idx = group;
      p.events.emplace_back(std::move(e));
    } else {
      events::BlockRemoved e;
      e.block_hashes = std::move(hashes);
      e.medium = std::string(medium);
      e.group_idx = group;
      p.events.emplace_back(std::move(e));
    }
    begin = end;
  }
}

// Converts a tier's drained events; true when it lost some (then only those after the last
// kLost count, the rest being cleared anyway).
bool ConvertAll(const std::vector<store::OffloadEvent>& drained, std::string_view medium,
                std::map<NamespaceId, Pending>* out) {
  size_t first = 0;
  bool lost = false;
  for (size_t i = 0; i < drained.size(); ++i) {
    if (drained[i].kind == store::OffloadEvent::Kind::kLost) {
      lost = true;
      first = i + 1;
    }
  }
  if (lost) out->clear();
  for (size_t i = first; i < drained.size(); ++i) Convert(drained[i], medium, out);
  return lost;
}

}  // namespace

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
    std::vector<BlockKey> keys = ssd->ResidentKeys();
    std::map<NamespaceId, Pending> held;
    Convert({store::OffloadEvent::Kind::kStored, std::move(keys)}, events::kMediumSsd, &held);
    for (auto& [ns, pending] : held) {
      std::optional<std::string> name = name_of_(ns);
      if (!name) continue;
      announced_.insert(ns);
      events::KvEventBatch batch{Now(), {events::AllBlocksCleared{}}, std::nullopt};
      for (events::KvEvent& e : pending.events) batch.events.push_back(std::move(e));
      publisher_->Publish(*name, std::move(batch));
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
  std::map<NamespaceId, Pending> cpu;
  std::map<NamespaceId, Pending> ssd;
  bool lost = ConvertAll(store_->cpu().TakeEvents(), events::kMediumCpu, &cpu);
  if (store::SsdTier* tier = store_->ssd()) {
    lost = ConvertAll(tier->TakeEvents(), events::kMediumSsd, &ssd) || lost;
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
  for (const auto& [ns, p] : cpu) namespaces.insert(ns);
  for (const auto& [ns, p] : ssd) namespaces.insert(ns);
  for (NamespaceId ns : namespaces) {
    std::optional<std::string> name = name_of_(ns);
    if (!name) continue;  // an id the table does not name: no client can hold its blocks
    std::vector<events::KvEvent> all;
    const bool restart = lost || dropped_.erase(ns) > 0;
    if (announced_.insert(ns).second || restart) all.emplace_back(events::AllBlocksCleared{});
    for (auto* tier : {&cpu, &ssd}) {
      auto it = tier->find(ns);
      if (it == tier->end()) continue;
      for (events::KvEvent& e : it->second.events) all.push_back(std::move(e));
    }
    // Batches of at most kMaxHashesPerBatch hashes (an event is never split).
    events::KvEventBatch batch{Now(), {}, std::nullopt};
    size_t hashes = 0;
    for (events::KvEvent& e : all) {
      const size_t n = std::visit(
          [](const auto& v) -> size_t {
            if constexpr (std::is_same_v<std::decay_t<decltype(v)>, events::AllBlocksCleared>) {
              return 0;
            } else {
              return v.block_hashes.size();
            }
          },
          e);
      if (!batch.events.empty() && hashes + n > kMaxHashesPerBatch) {
        if (!publisher_->Publish(*name, std::move(batch))) dropped_.insert(ns);
        batch = events::KvEventBatch{Now(), {}, std::nullopt};
        hashes = 0;
      }
      batch.events.push_back(std::move(e));
      hashes += n;
    }
    if (!batch.events.empty() && !publisher_->Publish(*name, std::move(batch))) {
      dropped_.insert(ns);
    }
  }
}

}  // namespace kvstash::node
