// Fuzz target `node_requests`: the protobuf requests of proto/wire.proto through a NodeServer and
// its NodeService, the way a node receives them: a small node (4 KiB blocks, a CPU tier of 16,
// namespace quotas, tokens) served over the in-process loopback transport
// (transport/loopback.h), called by three clients: one in namespace "default", one in
// "tenant-a" (which has its own token) and one naming "tenant-a" with the node's token (refused).
// A fresh node serves each input, so an input replays alone.
//
// Input: a sequence of steps, each one byte `op` and what that step reads after it:
//   client = op % 4 (3 reads as 0); raw = op & 4 (else built from small keys); action = op >> 3:
//   0 lookup, 1 put-block, 2 load, 3 get-block, 4 release, 5 touch, 6 stats, 7 echo, 8 any
//   method (16 bits), 9 the client disconnects, 10 leases expire (the node's clock jumps),
//   11 put-blocks, 12 get-blocks.
// A raw request is a 16-bit length and those bytes, then a 16-bit payload length; a built one
// reads a key count and one byte per key (its hash and group), a put its checksum choice (a
// put-blocks also a length choice).
//
// Checked besides the sanitizers: every call is answered (never left to its deadline) and never
// with Internal; a reply answers every key it was asked; an echo echoes; a block read back is
// the one its namespace stored (a block of another namespace or a torn one fails); and once
// every client has gone, no pin or reservation is left.

#include <google/protobuf/stubs/logging.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <future>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "fuzz_check.h"
#include "kvstash/common/block_key.h"
#include "kvstash/common/hash.h"
#include "kvstash/common/logging.h"
#include "kvstash/node/node_server.h"
#include "kvstash/proto/wire.pb.h"
#include "kvstash/store/block_manager.h"
#include "kvstash/transport/loopback.h"

namespace kvstash::node {
namespace {

using namespace std::chrono_literals;
using transport::Bytes;
using transport::MutableBytes;

constexpr size_t kBlock = 4096;
constexpr size_t kCapacity = 16;
constexpr size_t kDefaultQuota = 12;  // every namespace but tenant-a
constexpr size_t kTenantQuota = 4;
constexpr uint32_t kMaxKeys = 16;
constexpr size_t kMaxPayload = 4 * kBlock;
constexpr std::chrono::milliseconds kLease{40};
constexpr size_t kMaxSteps = 64;
// A call the node leaves unanswered this long is a finding, not a slow machine.
constexpr auto kDeadline = 10s;

struct ClientSpec {
  const char* key_namespace;
  const char* token;
};
constexpr ClientSpec kClients[] = {
    {"default", "node-token"}, {"tenant-a", "token-a"}, {"tenant-a", "node-token"}};
constexpr size_t kClientCount = std::size(kClients);

// The bytes a client stores under `key` in its namespace: a block read back that differs came
// from another namespace, another key, or was torn.
void FillBlock(std::string_view key_namespace, const wire::Key& key, MutableBytes out) {
  uint64_t x = Xxh3Hash64(std::as_bytes(std::span(key_namespace))) ^ key.hash_lo() ^
               Mix64(key.hash_hi() + key.group());
  for (size_t i = 0; i < out.size(); i += 8) {
    x = Mix64(x + i);
    std::memcpy(out.data() + i, &x, std::min<size_t>(8, out.size() - i));
  }
}

struct Outcome {
  Status status;
  std::vector<std::byte> reply;
  size_t payload_bytes = 0;
};

// KVSTASH_FUZZ_TRACE=1 in the environment: every call and its outcome on stderr, to read what a
// saved input does.
const bool kTrace = std::getenv("KVSTASH_FUZZ_TRACE") != nullptr;

Outcome CallAndWait(transport::Channel& channel, uint16_t method, Bytes request, Bytes payload,
                    MutableBytes receive) {
  std::promise<Outcome> promise;
  std::future<Outcome> done = promise.get_future();
  transport::CallOptions options;
  options.deadline = transport::Clock::now() + kDeadline;
  options.send_payload = payload;
  options.recv_payload = receive;
  channel.Call(method, request, options, [&promise](const transport::Response& response) {
    promise.set_value(Outcome{response.status,
                              {response.message.begin(), response.message.end()},
                              response.payload_bytes});
  });
  Outcome outcome = done.get();
  if (kTrace) {
    std::fprintf(stderr, "method %u: %zu request bytes, %zu payload bytes: %s, %zu reply bytes\n",
                 method, request.size(), payload.size(), outcome.status.ToString().c_str(),
                 outcome.reply.size());
  }
  // The node answers every call; Internal is a call it dropped.
  KVSTASH_FUZZ_CHECK(outcome.status.code() != StatusCode::kDeadlineExceeded);
  KVSTASH_FUZZ_CHECK(outcome.status.code() != StatusCode::kInternal);
  return outcome;
}

template <typename Message>
bool ParseReply(const Outcome& outcome, Message* message) {
  return message->ParseFromArray(outcome.reply.data(), static_cast<int>(outcome.reply.size()));
}

class Harness {
 public:
  explicit Harness(std::shared_ptr<transport::LoopbackNetwork> network)
      : network_(std::move(network)) {
    NodeOptions options;
    options.server.auth_token = "node-token";
    options.server.tenant_tokens = {{"tenant-a", "token-a"}};
    options.max_keys_per_request = kMaxKeys;
    options.server.transport.max_message_bytes = 64 * 1024;
    options.server.transport.max_payload_bytes = kMaxPayload;
    options.store.block_bytes = kBlock;
    options.store.cpu_capacity_blocks = kCapacity;
    options.store.prefault = false;
    options.namespace_quota_blocks = {{"tenant-a", kTenantQuota}};
    options.default_namespace_quota_blocks = kDefaultQuota;
    options.lease_timeout = kLease;
    options.clock = [this] {
      clock_reads_.fetch_add(1);
      return start_ + std::chrono::milliseconds(clock_ms_.load());
    };
    options.listen = [network = network_](const transport::ServerOptions& server) {
      return Result<std::unique_ptr<transport::Listener>>(network->Listen(server));
    };
    auto node = NodeServer::Create(std::move(options));
    KVSTASH_FUZZ_CHECK(node.ok());
    node_ = std::move(*node);
    for (size_t i = 0; i < kClientCount; ++i) channels_.push_back(Connect(kClients[i]));
    payload_.resize(5 * kBlock);
    receive_.resize(5 * kBlock);
  }

