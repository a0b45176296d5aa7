// What a process pays for copying through a server's shared memory (issue 32): one mapping of a
// server region per process, whatever the number of its connections, alive while a connection
// or a copy still uses it, made afresh for a restarted server, and faulted in only where copies
// reach. Server and clients run in this process over UCX shared memory (mapped payloads); the
// mappings are read from /proc/self/maps and their pages from /proc/self/pagemap, so the test
// checks what the kernel sees, not what the transport says.

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <functional>
#include <future>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <thread>

#include "block_pattern.h"
#include "kvstash/common/memory_warmer.h"
#include "kvstash/transport/call_group.h"
#include "kvstash/transport/rpc.h"
#include "transport_param.h"

namespace kvstash::transport {
namespace {

using namespace std::chrono_literals;
using ::kvstash::testing::FillPattern;
using ::kvstash::testing::MatchesPattern;
using ::kvstash::testing::TransportFor;

constexpr uint16_t kPut = 1;  // request: the offset; the payload goes to the region there
constexpr uint16_t kGet = 2;  // request: offset and length; replies with the region's bytes
constexpr size_t kChunk = ChunkPopulator::kDefaultChunkBytes;
// Not a whole number of chunks: the last chunk is short.
constexpr size_t kRegion = 8 * kChunk + (size_t{8} << 10);
constexpr size_t kBlock = size_t{256} << 10;

CallOptions Within(std::chrono::milliseconds timeout) {
  CallOptions options;
  options.deadline = Clock::now() + timeout;
  return options;
}

template <typename T>
Bytes AsBytes(const T& value) {
  return std::as_bytes(std::span(&value, 1));
}

struct Vma {
  uintptr_t start = 0;
  uintptr_t end = 0;
  uint64_t offset = 0;
  std::string device;
  uint64_t inode = 0;
};

std::vector<Vma> ReadMaps() {
  std::vector<Vma> vmas;
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    std::istringstream in(line);
    std::string range, perms;
    Vma vma;
    in >> range >> perms >> std::hex >> vma.offset >> vma.device >> std::dec >> vma.inode;
    const size_t dash = range.find('-');
    vma.start = std::stoull(range.substr(0, dash), nullptr, 16);
    vma.end = std::stoull(range.substr(dash + 1), nullptr, 16);
    vmas.push_back(vma);
  }
  return vmas;
}

// The shared-memory segment that `p` lies in: its device and inode.
std::optional<Vma> SegmentOf(const void* p) {
  const auto address = reinterpret_cast<uintptr_t>(p);
  for (const Vma& vma : ReadMaps()) {
    if (vma.start <= address && address < vma.end && vma.inode != 0) return vma;
  }
  return std::nullopt;
}

// This process's mappings of `segment` other than the one holding `except` (the server's own):
// the clients' mappings. A mapping is counted at its start (offset 0), however the kernel
// splits it.
std::vector<Vma> ClientMappingsOf(const Vma& segment, const void* except) {
  const auto skip = reinterpret_cast<uintptr_t>(except);
  std::vector<Vma> found;
  for (const Vma& vma : ReadMaps()) {
    if (vma.inode != segment.inode || vma.device != segment.device || vma.offset != 0) continue;
    if (vma.start <= skip && skip < vma.end) continue;
    found.push_back(vma);
  }
  return found;
}

// Which of the pages of [start, start + bytes) have a page-table entry in this process.
std::vector<bool> PresentPages(uintptr_t start, size_t bytes) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  std::vector<bool> present(bytes / page);
  const int fd = open("/proc/self/pagemap", O_RDONLY);
  if (fd < 0) return present;
  std::vector<uint64_t> entries(present.size());
  const ssize_t got = pread(fd, entries.data(), entries.size() * sizeof(uint64_t),
                            static_cast<off_t>(start / page * sizeof(uint64_t)));
  close(fd);
  for (size_t i = 0; got > 0 && i < present.size(); ++i) {
    present[i] = (entries[i] >> 63) != 0;
  }
  return present;
}

// Waits until `done` holds or 5 s pass (a client lets go of its connection on its worker's
// thread, after a grace period).
bool WaitFor(const std::function<bool()>& done) {
  for (const auto give_up = Clock::now() + 5s; Clock::now() < give_up;) {
    if (done()) return true;
    std::this_thread::sleep_for(5ms);
  }
  return done();
}

