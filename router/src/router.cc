#include "kvstash/router/router.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <deque>
#include <limits>
#include <map>
#include <optional>
#include <utility>

#include "kvstash/common/logging.h"
#include "kvstash/common/mutex.h"
#include "kvstash/events/kv_events.h"
#include "kvstash/events/subscriber.h"
#include "kvstash/router/scoring.h"
#include "kvstash/worker/client.h"
#include "kvstash/worker/protocol_json.h"

namespace kvstash::router {
namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

// Whether a failed call says the worker is at fault (it sits out, the call goes elsewhere)
// rather than the request (returned to the caller as is).
bool WorkerFault(const Status& status) {
  switch (status.code()) {
    case StatusCode::kUnavailable:
    case StatusCode::kDeadlineExceeded:
    case StatusCode::kInternal:
      return true;
    default:
      return false;
  }
}

bool SameLayout(const worker::WorkerInfo& a, const worker::WorkerInfo& b) {
  if (a.groups.size() != b.groups.size() || a.hash_block_size != b.hash_block_size ||
      a.cache_salt != b.cache_salt) {
    return false;
  }
  for (size_t g = 0; g < a.groups.size(); ++g) {
    const engine::AttentionSpec& x = a.groups[g];
    const engine::AttentionSpec& y = b.groups[g];
    if (x.kind != y.kind || x.block_size != y.block_size || x.window != y.window) return false;
  }
  return true;
}

// Each worker's hit and score, per role, in option order.
json ScoresJson(const Choice& c) {
  json scores = json::object();
  auto add = [&scores](std::string_view role, const std::vector<size_t>& hits,
                       const std::vector<double>& values) {
    json list = json::array();
    for (size_t i = 0; i < hits.size(); ++i) {
      list.push_back({{"hit_tokens", hits[i]}, {"score", values[i]}});
    }
    scores[std::string(role)] = std::move(list);
  };
  add("prefill", c.prefill_hits, c.prefill_scores);
  add("decode", c.decode_hits, c.decode_scores);
  return scores;
}

// usage.kvstash of a routed completion: computed_tokens and ttft_ms of the whole request (both
// workers'), and the router's choice under "router".
void AddRoutedUsage(json* usage, const RoutedCompletion& routed, Policy policy) {
  const Choice& c = routed.choice;
  json prefill = nullptr;
  if (!routed.prefill_worker.empty()) {
    prefill = {{"worker", routed.prefill_worker},
               {"computed_tokens", routed.prefill_usage.computed_tokens},
               {"node_tokens", routed.prefill_usage.node_tokens},
               {"local_hit_tokens", routed.prefill_usage.local_hit_tokens},
               {"latency_ms", routed.prefill_usage.latency_ms}};
  }
  json out = {{"policy", policy == Policy::kKv ? "kv" : "round-robin"},
              {"prefill", std::move(prefill)},
              {"decode_worker", routed.decode_worker},
              {"skipped_prefill", c.skip_reason.empty() ? json() : json(c.skip_reason)},
              {"node_tokens", c.node_tokens},
              {"node_memory_tokens", c.node_memory_tokens},
              {"scores", ScoresJson(c)},
              {"retries", routed.retries}};
  json& kv = (*usage)["kvstash"];
  kv["router"] = std::move(out);
  kv["computed_tokens"] =
      routed.completion.usage.computed_tokens + routed.prefill_usage.computed_tokens;
  kv["ttft_ms"] = routed.ttft_ms;
}

// One worker: its address, role and event subscription, and (under the router's lock) its
// load, health and idle HTTP clients.
struct Slot {
  std::string address;
  worker::Role role = worker::Role::kBoth;
  std::string source;  // its name in the index: "worker ADDRESS"
  bool member = true;  // false once it left (RemoveWorker): never chosen
  std::unique_ptr<events::EventSubscriber> subscriber;
  size_t running = 0;
  Clock::time_point down_until{};
  uint64_t chosen = 0;
  uint64_t failures = 0;
  uint64_t hit_tokens = 0;
  std::vector<std::unique_ptr<worker::WorkerClient>> idle;
};

class RouterImpl final : public Router {
 public:
  explicit RouterImpl(RouterOptions options) : options_(std::move(options)) {}

