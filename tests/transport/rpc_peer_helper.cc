// A transport peer in its own process, for multi-process tests.
//
//   rpc_peer_helper server TLS [PORT]
//     Serves echo (1), put (2: payload into registered memory), get (3: replies the last put)
//     and hold (4: never replies). Prints "port N" once listening; runs until killed or stdin
//     closes. A client naming tenant "stop-after-hello" gets its hello answered, and then the
//     whole process stops itself (SIGSTOP) before its UCX endpoint can answer: a node that stalls
//     between a client's hello and its first frame.
//   rpc_peer_helper client TLS PORT SIZE
//     Connects and keeps 4 puts of SIZE bytes in flight forever; prints "connected", then
//     "progress" after its first completed put. Runs until killed.

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <iostream>
#include <string>
#include <string_view>
#include <thread>

#include "kvstash/transport/rpc.h"
#include "transport_param.h"

using namespace kvstash;
using namespace kvstash::transport;

namespace {

int Server(const std::string& tls, uint16_t port) {
  ServerOptions options;
  options.transport = kvstash::testing::TransportFor(tls);
  options.port = port;
  // One progress thread: a task it is given from a handler runs after that handler (and after
  // the hello answer the handler wrote), not beside it on another thread.
  options.transport.progress_threads = 1;
  RpcServer* serving = nullptr;
  options.admit_tenant = [&serving](std::string_view tenant) {
    // Queued from another thread (and queued before this handler returns), the stop runs after
    // this handler, which goes on to write the hello's answer at once; asked from this thread,
    // it would run here, before the answer.
    if (tenant == "stop-after-hello") {
      std::thread([serving] { serving->RunOnProgressThread([] { ::raise(SIGSTOP); }); }).join();
    }
    return Status::OK();
  };
  auto server = RpcServer::Create(options);
  if (!server.ok()) {
    std::cerr << server.status().ToString() << "\n";
    return 1;
  }
  serving = server->get();
  auto region = (*server)->AllocateMemory(size_t{16} << 20);
  if (!region.ok()) {
    std::cerr << region.status().ToString() << "\n";
    return 1;
  }
  MemoryRegion& memory = *region;
  std::atomic<size_t> stored{0};
  (*server)->Handle(1, [](ServerCall call) { call.Reply(call.request()); });
  (*server)->Handle(2, [&](ServerCall call) {
    auto shared = std::make_shared<ServerCall>(std::move(call));
    const size_t n = shared->payload_bytes();
    shared->ReceivePayload(memory.bytes(), &memory, [shared, n, &stored](Status s) {
      if (!s.ok()) {
        shared->ReplyError(s);
        return;
      }
      stored = n;
      shared->Reply({});
    });
  });
  (*server)->Handle(
      3, [&](ServerCall call) { call.Reply({}, memory.bytes().first(stored.load()), &memory); });
  std::vector<ServerCall> held;
  (*server)->Handle(4, [&held](ServerCall call) { held.push_back(std::move(call)); });
  const Status started = (*server)->Start();
  if (!started.ok()) {
    std::cerr << started.ToString() << "\n";
    return 1;
  }
  std::cout << "port " << (*server)->port() << std::endl;
  char c;
  while (::read(0, &c, 1) > 0) {
  }
  return 0;
}

// Keeps 4 calls of `size` bytes in flight: puts (method 2) or, with `get`, gets (method 3)
// received into registered memory. Prints "progress" once the first completes.
int Client(const std::string& tls, uint16_t port, size_t size, bool get) {
  ClientOptions options;
  options.transport = kvstash::testing::TransportFor(tls);
  options.port = port;
  auto client = RpcClient::Create(options);
  if (!client.ok() || !(*client)->Connect().ok()) {
    std::cerr << "client could not connect\n";
    return 1;
  }
  std::cout << "connected" << std::endl;
  auto region = (*client)->AllocateMemory(size);
  if (!region.ok()) return 1;
  RpcClient* c = client->get();
  std::atomic<bool> reported{false};
  std::function<void()> issue = [&] {
    CallOptions call;
    call.deadline = Clock::now() + std::chrono::seconds(30);
    if (get) {
      call.recv_payload = region->bytes();
      call.recv_region = &*region;
    } else {
      call.send_payload = region->bytes();
      call.send_region = &*region;
    }
    c->Call(get ? 3 : 2, {}, call, [&](const Response& r) {
      if (r.status.ok() && !reported.exchange(true)) std::cout << "progress" << std::endl;
      issue();
    });
  };
  for (int i = 0; i < 4; ++i) issue();
  for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "server" && argc >= 3) {
    return Server(argv[2], argc > 3 ? static_cast<uint16_t>(std::stoi(argv[3])) : 0);
  }
  if (mode == "client" && (argc == 5 || (argc == 6 && std::string_view(argv[5]) == "get"))) {
    return Client(argv[2], static_cast<uint16_t>(std::stoi(argv[3])), std::stoull(argv[4]),
                  argc == 6);
  }
  std::cerr << "usage: rpc_peer_helper server TLS [PORT] | client TLS PORT SIZE [get]\n";
  return 2;
}
