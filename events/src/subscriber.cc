#include "kvstash/events/subscriber.h"

#include <zmq.h>

#include <atomic>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>
#include <thread>

#include "kvstash/common/logging.h"
#include "zmq_frames.h"

namespace kvstash::events {

class EventSubscriber::Impl {
 public:
  Impl(SubscriberOptions options, OnBatch on_batch, void* context)
      : options_(std::move(options)), on_batch_(std::move(on_batch)), context_(context) {}

  Status Start() {
    sub_ = zmq_socket(context_, ZMQ_SUB);
    if (sub_ == nullptr) return InvalidArgumentError("cannot create a SUB socket");
    const int linger = 0;
    zmq_setsockopt(sub_, ZMQ_LINGER, &linger, sizeof(linger));
    zmq_setsockopt(sub_, ZMQ_SUBSCRIBE, options_.topic.data(), options_.topic.size());
    // The connection's drops and returns, from ZMQ's monitor: a publisher that comes back may
    // be a new life whose numbers started over (see Handle).
    const std::string monitor =
        fmt::format("inproc://kvstash-events-monitor-{}", static_cast<const void*>(this));
    if (zmq_socket_monitor(sub_, monitor.c_str(), ZMQ_EVENT_CONNECTED | ZMQ_EVENT_DISCONNECTED) !=
        0) {
      return UnavailableError("KV events: cannot monitor the SUB socket: {}",
                              zmq_strerror(zmq_errno()));
    }
    monitor_ = zmq_socket(context_, ZMQ_PAIR);
    if (monitor_ == nullptr || zmq_connect(monitor_, monitor.c_str()) != 0) {
      return UnavailableError("KV events: cannot follow the SUB socket's monitor");
    }
    if (zmq_connect(sub_, options_.endpoint.c_str()) != 0) {
      return InvalidArgumentError("KV events: cannot connect to {}: {}", options_.endpoint,
                                  zmq_strerror(zmq_errno()));
    }
    if (!options_.replay_endpoint.empty()) KVSTASH_RETURN_IF_ERROR(OpenReplay());
    thread_ = std::thread([this] { Run(); });
    return Status::OK();
  }

  ~Impl() {
    stopping_ = true;
    if (thread_.joinable()) thread_.join();
    if (sub_ != nullptr) zmq_socket_monitor(sub_, nullptr, 0);
    if (monitor_ != nullptr) zmq_close(monitor_);
    if (sub_ != nullptr) zmq_close(sub_);
    if (replay_ != nullptr) zmq_close(replay_);
    zmq_ctx_term(context_);
  }

  // Returns once the thread has applied it (within a poll, 20 ms).
  void SetConnected(bool connected) {
    MutexLock lock(&mu_);
    want_connected_ = connected;
    while (connected_ != connected && !stopping_) {
      applied_.WaitFor(&mu_, std::chrono::milliseconds(50));
    }
  }
  int64_t expected() const { return expected_; }
  SubscriberStats stats() const {
    MutexLock lock(&mu_);
    return stats_;
  }

 private:
  Status OpenReplay() {
    if (replay_ != nullptr) zmq_close(replay_);
    replay_ = zmq_socket(context_, ZMQ_DEALER);
    const int linger = 0;
    zmq_setsockopt(replay_, ZMQ_LINGER, &linger, sizeof(linger));
    if (zmq_connect(replay_, options_.replay_endpoint.c_str()) != 0) {
      return InvalidArgumentError("KV events: cannot connect to the replay at {}: {}",
                                  options_.replay_endpoint, zmq_strerror(zmq_errno()));
    }
    return Status::OK();
  }

  void Run() {
    // History first, when asked: a subscriber learns it joined late only from the next live
    // batch, and a quiet publisher may send none for long.
    if (options_.replay_at_start && replay_ != nullptr) {
      FillGap(0, std::numeric_limits<int64_t>::max());
    }
    bool connected = true;
    while (!stopping_) {
      bool want;
      {
        MutexLock lock(&mu_);
        want = want_connected_;
      }
      if (want != connected) {
        if (want) {
          zmq_connect(sub_, options_.endpoint.c_str());
          came_back_ = true;
        } else {
          zmq_disconnect(sub_, options_.endpoint.c_str());
        }
        connected = want;
        MutexLock lock(&mu_);
        connected_ = connected;
        applied_.SignalAll();
      }
      zmq_pollitem_t items[] = {{sub_, 0, ZMQ_POLLIN, 0}, {monitor_, 0, ZMQ_POLLIN, 0}};
      if (zmq_poll(items, 2, 20) <= 0) continue;
      for (int i = 0; i < 64 && !stopping_; ++i) {
        ReadMonitor();  // before each batch: one from a new connection comes after its event
        bool fits = true;
        std::optional<std::vector<std::string>> frames = ReadFrames(sub_, 3, kMaxBatchBytes, &fits);
        if (!frames) break;
        if (!fits || frames->size() != 3) {
          Count(&SubscriberStats::malformed);
          continue;
        }
        if ((*frames)[0] != options_.topic) continue;  // another topic sharing the prefix
        Handle((*frames)[1], (*frames)[2]);
      }
    }
  }