  ~RouterImpl() override {
    // The subscriptions' threads call into the index: stopped first.
    std::vector<std::unique_ptr<events::EventSubscriber>> subscribers;
    {
      MutexLock lock(&mu_);
      for (auto& s : prefill_) subscribers.push_back(std::move(s.subscriber));
      for (auto& s : decode_) subscribers.push_back(std::move(s.subscriber));
      for (auto& [endpoint, node] : nodes_) subscribers.push_back(std::move(node.subscriber));
    }
    subscribers.clear();
  }

  Status Init() {
    if (options_.decode_workers.empty()) {
      return InvalidArgumentError("a router needs at least one decode worker");
    }
    if (options_.load_tokens < 0 || options_.ssd_weight < 0 || options_.ssd_weight > 1 ||
        options_.node_weight < 0 || options_.node_weight > 1) {
      return InvalidArgumentError(
          "load_tokens must be >= 0, and node_weight and ssd_weight from 0 to 1");
    }
    // The first decode worker's model is the one every other must serve.
    for (const std::string& address : options_.decode_workers) {
      KVSTASH_RETURN_IF_ERROR(AddWorker(address, /*prefill=*/false));
    }
    for (const std::string& address : options_.prefill_workers) {
      KVSTASH_RETURN_IF_ERROR(AddWorker(address, /*prefill=*/true));
    }
    for (const NodeEvents& node : options_.nodes) KVSTASH_RETURN_IF_ERROR(AddNode(node));
    return Status::OK();
  }

  Status AddWorker(const std::string& address, bool prefill) override {
    {
      MutexLock lock(&mu_);
      if (const Slot* s = Find(prefill ? prefill_ : decode_, address); s && s->member) {
        return Status::OK();
      }
    }
    KVSTASH_ASSIGN_OR_RETURN(auto client,
                             worker::WorkerClient::Create(address, options_.worker_timeout));
    KVSTASH_ASSIGN_OR_RETURN(worker::WorkerInfo info, client->Info());
    if (prefill && info.role != worker::Role::kPrefill) {
      return InvalidArgumentError("the prefill worker {} runs with --role {}, not prefill", address,
                                  worker::RoleName(info.role));
    }
    if (!prefill && info.role == worker::Role::kPrefill) {
      return InvalidArgumentError("the decode worker {} runs with --role prefill", address);
    }
    if (!have_model_.load()) {
      // The first worker (Init, before any other thread runs): its model is the router's.
      model_ = info;
      layout_.groups = model_.groups;
      layout_.hash_block_size = model_.hash_block_size;
      layout_.cache_salt = model_.cache_salt;
      have_model_ = true;
    } else if (info.fingerprint != model_.fingerprint || !SameLayout(info, model_)) {
      return InvalidArgumentError(
          "the worker {} runs {} (fingerprint {:#018x}) but the router's workers run {} "
          "({:#018x}): their blocks would never match",
          address, info.model, info.fingerprint, model_.model, model_.fingerprint);
    }
    // Its entry of the other role (it restarted with another) leaves first: one address, one
    // source in the index.
    Leave(address, {!prefill});
    const std::string source = "worker " + address;
    std::unique_ptr<events::EventSubscriber> subscriber;
    if (!info.kv_events.empty()) {
      events::SubscriberOptions sub;
      sub.endpoint = ReachableEndpoint(info.kv_events, address);
      sub.replay_endpoint =
          info.kv_events_replay.empty() ? "" : ReachableEndpoint(info.kv_events_replay, address);
      sub.topic = info.kv_events_topic;
      sub.replay_at_start = true;
      KVSTASH_ASSIGN_OR_RETURN(subscriber, Subscribe(sub, source));
    }
    std::unique_ptr<events::EventSubscriber> old;
    {
      MutexLock lock(&mu_);
      std::deque<Slot>& slots = prefill ? prefill_ : decode_;
      Slot* slot = Find(slots, address);
      if (slot == nullptr) {
        slot = &slots.emplace_back();
        slot->address = address;
        slot->source = source;
      } else if (slot->member) {
        return Status::OK();  // joined meanwhile (another call)
      }
      slot->member = true;
      slot->role = info.role;
      slot->down_until = {};
      old = std::move(slot->subscriber);
      slot->subscriber = std::move(subscriber);
      slot->idle.clear();
      slot->idle.push_back(std::move(client));
    }
    return Status::OK();
  }

