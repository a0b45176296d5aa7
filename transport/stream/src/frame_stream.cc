// FrameStream (frame_stream.h): one connection's frames both ways.

#include "frame_stream.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstring>
#include <utility>

namespace kvstash::transport::stream {
namespace {

// A payload read of at least this many bytes, with nothing of it buffered, goes straight from
// the socket into its destination; a smaller one comes through the buffer (one system call
// for many small frames).
constexpr size_t kDirectReadBytes = 64 * 1024;
constexpr size_t kReadBufferBytes = 256 * 1024;
// One gathered write: at most this many frames.
constexpr size_t kFramesPerWrite = 32;

// A peer host that vanishes (no FIN, no RST) is found by TCP keepalive within about a minute,
// not the system's default two hours.
void KeepAlive(asio::ip::tcp::socket& socket) {
  const int fd = socket.native_handle();
  const int on = 1, idle = 30, interval = 10, count = 3;
  ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &on, sizeof(on));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof(interval));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof(count));
  asio::error_code ignored;
  socket.set_option(asio::ip::tcp::no_delay(true), ignored);
}

}  // namespace

FrameStream::FrameStream(asio::ip::tcp::socket socket, StreamLimits limits,
                         std::chrono::milliseconds stall_timeout, Events events)
    : socket_(std::move(socket)),
      limits_(limits),
      stall_timeout_(std::max(stall_timeout, std::chrono::milliseconds(1))),
      events_(std::move(events)),
      stall_timer_(socket_.get_executor()),
      rbuf_(kReadBufferBytes),
      last_progress_(std::chrono::steady_clock::now()) {
  KeepAlive(socket_);
}

FrameStream::~FrameStream() = default;

void FrameStream::Start() {
  last_progress_ = std::chrono::steady_clock::now();
  WatchStalls();
  Process();
}

void FrameStream::Close(const Status& why) {
  if (!open_) return;
  open_ = false;
  auto self = shared_from_this();
  asio::error_code ignored;
  socket_.close(ignored);
  stall_timer_.cancel();
  if (state_ == ReadState::kPayload) FinishPayload(why);
  std::deque<Outgoing> outgoing = std::move(outgoing_);
  outgoing_.clear();
  for (Outgoing& frame : outgoing) {
    if (frame.done) frame.done(why);
  }
  if (events_.closed) events_.closed(why);
  events_ = {};
}

void FrameStream::Process() {
  if (processing_ || !open_) return;
  processing_ = true;
  auto self = shared_from_this();
  while (open_) {
    if (state_ == ReadState::kHeader) {
      if (paused_ || buffered() < kStreamHeaderBytes) break;
      Result<StreamHeader> header =
          ParseStreamHeader(std::span<const std::byte, kStreamHeaderBytes>(rbuf_.data() + rbegin_,
                                                                           kStreamHeaderBytes),
                            limits_);
      if (!header.ok()) {
        malformed_ = true;
        Close(InvalidArgumentError("malformed frame from the peer: {}", header.status().message()));
        break;
      }
      header_ = *header;
      rbegin_ += kStreamHeaderBytes;
      state_ = ReadState::kMessage;
    } else if (state_ == ReadState::kMessage) {
      if (buffered() < header_.message_bytes) break;
      const Bytes message(rbuf_.data() + rbegin_, header_.message_bytes);
      state_ = header_.payload_bytes != 0 ? ReadState::kAwaitPayload : ReadState::kHeader;
      events_.frame(header_, message);  // may ReadPayload, SkipPayload, Pause, Send, Close
      rbegin_ += header_.message_bytes;
    } else if (state_ == ReadState::kPayload || state_ == ReadState::kSkip) {
      const size_t take = std::min(buffered(), payload_left_);
      if (take != 0 && state_ == ReadState::kPayload) {
        std::memcpy(dest_.data() + payload_done_, rbuf_.data() + rbegin_, take);
        payload_done_ += take;
      }
      rbegin_ += take;
      payload_left_ -= take;
      if (payload_left_ != 0) break;
      const bool deliver = state_ == ReadState::kPayload;
      state_ = ReadState::kHeader;
      if (deliver) FinishPayload(Status::OK());
    } else {
      break;  // kAwaitPayload: the owner's word first
    }
  }
  processing_ = false;
  const bool wants_bytes = state_ == ReadState::kMessage || state_ == ReadState::kPayload ||
                           state_ == ReadState::kSkip || (state_ == ReadState::kHeader && !paused_);
  if (open_ && !reading_ && wants_bytes) StartRead();
}

