// Writes the fuzz targets' seeds (tests/fuzz/corpus/<target>/seed-*) from real messages: frames
// written by WriteFrame, a hello with a real UCX worker address, node requests serialized as
// clients send them, a worker's requests and replies as protocol.cc writes them, a config with
// every setting, both kinds of trace, and KV event batches as a node publishes them. Run by hand
// after a wire or format change:
//   build-asan/tests/fuzz/fuzz_make_seeds tests/fuzz/corpus
// It replaces the seed-* files it writes and leaves every other file (regression inputs) alone.

#include <fmt/format.h>
#include <ucp/api/ucp.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

#include "kvstash/common/hash.h"
#include "kvstash/events/kv_events.h"
#include "kvstash/proto/wire.pb.h"
#include "kvstash/transport/frame.h"
#include "kvstash/worker/protocol.h"
#include "kvstash/worker/protocol_json.h"

namespace kvstash::fuzz {
namespace {

namespace fs = std::filesystem;
using transport::FrameHeader;
using transport::FrameKind;

fs::path g_root;

void Write(std::string_view target, std::string_view name, std::string_view bytes) {
  const fs::path dir = g_root / target;
  fs::create_directories(dir);
  std::ofstream out(dir / fmt::format("seed-{}", name), std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

template <typename T>
void Append(std::string& out, T value) {
  out.append(reinterpret_cast<const char*>(&value), sizeof(T));
}

// ---- frame ----------------------------------------------------------------------------------

// mode, header length, header (frame header + message [+ trailer]), data.
std::string FrameInput(uint8_t mode, const std::vector<std::byte>& header, std::string_view data) {
  std::string out;
  Append<uint8_t>(out, mode);
  Append<uint16_t>(out, static_cast<uint16_t>(header.size()));
  out.append(reinterpret_cast<const char*>(header.data()), header.size());
  out.append(data);
  return out;
}

std::vector<std::byte> Header(FrameHeader h, std::string_view message) {
  h.message_bytes = static_cast<uint32_t>(message.size());
  std::vector<std::byte> out(transport::kFrameHeaderBytes + message.size());
  transport::WriteFrame(h, std::as_bytes(std::span(message)), out);
  return out;
}

FrameHeader Frame(FrameKind kind, uint16_t method = 0) {
  FrameHeader h;
  h.kind = kind;
  h.method = method;
  h.request_id = 7;
  h.connection_id = uint64_t{0x5eed} << 32 | 1;
  h.timeout_us = 10'000'000;
  return h;
}

wire::Key Key(uint64_t lo) {
  wire::Key key;
  key.set_hash_lo(lo);
  key.set_hash_hi(0x6b76);
  return key;
}

void Frames() {
  wire::LookupRequest lookup;
  *lookup.add_keys() = Key(1);
  *lookup.add_keys() = Key(2);
  const std::string lookup_bytes = lookup.SerializeAsString();
  Write("frame", "lookup", FrameInput(0, Header(Frame(FrameKind::kRequest, 1), lookup_bytes), ""));
  Write("frame", "lookup-small-limit",
        FrameInput(2, Header(Frame(FrameKind::kRequest, 1), lookup_bytes), ""));

  wire::PutBlockRequest put;
  *put.mutable_key() = Key(3);
  put.set_length(64);
  const std::string put_bytes = put.SerializeAsString();
  const std::string block(64, '\x5a');
  FrameHeader accepts = Frame(FrameKind::kRequest, 3);
  accepts.flags = transport::kAcceptsMapped;
  Write("frame", "put-eager", FrameInput(0, Header(accepts, put_bytes), block));
  Write("frame", "put-rendezvous", FrameInput(1, Header(accepts, put_bytes), block));

  FrameHeader in_data = Frame(FrameKind::kRequest, 1);
  in_data.flags = transport::kMessageInData;
  in_data.message_bytes = static_cast<uint32_t>(lookup_bytes.size());
  std::vector<std::byte> bare(transport::kFrameHeaderBytes);
  transport::WriteFrame(in_data, {}, bare);
  Write("frame", "message-in-data", FrameInput(0, bare, lookup_bytes));

  wire::LookupReply reply;
  reply.add_results(wire::LOOKUP_HIT);
  reply.add_results(wire::LOOKUP_MISS);
  Write("frame", "response",
        FrameInput(0, Header(Frame(FrameKind::kResponse, 1), reply.SerializeAsString()), ""));
  wire::Error error;
  error.set_code(wire::RESOURCE_EXHAUSTED);
  error.set_message("namespace 'tenant-a' is at its quota of 4 blocks");
  FrameHeader failed = Frame(FrameKind::kResponse, 3);
  failed.status = wire::RESOURCE_EXHAUSTED;
  Write("frame", "response-error", FrameInput(0, Header(failed, error.SerializeAsString()), ""));
  Write("frame", "response-payload",
        FrameInput(0, Header(Frame(FrameKind::kResponse, 6), "\x08\x40"), block));

  for (const auto& [name, kind] :
       {std::pair{"cancel", FrameKind::kCancel}, std::pair{"ack", FrameKind::kAck},
        std::pair{"pull-done", FrameKind::kPullDone}}) {
    Write("frame", name, FrameInput(0, Header(Frame(kind), ""), ""));
  }
  Write("frame", "payload", FrameInput(0, Header(Frame(FrameKind::kPayload), ""), block));

  // Mapped payloads: a request holding its payload, a pull naming where to copy it, a mapped
  // reply with the region's rkey.
  transport::MappedRef held;
  held.length = 64;
  Write("frame", "request-held",
        FrameInput(0,
                   transport::WriteFrameWithRef(Frame(FrameKind::kRequest, 3),
                                                std::as_bytes(std::span(put_bytes)), held, {}),
                   ""));
  transport::MappedRef region;
  region.region_id = 2;
  region.region_address = 0x7f0000000000;
  region.region_size = 1 << 20;
  region.address = 0x7f0000001000;
  region.length = 64;
  const std::string rkey(24, '\x11');
  Write("frame", "pull",
        FrameInput(0,
                   transport::WriteFrameWithRef(Frame(FrameKind::kPull), {}, region,
                                                std::as_bytes(std::span(rkey))),
                   ""));
  const std::string get_reply = "\x08\x40";
  Write("frame", "response-mapped",
        FrameInput(0,
                   transport::WriteFrameWithRef(Frame(FrameKind::kResponse, 6),
                                                std::as_bytes(std::span(get_reply)), region,
                                                std::as_bytes(std::span(rkey))),
                   ""));
}

// ---- hello ----------------------------------------------------------------------------------

// A real UCX worker address, as a client sends it (empty when UCX cannot start here).
std::string WorkerAddress() {
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_AM;
  ucp_context_h context = nullptr;
  if (ucp_init(&params, nullptr, &context) != UCS_OK) return {};
  ucp_worker_params_t worker_params{};
  ucp_worker_h worker = nullptr;
  std::string out;
  if (ucp_worker_create(context, &worker_params, &worker) == UCS_OK) {
    ucp_address_t* address = nullptr;
    size_t length = 0;
    if (ucp_worker_get_address(worker, &address, &length) == UCS_OK) {
      out.assign(reinterpret_cast<const char*>(address), length);
      ucp_worker_release_address(worker, address);
    }
    ucp_worker_destroy(worker);
  }
  ucp_cleanup(context);
  return out;
}

std::string Framed(const std::string& body) {
  std::string out;
  Append<uint32_t>(out, static_cast<uint32_t>(body.size()));
  return out + body;
}

void Hellos() {
  const std::string address = WorkerAddress();
  if (address.empty()) std::fprintf(stderr, "no UCX worker address: hello seeds without one\n");
  auto hello = [&](std::string_view ns, std::string_view token, uint32_t version) {
    wire::Hello h;
    h.set_protocol_version(version);
    h.set_namespace_(std::string(ns));
    h.set_auth_token(std::string(token));
    h.set_worker_address(address);
    h.set_client_name("host/4242/engine");
    return Framed(h.SerializeAsString());
  };
  Write("hello", "open", hello("default", "", wire::PROTOCOL_VERSION_CURRENT));
  Write("hello", "node-token", hello("default", "node-token", wire::PROTOCOL_VERSION_CURRENT));
  Write("hello", "tenant-token", hello("tenant-a", "token-a", wire::PROTOCOL_VERSION_CURRENT));
  Write("hello", "wrong-token", hello("tenant-a", "node-token", wire::PROTOCOL_VERSION_CURRENT));
  Write("hello", "old-version", hello("default", "", 1));
  wire::HelloReply reply;
  reply.set_protocol_version(wire::PROTOCOL_VERSION_CURRENT);
  reply.set_connection_id(uint64_t{0x5eed} << 32 | 1);
  reply.set_worker_address(address);
  wire::NodeLimits limits;
  limits.set_block_bytes(256 * 1024);
  limits.set_max_keys_per_request(4096);
  reply.set_service_limits(limits.SerializeAsString());
  reply.set_max_message_bytes(4 << 20);
  reply.set_max_payload_bytes(64 << 20);
  reply.mutable_mapped_probe()->set_region_id(1);
  reply.mutable_mapped_probe()->set_rkey(std::string(24, '\x11'));
  Write("hello", "reply", Framed(reply.SerializeAsString()));
  wire::HelloReply refused;
  refused.mutable_error()->set_code(wire::UNAUTHENTICATED);
  refused.mutable_error()->set_message("wrong auth token for the namespace");
  Write("hello", "reply-refused", Framed(refused.SerializeAsString()));
}

// ---- node_requests --------------------------------------------------------------------------

// One step of fuzz_node_requests.cc's input.
enum Action : uint8_t {
  kLookup = 0,
  kPut = 1,
  kLoad = 2,
  kGet = 3,
  kRelease = 4,
  kTouch = 5,
  kStats = 6,
  kEcho = 7,
  kAnyMethod = 8,
  kDisconnect = 9,
  kExpire = 10,
  kPutMany = 11,
  kGetMany = 12,
};
uint8_t Op(Action action, uint8_t client, bool raw = false) {
  return static_cast<uint8_t>(action << 3 | (raw ? 4 : 0) | client);
}

struct Steps {
  std::string bytes;
  Steps& Keys(Action action, uint8_t client, std::vector<uint8_t> keys) {
    Append<uint8_t>(bytes, Op(action, client));
    Append<uint8_t>(bytes, static_cast<uint8_t>(keys.size()));
    for (uint8_t k : keys) Append<uint8_t>(bytes, k);
    return *this;
  }
  // checksum: 0 unchecked, 1 right, 2 wrong.
  Steps& Put(uint8_t client, uint8_t key, uint8_t checksum = 1) {
    Append<uint8_t>(bytes, Op(kPut, client));
    Append<uint8_t>(bytes, key);
    Append<uint8_t>(bytes, checksum);
    Append<uint16_t>(bytes, 4096);
    return *this;
  }
  Steps& Get(uint8_t client, uint8_t key) {
    Append<uint8_t>(bytes, Op(kGet, client));
    Append<uint8_t>(bytes, key);
    return *this;
  }
  Steps& Raw(Action action, uint8_t client, const std::string& request, uint16_t payload) {
    Append<uint8_t>(bytes, Op(action, client, /*raw=*/true));
    Append<uint16_t>(bytes, static_cast<uint16_t>(request.size()));
    bytes += request;
    Append<uint16_t>(bytes, payload);
    return *this;
  }
  Steps& Stats(uint8_t client) {
    Append<uint8_t>(bytes, Op(kStats, client));
    Append<uint16_t>(bytes, 0);
    Append<uint16_t>(bytes, 0);
    return *this;
  }
  Steps& Echo(uint8_t client, std::string_view body, uint16_t reply_payload, uint16_t payload) {
    Append<uint8_t>(bytes, Op(kEcho, client));
    Append<uint8_t>(bytes, static_cast<uint8_t>(body.size()));
    bytes += body;
    Append<uint16_t>(bytes, reply_payload);
    Append<uint16_t>(bytes, payload);
    return *this;
  }
  // PutBlocks of `keys`; choice: as fuzz_node_requests.cc reads it (checksum kind = choice % 3,
  // 0x40 one length off, 0x80 one length too many).
  Steps& PutMany(uint8_t client, std::vector<uint8_t> keys, uint8_t choice = 1) {
    Keys(kPutMany, client, std::move(keys));
    Append<uint8_t>(bytes, choice);
    return *this;
  }
  Steps& Plain(Action action, uint8_t client) {
    Append<uint8_t>(bytes, Op(action, client));
    return *this;
  }
};

void NodeRequests() {
  Write("node_requests", "store-then-read",
        Steps()
            .Put(0, 1)
            .Put(0, 2)
            .Keys(kLookup, 0, {1, 2, 3})
            .Keys(kLoad, 0, {1, 2})
            .Get(0, 1)
            .Get(0, 2)
            .Keys(kRelease, 0, {1, 2})
            .Keys(kTouch, 0, {2, 1})
            .Stats(0)
            .bytes);
  Write("node_requests", "two-tenants",
        Steps()
            .Put(0, 5)
            .Put(1, 5)
            .Get(1, 5)
            .Get(0, 5)
            .Keys(kLookup, 1, {5, 6})
            .Put(2, 5)
            .Get(2, 5)
            .bytes);
  Steps quota;
  for (uint8_t k = 0; k < 6; ++k) quota.Put(1, k);
  quota.Keys(kLoad, 1, {0, 1, 2, 3, 4, 5}).Put(1, 9);
  Write("node_requests", "tenant-quota", quota.bytes);
  Write("node_requests", "checksums",
        Steps().Put(0, 1, 0).Put(0, 2, 2).Keys(kLookup, 0, {1, 2}).bytes);
  Write("node_requests", "pins-and-leases",
        Steps()
            .Put(0, 1)
            .Keys(kLoad, 0, {1, 1})
            .Plain(kExpire, 0)
            .Get(0, 1)
            .Keys(kLoad, 0, {1})
            .Plain(kDisconnect, 0)
            .Get(0, 1)
            .bytes);
  Write("node_requests", "echo", Steps().Echo(0, "ping", 64, 0).Echo(1, "", 0, 100).bytes);
  Write("node_requests", "batches",
        Steps()
            .PutMany(0, {1, 2, 3})
            .PutMany(1, {1, 4})
            .PutMany(0, {5, 6}, 2)
            .PutMany(0, {7, 8}, 0x43)
            .PutMany(0, {9}, 0x81)
            .Keys(kGetMany, 0, {1, 9, 2, 3, 7})
            .Keys(kGetMany, 1, {1, 2, 4})
            .Get(1, 4)
            .bytes);

  // Raw requests, serialized as clients send them.
  wire::LookupRequest lookup;
  *lookup.add_keys() = Key(1);
  wire::PutBlockRequest put;
  *put.mutable_key() = Key(1);
  put.set_length(4096);
  std::string block(4096, '\0');
  wire::GetBlockRequest get;
  *get.mutable_key() = Key(1);
  wire::LoadRequest load;
  *load.add_keys() = Key(1);
  wire::EchoRequest echo;
  echo.set_body("hello");
  echo.set_payload_bytes(16);
  Write("node_requests", "raw",
        Steps()
            .Raw(kPut, 0, put.SerializeAsString(), 4096)
            .Raw(kLookup, 0, lookup.SerializeAsString(), 0)
            .Raw(kLoad, 0, load.SerializeAsString(), 0)
            .Raw(kGet, 0, get.SerializeAsString(), 0)
            .Raw(kRelease, 0, load.SerializeAsString(), 0)
            .Raw(kTouch, 0, load.SerializeAsString(), 0)
            .Raw(kEcho, 0, echo.SerializeAsString(), 0)
            .bytes);
  std::string unknown;
  Append<uint8_t>(unknown, Op(kAnyMethod, 0));
  Append<uint16_t>(unknown, 2);  // PrepareStore of version 1
  Append<uint16_t>(unknown, 0);
  Append<uint16_t>(unknown, 0);
  Write("node_requests", "old-method", unknown);
}

// ---- worker_requests ------------------------------------------------------------------------

void WorkerRequests() {
  using worker::Dump;
  Write("worker_requests", "request", R"({"prompt": [1, 2, 3], "max_tokens": 8})");
  Write("worker_requests", "request-all",
        R"({"model": "tiny-llama", "prompt": [[5, 17, 3]], "max_tokens": 1048576, )"
        R"("stream": true, "temperature": 0})");
  Write("worker_requests", "request-text", R"({"prompt": "hello", "max_tokens": 0})");
  Write("worker_requests", "request-line", "POST /v1/completions HTTP/1.1\n{\"prompt\": [1]}");
  worker::Completion completion;
  completion.id = "cmpl-1";
  completion.model = "tiny-llama";
  completion.tokens = {5, 17, 3};
  completion.finish_reason = "length";
  completion.usage.prompt_tokens = 3;
  completion.usage.completion_tokens = 3;
  Write("worker_requests", "completion", Dump(worker::CompletionJson(completion, 1700000000)));
  worker::WorkerInfo info;
  info.model = "tiny-llama";
  info.fingerprint = 0x1234;
  info.block_size = 16;
  Write("worker_requests", "models", Dump(worker::ModelsJson(info, 1700000000)));
  Write("worker_requests", "totals", Dump(worker::TotalsJson(worker::WorkerTotals{})));
  Write("worker_requests", "error",
        Dump(worker::ErrorJson(400, "invalid_prompt", "\"prompt\" is missing", "prompt")));
}

// ---- daemon_config --------------------------------------------------------------------------

void DaemonConfigs() {
  Write("daemon_config", "every-setting", R"(listen = "127.0.0.1"
port = 7373
tls = "shm,tcp"
block-bytes = "256KiB"
cpu-bytes = "1GiB"
cpu-policy = "arc"
ssd-dir = "/var/lib/kvstash"
ssd-bytes = "100GiB"
ssd-policy = "lru"
cascade = "write-back"
ssd-sync = true
auth-token = "secret"
max-keys-per-request = 4096
max-message-bytes = "4MiB"
max-payload-bytes = "64MiB"
log-level = "warn"
metrics-address = "127.0.0.1:7374"
lease-timeout-ms = 30000
spin-us = 200
progress-threads = 2
namespace-quota = ["tenant-a=256MiB", "tenant-b=512MiB"]
default-namespace-quota = "128MiB"
etcd = "http://127.0.0.1:2379,http://127.0.0.2:2379"
cluster = "local"
advertise = "10.0.0.5:7373"
etcd-ttl-s = 10
)");
  Write("daemon_config", "small", "cpu-bytes = \"64KiB\"\nblock-bytes = \"4KiB\"\n");
  Write("daemon_config", "sections", "# comment\n[default]\nport=0\nmetrics-address = \"off\"\n");
  Write("daemon_config", "bad", "cpu-bytes = 12 monkeys\nunknown-setting = 1\n");
}

// ---- traces ---------------------------------------------------------------------------------

void Traces(const fs::path& example) {
  std::ifstream in(example, std::ios::binary);
  const std::string policy((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (policy.empty()) std::fprintf(stderr, "cannot read %s\n", example.c_str());
  Write("traces", "policy-lru", policy);
  Write("traces", "policy-arc",
        "policy arc\ncapacity 3\nthreshold 2\ntracker 16\nstore 1 2\ncommit 1 2\n"
        "lookup 1 2 3\ntouch 2\nstore 3 4 5\nstate\nevents\nreset\n");
  Write("traces", "mooncake",
        R"({"timestamp": 0, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, 48]})"
        "\n"
        R"({"timestamp": 27482, "input_length": 1024, "output_length": 4, "hash_ids": [46, 49]})"
        "\n\n"
        R"({"timestamp": 27483.5, "input_length": 0, "output_length": 0, "hash_ids": []})"
        "\n");
}

// KV event batches: a node's (a wide hash as bytes, a group), one with every field a worker
// fills, and an empty one.
void KvEvents() {
  using namespace events;
  BlockStored node_stored;
  node_stored.block_hashes = {std::string(16, '\x5a'), uint64_t{42}};
  node_stored.medium = std::string(kMediumCpu);
  node_stored.group_idx = 1;
  BlockStored worker_stored;
  worker_stored.block_hashes = {uint64_t{7}};
  worker_stored.parent_block_hash = uint64_t{6};
  worker_stored.token_ids = {1, 2, 3, 70000};
  worker_stored.block_size = 16;
  worker_stored.medium = std::string(kMediumGpu);
  worker_stored.group_idx = 2;
  worker_stored.kv_cache_spec_kind = "sliding_window";
  worker_stored.kv_cache_spec_sliding_window = 4096;
  BlockRemoved removed{{uint64_t{42}}, std::string(kMediumSsd), 1};
  Write("kv_events", "node",
        EncodeBatch(KvEventBatch{1.7e9, {AllBlocksCleared{}, node_stored, removed}, std::nullopt}));
  Write("kv_events", "worker", EncodeBatch(KvEventBatch{1.7e9, {worker_stored}, 0}));
  Write("kv_events", "empty", EncodeBatch(KvEventBatch{0, {}, std::nullopt}));
}

}  // namespace
}  // namespace kvstash::fuzz

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CORPUS_DIR (tests/fuzz/corpus)\n", argv[0]);
    return 2;
  }
  using namespace kvstash::fuzz;
  g_root = argv[1];
  Frames();
  Hellos();
  NodeRequests();
  WorkerRequests();
  DaemonConfigs();
  Traces(g_root / ".." / ".." / "data" / "policy" / "example.trace");
  KvEvents();
  return 0;
}