  ~Harness() {
    channels_.clear();
    network_->Flush();
  }

  void Step(std::span<const uint8_t>& in) {
    const uint8_t op = fuzz::Take<uint8_t>(in);
    const size_t client = (op & 3) % kClientCount;
    const bool raw = (op & 4) != 0;
    switch (op >> 3) {
      case 0:
        return Keys(client, wire::METHOD_LOOKUP, raw, in);
      case 1:
        return PutBlock(client, raw, in);
      case 2:
        return Keys(client, wire::METHOD_LOAD, raw, in);
      case 3:
        return GetBlock(client, raw, in);
      case 4:
        return Keys(client, wire::METHOD_RELEASE, raw, in);
      case 5:
        return Keys(client, wire::METHOD_TOUCH, raw, in);
      case 6:
        return Raw(client, wire::METHOD_STATS, in);
      case 7:
        return Echo(client, raw, in);
      case 8:
        return Raw(client, fuzz::Take<uint16_t>(in), in);
      case 9:
        return Disconnect(client);
      case 10:
        return ExpireLeases();
      case 11:
        return PutBlocks(client, raw, in);
      case 12:
        return GetBlocks(client, raw, in);
      default:
        return;
    }
  }

  // With every client gone, nothing they held is left: no block of the CPU tier is pinned or
  // being written.
  void CheckNothingHeld() {
    channels_.clear();
    network_->Flush();
    std::promise<store::BlockManagerState> promise;
    std::future<store::BlockManagerState> state = promise.get_future();
    network_->Run([&] { promise.set_value(node_->store().cpu().DebugState()); });
    for (const store::BlockInfo& block : state.get().lru) {
      if (block.ref_count != 0) {
        std::fprintf(stderr, "block %s is held (%d) after every client left\n",
                     block.key.ToString().c_str(), block.ref_count);
      }
      KVSTASH_FUZZ_CHECK(block.ref_count == 0);
    }
  }

 private:
  std::unique_ptr<transport::Channel> Connect(const ClientSpec& spec) {
    transport::ClientOptions options;
    options.port = node_->port();
    options.tenant = spec.key_namespace;
    options.auth_token = spec.token;
    options.client_name = "fuzz";
    return network_->Connect(options);
  }

  // A request's bytes: raw (a length and that many bytes), or `build` of the input.
  template <typename Build>
  std::string Request(bool raw, std::span<const uint8_t>& in, Build build) {
    if (raw) return std::string(fuzz::AsText(fuzz::TakeBytes(in, fuzz::Take<uint16_t>(in))));
    return build();
  }

  // One byte as a key: few hashes, so that stores, loads and reads meet.
  static void KeyOf(uint8_t byte, wire::Key* key) {
    key->set_hash_lo(byte & 0x1f);
    key->set_hash_hi(0x6b76);
    key->set_group(byte >> 5);
  }

