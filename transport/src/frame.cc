#include "kvstash/transport/frame.h"

#include <fmt/format.h>

#include <cstring>

namespace kvstash::transport {

Result<FrameView> ParseFrame(std::span<const std::byte> am_header, std::span<const std::byte> data,
                             size_t data_length, bool data_available, size_t max_message_bytes) {
  if (am_header.size() < kFrameHeaderBytes) {
    return InvalidArgumentError("frame header of {} bytes is shorter than {}", am_header.size(),
                                kFrameHeaderBytes);
  }
  FrameView view;
  std::memcpy(&view.header, am_header.data(), kFrameHeaderBytes);
  const FrameHeader& h = view.header;
  if (h.magic != kFrameMagic) {
    return InvalidArgumentError("bad frame magic {:#x}", h.magic);
  }
  if (h.version != kFrameVersion) {
    return InvalidArgumentError("frame version {} is not the supported {}", h.version,
                                kFrameVersion);
  }
  if (h.kind != FrameKind::kRequest && h.kind != FrameKind::kResponse &&
      h.kind != FrameKind::kCancel) {
    return InvalidArgumentError("unknown frame kind {}", static_cast<int>(h.kind));
  }
  if ((h.flags & ~uint16_t{kMessageInData}) != 0) {
    return InvalidArgumentError("unknown frame flags {:#x}", h.flags);
  }
  if (h.message_bytes > max_message_bytes) {
    return ResourceExhaustedError("message of {} bytes exceeds the limit of {}", h.message_bytes,
                                  max_message_bytes);
  }
  const size_t inline_bytes = am_header.size() - kFrameHeaderBytes;
  if (h.flags & kMessageInData) {
    if (inline_bytes != 0 || data_length != h.message_bytes) {
      return InvalidArgumentError(
          "frame says {} message bytes in data but carries {} header and {} data bytes",
          h.message_bytes, inline_bytes, data_length);
    }
    if (!data_available) {
      return InvalidArgumentError("frame message in data must arrive eagerly");
    }
    view.message = data.first(data_length);
    view.payload_bytes = 0;
  } else {
    if (inline_bytes != h.message_bytes) {
      return InvalidArgumentError("frame says {} message bytes but carries {}", h.message_bytes,
                                  inline_bytes);
    }
    view.message = am_header.subspan(kFrameHeaderBytes);
    view.payload_bytes = data_length;
  }
  if (h.kind == FrameKind::kCancel && view.payload_bytes != 0) {
    return InvalidArgumentError("cancel frame with a payload");
  }
  if (h.status > static_cast<uint16_t>(StatusCode::kUnauthenticated)) {
    return InvalidArgumentError("unknown status code {} in frame", h.status);
  }
  return view;
}

void WriteFrame(const FrameHeader& header, std::span<const std::byte> message,
                std::span<std::byte> out) {
  std::memcpy(out.data(), &header, kFrameHeaderBytes);
  if (!message.empty()) {
    std::memcpy(out.data() + kFrameHeaderBytes, message.data(), message.size());
  }
}

}  // namespace kvstash::transport
