#pragma once

// The stream transport's frame (stream.h): a 32-byte little-endian header, then message_bytes
// of message (a service's protobuf, or a wire.Error when status is not OK), then payload_bytes
// of payload. Private to transport/stream/.
//
//   offset  size  field
//        0     4  magic "KVSS"
//        4     1  kind (StreamKind)
//        5     1  version (kStreamVersion)
//        6     2  method
//        8     8  request_id: the client's call id, echoed by the response
//       16     4  message_bytes
//       20     4  payload_bytes
//       24     4  timeout_us: requests, the time left when sent (0: none)
//       28     2  status: responses, a StatusCode (0: OK)
//       30     2  reserved, 0
//
// Fields are read with memcpy, never cast; both ends are little-endian (checked at compile
// time, as the UCX frame is).

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

#include "kvstash/common/status.h"

namespace kvstash::transport::stream {

static_assert(std::endian::native == std::endian::little, "the frame format is little-endian");

inline constexpr uint32_t kStreamMagic = 0x5353564b;  // "KVSS"
inline constexpr uint8_t kStreamVersion = 1;
inline constexpr size_t kStreamHeaderBytes = 32;

enum class StreamKind : uint8_t {
  kRequest = 1,   // client -> server: message and payload
  kResponse = 2,  // server -> client: message (or wire.Error) and payload
  kCancel = 3,    // client -> server: call request_id is cancelled; no message, no payload
};

struct StreamHeader {
  StreamKind kind = StreamKind::kRequest;
  uint16_t method = 0;
  uint64_t request_id = 0;
  uint32_t message_bytes = 0;
  uint32_t payload_bytes = 0;
  uint32_t timeout_us = 0;
  uint16_t status = 0;
};

// What one end accepts from its peer.
struct StreamLimits {
  bool server = true;  // a server takes requests and cancels; a client, responses
  size_t max_message_bytes = 0;
  size_t max_payload_bytes = 0;
};

inline void EncodeStreamHeader(const StreamHeader& h, std::byte* out) {
  const uint32_t magic = kStreamMagic;
  const auto kind = static_cast<uint8_t>(h.kind);
  const uint8_t version = kStreamVersion;
  const uint16_t reserved = 0;
  std::memcpy(out + 0, &magic, 4);
  std::memcpy(out + 4, &kind, 1);
  std::memcpy(out + 5, &version, 1);
  std::memcpy(out + 6, &h.method, 2);
  std::memcpy(out + 8, &h.request_id, 8);
  std::memcpy(out + 16, &h.message_bytes, 4);
  std::memcpy(out + 20, &h.payload_bytes, 4);
  std::memcpy(out + 24, &h.timeout_us, 4);
  std::memcpy(out + 28, &h.status, 2);
  std::memcpy(out + 30, &reserved, 2);
}

// Parses and checks one header from the peer; the error says which field was wrong and how.
inline Result<StreamHeader> ParseStreamHeader(std::span<const std::byte, kStreamHeaderBytes> in,
                                              const StreamLimits& limits) {
  uint32_t magic = 0;
  uint8_t kind = 0, version = 0;
  uint16_t reserved = 0;
  StreamHeader h;
  std::memcpy(&magic, in.data() + 0, 4);
  std::memcpy(&kind, in.data() + 4, 1);
  std::memcpy(&version, in.data() + 5, 1);
  std::memcpy(&h.method, in.data() + 6, 2);
  std::memcpy(&h.request_id, in.data() + 8, 8);
  std::memcpy(&h.message_bytes, in.data() + 16, 4);
  std::memcpy(&h.payload_bytes, in.data() + 20, 4);
  std::memcpy(&h.timeout_us, in.data() + 24, 4);
  std::memcpy(&h.status, in.data() + 28, 2);
  std::memcpy(&reserved, in.data() + 30, 2);
  if (magic != kStreamMagic) return InvalidArgumentError("frame magic {:#010x} is not KVSS", magic);
  if (version != kStreamVersion) {
    return InvalidArgumentError("frame version {} is not {}", version, kStreamVersion);
  }
  if (reserved != 0) return InvalidArgumentError("frame reserved field is {}, not 0", reserved);
  h.kind = static_cast<StreamKind>(kind);
  const bool request = h.kind == StreamKind::kRequest, cancel = h.kind == StreamKind::kCancel;
  const bool response = h.kind == StreamKind::kResponse;
  if (limits.server ? !(request || cancel) : !response) {
    return InvalidArgumentError("frame kind {} is not one a {} takes", kind,
                                limits.server ? "server" : "client");
  }
  if (h.message_bytes > limits.max_message_bytes) {
    return InvalidArgumentError("frame message of {} bytes exceeds the limit of {}",
                                h.message_bytes, limits.max_message_bytes);
  }
  if (h.payload_bytes > limits.max_payload_bytes) {
    return InvalidArgumentError("frame payload of {} bytes exceeds the limit of {}",
                                h.payload_bytes, limits.max_payload_bytes);
  }
  if (cancel && (h.message_bytes != 0 || h.payload_bytes != 0)) {
    return InvalidArgumentError("a cancel frame carries {} message and {} payload bytes",
                                h.message_bytes, h.payload_bytes);
  }
  if (response && h.status > static_cast<uint16_t>(StatusCode::kUnauthenticated)) {
    return InvalidArgumentError("frame status {} is no status code", h.status);
  }
  if (response && h.status != 0 && h.payload_bytes != 0) {
    return InvalidArgumentError("an error response carries {} payload bytes", h.payload_bytes);
  }
  return h;
}

}  // namespace kvstash::transport::stream