void FrameStream::StartRead() {
  if (rbegin_ == rend_) rbegin_ = rend_ = 0;
  if (state_ == ReadState::kPayload && buffered() == 0 && payload_left_ >= kDirectReadBytes) {
    reading_ = read_direct_ = true;
    socket_.async_read_some(asio::buffer(dest_.data() + payload_done_, payload_left_),
                            [self = shared_from_this()](const asio::error_code& e, size_t n) {
                              self->OnRead(e, n, /*direct=*/true);
                            });
    return;
  }
  // Room after rend_ for at least what the frame under way still needs (a message may be
  // larger than the usual buffer), else some.
  const size_t need = state_ == ReadState::kMessage ? header_.message_bytes : kStreamHeaderBytes;
  if (rbegin_ != 0 && rbuf_.size() - rbegin_ < std::max(need, kReadBufferBytes / 2)) {
    std::memmove(rbuf_.data(), rbuf_.data() + rbegin_, buffered());
    rend_ -= rbegin_;
    rbegin_ = 0;
  }
  if (rbuf_.size() - rbegin_ < need) rbuf_.resize(rbegin_ + need);
  if (rbuf_.size() > kReadBufferBytes && rbegin_ == 0 && need <= kReadBufferBytes &&
      buffered() <= kReadBufferBytes / 2) {
    rbuf_.resize(kReadBufferBytes);  // a large message's room goes back
    rbuf_.shrink_to_fit();
  }
  reading_ = true;
  read_direct_ = false;
  socket_.async_read_some(asio::buffer(rbuf_.data() + rend_, rbuf_.size() - rend_),
                          [self = shared_from_this()](const asio::error_code& e, size_t n) {
                            self->OnRead(e, n, /*direct=*/false);
                          });
}

void FrameStream::OnRead(const asio::error_code& error, size_t bytes, bool direct) {
  reading_ = false;
  if (!open_) return;
  if (bytes != 0) last_progress_ = std::chrono::steady_clock::now();
  if (direct) {
    // Bytes that came before a DetachPayload are still this payload's (and were wanted then).
    payload_done_ += bytes;
    payload_left_ -= bytes;
    if (payload_left_ == 0 && (state_ == ReadState::kPayload || state_ == ReadState::kSkip)) {
      const bool deliver = state_ == ReadState::kPayload;
      state_ = ReadState::kHeader;
      if (deliver) FinishPayload(Status::OK());
    }
  } else {
    rend_ += bytes;
  }
  if (error && error != asio::error::operation_aborted) {
    Close(error == asio::error::eof
              ? UnavailableError("the peer closed the connection")
              : UnavailableError("reading from the peer: {}", error.message()));
    return;
  }
  // operation_aborted with the stream open: DetachPayload or Detach stopped the read to change
  // where bytes go; read on.
  Process();
}

void FrameStream::FinishPayload(const Status& status) {
  dest_ = {};
  std::function<void(Status)> done = std::move(payload_callback_);
  payload_callback_ = nullptr;
  if (done) done(status);
}

void FrameStream::ReadPayload(MutableBytes dest, std::function<void(Status)> done) {
  if (!open_) {
    done(UnavailableError("the connection is closed"));
    return;
  }
  if (state_ != ReadState::kAwaitPayload || dest.size() < header_.payload_bytes) {
    const size_t size = dest.size();
    SkipPayload();
    done(state_ == ReadState::kAwaitPayload || size >= header_.payload_bytes
             ? FailedPreconditionError("no payload waits to be read")
             : InvalidArgumentError("a payload of {} bytes does not fit {} bytes",
                                    header_.payload_bytes, size));
    return;
  }
  state_ = ReadState::kPayload;
  dest_ = dest.first(header_.payload_bytes);
  payload_left_ = header_.payload_bytes;
  payload_done_ = 0;
  payload_callback_ = std::move(done);
  last_progress_ = std::chrono::steady_clock::now();
  Process();
}

void FrameStream::SkipPayload() {
  if (!open_ || state_ != ReadState::kAwaitPayload) return;
  state_ = ReadState::kSkip;
  payload_left_ = header_.payload_bytes;
  last_progress_ = std::chrono::steady_clock::now();
  Process();
}

void FrameStream::DetachPayload() {
  if (!open_ || state_ != ReadState::kPayload) return;
  state_ = ReadState::kSkip;
  // A read in flight into the destination is stopped: on this thread nothing is written to it
  // after cancel returns (the reactor reads only here), and bytes it already read are counted
  // when its handler runs.
  if (reading_ && read_direct_) {
    asio::error_code ignored;
    socket_.cancel(ignored);
  }
  FinishPayload(CancelledError("the payload's destination went away"));
}

void FrameStream::Pause() { paused_ = true; }

void FrameStream::Resume() {
  if (!paused_) return;
  paused_ = false;
  last_progress_ = std::chrono::steady_clock::now();
  Process();
}

