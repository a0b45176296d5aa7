#pragma once

// The framing of one RPC active message. The UCX active-message header holds a fixed 40-byte
// FrameHeader followed by the RPC message (protobuf bytes); the active-message data holds the
// payload. A message too large for the UCX header limit travels as the data instead (flag
// kMessageInData; such frames carry no payload).
//
// Both ends run on the same architecture (little-endian, checked at compile time): UCX
// connects hosts of one cluster, and the fields are read with memcpy, never cast.

#include <bit>
#include <cstddef>
#include <cstdint>
#include <span>

#include "kvstash/common/status.h"

namespace kvstash::transport {

static_assert(std::endian::native == std::endian::little, "the frame format is little-endian");

inline constexpr uint32_t kFrameMagic = 0x5453564b;  // "KVST"
inline constexpr uint8_t kFrameVersion = 1;
inline constexpr uint16_t kRpcAmId = 7;  // the UCX active-message id of every frame

enum class FrameKind : uint8_t { kRequest = 1, kResponse = 2, kCancel = 3 };

enum FrameFlags : uint16_t { kMessageInData = 1 };

struct FrameHeader {
  uint32_t magic = kFrameMagic;
  uint8_t version = kFrameVersion;
  FrameKind kind = FrameKind::kRequest;
  uint16_t method = 0;
  uint64_t request_id = 0;
  uint64_t connection_id = 0;
  uint32_t message_bytes = 0;
  uint32_t timeout_us = 0;  // requests: time left when sent (0: none)
  uint16_t status = 0;      // responses: a StatusCode; the message is then a wire.Error
  uint16_t flags = 0;
  uint32_t reserved = 0;
};
static_assert(sizeof(FrameHeader) == 40);

inline constexpr size_t kFrameHeaderBytes = sizeof(FrameHeader);

struct FrameView {
  FrameHeader header;
  std::span<const std::byte> message;  // inside the AM header, or the AM data
  size_t payload_bytes = 0;            // AM data bytes that are payload
};

// Parses and validates one frame: magic, version, kind, sizes against the AM lengths and
// `max_message_bytes`. `data` is only read when the message is in it (kMessageInData and eager
// data; pass an empty span for rendezvous data). Errors name what was wrong.
Result<FrameView> ParseFrame(std::span<const std::byte> am_header, std::span<const std::byte> data,
                             size_t data_length, bool data_available, size_t max_message_bytes);

// Writes header + message into out (which must hold kFrameHeaderBytes + message.size()).
void WriteFrame(const FrameHeader& header, std::span<const std::byte> message,
                std::span<std::byte> out);

}  // namespace kvstash::transport
