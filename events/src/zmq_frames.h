// Reading one ZMQ multipart message without trusting its sender: what the publisher's replay
// socket and the subscriber share.
#pragma once

#include <zmq.h>

#include <cstddef>
#include <optional>
#include <string>
#include <vector>

namespace kvstash::events {

// The waiting message's frames, at most `max_frames` of at most `max_frame_bytes` each (the
// rest read and dropped, `*fits` false then), or nullopt when none was waiting. Never blocks.
inline std::optional<std::vector<std::string>> ReadFrames(void* socket, size_t max_frames,
                                                          size_t max_frame_bytes, bool* fits) {
  std::vector<std::string> frames;
  *fits = true;
  bool first = true;
  for (int more = 1; more != 0;) {
    zmq_msg_t msg;
    zmq_msg_init(&msg);
    if (zmq_msg_recv(&msg, socket, ZMQ_DONTWAIT) < 0) {
      zmq_msg_close(&msg);
      if (first) return std::nullopt;
      *fits = false;
      return frames;
    }
    first = false;
    if (frames.size() < max_frames && zmq_msg_size(&msg) <= max_frame_bytes) {
      frames.emplace_back(static_cast<const char*>(zmq_msg_data(&msg)), zmq_msg_size(&msg));
    } else {
      *fits = false;
    }
    more = zmq_msg_more(&msg);
    zmq_msg_close(&msg);
  }
  return frames;
}

}  // namespace kvstash::events