// Holds every copy posted to it until RunAll.
struct Holder final : CopyExecutor {
  std::mutex mu;
  std::vector<std::function<void()>> held;
  void Post(std::function<void()> copy) override {
    std::lock_guard lock(mu);
    held.push_back(std::move(copy));
  }
  bool WaitForOne() {
    return WaitFor([this] {
      std::lock_guard lock(mu);
      return !held.empty();
    });
  }
  void RunAll() {
    std::vector<std::function<void()>> copies;
    {
      std::lock_guard lock(mu);
      copies.swap(held);
    }
    for (auto& copy : copies) copy();
  }
};

class SharedMappingTest : public ::testing::Test {
 protected:
  void SetUp() override { StartServer(0); }

  void TearDown() override {
    server_block_ = MemoryRegion();
    server_.reset();
  }

  void StartServer(uint16_t port) {
    ServerOptions options;
    options.transport = TransportFor("shm");
    options.port = port;
    auto server = RpcServer::Create(options);
    ASSERT_TRUE(server.ok()) << server.status().ToString();
    server_ = std::move(*server);
    auto region = server_->AllocateMemory(kRegion);
    ASSERT_TRUE(region.ok()) << region.status().ToString();
    server_block_ = std::move(*region);
    server_->Handle(kPut, [this](ServerCall call) {
      uint64_t offset = 0;
      std::memcpy(&offset, call.request().data(), sizeof(offset));
      const size_t n = call.payload_bytes();
      auto shared = std::make_shared<ServerCall>(std::move(call));
      shared->ReceivePayload(server_block_.bytes().subspan(offset, n), &server_block_,
                             [shared](Status s) {
                               if (s.ok()) {
                                 shared->Reply({});
                               } else {
                                 shared->ReplyError(s);
                               }
                             });
    });
    server_->Handle(kGet, [this](ServerCall call) {
      uint64_t range[2] = {0, 0};
      std::memcpy(range, call.request().data(), sizeof(range));
      call.Reply({}, server_block_.bytes().subspan(range[0], range[1]), &server_block_);
    });
    ASSERT_TRUE(server_->Start().ok());
    auto segment = SegmentOf(server_block_.data());
    ASSERT_TRUE(segment.has_value()) << "the server's region is no shared segment";
    segment_ = *segment;
  }

  std::unique_ptr<RpcClient> MakeClient(std::shared_ptr<ClientWorker> worker = nullptr) {
    ClientOptions options;
    options.port = server_->port();
    options.transport = TransportFor("shm");
    options.worker = std::move(worker);
    auto client = RpcClient::Create(options);
    EXPECT_TRUE(client.ok()) << client.status().ToString();
    return client.ok() ? std::move(*client) : nullptr;
  }

  Status Put(RpcClient& client, uint64_t offset, uint64_t seed, size_t n = kBlock) {
    std::vector<std::byte> block(n);
    FillPattern(seed, block);
    CallOptions put = Within(10s);
    put.send_payload = block;
    return client.CallSync(kPut, AsBytes(offset), put, nullptr);
  }

  // Reads [offset, offset + n) back through `client` and checks it against `seed`.
  bool GetMatches(RpcClient& client, uint64_t offset, uint64_t seed, size_t n = kBlock,
                  CopyExecutor* copier = nullptr) {
    const uint64_t range[2] = {offset, n};
    std::vector<std::byte> back(n);
    CallOptions get = Within(10s);
    get.recv_payload = back;
    get.copier = copier;
    size_t got = 0;
    const Status status = client.CallSync(kGet, AsBytes(range), get, nullptr, &got);
    EXPECT_TRUE(status.ok()) << status.ToString();
    return status.ok() && got == n && MatchesPattern(seed, back);
  }

  std::vector<Vma> ClientMappings() const {
    return ClientMappingsOf(segment_, server_block_.data());
  }

  std::unique_ptr<RpcServer> server_;
  MemoryRegion server_block_;
  Vma segment_;
};