  void RemoveWorker(const std::string& address) override { Leave(address, {true, false}); }

  // The worker at `address` leaves the roles named (prefill or not).
  void Leave(const std::string& address, std::initializer_list<bool> roles) {
    std::vector<std::unique_ptr<events::EventSubscriber>> gone;
    std::string source;
    {
      MutexLock lock(&mu_);
      for (const bool prefill : roles) {
        Slot* slot = Find(prefill ? prefill_ : decode_, address);
        if (slot == nullptr || !slot->member) continue;
        slot->member = false;
        slot->idle.clear();
        gone.push_back(std::move(slot->subscriber));
        source = slot->source;
      }
    }
    if (gone.empty()) return;
    gone.clear();  // its thread stopped: nothing more reaches the index from it
    index_.Forget(source);
    KVSTASH_LOG_INFO("worker {} left the router's set", address);
  }

  Status AddNode(const NodeEvents& node) override {
    {
      MutexLock lock(&mu_);
      if (nodes_.count(node.endpoint) > 0) return Status::OK();
    }
    const std::string source = "node " + node.endpoint;
    events::SubscriberOptions sub;
    sub.endpoint = node.endpoint;
    sub.replay_endpoint = node.replay;
    sub.topic = options_.node_topic;
    sub.replay_at_start = true;
    KVSTASH_ASSIGN_OR_RETURN(auto subscriber, Subscribe(sub, source));
    MutexLock lock(&mu_);
    if (nodes_.count(node.endpoint) > 0) return Status::OK();  // added meanwhile
    nodes_[node.endpoint] = NodeSlot{source, std::move(subscriber)};
    node_sources_.push_back(source);
    return Status::OK();
  }

  void RemoveNode(const std::string& endpoint) override {
    std::unique_ptr<events::EventSubscriber> gone;
    std::string source;
    {
      MutexLock lock(&mu_);
      auto it = nodes_.find(endpoint);
      if (it == nodes_.end()) return;
      source = it->second.source;
      gone = std::move(it->second.subscriber);
      nodes_.erase(it);
      std::erase(node_sources_, source);
    }
    gone.reset();
    index_.Forget(source);
    KVSTASH_LOG_INFO("node events {} left the router's set", endpoint);
  }

  size_t nodes() const override {
    MutexLock lock(&mu_);
    return nodes_.size();
  }

  Choice Choose(std::span<const uint32_t> prompt) override {
    MutexLock lock(&mu_);
    return ChooseLocked(prompt);
  }

  Result<RoutedCompletion> Complete(const worker::CompletionRequest& request) override {
    RoutedCompletion routed;
    const auto arrival = Clock::now();
    Placement placement = Place(request, &routed);
    // A prefill that failed for a worker's fault is skipped (the decode worker computes the
    // prompt); one the request is at fault for fails the request.
    if (Status prefilled = Prefill(request, &placement, &routed);
        !prefilled.ok() && !WorkerFault(prefilled)) {
      Release(placement);
      Count(routed, /*ok=*/false);
      return prefilled;
    }
    const double prefill_ms =
        std::chrono::duration<double, std::milli>(Clock::now() - arrival).count();
    Result<worker::Completion> decoded = Decode(request, &placement, &routed);
    Release(placement);
    if (!decoded.ok()) {
      Count(routed, /*ok=*/false);
      return decoded.status();
    }
    routed.completion = std::move(*decoded);
    routed.ttft_ms = prefill_ms + routed.completion.usage.ttft_ms;
    Count(routed, /*ok=*/true);
    return routed;
  }

