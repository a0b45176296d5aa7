#pragma once

// The transport a parameterised test runs over: a UCX_TLS value ("shm", "tcp"...), where a
// "_rndv" suffix turns mapped payloads off (payloads then go by UCX rendezvous).

#include <string>

#include "kvstash/transport/rpc.h"

namespace kvstash::testing {

inline transport::TransportOptions TransportFor(const std::string& param) {
  transport::TransportOptions options;
  const bool rndv = param.ends_with("_rndv");
  options.tls = rndv ? param.substr(0, param.size() - 5) : param;
  options.mapped_payloads = !rndv;
  return options;
}

}  // namespace kvstash::testing
