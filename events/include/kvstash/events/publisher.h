// EventPublisher: sends KV event batches the way vLLM's ZmqEventPublisher does, so that any of
// its subscribers (a router, an indexer) reads kvstash's too.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "kvstash/common/status.h"
#include "kvstash/events/kv_events.h"

namespace kvstash::events {

struct PublisherOptions {
  // The ZMQ PUB endpoint. Bound when it has a wildcard (`tcp://*:5557`, `::`) or is ipc:// or
  // inproc://, else connected to (a subscriber that binds), as vLLM decides. Port 0 binds any
  // free port (endpoint() names it).
  std::string endpoint;
  // The ROUTER endpoint that replays buffered batches on request, bound; empty: none.
  std::string replay_endpoint;
  // Batches kept for replay, over all topics, the oldest dropped first: at most this many and
  // this many bytes.
  size_t buffer_batches = 10000;
  size_t buffer_bytes = 64 << 20;
  // Batches waiting to be encoded and sent; Publish drops past it.
  size_t max_queue_batches = 10000;
  // ZMQ's high-water mark of the PUB socket, per subscriber (it drops past it; the subscriber
  // sees the gap in the sequence numbers and asks for a replay).
  int send_hwm = 100000;
  // The topic a replay request without a topic frame asks for (vLLM's requests have none).
  std::string default_topic;
};

// Counters since Create. Monotonic.
struct PublisherStats {
  uint64_t batches_sent = 0;
  uint64_t batches_dropped = 0;   // the queue was full: never sent, the sequence number skipped
  uint64_t replays_served = 0;    // replay requests answered
  uint64_t replays_refused = 0;   // malformed replay requests, ignored
  uint64_t batches_replayed = 0;  // batches sent again by replays
};

// Publishes batches on topics, each topic with its own sequence numbers from 0 (a subscriber
// of one topic sees every number of it: a gap is a loss). Each message is three frames, as
// vLLM's: [topic, sequence (8 bytes, big-endian), the batch's msgpack (EncodeBatch)].
//
// Replay: a request to the ROUTER endpoint is [empty frame, start sequence (8 bytes,
// big-endian)] as vLLM's subscribers send it, for the default topic, or the same with a third
// frame naming the topic. The reply is each buffered batch of that topic from that number on,
// [empty, sequence, batch], then [empty, -1 as 8 bytes, empty]. A replay that starts after the
// oldest batch still buffered shows its own gap: the subscriber then knows it missed batches
// for good, and starts over from the next AllBlocksCleared.
//
// Encoding and every socket run on the publisher's own thread; Publish only queues, so a
// caller on the data path never waits for a subscriber. Thread-safe.
class EventPublisher {
 public:
  // InvalidArgument for an endpoint ZMQ refuses; Unavailable when one cannot be bound.
  static Result<std::unique_ptr<EventPublisher>> Create(const PublisherOptions& options);
  // Sends what is queued (for at most a second), then closes the sockets.
  ~EventPublisher();
  EventPublisher(const EventPublisher&) = delete;
  EventPublisher& operator=(const EventPublisher&) = delete;

  // Queues `batch` on `topic`, numbered now. False when the queue is full: the batch is
  // dropped and counted, its number skipped. Never blocks.
  bool Publish(std::string_view topic, KvEventBatch batch);
  // The same for a batch already encoded (EncodeBatch, EncodeRuns).
  bool PublishEncoded(std::string_view topic, std::string payload);
  // Waits until every batch queued before the call is sent (tests, shutdown).
  void Flush();
  // The next sequence number of `topic` (how many it has had).
  int64_t next_sequence(std::string_view topic) const;
  PublisherStats stats() const;
  // The endpoints as bound ("tcp://0.0.0.0:41234"), or as given when connected to.
  const std::string& endpoint() const;
  const std::string& replay_endpoint() const;

  class Impl;

 private:
  explicit EventPublisher(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvstash::events
