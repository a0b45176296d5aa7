#pragma once

// An error reply's message on the wire: a wire.Error with the status's code and text, and the
// Status a client makes of it. Private to transport/ (the UCX and the stream transports both
// carry errors this way).

#include <cstdint>
#include <span>
#include <string>

#include "kvstash/common/status.h"
#include "kvstash/proto/wire.pb.h"

namespace kvstash::transport::internal {

// The serialized wire.Error of `status`.
inline std::string WireErrorBytes(const Status& status) {
  wire::Error error;
  error.set_code(static_cast<wire::Code>(status.code()));
  error.set_message(std::string(status.message()));
  return error.SerializeAsString();
}

// The status a server's error reply carries: `code`, with the message of the wire.Error in
// `message` (or a note that it did not parse).
inline Status StatusFromWireError(uint16_t code, std::span<const std::byte> message) {
  wire::Error error;
  if (!error.ParseFromArray(message.data(), static_cast<int>(message.size()))) {
    return Status(static_cast<StatusCode>(code), "(unparseable error message from the server)");
  }
  return Status(static_cast<StatusCode>(code), error.message());
}

}  // namespace kvstash::transport::internal