uint64_t FrameStream::Send(const StreamHeader& header, std::string message, Bytes payload,
                           std::function<void(Status)> sent) {
  const uint64_t token = next_token_++;
  if (!open_) {
    if (sent) sent(UnavailableError("the connection is closed"));
    return token;
  }
  if (outgoing_.empty()) last_progress_ = std::chrono::steady_clock::now();
  Outgoing& frame = outgoing_.emplace_back();
  frame.token = token;
  StreamHeader h = header;
  h.message_bytes = static_cast<uint32_t>(message.size());
  h.payload_bytes = static_cast<uint32_t>(payload.size());
  EncodeStreamHeader(h, frame.header.data());
  frame.message = std::move(message);
  frame.payload = payload;
  frame.done = std::move(sent);
  StartWrite();
  return token;
}

void FrameStream::Detach(uint64_t token) {
  const auto it = std::find_if(outgoing_.begin(), outgoing_.end(),
                               [token](const Outgoing& f) { return f.token == token; });
  if (it == outgoing_.end() || it->payload.empty() || !it->owned.empty()) return;
  const bool in_flight = writing_ && static_cast<size_t>(it - outgoing_.begin()) < write_frames_;
  if (it->sent == 0 && !in_flight) {
    // Not a byte of it left: the peer never hears of it.
    std::function<void(Status)> done = std::move(it->done);
    outgoing_.erase(it);
    if (done) done(CancelledError("the frame was withdrawn before it was sent"));
    return;
  }
  it->owned.assign(it->payload.begin(), it->payload.end());
  it->payload = Bytes(it->owned);
  if (in_flight) {
    // The write in flight still names the old memory: stop it (bytes it wrote are counted
    // when its handler runs) and write on from the copy.
    asio::error_code ignored;
    socket_.cancel(ignored);
  }
}

void FrameStream::StartWrite() {
  if (writing_ || outgoing_.empty() || !open_) return;
  write_buffers_.clear();
  write_frames_ = 0;
  for (const Outgoing& frame : outgoing_) {
    if (write_frames_ == kFramesPerWrite) break;
    const size_t m = frame.message.size();
    const std::byte* message = reinterpret_cast<const std::byte*>(frame.message.data());
    // Each part of the frame from what was already sent of it on.
    auto add = [&](const std::byte* data, size_t begin, size_t end) {
      const size_t from = std::max(begin, frame.sent);
      if (from < end) write_buffers_.emplace_back(data + (from - begin), end - from);
    };
    add(frame.header.data(), 0, kStreamHeaderBytes);
    add(message, kStreamHeaderBytes, kStreamHeaderBytes + m);
    add(frame.payload.data(), kStreamHeaderBytes + m, frame.total());
    ++write_frames_;
  }
  writing_ = true;
  socket_.async_write_some(
      write_buffers_,
      [self = shared_from_this()](const asio::error_code& e, size_t n) { self->OnWrite(e, n); });
}

void FrameStream::OnWrite(const asio::error_code& error, size_t bytes) {
  writing_ = false;
  write_frames_ = 0;
  if (!open_) return;
  if (bytes != 0) last_progress_ = std::chrono::steady_clock::now();
  std::vector<std::function<void(Status)>> sent;
  while (bytes != 0 && !outgoing_.empty()) {
    Outgoing& frame = outgoing_.front();
    const size_t take = std::min(bytes, frame.total() - frame.sent);
    frame.sent += take;
    bytes -= take;
    if (frame.sent < frame.total()) break;
    sent.push_back(std::move(frame.done));
    outgoing_.pop_front();
  }
  if (error && error != asio::error::operation_aborted) {
    for (auto& done : sent) {
      if (done) done(Status::OK());
    }
    Close(UnavailableError("writing to the peer: {}", error.message()));
    return;
  }
  StartWrite();
  for (auto& done : sent) {
    if (done) done(Status::OK());
  }
}

bool FrameStream::MidFrame() const {
  return (state_ == ReadState::kHeader && buffered() != 0) || state_ == ReadState::kMessage ||
         state_ == ReadState::kPayload || state_ == ReadState::kSkip || !outgoing_.empty();
}

void FrameStream::WatchStalls() {
  stall_timer_.expires_after(std::max(stall_timeout_ / 4, std::chrono::milliseconds(5)));
  stall_timer_.async_wait([weak = weak_from_this()](const asio::error_code& error) {
    auto self = weak.lock();
    if (error || !self || !self->open_) return;
    if (self->MidFrame() &&
        std::chrono::steady_clock::now() - self->last_progress_ > self->stall_timeout_) {
      self->Close(DeadlineExceededError("the peer moved no byte for {} ms in the middle of a frame",
                                        self->stall_timeout_.count()));
      return;
    }
    self->WatchStalls();
  });
}

}  // namespace kvstash::transport::stream