  // A connection that dropped and came back marks the next live batch for a check: the
  // publisher may have restarted meanwhile.
  void ReadMonitor() {
    bool fits = true;
    std::optional<std::vector<std::string>> frames;
    while ((frames = ReadFrames(monitor_, 2, 1024, &fits))) {
      if (frames->empty() || (*frames)[0].size() < sizeof(uint16_t)) continue;
      uint16_t event = 0;
      std::memcpy(&event, (*frames)[0].data(), sizeof(event));
      if (event == ZMQ_EVENT_DISCONNECTED) {
        dropped_ = true;
      } else if (event == ZMQ_EVENT_CONNECTED && dropped_) {
        dropped_ = false;
        came_back_ = true;
      }
    }
  }

  void Count(uint64_t SubscriberStats::*counter, uint64_t n = 1) {
    MutexLock lock(&mu_);
    stats_.*counter += n;
  }

  void Handle(const std::string& seq_bytes, const std::string& payload) {
    Result<int64_t> seq = DecodeSequence(std::as_bytes(std::span(seq_bytes)));
    if (!seq.ok() || *seq < 0) {
      Count(&SubscriberStats::malformed);
      return;
    }
    Result<KvEventBatch> batch = DecodeBatch(std::as_bytes(std::span(payload)));
    const int64_t last_live = last_live_;
    last_live_ = *seq;
    // A new life of the publisher numbers from 0 again. Its batch 0 (AllBlocksCleared) is often
    // missed (sent before the connection came back), so a restart shows as live numbers going
    // back, or, after a reconnect, as a last batch the replay does not know.
    const bool check = came_back_;
    came_back_ = false;
    if (expected_ >= 0 && (*seq < last_live || (check && !SameLife(*seq)))) {
      StartOver(*seq, batch, payload);
      return;
    }
    const int64_t expected = expected_;
    if (!batch.ok()) {
      // Unreadable: lost for good.
      Count(&SubscriberStats::malformed);
      if (*seq >= expected) {
        pending_reset_ = true;
        SetExpected(*seq + 1);
      }
      return;
    }
    if (expected >= 0 && *seq < expected) {
      Count(&SubscriberStats::duplicates);
      return;
    }
    if (expected == -1 && *seq != 0) {
      FillGap(0, *seq);  // joined late: the history, if the replay still has it
    } else if (expected >= 0 && *seq > expected) {
      Count(&SubscriberStats::gaps);
      FillGap(expected, *seq);
    }
    Deliver(*seq, std::move(*batch), Digest(payload));
  }

  // The publisher started over: what it said before is stale. Its new history (up to `seq`)
  // from the replay, then this batch, the first delivery a reset.
  void StartOver(int64_t seq, Result<KvEventBatch>& batch, const std::string& payload) {
    Count(&SubscriberStats::restarts);
    pending_reset_ = true;
    SetExpected(0);
    if (seq > 0) FillGap(0, seq);
    if (!batch.ok()) {
      Count(&SubscriberStats::malformed);
      pending_reset_ = true;
      SetExpected(seq + 1);
      return;
    }
    Deliver(seq, std::move(*batch), Digest(payload));
  }

  // Whether the publisher behind a connection that came back is the one whose batches were
  // delivered: its replay still has the last of them, byte for byte (a batch's timestamp makes
  // another life's differ). Unsure (no replay, no answer) counts as not.
  bool SameLife(int64_t seq) {
    if (seq < expected_) return false;  // numbers went back
    if (replay_ == nullptr) return false;
    const int64_t last = expected_ - 1;
    if (last < 0) return true;  // nothing delivered yet: nothing to be stale
    std::optional<bool> same;
    Replay(last, [&](int64_t r, const std::string& bytes) {
      if (r == last) same = Digest(bytes) == last_digest_;
      return false;  // the first is all it needs
    });
    return same.value_or(false);
  }