  Status Stream(const worker::CompletionRequest& request,
                const std::function<bool(std::string_view event)>& on_event) override {
    RoutedCompletion routed;
    const auto arrival = Clock::now();
    Placement placement = Place(request, &routed);
    Status status = Prefill(request, &placement, &routed);
    if (!status.ok() && !WorkerFault(status)) {
      Release(placement);
      Count(routed, /*ok=*/false);
      return status;
    }
    status = Status::OK();
    for (int attempt = 0; attempt < 2; ++attempt) {
      if (placement.decode < 0) break;
      Slot& slot = At(/*prefill=*/false, placement.decode);
      routed.decode_worker = slot.address;
      auto client = Acquire(slot);
      bool started = false;
      bool first = true;
      status = client->Stream(
          request,
          [&](std::string_view event) {
            if (event == "[DONE]") return on_event(event);
            json chunk = json::parse(event, nullptr, /*allow_exceptions=*/false);
            if (!chunk.is_object()) return on_event(event);
            if (first) {
              routed.ttft_ms =
                  std::chrono::duration<double, std::milli>(Clock::now() - arrival).count();
              first = false;
            }
            if (chunk.contains("usage") && chunk["usage"].is_object()) {
              if (Result<worker::CompletionUsage> usage = UsageOf(chunk["usage"]); usage.ok()) {
                routed.completion.usage = *usage;
              }
              AddRouterUsage(&chunk["usage"], routed);
            }
            return on_event(worker::Dump(chunk));
          },
          &started);
      if (status.ok()) {
        Give(slot, std::move(client));
        break;
      }
      if (started || !WorkerFault(status)) break;
      MarkDown(placement.decode, /*prefill=*/false, status);
      placement.decode = NextBest(/*prefill=*/false, placement.decode, routed.choice);
      ++routed.retries;
    }
    Release(placement);
    Count(routed, status.ok());
    if (placement.decode < 0 && status.ok()) {
      status = UnavailableError("no decode worker is up");
    }
    return status;
  }

  const worker::WorkerInfo& model() const override { return model_; }
  std::vector<WorkerView> prefill_workers() const override { return Views(/*prefill=*/true); }
  std::vector<WorkerView> decode_workers() const override { return Views(/*prefill=*/false); }

  RouterTotals totals() const override {
    RouterTotals t;
    {
      MutexLock lock(&mu_);
      t = totals_;
    }
    t.event_batches = event_batches_.load();
    auto add = [&t](const events::EventSubscriber* s) {
      if (s == nullptr) return;
      const events::SubscriberStats st = s->stats();
      t.event_gaps += st.gaps;
      t.event_replayed += st.replayed;
      t.event_resets += st.resets;
    };
    MutexLock lock(&mu_);
    for (const auto& s : prefill_) add(s.subscriber.get());
    for (const auto& s : decode_) add(s.subscriber.get());
    for (const auto& [endpoint, node] : nodes_) add(node.subscriber.get());
    return t;
  }

  const RouterOptions& options() const override { return options_; }

 private:
  // The workers a request holds: indexes into prefill_ and decode_ (-1: none), counted in their
  // `running` while it holds them.
  struct Placement {
    int prefill = -1;
    int decode = -1;
  };

  static Slot* Find(std::deque<Slot>& slots, const std::string& address) {
    for (Slot& s : slots) {
      if (s.address == address) return &s;
    }
    return nullptr;
  }

  Result<std::unique_ptr<events::EventSubscriber>> Subscribe(const events::SubscriberOptions& sub,
                                                             const std::string& source) {
    return events::EventSubscriber::Create(sub, [this, source](const events::Delivery& d) {
      index_.Apply(source, d);
      event_batches_.fetch_add(1, std::memory_order_relaxed);
    });
  }

  static bool Up(const Slot& slot, Clock::time_point now) {
    return slot.member && now >= slot.down_until;
  }

