// Fuzz target `hello`: what a node reads on a client's bootstrap socket before the client is
// anybody: a 4-byte length, the wire.Hello it frames (proto/wire.proto), and the node's checks
// of it (protocol version, then the tokens: CheckHelloToken, transport/src/hello.h), under four
// token settings. It follows RpcServer::Impl::OnHello (transport/src/ucx/rpc_server_connections.cc)
// up to the UCX endpoint it opens, which needs UCX; the loopback transport runs the same checks.
// The same bytes are also read as the wire.HelloReply a client reads from a node.
//
// Checked besides the sanitizers: what the tokens let in (a namespace with its own token only
// with that token; any other with the node's token when it has one, else only when no namespace
// has a token), and that an accepted hello's reply reads back.

#include <fmt/format.h>
#include <google/protobuf/stubs/logging.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>

#include "bootstrap.h"
#include "fuzz_check.h"
#include "hello.h"
#include "kvstash/common/status.h"
#include "kvstash/proto/wire.pb.h"
#include "kvstash/transport/rpc.h"

namespace kvstash::transport {
namespace {

constexpr std::string_view kNodeToken = "node-token";

// The node's token settings: none; a node token; namespace tokens only; both.
ServerOptions Settings(int which) {
  ServerOptions options;
  if (which & 1) options.auth_token = std::string(kNodeToken);
  if (which & 2) options.namespace_tokens = {{"tenant-a", "token-a"}, {"tenant-b", "token-b"}};
  options.block_bytes = 4096;
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
  // The client's UCX worker address, before UCX unpacks it (issue 29, item 2): the node's check
  // of it goes here, so that this target drives it with every address the fuzzer makes. Until
  // then the address is only carried.
  return Status::OK();
}

// What the tokens must have let in.
void CheckAdmission(const ServerOptions& options, const wire::Hello& hello) {
  const auto own = options.namespace_tokens.find(hello.namespace_());
  if (own != options.namespace_tokens.end()) {
    KVSTASH_FUZZ_CHECK(hello.auth_token() == own->second);
  } else if (!options.auth_token.empty()) {
    KVSTASH_FUZZ_CHECK(hello.auth_token() == options.auth_token);
  } else {
    KVSTASH_FUZZ_CHECK(options.namespace_tokens.empty());
  }
}

void HelloOnNode(const ServerOptions& options, const std::string& body) {
  wire::Hello hello;
  const Status decided = Decide(options, body, &hello);
  wire::HelloReply reply;
  reply.set_protocol_version(wire::PROTOCOL_VERSION_CURRENT);
  reply.set_block_bytes(options.block_bytes);
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
