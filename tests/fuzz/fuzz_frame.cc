// Fuzz target `frame`: the RPC frame as a node and a client read it out of a UCX active message
// (transport/ucx/include/kvstash/transport/frame.h). Every frame a node receives goes through
// ParseFrame before anything else looks at it (RpcServer's Dispatch, which needs UCX past that
// point), and a client parses the node's frames and their error messages the same way.
//
// Input: one byte of mode (bit 0: the data came by rendezvous, so only its length is known;
// bit 1: a message limit small enough to cross), the active message's header length (16 bits,
// little-endian), that header, and the rest as the active message's data.
//
// Checked besides the sanitizers: a frame ParseFrame accepts names only bytes it was given (its
// message, rkey and payload lie in the header or the data), and written back as a peer writes it
// (WriteFrame, WriteFrameWithRef) it parses to the same frame.

#include <google/protobuf/stubs/logging.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "fuzz_check.h"
#include "kvstash/common/status.h"
#include "kvstash/transport/frame.h"
#include "kvstash/transport/rpc.h"

namespace kvstash::transport::internal {
// How a client turns a node's error frame into a Status: transport/ucx/src/rpc_client_calls.cc,
// declared in the private rpc_client_impl.h (not included here: it brings UCX's and Asio's
// headers).
Status StatusFromWireError(uint16_t code, Bytes message);
}  // namespace kvstash::transport::internal

namespace kvstash::transport {
namespace {

bool Within(Bytes part, Bytes whole) {
  if (part.empty()) return true;
  return part.data() >= whole.data() && part.data() + part.size() <= whole.data() + whole.size();
}

bool SameBytes(Bytes a, Bytes b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size()) == 0);
}

// The frame written back as a peer writes it, parsed again: the same header, message, payload
// and trailer.
void CheckRoundTrip(const FrameView& view, Bytes data, size_t data_length, bool data_available,
                    size_t max_message_bytes) {
  std::vector<std::byte> header;
  if (view.has_ref) {
    header = WriteFrameWithRef(view.header, view.message, view.ref, view.rkey);
  } else if (view.header.flags & kMessageInData) {
    header.resize(kFrameHeaderBytes);
    WriteFrame(view.header, {}, header);
  } else {
    header.resize(kFrameHeaderBytes + view.message.size());
    WriteFrame(view.header, view.message, header);
  }
  Result<FrameView> again =
      ParseFrame(header, data, data_length, data_available, max_message_bytes);
  KVSTASH_FUZZ_CHECK(again.ok());
  KVSTASH_FUZZ_CHECK(std::memcmp(&again->header, &view.header, kFrameHeaderBytes) == 0);
  KVSTASH_FUZZ_CHECK(SameBytes(again->message, view.message));
  KVSTASH_FUZZ_CHECK(again->payload_bytes == view.payload_bytes);
  KVSTASH_FUZZ_CHECK(again->has_ref == view.has_ref);
  if (view.has_ref) {
    KVSTASH_FUZZ_CHECK(std::memcmp(&again->ref, &view.ref, kMappedRefBytes) == 0);
    KVSTASH_FUZZ_CHECK(SameBytes(again->rkey, view.rkey));
  }
}

void FuzzFrame(std::span<const uint8_t> input) {
  const uint8_t mode = fuzz::Take<uint8_t>(input);
  const bool rendezvous = (mode & 1) != 0;
  // The node's default limit, or a small one.
  const size_t max_message_bytes = (mode & 2) != 0 ? 64 : (size_t{4} << 20);
  const size_t header_length = fuzz::Take<uint16_t>(input);
  const Bytes am_header = std::as_bytes(fuzz::TakeBytes(input, header_length));
  const Bytes am_data = std::as_bytes(input);
  // A rendezvous payload is not in memory yet: only its length is known (Dispatch passes it so).
  const Bytes eager = rendezvous ? Bytes{} : am_data;
  const size_t data_length = am_data.size();

  Result<FrameView> frame =
      ParseFrame(am_header, eager, data_length, !rendezvous, max_message_bytes);
  if (!frame.ok()) {
    KVSTASH_FUZZ_CHECK(!frame.status().message().empty());
    return;
  }
  const FrameView& view = *frame;
  KVSTASH_FUZZ_CHECK(view.message.size() == view.header.message_bytes);
  KVSTASH_FUZZ_CHECK(view.message.size() <= max_message_bytes);
  KVSTASH_FUZZ_CHECK(Within(view.message, am_header) || Within(view.message, eager));
  KVSTASH_FUZZ_CHECK(Within(view.rkey, am_header));
  if (view.has_ref) {
    KVSTASH_FUZZ_CHECK(view.rkey.size() == view.ref.rkey_bytes);
    KVSTASH_FUZZ_CHECK(view.header.kind == FrameKind::kRequest ||
                       view.header.kind == FrameKind::kResponse ||
                       view.header.kind == FrameKind::kPull);
  } else {
    // A payload is the active message's data, never more.
    KVSTASH_FUZZ_CHECK(view.payload_bytes <= data_length);
  }
  if (view.header.kind == FrameKind::kResponse && view.header.status != 0) {
    const Status status = internal::StatusFromWireError(view.header.status, view.message);
    KVSTASH_FUZZ_CHECK(!status.ok());
    KVSTASH_FUZZ_CHECK(!status.ToString().empty());
  }
  CheckRoundTrip(view, eager, data_length, !rendezvous, max_message_bytes);
}

}  // namespace
}  // namespace kvstash::transport

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // protobuf logs every string field that is not UTF-8: thousands of lines a second.
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kvstash::transport::FuzzFrame(std::span<const uint8_t>(data, size));
  return 0;
}
