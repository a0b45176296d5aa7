#include "kvstash/events/publisher.h"

#include <zmq.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <deque>
#include <map>
#include <thread>
#include <variant>
#include <vector>

#include "kvstash/common/logging.h"
#include "kvstash/common/mutex.h"
#include "zmq_frames.h"

namespace kvstash::events {
namespace {

// libzmq's errors, translated once.
Status FromZmq(std::string_view what) {
  const int e = zmq_errno();
  const std::string text = fmt::format("{}: {}", what, zmq_strerror(e));
  if (e == EINVAL || e == EPROTONOSUPPORT || e == ENOCOMPATPROTO) {
    return InvalidArgumentError("{}", text);
  }
  return UnavailableError("{}", text);
}

// vLLM's rule: bind a wildcard, ipc or inproc endpoint; connect to any other.
bool ShouldBind(std::string_view endpoint) {
  return endpoint.find('*') != std::string_view::npos ||
         endpoint.find("::") != std::string_view::npos || endpoint.starts_with("ipc://") ||
         endpoint.starts_with("inproc://");
}

// A socket that is closed with its owner.
struct Socket {
  void* s = nullptr;
  Socket() = default;
  explicit Socket(void* socket) : s(socket) {}
  Socket(Socket&& o) noexcept : s(std::exchange(o.s, nullptr)) {}
  Socket& operator=(Socket&& o) noexcept {
    std::swap(s, o.s);
    return *this;
  }
  ~Socket() {
    if (s != nullptr) zmq_close(s);
  }
};

Result<std::string> LastEndpoint(void* socket) {
  char buffer[256] = {};
  size_t size = sizeof(buffer);
  if (zmq_getsockopt(socket, ZMQ_LAST_ENDPOINT, buffer, &size) != 0) {
    return FromZmq("reading the bound endpoint");
  }
  return std::string(buffer);
}

bool SendFrame(void* socket, std::string_view frame, bool more) {
  return zmq_send(socket, frame.data(), frame.size(), ZMQ_DONTWAIT | (more ? ZMQ_SNDMORE : 0)) >= 0;
}

}  // namespace

class EventPublisher::Impl {
 public:
  Impl(const PublisherOptions& options, void* context, Socket pub, Socket replay,
       std::string endpoint, std::string replay_endpoint)
      : options_(options),
        context_(context),
        pub_(std::move(pub)),
        replay_(std::move(replay)),
        endpoint_(std::move(endpoint)),
        replay_endpoint_(std::move(replay_endpoint)),
        thread_([this] { Run(); }) {}

  ~Impl() {
    {
      MutexLock lock(&mu_);
      stopping_ = true;
      work_.SignalAll();
    }
    thread_.join();
    pub_ = Socket();
    replay_ = Socket();
    zmq_ctx_term(context_);
  }

  bool Publish(std::string_view topic, std::variant<KvEventBatch, std::string> batch) {
    MutexLock lock(&mu_);
    int64_t& next = sequences_[std::string(topic)];
    const int64_t sequence = next++;
    if (queue_.size() >= options_.max_queue_batches || stopping_) {
      ++stats_.batches_dropped;
      return false;
    }
    queue_.push_back({std::string(topic), sequence, std::move(batch)});
    ++queued_;
    work_.SignalAll();
    return true;
  }

  void Flush() {
    MutexLock lock(&mu_);
    const uint64_t target = queued_;
    while (done_ < target && !stopped_) done_cv_.Wait(&mu_);
  }

  int64_t next_sequence(std::string_view topic) const {
    MutexLock lock(&mu_);
    auto it = sequences_.find(std::string(topic));
    return it == sequences_.end() ? 0 : it->second;
  }

  PublisherStats stats() const {
    MutexLock lock(&mu_);
    return stats_;
  }

  const std::string& endpoint() const { return endpoint_; }
  const std::string& replay_endpoint() const { return replay_endpoint_; }

 private:
  struct Queued {
    std::string topic;
    int64_t sequence;
    std::variant<KvEventBatch, std::string> batch;  // to encode, or encoded
  };
  struct Buffered {
    std::string topic;
    int64_t sequence;
    std::string payload;
  };

