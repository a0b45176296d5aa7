// Fuzz target `hello`: what a node reads on a client's bootstrap socket before the client is
// anybody: a 4-byte length, the wire.Hello it frames (proto/wire.proto), and the node's checks
// of it (protocol version, then the tokens: CheckHelloToken,
// transport/include/kvstash/transport/admission.h, then the client's UCX worker address:
// CheckPeerWorkerAddress, transport/ucx/src/worker_address.h), under four token settings; and the
// whole input as a UCX worker address. It follows HelloAcceptor::OnHello
// (transport/ucx/src/rpc_server_connections.cc) up to the UCX endpoint it opens, which needs UCX;
// the loopback transport runs the same checks. The same bytes are also read as the wire.HelloReply
// a client reads from a node.
//
// Checked besides the sanitizers: what the tokens let in (a namespace with its own token only
// with that token; any other with the node's token when it has one, else only when no namespace
// has a token), and that an accepted hello's reply reads back.

#include <fmt/format.h>
#include <google/protobuf/stubs/logging.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "bootstrap.h"
#include "fuzz_check.h"
#include "kvstash/common/status.h"
#include "kvstash/proto/wire.pb.h"
#include "kvstash/transport/admission.h"
#include "kvstash/transport/rpc.h"
#include "worker_address.h"

