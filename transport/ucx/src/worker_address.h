#pragma once

// Reads a packed UCX worker address (what ucp_worker_get_address gives, and what a client sends
// in its wire.Hello) without UCX, so that a node checks a peer's bytes before handing them to
// ucp_ep_create. UCX 1.13 trusts the bytes: its unpacker reads past the end of a short buffer
// and asserts on an unknown version ("addr version 15"), so 64 bytes of 0xff abort a node.
//
// The layout is UCX's own (src/ucp/wireup/address.c, formats v1 and v2, non-unified mode, as
// ucp_ep_create unpacks a worker address): a header (version, flags, worker uuid, optional
// client id and name), then devices, each with its memory domain, device address and
// transport interfaces (a 16-bit transport-name checksum, packed attributes, an interface
// address and, in wireup messages only, endpoint addresses). A worker address from
// ucp_worker_get_address never carries endpoint addresses.
//
// Not thread-affine; pure functions.

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "kvstash/common/status.h"

namespace kvstash::transport {

// One transport interface of a worker address.
struct AddressInterface {
  uint16_t transport_checksum = 0;  // UCX's checksum of the transport's name ("tcp", "posix"...)
  uint32_t device_index = 0;        // which device of the address it is on
  size_t device_address_bytes = 0;
  size_t interface_address_bytes = 0;
  size_t endpoint_addresses = 0;
};

// What a worker address holds, read from its bytes.
struct WorkerAddressShape {
  unsigned version = 0;  // 0: v1, 1: v2 (UCX's ucp_object_version_t)
  uint64_t worker_uuid = 0;
  size_t devices = 0;
  std::vector<AddressInterface> interfaces;
};

// Reads `address` as UCX 1.13 would, checking every length against the buffer and every field
// against what UCX can take without asserting or indexing past its tables: a known version and
// header flags, memory-domain indexes below 64, at most 128 interfaces, endpoint lanes below 6,
// a positive finite bandwidth, and no byte left over. InvalidArgument naming the first problem
// and its offset.
Result<WorkerAddressShape> ParseWorkerAddress(std::span<const std::byte> address);

// Whether a peer's worker address (a client's, at hello) is one this node may open an endpoint
// to: well formed (ParseWorkerAddress), without endpoint addresses, and for every transport it
// shares with `own` (this node's address) with the same device and interface address sizes,
// since a transport's addresses have one size per UCX build; and sharing at least one transport.
// InvalidArgument (malformed) or FailedPrecondition (no transport in common, or another UCX
// build), with a message for the peer.
Status CheckPeerWorkerAddress(std::span<const std::byte> peer, std::span<const std::byte> own);

}  // namespace kvstash::transport