  Choice ChooseLocked(std::span<const uint32_t> prompt) REQUIRES(mu_) {
    Choice c;
    c.prompt_tokens = prompt.size();
    const auto now = Clock::now();
    const bool kv = options_.policy == Policy::kKv;
    std::vector<BlockHash> hashes;
    size_t max_hit = 0;
    double node_score = 0;
    if (kv) {
      hashes = PromptHashes(layout_, prompt);
      max_hit = MaxHitTokens(layout_, hashes.size(), prompt.size());
      c.node_tokens = HybridHitTokens(index_, node_sources_, "", layout_, hashes, prompt.size());
      // At most the hit over every tier (events may land between the two searches).
      c.node_memory_tokens =
          std::min(c.node_tokens, HybridHitTokens(index_, node_sources_, events::kMediumCpu,
                                                  layout_, hashes, prompt.size()));
      node_score =
          options_.node_weight *
          (static_cast<double>(c.node_memory_tokens) +
           options_.ssd_weight * static_cast<double>(c.node_tokens - c.node_memory_tokens));
    }
    auto local_hit = [&](const Slot& s) -> size_t {
      if (!kv || !s.member || s.subscriber == nullptr) return 0;
      return HybridHitTokens(index_, s.source, events::kMediumGpu, layout_, hashes, prompt.size());
    };
    // Decode: the worker that would compute the least (its own cache, or the nodes), less its load.
    for (const Slot& s : decode_) {
      const size_t hit = local_hit(s);
      c.decode_hits.push_back(hit);
      c.decode_scores.push_back(std::max(static_cast<double>(hit), node_score) -
                                options_.load_tokens * static_cast<double>(s.running));
    }
    for (const Slot& s : prefill_) {
      const size_t hit = local_hit(s);
      c.prefill_hits.push_back(hit);
      c.prefill_scores.push_back(static_cast<double>(hit) -
                                 options_.load_tokens * static_cast<double>(s.running));
    }
    if (!kv) {
      c.decode = RoundRobin(decode_, &next_decode_, now);
      c.prefill = prefill_.empty() ? -1 : RoundRobin(prefill_, &next_prefill_, now);
      if (prefill_.empty()) c.skip_reason = "no-prefill-workers";
      return c;
    }
    c.decode = Best(decode_, c.decode_scores, &next_decode_, now, -1);
    if (prefill_.empty()) {
      c.skip_reason = "no-prefill-workers";
    } else if (c.node_tokens >= max_hit) {
      c.skip_reason = "nodes-hold-prompt";
    } else if (c.decode >= 0 && c.decode_hits[c.decode] >= max_hit) {
      c.skip_reason = "decode-holds-prompt";
    } else if (c.decode >= 0 && prompt.size() - std::max(c.decode_hits[c.decode], c.node_tokens) <=
                                    options_.local_prefill_tokens) {
      c.skip_reason = "short-prefill";
    } else {
      c.prefill = Best(prefill_, c.prefill_scores, &next_prefill_, now, -1);
      if (c.prefill < 0) c.skip_reason = "prefill-workers-down";
    }
    return c;
  }

  // The next worker of `slots` that is up, from *next on (all of them down: the next one).
  int RoundRobin(const std::deque<Slot>& slots, size_t* next, Clock::time_point now) const {
    for (size_t k = 0; k < slots.size(); ++k) {
      const size_t i = (*next + k) % slots.size();
      if (Up(slots[i], now)) {
        *next = i + 1;
        return static_cast<int>(i);
      }
    }
    for (size_t k = 0; k < slots.size(); ++k) {  // every member down: the next one
      const size_t i = (*next)++ % slots.size();
      if (slots[i].member) return static_cast<int>(i);
    }
    return -1;
  }

