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
  if (h.kind < FrameKind::kRequest || h.kind > FrameKind::kBind) {
    return InvalidArgumentError("unknown frame kind {}", static_cast<int>(h.kind));
  }
  if ((h.flags & ~kKnownFrameFlags) != 0) {
    return InvalidArgumentError("unknown frame flags {:#x}", h.flags);
  }
  if (h.message_bytes > max_message_bytes) {
    return ResourceExhaustedError("message of {} bytes exceeds the limit of {}", h.message_bytes,
                                  max_message_bytes);
  }
  const size_t inline_bytes = am_header.size() - kFrameHeaderBytes;
  if (h.trailer_bytes != 0) {
    if (h.flags & kMessageInData) {
      return InvalidArgumentError("frame with its message in data cannot carry a mapped payload");
    }
    if (h.kind != FrameKind::kRequest && h.kind != FrameKind::kResponse &&
        h.kind != FrameKind::kPull) {
      return InvalidArgumentError("frame kind {} cannot carry a mapped payload",
                                  static_cast<int>(h.kind));
    }
    if (h.trailer_bytes < kMappedRefBytes || inline_bytes < h.trailer_bytes ||
        inline_bytes - h.trailer_bytes != h.message_bytes) {
      return InvalidArgumentError("frame says {} message and {} trailer bytes but carries {}",
                                  h.message_bytes, h.trailer_bytes, inline_bytes);
    }
    if (data_length != 0) {
      return InvalidArgumentError("frame with a mapped payload also carries {} data bytes",
                                  data_length);
    }
    const std::byte* trailer = am_header.data() + kFrameHeaderBytes + h.message_bytes;
    std::memcpy(&view.ref, trailer, kMappedRefBytes);
    const MappedRef& ref = view.ref;
    if (ref.rkey_bytes != h.trailer_bytes - kMappedRefBytes) {
      return InvalidArgumentError("mapped payload names a {}-byte rkey but carries {}",
                                  ref.rkey_bytes, h.trailer_bytes - kMappedRefBytes);
    }
    if (h.kind == FrameKind::kRequest && (ref.region_id != 0 || ref.rkey_bytes != 0)) {
      return InvalidArgumentError("a request's held payload names no region");
    }
    if (ref.region_id != 0 && (ref.address < ref.region_address || ref.length > ref.region_size ||
                               ref.address - ref.region_address > ref.region_size - ref.length)) {
      return InvalidArgumentError("mapped payload of {} bytes at {:#x} is outside its region",
                                  ref.length, ref.address);
    }
    if (h.kind == FrameKind::kResponse && ref.region_id == 0) {
      return InvalidArgumentError("a mapped reply payload names no region");
    }
    view.has_ref = true;
    view.rkey = std::span<const std::byte>(trailer + kMappedRefBytes, ref.rkey_bytes);
    view.message = am_header.subspan(kFrameHeaderBytes, h.message_bytes);
    view.payload_bytes = h.kind == FrameKind::kPull ? 0 : ref.length;
  } else if (h.flags & kMessageInData) {
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
  const bool control = h.kind == FrameKind::kCancel || h.kind == FrameKind::kPullDone ||
                       h.kind == FrameKind::kAck || h.kind == FrameKind::kPull ||
                       h.kind == FrameKind::kBind;
  if (control && (h.message_bytes != 0 || (h.kind != FrameKind::kPull && data_length != 0))) {
    return InvalidArgumentError("frame kind {} with a message or payload",
                                static_cast<int>(h.kind));
  }
  if (h.kind == FrameKind::kPull && !view.has_ref) {
    return InvalidArgumentError("pull frame without a mapped-payload trailer");
  }
  if (h.kind == FrameKind::kPayload && h.message_bytes != 0) {
    return InvalidArgumentError("payload frame with a message");
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

std::vector<std::byte> WriteFrameWithRef(FrameHeader header, std::span<const std::byte> message,
                                         const MappedRef& ref, std::span<const std::byte> rkey) {
  MappedRef written = ref;
  written.rkey_bytes = static_cast<uint32_t>(rkey.size());
  header.message_bytes = static_cast<uint32_t>(message.size());
  header.trailer_bytes = static_cast<uint32_t>(kMappedRefBytes + rkey.size());
  std::vector<std::byte> out(kFrameHeaderBytes + message.size() + header.trailer_bytes);
  WriteFrame(header, message, out);
  std::byte* trailer = out.data() + kFrameHeaderBytes + message.size();
  std::memcpy(trailer, &written, kMappedRefBytes);
  if (!rkey.empty()) std::memcpy(trailer + kMappedRefBytes, rkey.data(), rkey.size());
  return out;
}

}  // namespace kvstash::transport