  template <typename Message>
  void ReadKeys(std::span<const uint8_t>& in, Message* message) {
    const size_t count = fuzz::Take<uint8_t>(in) % (kMaxKeys + 4);
    for (size_t i = 0; i < count && !in.empty(); ++i) {
      KeyOf(fuzz::Take<uint8_t>(in), message->add_keys());
    }
  }

  // Lookup, load, release and touch: a list of keys each.
  void Keys(size_t client, wire::Method method, bool raw, std::span<const uint8_t>& in) {
    const std::string request = Request(raw, in, [&] {
      wire::LoadRequest keys;  // every one of these requests is `repeated Key keys = 1`...
      ReadKeys(in, &keys);
      if (method != wire::METHOD_LOOKUP) return keys.SerializeAsString();
      wire::LookupRequest lookup;  // ...but a lookup's, which is field 2
      lookup.mutable_keys()->Swap(keys.mutable_keys());
      return lookup.SerializeAsString();
    });
    const size_t payload = raw ? fuzz::Take<uint16_t>(in) % (5 * kBlock) : 0;
    const Outcome outcome = Call(client, method, request, std::span(payload_).first(payload));
    if (!outcome.status.ok()) return;
    if (method == wire::METHOD_LOOKUP) {
      wire::LookupRequest asked;
      wire::LookupReply reply;
      KVSTASH_FUZZ_CHECK(asked.ParseFromString(request) && ParseReply(outcome, &reply));
      KVSTASH_FUZZ_CHECK(reply.results_size() == asked.keys_size());
    } else if (method == wire::METHOD_LOAD) {
      wire::LoadRequest asked;
      wire::LoadReply reply;
      KVSTASH_FUZZ_CHECK(asked.ParseFromString(request) && ParseReply(outcome, &reply));
      KVSTASH_FUZZ_CHECK(reply.pinned_size() == asked.keys_size());
      KVSTASH_FUZZ_CHECK(reply.length_size() == asked.keys_size());
      for (int i = 0; i < reply.pinned_size(); ++i) {
        KVSTASH_FUZZ_CHECK(reply.length(i) == (reply.pinned(i) ? kBlock : 0));
      }
    }
  }

  void PutBlock(size_t client, bool raw, std::span<const uint8_t>& in) {
    wire::PutBlockRequest built;
    uint8_t checksum_choice = 0;
    std::string request = Request(raw, in, [&] {
      KeyOf(fuzz::Take<uint8_t>(in), built.mutable_key());
      built.set_length(kBlock);
      checksum_choice = fuzz::Take<uint8_t>(in);
      return std::string();
    });
    // The payload: a block, or (raw, or a built request that asks so) any length.
    const uint16_t asked = fuzz::Take<uint16_t>(in);
    const size_t payload = raw || (checksum_choice & 0x80) ? asked % (5 * kBlock) : kBlock;
    // Whatever key the node reads, the bytes are those of that key in this client's namespace.
    wire::PutBlockRequest parsed;
    const bool parses = raw ? parsed.ParseFromString(request) : true;
    if (!raw) parsed = built;
    const MutableBytes bytes = std::span(payload_).first(payload);
    if (parses) FillBlock(kClients[client].key_namespace, parsed.key(), bytes);
    if (!raw) {
      // 0: unchecked; 1: right; else a wrong one (the store is refused, the block absent).
      const uint8_t kind = checksum_choice % 3;
      built.set_checksum(kind == 0 ? 0 : Xxh3Hash64(bytes) + (kind == 2 ? 1 : 0));
      request = built.SerializeAsString();
    }
    const Outcome outcome = Call(client, wire::METHOD_PUT_BLOCK, request, bytes);
    if (outcome.status.ok()) {
      wire::PutBlockReply reply;
      KVSTASH_FUZZ_CHECK(ParseReply(outcome, &reply));
      KVSTASH_FUZZ_CHECK(parses && payload == kBlock);
    }
  }

