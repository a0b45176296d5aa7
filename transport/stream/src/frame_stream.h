#pragma once

// FrameStream: one connection's socket after the hello, carrying frames (stream_frame.h) both
// ways for a StreamServer's connection or a StreamClient. Private to transport/stream/.
//
// Reading: bytes come into a buffer of its own; each frame's header and message go to the
// owner (Events::frame), and its payload then waits for the owner's word: ReadPayload (into
// the owner's memory: straight from the socket, the part already buffered copied) or
// SkipPayload. Until then no further frame is read, so a payload never needs a second home.
// Writing: frames queue and leave in gathered writes (header, message, payload, several frames
// per system call); a payload is the owner's memory until its `sent` callback runs.
//
// An owner whose memory goes away before the stream is done with it (a call past its
// deadline) calls DetachPayload or Detach: the stream stops using that memory at once (the
// rest of a payload being read is read and dropped; the unsent rest of a payload being sent is
// copied first, so the peer still gets every byte it was promised and the frame stays whole).
//
// A peer that stops mid-frame (reading or writing) for `stall_timeout` is cut off: the stream
// closes with DeadlineExceeded. Every close runs Events::closed once, and every pending
// ReadPayload and Send callback fails.
//
// Thread-safety: every method on the io_context's thread only (the one thread that runs it);
// callbacks run there. Held by shared_ptr: its handlers hold it.

#include <array>
#include <asio.hpp>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kvstash/common/status.h"
#include "kvstash/transport/channel.h"
#include "stream_frame.h"

namespace kvstash::transport::stream {

class FrameStream : public std::enable_shared_from_this<FrameStream> {
 public:
  struct Events {
    // A frame's header and message (valid during the call). Its payload (header.payload_bytes)
    // is next on the socket: reading stays paused until ReadPayload or SkipPayload.
    std::function<void(const StreamHeader& header, Bytes message)> frame;
    // The stream closed: the peer went, broke the protocol, stalled, or Close was called.
    std::function<void(const Status& why)> closed;
  };

  FrameStream(asio::ip::tcp::socket socket, StreamLimits limits,
              std::chrono::milliseconds stall_timeout, Events events);
  ~FrameStream();

  // Starts reading and the stall watch. Once.
  void Start();
  // Closes the socket: Events::closed runs with `why` (once), pending callbacks fail with it.
  void Close(const Status& why);
  bool open() const { return open_; }
  // True when the stream closed because the peer's bytes broke the frame format.
  bool malformed() const { return malformed_; }

  // The payload of the frame just delivered goes into `dest` (dest.size() == payload_bytes);
  // `done` runs once when it is all there, or with why not.
  void ReadPayload(MutableBytes dest, std::function<void(Status)> done);
  // The payload of the frame just delivered is read and dropped.
  void SkipPayload();
  // The payload being read goes on into a scratch buffer: its `dest` is no longer touched
  // after this returns. Its `done` still runs, with Cancelled.
  void DetachPayload();
  // Stops (or resumes) reading new frames: a server with too many calls in flight.
  void Pause();
  void Resume();

  // Queues a frame; `payload` must stay valid until `sent` runs (once: OK when the kernel has
  // every byte, else why not; inside Send when the stream is closed). Returns a token for
  // Detach.
  uint64_t Send(const StreamHeader& header, std::string message, Bytes payload,
                std::function<void(Status)> sent);
  // The payload of frame `token` may go away now: what is unsent of it is copied. No-op when
  // that frame is gone.
  void Detach(uint64_t token);

 private:
  enum class ReadState { kHeader, kMessage, kAwaitPayload, kPayload, kSkip };
  struct Outgoing {
    uint64_t token = 0;
    std::array<std::byte, kStreamHeaderBytes> header;
    std::string message;
    Bytes payload;
    std::vector<std::byte> owned;  // the payload's unsent rest, once detached
    size_t sent = 0;               // bytes of header + message + payload written
    std::function<void(Status)> done;
    size_t total() const { return kStreamHeaderBytes + message.size() + payload.size(); }
  };

  // Delivers what the buffer holds, then reads more when the state wants more.
  void Process();
  void StartRead();
  void OnRead(const asio::error_code& error, size_t bytes, bool direct);
  void FinishPayload(const Status& status);
  void StartWrite();
  void OnWrite(const asio::error_code& error, size_t bytes);
  void WatchStalls();
  bool MidFrame() const;
  size_t buffered() const { return rend_ - rbegin_; }

  asio::ip::tcp::socket socket_;
  const StreamLimits limits_;
  const std::chrono::milliseconds stall_timeout_;
  Events events_;
  asio::steady_timer stall_timer_;
  bool open_ = true;
  bool malformed_ = false;

  // Reading.
  std::vector<std::byte> rbuf_;
  size_t rbegin_ = 0, rend_ = 0;
  ReadState state_ = ReadState::kHeader;
  StreamHeader header_;
  bool reading_ = false;      // a read is in flight
  bool read_direct_ = false;  // ... into dest_, not rbuf_
  bool processing_ = false;   // Process is on the stack
  bool paused_ = false;
  MutableBytes dest_;        // kPayload: where the rest goes (empty once detached)
  size_t payload_left_ = 0;  // kPayload, kSkip
  size_t payload_done_ = 0;  // kPayload: bytes of dest_ filled
  std::function<void(Status)> payload_callback_;

  // Writing.
  std::deque<Outgoing> outgoing_;
  uint64_t next_token_ = 1;
  bool writing_ = false;
  size_t write_frames_ = 0;  // frames at the front of outgoing_ in the write in flight
  std::vector<asio::const_buffer> write_buffers_;

  // Stall watch: the last time a byte moved either way.
  std::chrono::steady_clock::time_point last_progress_;
};

}  // namespace kvstash::transport::stream
