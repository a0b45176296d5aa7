#pragma once

// An in-process transport, for fast unit tests of a service and its clients without UCX or
// processes: servers (Listener) and channels (Channel) on one LoopbackNetwork talk through
// memory.
//
// It keeps what a client and a service can observe of the real transport: requests and
// replies are copied, payloads are copied from the caller's buffer and into the reply buffer,
// deadlines and cancellation complete a call once, a late reply goes nowhere, a lost connection
// fails its calls with Unavailable and tells the server (OnDisconnect), the hello checks the
// token and namespace as the UCX server does (the same code), and the server's limits are
// stated at connection. One thread of the network stands for the progress thread of every
// server and client on it: handlers, completions and timers run there, one at a time. There is
// no shared memory (AllocateMemory is Unimplemented), so a node maps its own and every payload
// is copied.
//
// Thread-safe. Listeners and channels hold their network.

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>

#include "kvstash/transport/channel.h"

namespace kvstash::transport {

class LoopbackNetwork : public std::enable_shared_from_this<LoopbackNetwork> {
 public:
  static std::shared_ptr<LoopbackNetwork> Create();
  ~LoopbackNetwork();

  // A server; its port is chosen at Start (options.port when free, else the next free one).
  std::unique_ptr<Listener> Listen(ServerOptions options);
  // A client of the server at options.port (options.host is not looked at); it connects on its
  // first call or ConnectAsync. options.transport's message and payload limits apply.
  std::unique_ptr<Channel> Connect(ClientOptions options);

  // Ends connection `id` as a lost peer does: its calls in flight fail with Unavailable (a
  // payload not yet received fails too), its server's OnDisconnect runs, and its channel
  // connects again on its next call. No-op for an unknown or closed connection.
  void Disconnect(uint64_t connection_id);
  // Cuts the connection of `channel` (of this network) right after its next request has reached
  // its handler, as a peer lost mid-call: what the handler started (receiving the payload,
  // replying) then finds the connection gone. For FaultChannel's kDisconnectAfterRequest.
  static void CutAfterNextRequest(Channel& channel);
  // The connection a channel of this network uses now; 0 when it has none.
  static uint64_t ConnectionOf(const Channel& channel);

  // Runs `fn` on the network's thread (after what is queued), or after `delay`.
  void Run(std::function<void()> fn);
  void RunAfter(std::chrono::nanoseconds delay, std::function<void()> fn);
  // Returns once everything queued before the call has run. Not on the network's thread.
  void Flush();
  bool OnThread() const;

  class Impl;

 private:
  LoopbackNetwork();
  std::shared_ptr<Impl> impl_;
};

}  // namespace kvstash::transport