  void GetBlock(size_t client, bool raw, std::span<const uint8_t>& in) {
    const std::string request = Request(raw, in, [&] {
      wire::GetBlockRequest built;
      KeyOf(fuzz::Take<uint8_t>(in), built.mutable_key());
      return built.SerializeAsString();
    });
    const size_t payload = raw ? fuzz::Take<uint16_t>(in) % (5 * kBlock) : 0;
    const Outcome outcome =
        Call(client, wire::METHOD_GET_BLOCK, request, std::span(payload_).first(payload));
    if (!outcome.status.ok()) return;
    wire::GetBlockRequest asked;
    wire::GetBlockReply reply;
    KVSTASH_FUZZ_CHECK(asked.ParseFromString(request) && ParseReply(outcome, &reply));
    KVSTASH_FUZZ_CHECK(reply.length() == kBlock && outcome.payload_bytes == kBlock);
    std::vector<std::byte> expected(kBlock);
    FillBlock(kClients[client].key_namespace, asked.key(), expected);
    KVSTASH_FUZZ_CHECK(std::memcmp(receive_.data(), expected.data(), kBlock) == 0);
  }

  // Several blocks in one call; each key's bytes are those of that key in this client's
  // namespace, so that a block later read back (GetBlock, GetBlocks) is checked.
  void PutBlocks(size_t client, bool raw, std::span<const uint8_t>& in) {
    wire::PutBlocksRequest built;
    uint8_t choice = 0;
    std::string request = Request(raw, in, [&] {
      ReadKeys(in, &built);
      choice = fuzz::Take<uint8_t>(in);
      return std::string();
    });
    wire::PutBlocksRequest parsed;
    const bool parses = raw ? parsed.ParseFromString(request) : true;
    if (!raw) {
      // Lengths: a block each, or (choice & 0x40) one of them another length, or (0x80) one
      // length too many.
      for (int i = 0; i < built.keys_size(); ++i) built.add_lengths(kBlock);
      if ((choice & 0x40) && built.lengths_size() != 0) built.set_lengths(0, choice & 0x3f);
      if (choice & 0x80) built.add_lengths(kBlock);
      parsed = built;
    }
    // The payload: each stated length, filled as its key's bytes where it is a block.
    uint64_t total = 0;
    for (uint64_t length : parsed.lengths()) total += std::min<uint64_t>(length, 5 * kBlock);
    const size_t payload = raw ? fuzz::Take<uint16_t>(in) % (5 * kBlock)
                               : static_cast<size_t>(std::min<uint64_t>(total, 5 * kBlock));
    const MutableBytes bytes = std::span(payload_).first(payload);
    if (parses) {
      size_t at = 0;
      for (int i = 0; i < parsed.keys_size() && i < parsed.lengths_size(); ++i) {
        const size_t length =
            static_cast<size_t>(std::min<uint64_t>(parsed.lengths(i), 5 * kBlock));
        if (at + length > bytes.size()) break;
        if (length == kBlock) {
          FillBlock(kClients[client].key_namespace, parsed.keys(i), bytes.subspan(at, length));
        }
        at += length;
      }
    }
    if (!raw) {
      const uint8_t kind = choice % 3;  // as PutBlock: unchecked, right, wrong
      built.set_checksum(kind == 0 ? 0 : Xxh3Hash64(bytes) + (kind == 2 ? 1 : 0));
      request = built.SerializeAsString();
    }
    const Outcome outcome = Call(client, wire::METHOD_PUT_BLOCKS, request, bytes);
    if (!outcome.status.ok()) return;
    wire::PutBlocksReply reply;
    KVSTASH_FUZZ_CHECK(parses && ParseReply(outcome, &reply));
    KVSTASH_FUZZ_CHECK(reply.results_size() == parsed.keys_size());
    for (int i = 0; i < reply.results_size(); ++i) {
      // A block of another length is refused, never stored.
      if (parsed.lengths(i) != kBlock) KVSTASH_FUZZ_CHECK(reply.results(i).code() != wire::OK);
    }
  }

  // Several blocks read in one call: each one read is its key's, back to back.
  void GetBlocks(size_t client, bool raw, std::span<const uint8_t>& in) {
    const std::string request = Request(raw, in, [&] {
      wire::GetBlocksRequest built;
      ReadKeys(in, &built);
      return built.SerializeAsString();
    });
    const size_t payload = raw ? fuzz::Take<uint16_t>(in) % (5 * kBlock) : 0;
    const Outcome outcome =
        Call(client, wire::METHOD_GET_BLOCKS, request, std::span(payload_).first(payload));
    if (!outcome.status.ok()) return;
    wire::GetBlocksRequest asked;
    wire::GetBlocksReply reply;
    KVSTASH_FUZZ_CHECK(asked.ParseFromString(request) && ParseReply(outcome, &reply));
    KVSTASH_FUZZ_CHECK(reply.results_size() == asked.keys_size());
    size_t at = 0;
    std::vector<std::byte> expected(kBlock);
    for (int i = 0; i < reply.results_size(); ++i) {
      const wire::BlockResult& result = reply.results(i);
      if (result.code() != wire::OK) {
        KVSTASH_FUZZ_CHECK(result.length() == 0);
        continue;
      }
      KVSTASH_FUZZ_CHECK(result.length() == kBlock && at + kBlock <= outcome.payload_bytes);
      FillBlock(kClients[client].key_namespace, asked.keys(i), expected);
      KVSTASH_FUZZ_CHECK(std::memcmp(receive_.data() + at, expected.data(), kBlock) == 0);
      at += kBlock;
    }
    KVSTASH_FUZZ_CHECK(at == outcome.payload_bytes);
  }