  static uint64_t Digest(std::string_view payload) {
    return std::hash<std::string_view>()(payload);
  }

  // Asks the replay for the batches from `from` on and hands each (sequence, raw batch) to
  // `take` until the end marker or until `take` returns false; false when no end came within the
  // replay timeout. The request goes again on a fresh socket after each 250 ms without an
  // answer: one sent while the socket was (re)connecting to a restarted publisher is lost.
  template <typename Take>
  bool Replay(int64_t from, Take take) {
    const auto deadline = std::chrono::steady_clock::now() + options_.replay_timeout;
    constexpr auto kResend = std::chrono::milliseconds(250);
    bool fits = true;
    // Stale replies of an earlier replay are dropped first.
    while (ReadFrames(replay_, 3, kMaxBatchBytes, &fits)) {
    }
    bool answered = false;
    bool wanted = true;
    auto sent = std::chrono::steady_clock::time_point();
    while (!stopping_) {
      const auto now = std::chrono::steady_clock::now();
      if (now >= deadline) break;
      if (!answered && now - sent >= kResend) {
        if (sent != std::chrono::steady_clock::time_point()) (void)OpenReplay();
        SendReplayRequest(from);
        sent = now;
      }
      const auto wait = std::min(deadline, answered ? deadline : sent + kResend) - now;
      zmq_pollitem_t item = {replay_, 0, ZMQ_POLLIN, 0};
      const long ms = std::max<long>(
          1,
          static_cast<long>(std::chrono::duration_cast<std::chrono::milliseconds>(wait).count()));
      if (zmq_poll(&item, 1, ms) <= 0) continue;
      std::optional<std::vector<std::string>> frames;
      while ((frames = ReadFrames(replay_, 3, kMaxBatchBytes, &fits))) {
        answered = true;
        if (!fits || frames->size() != 3) {
          Count(&SubscriberStats::malformed);
          continue;
        }
        Result<int64_t> r = DecodeSequence(std::as_bytes(std::span((*frames)[1])));
        if (!r.ok()) {
          Count(&SubscriberStats::malformed);
          continue;
        }
        if (*r == -1) return true;
        if (wanted) wanted = take(*r, (*frames)[2]);
      }
    }
    KVSTASH_LOG_WARN("KV events: the replay at {} did not answer within {} ms",
                     options_.replay_endpoint, options_.replay_timeout.count());
    (void)OpenReplay();  // its late answer must not reach the next replay
    return false;
  }

  void SendReplayRequest(int64_t from) {
    const std::string start = EncodeSequence(from);
    const bool with_topic = !options_.topic.empty();
    zmq_send(replay_, "", 0, ZMQ_SNDMORE | ZMQ_DONTWAIT);
    zmq_send(replay_, start.data(), start.size(), (with_topic ? ZMQ_SNDMORE : 0) | ZMQ_DONTWAIT);
    if (with_topic) zmq_send(replay_, options_.topic.data(), options_.topic.size(), ZMQ_DONTWAIT);
  }

  // Delivers the batches [from, to) from the replay; whatever it cannot deliver is lost (the
  // next delivery resets).
  void FillGap(int64_t from, int64_t to) {
    if (replay_ == nullptr) {
      pending_reset_ = true;
      SetExpected(to);
      return;
    }
    Replay(from, [&](int64_t r, const std::string& bytes) {
      if (r < expected_ || r < from || r >= to) return true;
      Result<KvEventBatch> batch = DecodeBatch(std::as_bytes(std::span(bytes)));
      if (!batch.ok()) {
        Count(&SubscriberStats::malformed);
        return true;
      }
      if (r > std::max<int64_t>(expected_, from)) pending_reset_ = true;  // a hole in the replay
      Count(&SubscriberStats::replayed);
      Deliver(r, std::move(*batch), Digest(bytes));
      return true;
    });
    // (An open-ended replay, the history at start, loses nothing: what it did not get comes
    // live, or shows as a gap.)
    if (expected_ < to && to != std::numeric_limits<int64_t>::max()) {
      pending_reset_ = true;
      SetExpected(to);
    }
  }

  void Deliver(int64_t seq, KvEventBatch batch, uint64_t digest) {
    Delivery d{seq, std::move(batch), pending_reset_};
    pending_reset_ = false;
    on_batch_(d);
    expected_ = seq + 1;
    last_digest_ = digest;
    MutexLock lock(&mu_);
    ++stats_.delivered;
    if (d.reset) ++stats_.resets;
  }

  void SetExpected(int64_t e) { expected_ = e; }