// Four clients of this process, two with workers of their own and two sharing one, copy through
// the server's region: the process maps it once (each connection mapped it whole before).
TEST_F(SharedMappingTest, ClientsOfOneProcessShareOneMappingOfAServerRegion) {
  auto shared = ClientWorker::Create(TransportFor("shm"));
  ASSERT_TRUE(shared.ok()) << shared.status().ToString();
  std::vector<std::unique_ptr<RpcClient>> clients;
  clients.push_back(MakeClient());
  clients.push_back(MakeClient());
  clients.push_back(MakeClient(*shared));
  clients.push_back(MakeClient(*shared));
  for (size_t i = 0; i < clients.size(); ++i) {
    ASSERT_NE(clients[i], nullptr);
    ASSERT_TRUE(Put(*clients[i], i * kBlock, 10 + i).ok()) << i;
  }
  for (size_t i = 0; i < clients.size(); ++i) {
    const size_t other = (i + 1) % clients.size();
    EXPECT_TRUE(GetMatches(*clients[i], other * kBlock, 10 + other)) << i;
    EXPECT_TRUE(clients[i]->payloads_mapped()) << i;
    EXPECT_EQ(clients[i]->stats().mapped_payloads, 2u) << i;
  }
  EXPECT_EQ(ClientMappings().size(), 1u);
  clients.clear();
  EXPECT_TRUE(WaitFor([&] { return ClientMappings().empty(); }))
      << ClientMappings().size() << " mapping(s) left after every client went";
}

// The client whose connection mapped the region goes away (its worker and thread with it) while
// another client's copy through the mapping is held: the copy still lands, the other client
// keeps copying through the same mapping, and the mapping goes with the last client.
TEST_F(SharedMappingTest, AMappingOutlivesTheClientThatMadeIt) {
  auto first = MakeClient();
  auto second = MakeClient();
  ASSERT_NE(first, nullptr);
  ASSERT_NE(second, nullptr);
  ASSERT_TRUE(Put(*first, 0, 1).ok());
  ASSERT_TRUE(Put(*second, kBlock, 2).ok());
  const std::vector<Vma> before = ClientMappings();
  ASSERT_EQ(before.size(), 1u);

  Holder holder;
  std::vector<std::byte> block(kBlock);
  FillPattern(3, block);
  std::promise<Status> put_done;
  CallOptions put = Within(10s);
  put.send_payload = block;
  put.copier = &holder;
  const uint64_t offset = 3 * kChunk;
  second->Call(kPut, AsBytes(offset), put,
               [&](const Response& r) { put_done.set_value(r.status); });
  ASSERT_TRUE(holder.WaitForOne());
  first.reset();
  holder.RunAll();
  auto done = put_done.get_future();
  ASSERT_EQ(done.wait_for(10s), std::future_status::ready);
  EXPECT_TRUE(done.get().ok());
  EXPECT_TRUE(MatchesPattern(3, server_block_.bytes().subspan(offset, kBlock)));

  ASSERT_TRUE(Put(*second, 4 * kChunk, 4).ok());
  EXPECT_TRUE(GetMatches(*second, 0, 1));
  EXPECT_TRUE(GetMatches(*second, 4 * kChunk, 4));
  const std::vector<Vma> after = ClientMappings();
  ASSERT_EQ(after.size(), 1u);
  EXPECT_EQ(after[0].start, before[0].start) << "mapped again";
  second.reset();
  EXPECT_TRUE(WaitFor([&] { return ClientMappings().empty(); }));
}

// A copy held while its connection closes keeps the mapping it copies through: the mapping
// stays while the copy is out, and goes once it reported back.
TEST_F(SharedMappingTest, ACopyOutKeepsItsMappingAfterItsConnectionCloses) {
  auto client = MakeClient();
  ASSERT_NE(client, nullptr);
  ASSERT_TRUE(Put(*client, 0, 1).ok());
  Holder holder;
  std::vector<std::byte> back(kBlock);
  std::promise<Status> get_done;
  const uint64_t range[2] = {0, kBlock};
  CallOptions get = Within(10s);
  get.recv_payload = back;
  get.copier = &holder;
  client->Call(kGet, AsBytes(range), get, [&](const Response& r) { get_done.set_value(r.status); });
  ASSERT_TRUE(holder.WaitForOne());
  client->Reset(UnavailableError("closed by the test"));
  // The connection let go of its regions on its thread; the held copy has not.
  ASSERT_TRUE(WaitFor([&] { return !client->payloads_mapped(); }));
  EXPECT_EQ(ClientMappings().size(), 1u) << "unmapped under a copy still out";
  holder.RunAll();
  auto done = get_done.get_future();
  ASSERT_EQ(done.wait_for(10s), std::future_status::ready);
  EXPECT_TRUE(WaitFor([&] { return ClientMappings().empty(); }))
      << "the mapping outlived its last copy and connection";
}