  void Echo(size_t client, bool raw, std::span<const uint8_t>& in) {
    const std::string request = Request(raw, in, [&] {
      wire::EchoRequest built;
      built.set_body(std::string(fuzz::AsText(fuzz::TakeBytes(in, fuzz::Take<uint8_t>(in)))));
      built.set_payload_bytes(fuzz::Take<uint16_t>(in) % (5 * kBlock));
      return built.SerializeAsString();
    });
    const size_t payload = fuzz::Take<uint16_t>(in) % (5 * kBlock);
    const Outcome outcome =
        Call(client, wire::METHOD_ECHO, request, std::span(payload_).first(payload));
    if (!outcome.status.ok()) return;
    wire::EchoRequest asked;
    wire::EchoReply reply;
    KVSTASH_FUZZ_CHECK(asked.ParseFromString(request) && ParseReply(outcome, &reply));
    KVSTASH_FUZZ_CHECK(reply.body() == asked.body());
    KVSTASH_FUZZ_CHECK(outcome.payload_bytes == asked.payload_bytes());
  }

  // A method with raw request bytes (stats, or any method number at all).
  void Raw(size_t client, uint16_t method, std::span<const uint8_t>& in) {
    const std::string request(fuzz::AsText(fuzz::TakeBytes(in, fuzz::Take<uint16_t>(in))));
    const size_t payload = fuzz::Take<uint16_t>(in) % (5 * kBlock);
    const Outcome outcome = Call(client, method, request, std::span(payload_).first(payload));
    if (outcome.status.ok() && method == wire::METHOD_STATS) {
      wire::StatsReply reply;
      KVSTASH_FUZZ_CHECK(ParseReply(outcome, &reply));
      KVSTASH_FUZZ_CHECK(reply.counters().contains("cpu.resident_blocks"));
    }
  }

  Outcome Call(size_t client, uint16_t method, const std::string& request, Bytes payload) {
    if (kTrace) std::fprintf(stderr, "client %zu: ", client);
    return CallAndWait(*channels_[client], method, std::as_bytes(std::span(request)), payload,
                       receive_);
  }

  void Disconnect(size_t client) {
    if (kTrace) std::fprintf(stderr, "client %zu disconnects\n", client);
    network_->Disconnect(transport::LoopbackNetwork::ConnectionOf(*channels_[client]));
    network_->Flush();
  }

  // The node's clock jumps past the lease; returns once the node has read it on its own (its
  // lease timer: no call is in flight), so the leases expired.
  void ExpireLeases() {
    if (kTrace) std::fprintf(stderr, "leases expire\n");
    clock_ms_.fetch_add((kLease + 1ms).count());
    const uint64_t reads = clock_reads_.load();
    const auto give_up = std::chrono::steady_clock::now() + kDeadline;
    while (clock_reads_.load() == reads) {
      KVSTASH_FUZZ_CHECK(std::chrono::steady_clock::now() < give_up);
      std::this_thread::sleep_for(1ms);
    }
    network_->Flush();
  }

  std::shared_ptr<transport::LoopbackNetwork> network_;
  const std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  std::atomic<int64_t> clock_ms_{0};
  std::atomic<uint64_t> clock_reads_{0};
  std::unique_ptr<NodeServer> node_;
  std::vector<std::unique_ptr<transport::Channel>> channels_;
  std::vector<std::byte> payload_;
  std::vector<std::byte> receive_;
};

}  // namespace
}  // namespace kvstash::node

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // Refusals and malformed requests are logged as warnings, and protobuf logs every string field
  // that is not UTF-8: thousands of lines a second.
  (void)kvstash::SetLogLevel("off");
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // One network for the process (its thread outlives the inputs), a fresh node per input.
  static const auto network = kvstash::transport::LoopbackNetwork::Create();
  std::span<const uint8_t> input(data, size);
  kvstash::node::Harness harness(network);
  for (size_t step = 0; step < kvstash::node::kMaxSteps && !input.empty(); ++step) {
    harness.Step(input);
  }
  harness.CheckNothingHeld();
  return 0;
}
