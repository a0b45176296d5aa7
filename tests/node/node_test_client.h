#pragma once

// A test's view of a node: wire-level calls over an RpcClient, or a StreamClient for a node of
// kvstashd --transport stream (tls "stream"), with blocks of FillPattern(key).

#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "block_pattern.h"
#include "kvstash/common/hash.h"
#include "kvstash/proto/wire.pb.h"
#include "kvstash/transport/rpc.h"
#include "kvstash/transport/stream.h"

namespace kvstash::testing {

inline wire::Key WireKey(uint64_t k, uint32_t group = 0) {
  wire::Key key;
  key.set_hash_lo(k);
  key.set_hash_hi(k * 7 + 1);
  key.set_group(group);
  return key;
}

class NodeTestClient {
 public:
  NodeTestClient(uint16_t port, const std::string& ns, const std::string& token,
                 const std::string& tls, size_t block_bytes)
      : block_bytes_(block_bytes) {
    transport::ClientOptions options;
    options.port = port;
    options.auth_token = token;
    options.tenant = ns;
    if (tls == "stream") {
      auto stream = transport::StreamClient::Create(options);
      EXPECT_TRUE(stream.ok()) << stream.status().ToString();
      if (stream.ok()) stream_ = std::move(*stream);
      return;
    }
    options.transport.tls = tls;
    auto client = transport::RpcClient::Create(options);
    EXPECT_TRUE(client.ok()) << client.status().ToString();
    if (client.ok()) client_ = std::move(*client);
  }

  transport::RpcClient& rpc() { return *client_; }
  bool ok() const { return client_ != nullptr || stream_ != nullptr; }

  template <typename Request, typename Reply>
  Status Call(wire::Method method, const Request& request, Reply* reply,
              transport::CallOptions options = {}, size_t* payload = nullptr) {
    options.deadline = transport::Clock::now() + std::chrono::seconds(10);
    const std::string bytes = request.SerializeAsString();
    std::vector<std::byte> out;
    const Status status =
        stream_ ? StreamCall(static_cast<uint16_t>(method), std::as_bytes(std::span(bytes)),
                             options, &out, payload)
                : client_->CallSync(static_cast<uint16_t>(method), std::as_bytes(std::span(bytes)),
                                    options, &out, payload);
    if (status.ok() && reply != nullptr &&
        !reply->ParseFromArray(out.data(), static_cast<int>(out.size()))) {
      return InternalError("unparseable reply");
    }
    return status;
  }

  // PutBlock (pattern k, with its checksum) per key: each call stores its block whole.
  void Store(const std::vector<uint64_t>& ks) {
    std::vector<std::byte> block(block_bytes_);
    for (uint64_t k : ks) {
      FillPattern(k, block);
      wire::PutBlockRequest put;
      *put.mutable_key() = WireKey(k);
      put.set_length(block_bytes_);
      put.set_checksum(Xxh3Hash64(block));
      transport::CallOptions options;
      options.send_payload = block;
      const Status s = Call(wire::METHOD_PUT_BLOCK, put, (wire::PutBlockReply*)nullptr, options);
      ASSERT_TRUE(s.ok()) << s.ToString();
    }
  }

  std::vector<wire::LookupResult> PerKey(const std::vector<uint64_t>& ks) {
    wire::LookupRequest request;
    for (uint64_t k : ks) *request.add_keys() = WireKey(k);
    wire::LookupReply reply;
    EXPECT_TRUE(Call(wire::METHOD_LOOKUP, request, &reply).ok());
    std::vector<wire::LookupResult> out;
    for (int r : reply.results()) out.push_back(static_cast<wire::LookupResult>(r));
    return out;
  }

  // Loads, reads and releases key k; true when its bytes are FillPattern(k).
  bool ReadBack(uint64_t k) {
    wire::LoadRequest load;
    *load.add_keys() = WireKey(k);
    wire::LoadReply loaded;
    if (!Call(wire::METHOD_LOAD, load, &loaded).ok() || loaded.pinned_size() != 1 ||
        !loaded.pinned(0)) {
      return false;
    }
    std::vector<std::byte> out(block_bytes_);
    wire::GetBlockRequest get;
    *get.mutable_key() = WireKey(k);
    transport::CallOptions options;
    options.recv_payload = out;
    size_t payload = 0;
    const bool got =
        Call(wire::METHOD_GET_BLOCK, get, (wire::GetBlockReply*)nullptr, options, &payload).ok();
    wire::ReleaseRequest release;
    *release.add_keys() = WireKey(k);
    (void)Call(wire::METHOD_RELEASE, release, (wire::ReleaseReply*)nullptr);
    return got && payload == block_bytes_ && MatchesPattern(k, out);
  }

 private:
  Status StreamCall(uint16_t method, transport::Bytes request,
                    const transport::CallOptions& options, std::vector<std::byte>* out,
                    size_t* payload) {
    std::promise<Status> done;
    stream_->Call(method, request, options, [&](const transport::Response& r) {
      out->assign(r.message.begin(), r.message.end());
      if (payload != nullptr) *payload = r.payload_bytes;
      done.set_value(r.status);
    });
    return done.get_future().get();
  }

  size_t block_bytes_;
  std::unique_ptr<transport::RpcClient> client_;
  std::unique_ptr<transport::StreamClient> stream_;  // when tls is stream
};

}  // namespace kvstash::testing