// A server restarted on the same port is another server start: the client maps its region
// afresh and lets go of the old one; its copies land in the new server's memory.
TEST_F(SharedMappingTest, AServerRestartGetsAFreshMapping) {
  auto client = MakeClient();
  ASSERT_NE(client, nullptr);
  ASSERT_TRUE(Put(*client, 0, 1).ok());
  ASSERT_EQ(ClientMappings().size(), 1u);
  const Vma old_segment = segment_;
  const uint16_t port = server_->port();
  server_block_ = MemoryRegion();
  server_.reset();
  StartServer(port);
  // The first call may find the old connection's loss.
  Status put = Put(*client, kBlock, 2);
  if (!put.ok()) put = Put(*client, kBlock, 2);
  ASSERT_TRUE(put.ok()) << put.ToString();
  EXPECT_TRUE(MatchesPattern(2, server_block_.bytes().subspan(kBlock, kBlock)));
  EXPECT_TRUE(GetMatches(*client, kBlock, 2));
  EXPECT_EQ(ClientMappings().size(), 1u);
  EXPECT_TRUE(WaitFor([&] { return ClientMappingsOf(old_segment, nullptr).empty(); }))
      << "the old server's region is still mapped";
}

// Copies fault in the chunks they reach, whole, and nothing else of the region (a connection
// faulted in the whole region before): on the progress thread and on a copier, at the region's
// start, across a chunk boundary and in its short last chunk.
TEST_F(SharedMappingTest, CopiesFaultInOnlyTheChunksTheyReach) {
  auto client = MakeClient();
  ASSERT_NE(client, nullptr);
  const uint64_t across = 5 * kChunk - kBlock / 2;  // chunks 4 and 5
  const uint64_t tail = 8 * kChunk;                 // the short chunk 8, whole
  const size_t tail_bytes = kRegion - tail;
  ASSERT_TRUE(Put(*client, 0, 1).ok());
  {
    // The first copy into chunks 4 and 5 runs on a copier.
    CallGroup group;
    std::vector<std::byte> block(kBlock);
    FillPattern(2, block);
    std::promise<Status> put_done;
    CallOptions put = Within(10s);
    put.send_payload = block;
    put.copier = &group;
    client->Call(kPut, AsBytes(across), put,
                 group.Track([&](const Response& r) { put_done.set_value(r.status); }));
    group.Wait();
    ASSERT_TRUE(put_done.get_future().get().ok());
  }
  ASSERT_TRUE(Put(*client, tail, 3, tail_bytes).ok());
  EXPECT_TRUE(GetMatches(*client, across, 2));
  EXPECT_TRUE(GetMatches(*client, tail, 3, tail_bytes));
  EXPECT_TRUE(MatchesPattern(2, server_block_.bytes().subspan(across, kBlock)));

  const std::vector<Vma> mappings = ClientMappings();
  ASSERT_EQ(mappings.size(), 1u);
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const std::vector<bool> present = PresentPages(mappings[0].start, kRegion);
  ASSERT_EQ(present.size(), kRegion / page);
  const std::set<size_t> reached = {0, 4, 5, 8};
  for (size_t chunk = 0; chunk * kChunk < kRegion; ++chunk) {
    size_t pages = 0, total = 0;
    for (size_t p = chunk * kChunk / page; p < std::min(kRegion, (chunk + 1) * kChunk) / page;
         ++p, ++total) {
      pages += present[p] ? 1 : 0;
    }
    if (reached.contains(chunk)) {
      EXPECT_EQ(pages, total) << "chunk " << chunk << " reached but not faulted in whole";
    } else {
      EXPECT_EQ(pages, 0u) << "chunk " << chunk << " faulted in, never reached";
    }
  }
}

}  // namespace
}  // namespace kvstash::transport
