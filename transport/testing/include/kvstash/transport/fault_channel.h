#pragma once

// FaultChannel: a Channel that wraps another and breaks some of its calls on purpose, for tests
// of what a client and a service do when the network misbehaves. A plan decides, per call, one
// fault:
//
//   kDrop                   the request never arrives: the call ends with DeadlineExceeded at
//                           its deadline, and the server sees nothing
//   kDelay                  the request arrives `delay` later, with its payload; past the
//                           call's deadline the client has DeadlineExceeded already and the
//                           server's reply goes nowhere
//   kCorruptRequest         the request's first byte is made an invalid protobuf tag (a frame
//                           damaged in flight: the server cannot parse it)
//   kCorruptPayload         one byte of the request's payload is flipped (the server's checksum
//                           must catch it)
//   kDisconnectAfterRequest the request arrives, then the connection is cut before anything
//                           else of the call moves: the payload of a store is lost
//                           mid-transfer (the `disconnect` hook, called before the request goes,
//                           arranges it: LoopbackNetwork::CutAfterNextRequest)
//
// Thread-safe. Owns the wrapped channel; its own timer thread delivers delayed and dropped calls.

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>

#include "kvstash/transport/channel.h"

namespace kvstash::transport {

struct Fault {
  enum class Kind : uint8_t {
    kNone,
    kDrop,
    kDelay,
    kCorruptRequest,
    kCorruptPayload,
    kDisconnectAfterRequest
  };
  Kind kind = Kind::kNone;
  std::chrono::milliseconds delay{0};  // kDelay
};

// The fault of the `index`-th call (from 0) of `method` through the channel.
using FaultPlan = std::function<Fault(uint16_t method, uint64_t index)>;

struct FaultCounts {
  uint64_t dropped = 0, delayed = 0, corrupted = 0, disconnects = 0;
};

class FaultChannel : public Channel {
 public:
  // `disconnect` arranges that the wrapped channel's connection is cut once the next request
  // has arrived (LoopbackNetwork::CutAfterNextRequest); needed for kDisconnectAfterRequest only.
  FaultChannel(std::unique_ptr<Channel> inner, FaultPlan plan,
               std::function<void()> disconnect = {});
  ~FaultChannel() override;

  uint64_t Call(uint16_t method, Bytes request, const CallOptions& options,
                ResponseCallback done) override;
  void Cancel(uint64_t id) override;
  void ConnectAsync(std::function<void(const Status&)> done) override;
  // Completes the calls it holds (dropped, delayed) with `why` too.
  void Reset(const Status& why) override;
  std::optional<ServerLimits> server_limits() const override;

  FaultCounts counts() const;
  Channel& inner() { return *inner_; }

  class Impl;

 private:
  std::unique_ptr<Channel> inner_;
  std::shared_ptr<Impl> impl_;
};

}  // namespace kvstash::transport