  const SubscriberOptions options_;
  const OnBatch on_batch_;
  void* const context_;
  void* sub_ = nullptr;      // the thread's (Start and the destructor aside)
  void* monitor_ = nullptr;  // the thread's: sub_'s connection events
  void* replay_ = nullptr;   // the thread's
  // The thread's: the delivered state's last batch, and what the connection did since.
  bool pending_reset_ = false;
  int64_t last_live_ = -1;    // the last live batch's number
  uint64_t last_digest_ = 0;  // of batch expected_ - 1, as delivered
  bool dropped_ = false;      // the connection dropped
  bool came_back_ = false;    // ... and came back: the next live batch is checked
  std::atomic<bool> stopping_{false};

  mutable Mutex mu_;
  bool want_connected_ GUARDED_BY(mu_) = true;
  bool connected_ GUARDED_BY(mu_) = true;  // as the thread last applied it
  CondVar applied_;
  std::atomic<int64_t> expected_{-1};  // written by the thread only
  SubscriberStats stats_ GUARDED_BY(mu_);
  std::thread thread_;
};

Result<std::unique_ptr<EventSubscriber>> EventSubscriber::Create(const SubscriberOptions& options,
                                                                 OnBatch on_batch) {
  if (options.endpoint.empty()) return InvalidArgumentError("KV events: no endpoint to follow");
  void* context = zmq_ctx_new();
  if (context == nullptr) return UnavailableError("cannot create a ZMQ context");
  auto impl = std::make_unique<Impl>(options, std::move(on_batch), context);
  KVSTASH_RETURN_IF_ERROR(impl->Start());
  return std::unique_ptr<EventSubscriber>(new EventSubscriber(std::move(impl)));
}

EventSubscriber::EventSubscriber(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
EventSubscriber::~EventSubscriber() = default;
void EventSubscriber::Disconnect() { impl_->SetConnected(false); }
void EventSubscriber::Reconnect() { impl_->SetConnected(true); }
int64_t EventSubscriber::expected() const { return impl_->expected(); }
SubscriberStats EventSubscriber::stats() const { return impl_->stats(); }

void KvIndex::Apply(std::string_view source, const Delivery& delivery) {
  MutexLock lock(&mu_);
  auto it = sources_.find(source);
  if (it == sources_.end()) it = sources_.emplace(std::string(source), std::set<Entry>()).first;
  std::set<Entry>& held = it->second;
  if (delivery.reset) held.clear();
  for (const KvEvent& e : delivery.batch.events) {
    if (std::holds_alternative<AllBlocksCleared>(e)) {
      held.clear();
    } else if (const auto* s = std::get_if<BlockStored>(&e)) {
      for (const ExternalHash& h : s->block_hashes) {
        held.emplace(s->medium.value_or(""), s->group_idx.value_or(0), h);
      }
    } else if (const auto* r = std::get_if<BlockRemoved>(&e)) {
      for (const ExternalHash& h : r->block_hashes) {
        held.erase(Entry(r->medium.value_or(""), r->group_idx.value_or(0), h));
      }
    }
    if (held.size() > max_blocks_) {
      held.clear();
      ++overflows_;
    }
  }
}

bool KvIndex::Holds(std::string_view source, std::string_view medium, int64_t group,
                    const ExternalHash& hash) const {
  MutexLock lock(&mu_);
  auto it = sources_.find(source);
  if (it == sources_.end()) return false;
  if (!medium.empty()) return it->second.count(Entry(std::string(medium), group, hash)) > 0;
  for (std::string_view m : {kMediumGpu, kMediumCpu, kMediumSsd, std::string_view()}) {
    if (it->second.count(Entry(std::string(m), group, hash)) > 0) return true;
  }
  return false;
}

size_t KvIndex::blocks(std::string_view source) const {
  MutexLock lock(&mu_);
  auto it = sources_.find(source);
  return it == sources_.end() ? 0 : it->second.size();
}

void KvIndex::Forget(std::string_view source) {
  MutexLock lock(&mu_);
  if (auto it = sources_.find(source); it != sources_.end()) sources_.erase(it);
}

std::vector<KvIndex::Entry> KvIndex::Snapshot(std::string_view source) const {
  MutexLock lock(&mu_);
  auto it = sources_.find(source);
  if (it == sources_.end()) return {};
  return std::vector<Entry>(it->second.begin(), it->second.end());
}

uint64_t KvIndex::overflows() const {
  MutexLock lock(&mu_);
  return overflows_;
}

}  // namespace kvstash::events