namespace kvstash::transport {
namespace {

constexpr std::string_view kNodeToken = "node-token";

// A node's own UCX worker address, as UCX 1.13 on Debian 12 packs it (its default transports:
// posix, sysv, self, tcp, cma): what a client's address is checked against. The seeds' addresses
// are other workers' of the same UCX, so they share its transports.
constexpr uint8_t kNodeAddress[] = {
    0x20, 0x91, 0xad, 0x4c, 0xc8, 0x81, 0x93, 0x42, 0x8c, 0x20, 0x00, 0x63, 0x75, 0x77, 0xcc, 0x2b,
    0x32, 0x00, 0xf8, 0xd7, 0x4f, 0x00, 0x00, 0x00, 0x00, 0x00, 0x4f, 0x03, 0x00, 0x88, 0xd1, 0xad,
    0x5a, 0xc8, 0x78, 0xcd, 0x03, 0x3c, 0x21, 0x12, 0x01, 0x02, 0x09, 0x16, 0xd5, 0xff, 0x7d, 0xcf,
    0xd5, 0xf6, 0xf9, 0xff, 0xff, 0xef, 0x00, 0x00, 0x00, 0x00, 0xcf, 0x19, 0x17, 0xb7, 0x51, 0x38,
    0x53, 0x9e, 0x3e, 0x4b, 0xd7, 0xe0, 0x37, 0x37, 0x01, 0x13, 0x23, 0x00, 0x82, 0x8c, 0x83, 0x21,
    0x06, 0x00, 0x02, 0xc0, 0x00, 0x02, 0x02, 0xcf, 0x19, 0x17, 0xb7, 0x51, 0x38, 0x97, 0x63, 0x34,
    0x4b, 0xd7, 0xe0, 0x37, 0x37, 0x00, 0x13, 0x23, 0x00, 0x82, 0xe3, 0x13, 0x42, 0x08, 0x09, 0x16,
    0xd5, 0xff, 0x7d, 0xcf, 0xd5, 0x76, 0x8d, 0x53, 0x77, 0xcc, 0x2b, 0x32, 0x00, 0x4c, 0x3e, 0x50,
    0x77, 0xcc, 0xab, 0x33, 0x00, 0x4f, 0x23, 0x00, 0x88, 0x34, 0x80, 0x8c, 0x00, 0x00, 0x00, 0x00,
    0x00, 0x43, 0x08, 0x09, 0x16, 0xd5, 0xff, 0x7d, 0xcf, 0xd5, 0x76, 0xa7, 0xd3, 0x77, 0xcc, 0x2b,
    0x32, 0x00, 0x4c, 0x3e, 0x50, 0x77, 0xcc, 0xab, 0x33, 0x00, 0x4f, 0x23, 0x00, 0x88, 0x59, 0x7c,
    0x00, 0x80, 0x03, 0x00, 0x00, 0xc0, 0x24, 0x88, 0x09, 0x16, 0xd5, 0xff, 0x7d, 0xcf, 0xd5, 0x76,
    0x47, 0x8b, 0xbd, 0x37, 0x06, 0x36, 0x00, 0x24, 0x2e, 0x50, 0x77, 0xcc, 0xab, 0x33, 0x00, 0x92,
    0x21, 0x00, 0x84, 0x59, 0x7c, 0x00, 0x00,
};

// `bytes` in a heap block of exactly their size, so that a read past them is an overflow
// AddressSanitizer reports (a std::string's spare capacity would hide it).
std::unique_ptr<std::byte[]> ExactCopy(std::string_view bytes) {
  auto copy = std::make_unique<std::byte[]>(bytes.size());
  std::memcpy(copy.get(), bytes.data(), bytes.size());
  return copy;
}

// A client's UCX worker address against the node's (transport/ucx/src/worker_address.h): read
// within its bytes, refused with a message or accepted.
Status CheckAddress(std::string_view address) {
  const auto copy = ExactCopy(address);
  const std::span<const std::byte> peer(copy.get(), address.size());
  const Result<WorkerAddressShape> shape = ParseWorkerAddress(peer);
  const Status checked = CheckPeerWorkerAddress(peer, std::as_bytes(std::span(kNodeAddress)));
  // An accepted address reads whole, and a refusal says why.
  if (checked.ok()) KVSTASH_FUZZ_CHECK(shape.ok() && !shape->interfaces.empty());
  if (!checked.ok()) KVSTASH_FUZZ_CHECK(!checked.message().empty());
  return checked;
}

// The node's token settings: none; a node token; namespace tokens only; both.
ServerOptions Settings(int which) {
  ServerOptions options;
  if (which & 1) options.auth_token = std::string(kNodeToken);
  if (which & 2) options.tenant_tokens = {{"tenant-a", "token-a"}, {"tenant-b", "token-b"}};
  options.service_limits = "node limits";
  return options;
}

// The node's answer to a hello body, as OnHello decides it: OK to open the UCX endpoint, or why
// the client is refused.
Status Decide(const ServerOptions& options, const std::string& body, wire::Hello* hello) {
  if (!hello->ParseFromString(body)) {
    return InvalidArgumentError("unparseable hello of {} bytes", body.size());
  }
  if (hello->protocol_version() != wire::PROTOCOL_VERSION_CURRENT) {
    return FailedPreconditionError("protocol version {} is not the node's {}",
                                   hello->protocol_version(),
                                   static_cast<int>(wire::PROTOCOL_VERSION_CURRENT));
  }
  KVSTASH_RETURN_IF_ERROR(CheckHelloToken(options, hello->namespace_(), hello->auth_token()));
  // The client's UCX worker address, before UCX unpacks it.
  return CheckAddress(hello->worker_address());
}

// What the tokens must have let in.
void CheckAdmission(const ServerOptions& options, const wire::Hello& hello) {
  const auto own = options.tenant_tokens.find(hello.namespace_());
  if (own != options.tenant_tokens.end()) {
    KVSTASH_FUZZ_CHECK(hello.auth_token() == own->second);
  } else if (!options.auth_token.empty()) {
    KVSTASH_FUZZ_CHECK(hello.auth_token() == options.auth_token);
  } else {
    KVSTASH_FUZZ_CHECK(options.tenant_tokens.empty());
  }
}

void HelloOnNode(const ServerOptions& options, const std::string& body) {
  wire::Hello hello;
  const Status decided = Decide(options, body, &hello);
  wire::HelloReply reply;
  reply.set_protocol_version(wire::PROTOCOL_VERSION_CURRENT);
  reply.set_service_limits(options.service_limits);
  if (!decided.ok()) {
    // The refusal's log line quotes the client's name and namespace, escaped and cut short.
    const std::string line =
        fmt::format("refused a client: {} (client {:?}, namespace {:?})", decided.ToString(),
                    std::string_view(hello.client_name()).substr(0, 64),
                    std::string_view(hello.namespace_()).substr(0, 64));
    KVSTASH_FUZZ_CHECK(!line.empty());
    reply.mutable_error()->set_code(static_cast<wire::Code>(decided.code()));
    reply.mutable_error()->set_message(std::string(decided.message()));
  } else {
    CheckAdmission(options, hello);
    reply.set_connection_id(uint64_t{0x1234} << 32 | 1);
  }
  wire::HelloReply read;
  KVSTASH_FUZZ_CHECK(read.ParseFromString(reply.SerializeAsString()));
  KVSTASH_FUZZ_CHECK(read.has_error() == !decided.ok());
}

// The same bytes as a node's reply, read as a client reads it (RpcClient's OnHelloReply).
void HelloReplyOnClient(const std::string& body) {
  wire::HelloReply reply;
  if (!reply.ParseFromString(body)) return;
  if (reply.has_error() && reply.error().code() != wire::OK) {
    const Status refused(static_cast<StatusCode>(reply.error().code()),
                         fmt::format("refused the connection: {}", reply.error().message()));
    KVSTASH_FUZZ_CHECK(!refused.ToString().empty());
  }
}

void FuzzHello(std::span<const uint8_t> input) {
  // The whole input as a worker address too: the fuzzer then mutates an address byte by byte
  // (the seeds include real ones, seed-address-*).
  (void)CheckAddress(fuzz::AsText(input));
  // The bootstrap framing (AsyncReadMessage): a length, then that many bytes; a socket that
  // closes first never gets to a hello.
  if (input.size() < 4) return;
  const uint32_t length = fuzz::Take<uint32_t>(input);
  if (length > kMaxBootstrapMessageBytes || input.size() < length) return;
  const std::string body(fuzz::AsText(input.first(length)));
  for (int which = 0; which < 4; ++which) HelloOnNode(Settings(which), body);
  HelloReplyOnClient(body);
}

}  // namespace
}  // namespace kvstash::transport

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // protobuf logs every string field that is not UTF-8: thousands of lines a second.
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kvstash::transport::FuzzHello(std::span<const uint8_t>(data, size));
  return 0;
}