  void Run() {
    using Clock = std::chrono::steady_clock;
    std::optional<Clock::time_point> drain_deadline;
    while (true) {
      std::deque<Queued> work;
      {
        MutexLock lock(&mu_);
        if (queue_.empty() && !stopping_) {
          // Wakes for new batches at once; a replay request waits at most this long.
          work_.WaitFor(&mu_, std::chrono::milliseconds(replay_.s != nullptr ? 5 : 100));
        }
        work.swap(queue_);
        if (stopping_ && !drain_deadline) drain_deadline = Clock::now() + std::chrono::seconds(1);
      }
      for (Queued& q : work) {
        Send(std::move(q));
      }
      ServeReplays();
      {
        MutexLock lock(&mu_);
        done_ += work.size();
        done_cv_.SignalAll();
        if (stopping_ && (queue_.empty() || Clock::now() >= *drain_deadline)) {
          stopped_ = true;
          done_cv_.SignalAll();
          return;
        }
      }
    }
  }

  void Send(Queued q) {
    const std::string seq = EncodeSequence(q.sequence);
    std::string payload = std::holds_alternative<std::string>(q.batch)
                              ? std::move(std::get<std::string>(q.batch))
                              : EncodeBatch(std::get<KvEventBatch>(q.batch));
    const bool sent = SendFrame(pub_.s, q.topic, true) && SendFrame(pub_.s, seq, true) &&
                      SendFrame(pub_.s, payload, false);
    // A PUB socket drops what a subscriber cannot take rather than block; the batch is still
    // buffered for replay.
    (void)sent;
    buffered_bytes_ += payload.size();
    buffer_.push_back({std::move(q.topic), q.sequence, std::move(payload)});
    while (buffer_.size() > options_.buffer_batches ||
           (buffered_bytes_ > options_.buffer_bytes && !buffer_.empty())) {
      buffered_bytes_ -= buffer_.front().payload.size();
      buffer_.pop_front();
    }
    MutexLock lock(&mu_);
    ++stats_.batches_sent;
  }

  // Answers the replay requests waiting, at most 16 per round so that new batches keep going.
  void ServeReplays() {
    if (replay_.s == nullptr) return;
    std::vector<std::string> frames;
    for (int i = 0; i < 16; ++i) {
      int events = 0;
      size_t size = sizeof(events);
      if (zmq_getsockopt(replay_.s, ZMQ_EVENTS, &events, &size) != 0 ||
          (events & ZMQ_POLLIN) == 0) {
        return;
      }
      // ROUTER prefixes the sender's identity: [identity, empty, start, (topic)].
      bool fits = true;
      frames = ReadFrames(replay_.s, 4, 256, &fits).value_or(std::vector<std::string>{});
      Result<int64_t> start = InvalidArgumentError("malformed");
      if (fits && (frames.size() == 3 || frames.size() == 4) && frames[1].empty()) {
        start = DecodeSequence(std::as_bytes(std::span(frames[2])));
      }
      if (!start.ok()) {
        MutexLock lock(&mu_);
        if (std::has_single_bit(++stats_.replays_refused)) {
          KVSTASH_LOG_WARN("KV events: ignored a malformed replay request ({} so far)",
                           stats_.replays_refused);
        }
        continue;
      }
      const std::string& topic = frames.size() == 4 ? frames[3] : options_.default_topic;
      uint64_t replayed = 0;
      for (const Buffered& b : buffer_) {
        if (b.topic != topic || b.sequence < *start) continue;
        if (!SendFrame(replay_.s, frames[0], true) || !SendFrame(replay_.s, "", true) ||
            !SendFrame(replay_.s, EncodeSequence(b.sequence), true) ||
            !SendFrame(replay_.s, b.payload, false)) {
          break;  // the requester cannot take more now (or is gone): it sees the gap
        }
        ++replayed;
      }
      (void)(SendFrame(replay_.s, frames[0], true) && SendFrame(replay_.s, "", true) &&
             SendFrame(replay_.s, EncodeSequence(-1), true) && SendFrame(replay_.s, "", false));
      MutexLock lock(&mu_);
      ++stats_.replays_served;
      stats_.batches_replayed += replayed;
    }
  }

  const PublisherOptions options_;
  void* const context_;
  Socket pub_;
  Socket replay_;
  const std::string endpoint_;
  const std::string replay_endpoint_;

  mutable Mutex mu_;
  CondVar work_;
  CondVar done_cv_;
  std::deque<Queued> queue_ GUARDED_BY(mu_);
  std::map<std::string, int64_t, std::less<>> sequences_ GUARDED_BY(mu_);
  uint64_t queued_ GUARDED_BY(mu_) = 0;
  uint64_t done_ GUARDED_BY(mu_) = 0;
  bool stopping_ GUARDED_BY(mu_) = false;
  bool stopped_ GUARDED_BY(mu_) = false;
  PublisherStats stats_ GUARDED_BY(mu_);