  // The up worker with the best score other than `except`, among those not running more than
  // max_imbalance requests beyond the least loaded up one (a prefix everyone wants must not pile
  // every request on one worker); ties go to the one running fewer, then to the first from *next
  // on (so that equal workers take turns). -1 when none is up and `except` is the only one; when
  // every other is down, the one whose time out ends first.
  int Best(const std::deque<Slot>& slots, const std::vector<double>& scores, size_t* next,
           Clock::time_point now, int except) const {
    size_t least = std::numeric_limits<size_t>::max();
    for (size_t i = 0; i < slots.size(); ++i) {
      if (static_cast<int>(i) != except && Up(slots[i], now)) {
        least = std::min(least, slots[i].running);
      }
    }
    int best = -1;
    for (size_t k = 0; k < slots.size(); ++k) {
      const size_t i = (*next + k) % slots.size();
      if (static_cast<int>(i) == except || !Up(slots[i], now)) continue;
      if (slots[i].running > least + options_.max_imbalance) continue;
      if (best < 0 || scores[i] > scores[best] ||
          (scores[i] == scores[best] && slots[i].running < slots[best].running)) {
        best = static_cast<int>(i);
      }
    }
    if (best >= 0) {
      *next = static_cast<size_t>(best) + 1;
      return best;
    }
    for (size_t i = 0; i < slots.size(); ++i) {
      if (static_cast<int>(i) == except || !slots[i].member) continue;
      if (best < 0 || slots[i].down_until < slots[best].down_until) best = static_cast<int>(i);
    }
    return best;
  }

  Placement Place(const worker::CompletionRequest& request, RoutedCompletion* routed) {
    MutexLock lock(&mu_);
    routed->choice = ChooseLocked(request.prompt);
    Placement p{routed->choice.prefill, routed->choice.decode};
    if (p.prefill >= 0) {
      Slot& s = prefill_[p.prefill];
      ++s.running;
      ++s.chosen;
      s.hit_tokens += routed->choice.prefill_hits[p.prefill];
    }
    if (p.decode >= 0) {
      Slot& s = decode_[p.decode];
      ++s.running;
      ++s.chosen;
      s.hit_tokens += routed->choice.decode_hits[p.decode];
    }
    return p;
  }

  void Release(const Placement& p) {
    MutexLock lock(&mu_);
    if (p.prefill >= 0) --prefill_[p.prefill].running;
    if (p.decode >= 0) --decode_[p.decode].running;
  }

  // Moves the request's hold from worker `from` of a role to `to` (-1: none).
  void Move(bool prefill, int from, int to) {
    MutexLock lock(&mu_);
    std::deque<Slot>& slots = prefill ? prefill_ : decode_;
    if (from >= 0) --slots[from].running;
    if (to >= 0) {
      ++slots[to].running;
      ++slots[to].chosen;
    }
  }

  void MarkDown(int i, bool prefill, const Status& why) {
    MutexLock lock(&mu_);
    Slot& s = (prefill ? prefill_ : decode_)[i];
    s.down_until = Clock::now() + options_.down_for;
    ++s.failures;
    s.idle.clear();  // their connections may be as broken as the one that failed
    KVSTASH_LOG_WARN("{} worker {} failed ({}); it sits out for {} ms",
                     prefill ? "prefill" : "decode", s.address, why.ToString(),
                     options_.down_for.count());
  }

  // The next best worker of a role after `failed` (-1: none other); moves the request's hold.
  int NextBest(bool prefill, int failed, const Choice& choice) {
    int next;
    {
      MutexLock lock(&mu_);
      std::deque<Slot>& slots = prefill ? prefill_ : decode_;
      const std::vector<double>& scores = prefill ? choice.prefill_scores : choice.decode_scores;
      size_t* rotate = prefill ? &next_prefill_ : &next_decode_;
      next = Best(slots, scores, rotate, Clock::now(), failed);
    }
    Move(prefill, failed, next);
    return next;
  }

  // A slot by index (its address is fixed, its other fields under mu_): slots are only ever
  // appended, and a deque's elements stay where they are.
  Slot& At(bool prefill, int i) {
    MutexLock lock(&mu_);
    return (prefill ? prefill_ : decode_)[static_cast<size_t>(i)];
  }

