#pragma once

// The framing of one RPC active message. The UCX active-message header holds a fixed 40-byte
// FrameHeader followed by the RPC message (protobuf bytes); the active-message data holds the
// payload. A message too large for the UCX header limit travels as the data instead (flag
// kMessageInData; such frames carry no payload).
//
// Mapped payloads (shared memory between processes of one host): a payload can instead stay in
// memory one side maps from the other, named by a MappedRef trailer after the message. A request
// with a trailer announces a payload the client holds until the server pulls it (kPull names
// where to copy it, or asks for it as active-message data in a kPayload frame; kPullDone says
// the copy is done). A response with a trailer names a payload in the server's shared memory,
// which the client copies out and acknowledges (kAck) so the server may reuse it.
//
// A connection is its endpoint: the client's first frame, kBind, carries the secret token of its
// hello reply, and the server then takes every frame of that connection from that UCX endpoint
// only (a frame naming another connection is refused), never from the id a header names.
//
// Both ends run on the same architecture (little-endian, checked at compile time): UCX
// connects hosts of one cluster, and the fields are read with memcpy, never cast.

#include <bit>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "kvstash/common/status.h"

namespace kvstash::transport {

static_assert(std::endian::native == std::endian::little, "the frame format is little-endian");

inline constexpr uint32_t kFrameMagic = 0x5453564b;  // "KVST"
inline constexpr uint8_t kFrameVersion = 2;
inline constexpr uint16_t kRpcAmId = 7;  // the UCX active-message id of every frame

enum class FrameKind : uint8_t {
  kRequest = 1,   // client -> server
  kResponse = 2,  // server -> client
  kCancel = 3,    // client -> server: the call is cancelled
  kPull = 4,      // server -> client: copy the held payload (trailer: where; or send as data)
  kPullDone = 5,  // client -> server: the pulled payload is in place (status: or why not)
  kPayload = 6,   // client -> server: the held payload, as active-message data
  kAck = 7,       // client -> server: the mapped reply payload was copied out
  kBind = 8,      // client -> server, first on its endpoint: request_id carries the bind token
};

enum FrameFlags : uint16_t {
  kMessageInData = 1,
  kAcceptsMapped = 2,  // requests: the client can copy a mapped reply payload
};
inline constexpr uint16_t kKnownFrameFlags = kMessageInData | kAcceptsMapped;

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
  uint32_t trailer_bytes = 0;  // a MappedRef (and its rkey) after the message
};
static_assert(sizeof(FrameHeader) == 40);

inline constexpr size_t kFrameHeaderBytes = sizeof(FrameHeader);

// Where a mapped payload is. In a request: region_id 0, `length` bytes held by the client. In a
// response or a pull: `length` bytes at `address` in region `region_id` of the server, a region
// of `region_size` bytes at `region_address`; the region's packed UCX rkey follows
// (`rkey_bytes`, 0 when this connection already carried it). kPull with region_id 0 asks for
// the payload as active-message data.
struct MappedRef {
  uint64_t region_id = 0;
  uint64_t region_address = 0;
  uint64_t region_size = 0;
  uint64_t address = 0;
  uint64_t length = 0;
  uint32_t rkey_bytes = 0;
  uint32_t reserved = 0;
};
static_assert(sizeof(MappedRef) == 48);
inline constexpr size_t kMappedRefBytes = sizeof(MappedRef);

struct FrameView {
  FrameHeader header;
  std::span<const std::byte> message;  // inside the AM header, or the AM data
  size_t payload_bytes = 0;            // AM data bytes that are payload
  bool has_ref = false;                // a MappedRef trailer came with the frame
  MappedRef ref;
  std::span<const std::byte> rkey;  // the trailer's packed rkey (may be empty)
};

// Parses and validates one frame: magic, version, kind, sizes against the AM lengths and
// `max_message_bytes`. `data` is only read when the message is in it (kMessageInData and eager
// data; pass an empty span for rendezvous data). Errors name what was wrong.
Result<FrameView> ParseFrame(std::span<const std::byte> am_header, std::span<const std::byte> data,
                             size_t data_length, bool data_available, size_t max_message_bytes);

// Writes header + message into out (which must hold kFrameHeaderBytes + message.size()).
void WriteFrame(const FrameHeader& header, std::span<const std::byte> message,
                std::span<std::byte> out);

// Header + message + a MappedRef trailer with `rkey`; sets header.trailer_bytes.
std::vector<std::byte> WriteFrameWithRef(FrameHeader header, std::span<const std::byte> message,
                                         const MappedRef& ref, std::span<const std::byte> rkey);

}  // namespace kvstash::transport