  // The publisher thread's own.
  std::deque<Buffered> buffer_;
  size_t buffered_bytes_ = 0;

  std::thread thread_;  // last: starts once everything else is built
};

Result<std::unique_ptr<EventPublisher>> EventPublisher::Create(const PublisherOptions& options) {
  if (options.endpoint.empty()) return InvalidArgumentError("KV events need an endpoint");
  if (options.max_queue_batches == 0 || options.buffer_batches == 0) {
    return InvalidArgumentError("KV events: the queue and the replay buffer need room");
  }
  void* context = zmq_ctx_new();
  if (context == nullptr) return FromZmq("creating a ZMQ context");
  auto fail = [&](Status s) {
    zmq_ctx_term(context);
    return s;
  };
  std::string endpoint = options.endpoint;
  std::string replay_endpoint;
  Socket pub;
  Socket replay;
  {
    Socket p(zmq_socket(context, ZMQ_PUB));
    if (p.s == nullptr) return fail(FromZmq("creating the PUB socket"));
    const int linger = 1000;
    zmq_setsockopt(p.s, ZMQ_LINGER, &linger, sizeof(linger));
    zmq_setsockopt(p.s, ZMQ_SNDHWM, &options.send_hwm, sizeof(options.send_hwm));
    if (ShouldBind(options.endpoint)) {
      if (zmq_bind(p.s, options.endpoint.c_str()) != 0) {
        Status s = FromZmq(fmt::format("binding KV events to {}", options.endpoint));
        p = Socket();
        return fail(std::move(s));
      }
      Result<std::string> bound = LastEndpoint(p.s);
      if (!bound.ok()) {
        p = Socket();
        return fail(bound.status());
      }
      endpoint = *bound;
    } else if (zmq_connect(p.s, options.endpoint.c_str()) != 0) {
      Status s = FromZmq(fmt::format("connecting KV events to {}", options.endpoint));
      p = Socket();
      return fail(std::move(s));
    }
    pub = std::move(p);
  }
  if (!options.replay_endpoint.empty()) {
    Socket r(zmq_socket(context, ZMQ_ROUTER));
    if (r.s == nullptr) {
      pub = Socket();
      return fail(FromZmq("creating the replay socket"));
    }
    const int linger = 0;
    zmq_setsockopt(r.s, ZMQ_LINGER, &linger, sizeof(linger));
    // One whole replay (the buffer and its end marker, in 2-frame messages) must fit in the
    // socket's queue: past its high-water mark (1,000 by default) ROUTER drops what it cannot
    // queue, end marker included, and the requester waits for its timeout and starts over.
    const int replay_hwm = static_cast<int>(std::min<size_t>(options.buffer_batches + 16, 1 << 24));
    zmq_setsockopt(r.s, ZMQ_SNDHWM, &replay_hwm, sizeof(replay_hwm));
    Status s;
    if (zmq_bind(r.s, options.replay_endpoint.c_str()) != 0) {
      s = FromZmq(fmt::format("binding the KV events replay to {}", options.replay_endpoint));
    } else if (Result<std::string> bound = LastEndpoint(r.s); !bound.ok()) {
      s = bound.status();
    } else {
      replay_endpoint = *bound;
    }
    if (!s.ok()) {
      r = Socket();
      pub = Socket();
      return fail(std::move(s));
    }
    replay = std::move(r);
  }
  return std::unique_ptr<EventPublisher>(new EventPublisher(std::make_unique<Impl>(
      options, context, std::move(pub), std::move(replay), endpoint, replay_endpoint)));
}

EventPublisher::EventPublisher(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
EventPublisher::~EventPublisher() = default;
bool EventPublisher::Publish(std::string_view topic, KvEventBatch batch) {
  return impl_->Publish(topic, std::move(batch));
}
bool EventPublisher::PublishEncoded(std::string_view topic, std::string payload) {
  return impl_->Publish(topic, std::move(payload));
}
void EventPublisher::Flush() { impl_->Flush(); }
int64_t EventPublisher::next_sequence(std::string_view topic) const {
  return impl_->next_sequence(topic);
}
PublisherStats EventPublisher::stats() const { return impl_->stats(); }
const std::string& EventPublisher::endpoint() const { return impl_->endpoint(); }
const std::string& EventPublisher::replay_endpoint() const { return impl_->replay_endpoint(); }

}  // namespace kvstash::events