  std::unique_ptr<worker::WorkerClient> Acquire(Slot& slot) {
    {
      MutexLock lock(&mu_);
      if (!slot.idle.empty()) {
        auto client = std::move(slot.idle.back());
        slot.idle.pop_back();
        return client;
      }
    }
    // The address was checked when the worker joined.
    auto client = worker::WorkerClient::Create(slot.address, options_.worker_timeout);
    return std::move(*client);
  }

  void Give(Slot& slot, std::unique_ptr<worker::WorkerClient> client) {
    MutexLock lock(&mu_);
    if (slot.idle.size() < 64) slot.idle.push_back(std::move(client));
  }

  Status Prefill(const worker::CompletionRequest& request, Placement* p, RoutedCompletion* routed) {
    Status last;
    for (int attempt = 0; attempt < 2 && p->prefill >= 0; ++attempt) {
      Slot& slot = At(/*prefill=*/true, p->prefill);
      auto client = Acquire(slot);
      Result<worker::Completion> done = client->Complete(request);
      if (done.ok()) {
        Give(slot, std::move(client));
        routed->prefill_worker = slot.address;
        routed->prefill_usage = done->usage;
        return Status::OK();
      }
      last = done.status();
      if (!WorkerFault(last)) break;
      MarkDown(p->prefill, /*prefill=*/true, last);
      ++routed->retries;
      if (attempt == 0) p->prefill = NextBest(/*prefill=*/true, p->prefill, routed->choice);
    }
    // Without a prefill the decode worker computes the prompt itself: slower, never lost.
    if (p->prefill >= 0) Move(/*prefill=*/true, p->prefill, -1);
    p->prefill = -1;
    if (!last.ok() && routed->choice.skip_reason.empty()) {
      routed->choice.skip_reason = "prefill-failed";
    }
    return last;
  }

  Result<worker::Completion> Decode(const worker::CompletionRequest& request, Placement* p,
                                    RoutedCompletion* routed) {
    Status last = UnavailableError("no decode worker is up");
    for (int attempt = 0; attempt < 2 && p->decode >= 0; ++attempt) {
      Slot& slot = At(/*prefill=*/false, p->decode);
      routed->decode_worker = slot.address;
      auto client = Acquire(slot);
      Result<worker::Completion> done = client->Complete(request);
      if (done.ok()) {
        Give(slot, std::move(client));
        return done;
      }
      last = done.status();
      if (!WorkerFault(last)) return last;
      MarkDown(p->decode, /*prefill=*/false, last);
      ++routed->retries;
      if (attempt == 0) p->decode = NextBest(/*prefill=*/false, p->decode, routed->choice);
    }
    return last;
  }

  static Result<worker::CompletionUsage> UsageOf(const json& usage) {
    // The worker's own reader, over a completion that holds just this usage.
    json completion = {
        {"id", ""},
        {"model", ""},
        {"choices", json::array({{{"token_ids", json::array()}, {"finish_reason", ""}}})},
        {"usage", usage}};
    KVSTASH_ASSIGN_OR_RETURN(worker::Completion c,
                             worker::ParseCompletion(worker::Dump(completion)));
    return c.usage;
  }

  void AddRouterUsage(json* usage, const RoutedCompletion& routed) const {
    AddRoutedUsage(usage, routed, options_.policy);
  }

  void Count(const RoutedCompletion& routed, bool ok) {
    MutexLock lock(&mu_);
    if (!ok) {
      ++totals_.failed_requests;
      totals_.retries += routed.retries;
      return;
    }
    ++totals_.requests;
    totals_.retries += routed.retries;
    if (routed.prefill_worker.empty()) {
      ++totals_.skipped_prefills;
    } else {
      ++totals_.prefills;
    }
    const worker::CompletionUsage& d = routed.completion.usage;
    totals_.prompt_tokens += d.prompt_tokens;
    totals_.computed_tokens += d.computed_tokens + routed.prefill_usage.computed_tokens;
    totals_.node_tokens += d.node_tokens;
    totals_.local_hit_tokens += d.local_hit_tokens;
  }

  std::vector<WorkerView> Views(bool prefill) const {
    std::vector<WorkerView> views;
    const auto now = Clock::now();
    MutexLock lock(&mu_);
    for (const Slot& s : prefill ? prefill_ : decode_) {
      WorkerView v;
      v.address = s.address;
      v.role = s.role;
      v.up = Up(s, now);
      v.member = s.member;
      v.events = s.subscriber != nullptr;
      v.running = s.running;
      v.blocks = index_.blocks(s.source);
      v.chosen = s.chosen;
      v.failures = s.failures;
      v.hit_tokens = s.hit_tokens;
      views.push_back(std::move(v));
    }
    return views;
  }

  // A followed node: its name in the index and its subscription.
  struct NodeSlot {
    std::string source;
    std::unique_ptr<events::EventSubscriber> subscriber;
  };

  const RouterOptions options_;
  // Set by the first worker, in Init; read-only after.
  worker::WorkerInfo model_;
  std::atomic<bool> have_model_{false};
  CacheLayout layout_;
  events::KvIndex index_;
  std::atomic<uint64_t> event_batches_{0};
  mutable Mutex mu_;
  // Appended to, never shrunk (a worker that leaves stays, not a member): an index into them
  // stays valid, and so does a reference (At).
  std::deque<Slot> prefill_ GUARDED_BY(mu_);
  std::deque<Slot> decode_ GUARDED_BY(mu_);
  std::map<std::string, NodeSlot> nodes_ GUARDED_BY(mu_);  // by events endpoint
  std::vector<std::string> node_sources_ GUARDED_BY(mu_);
  size_t next_prefill_ GUARDED_BY(mu_) = 0;
  size_t next_decode_ GUARDED_BY(mu_) = 0;
  RouterTotals totals_ GUARDED_BY(mu_);
};

}  // namespace

std::string ReachableEndpoint(const std::string& endpoint, std::string_view address) {
  const std::string host(address.substr(0, address.rfind(':')));
  for (std::string_view any : {"tcp://*:", "tcp://0.0.0.0:"}) {
    if (endpoint.rfind(any, 0) == 0) return "tcp://" + host + ":" + endpoint.substr(any.size());
  }
  return endpoint;
}

std::string_view PolicyName(Policy policy) { return policy == Policy::kKv ? "kv" : "round-robin"; }

Result<Policy> ParsePolicy(std::string_view name) {
  if (name == "kv") return Policy::kKv;
  if (name == "round-robin") return Policy::kRoundRobin;
  return InvalidArgumentError("routing policy '{}' is not kv or round-robin", name);
}

std::string RoutedCompletionBody(const RoutedCompletion& routed, Policy policy, int64_t created) {
  json body = worker::CompletionJson(routed.completion, created);
  AddRoutedUsage(&body["usage"], routed, policy);
  return worker::Dump(body);
}

std::string ChoiceJson(const Router& router, const Choice& choice) {
  const std::vector<WorkerView> prefill = router.prefill_workers();
  const std::vector<WorkerView> decode = router.decode_workers();
  auto name = [](const std::vector<WorkerView>& workers, int i) {
    return i < 0 || static_cast<size_t>(i) >= workers.size() ? json() : json(workers[i].address);
  };
  return worker::Dump(
      {{"policy", PolicyName(router.options().policy)},
       {"prompt_tokens", choice.prompt_tokens},
       {"prefill_worker", name(prefill, choice.prefill)},
       {"decode_worker", name(decode, choice.decode)},
       {"skipped_prefill", choice.skip_reason.empty() ? json() : json(choice.skip_reason)},
       {"node_tokens", choice.node_tokens},
       {"node_memory_tokens", choice.node_memory_tokens},
       {"scores", ScoresJson(choice)}});
}

Result<std::unique_ptr<Router>> Router::Create(RouterOptions options) {
  auto router = std::make_unique<RouterImpl>(std::move(options));
  KVSTASH_RETURN_IF_ERROR(router->Init());
  return std::unique_ptr<Router>(std::move(router));
}

}  // namespace kvstash::router
