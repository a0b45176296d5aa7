// The check of a peer's UCX worker address (transport/ucx/src/worker_address.h), against real
// addresses of this machine's UCX: every valid one passes, every truncation and the garbage that
// once aborted a node (64 bytes of 0xff, "addr version 15") is refused with a message, and no
// mutation of a valid address makes the reader go past its bytes (AddressSanitizer would say).

#include "worker_address.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "worker.h"

namespace kvstash::transport {
namespace {

using ::testing::HasSubstr;

std::vector<std::byte> AddressOf(const std::string& tls) {
  TransportOptions options;
  options.tls = tls;
  auto worker = Worker::Create(options, "worker_address_test");
  EXPECT_TRUE(worker.ok()) << worker.status().ToString();
  if (!worker.ok()) return {};
  const std::string_view address = (*worker)->address();
  const auto* bytes = reinterpret_cast<const std::byte*>(address.data());
  return std::vector<std::byte>(bytes, bytes + address.size());
}

TEST(WorkerAddressTest, ReadsThisMachinesAddressesWhole) {
  for (const std::string tls : {"", "tcp", "shm", "shm,tcp"}) {
    SCOPED_TRACE("UCX_TLS=" + tls);
    const std::vector<std::byte> address = AddressOf(tls);
    Result<WorkerAddressShape> shape = ParseWorkerAddress(address);
    ASSERT_TRUE(shape.ok()) << shape.status().ToString();
    EXPECT_GT(shape->devices, 0u);
    EXPECT_FALSE(shape->interfaces.empty());
    EXPECT_NE(shape->worker_uuid, 0u);
    for (const AddressInterface& i : shape->interfaces) EXPECT_EQ(i.endpoint_addresses, 0u);
  }
}

TEST(WorkerAddressTest, APeerWithATransportInCommonPasses) {
  const std::vector<std::byte> node = AddressOf("");
  EXPECT_TRUE(CheckPeerWorkerAddress(AddressOf(""), node).ok());
  EXPECT_TRUE(CheckPeerWorkerAddress(AddressOf("tcp"), node).ok());
  EXPECT_TRUE(CheckPeerWorkerAddress(AddressOf("shm"), node).ok());
}

TEST(WorkerAddressTest, APeerWithNoTransportInCommonIsRefusedSayingSo) {
  const Status s = CheckPeerWorkerAddress(AddressOf("shm"), AddressOf("tcp"));
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
  EXPECT_THAT(std::string(s.message()), HasSubstr("none of this node's transports"));
}

TEST(WorkerAddressTest, TheNodesOwnAddressIsRefused) {
  const std::vector<std::byte> node = AddressOf("");
  EXPECT_EQ(CheckPeerWorkerAddress(node, node).code(), StatusCode::kInvalidArgument);
}

TEST(WorkerAddressTest, GarbageThatAbortedANodeIsRefused) {
  const std::vector<std::byte> node = AddressOf("");
  const std::vector<std::byte> ff(64, std::byte{0xff});
  const Status s = CheckPeerWorkerAddress(ff, node);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("version 15"));
  EXPECT_EQ(CheckPeerWorkerAddress({}, node).code(), StatusCode::kInvalidArgument);
  std::mt19937 random(7);
  std::vector<std::byte> noise(300);
  for (int round = 0; round < 1000; ++round) {
    for (std::byte& b : noise) b = static_cast<std::byte>(random());
    EXPECT_FALSE(CheckPeerWorkerAddress(noise, node).ok());
  }
}

TEST(WorkerAddressTest, EveryTruncationAndExtensionIsRefused) {
  const std::vector<std::byte> node = AddressOf("");
  const std::vector<std::byte> peer = AddressOf("");
  for (size_t n = 0; n < peer.size(); ++n) {
    const std::vector<std::byte> cut(peer.begin(), peer.begin() + n);
    const Status s = CheckPeerWorkerAddress(cut, node);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << "cut at " << n;
  }
  std::vector<std::byte> longer = peer;
  longer.push_back(std::byte{0});
  const Status s = CheckPeerWorkerAddress(longer, node);
  EXPECT_THAT(std::string(s.message()), HasSubstr("after its end"));
}

TEST(WorkerAddressTest, MutatedAddressesAreReadWithinTheirBytes) {
  // Each copy is exactly as long as its bytes: a read past it is a heap overflow under ASan.
  const std::vector<std::byte> node = AddressOf("");
  const std::vector<std::byte> peer = AddressOf("");
  size_t passed = 0;
  for (size_t at = 0; at < peer.size(); ++at) {
    for (const int value : {0x00, 0x01, 0x1f, 0x20, 0x3f, 0x40, 0x7f, 0x80, 0xbf, 0xff}) {
      auto mutated = std::make_unique<std::byte[]>(peer.size());
      std::copy(peer.begin(), peer.end(), mutated.get());
      mutated[at] = static_cast<std::byte>(value);
      passed += CheckPeerWorkerAddress({mutated.get(), peer.size()}, node).ok() ? 1 : 0;
    }
  }
  // Many mutations change only a checksum, a name or an attribute UCX accepts; the point is
  // that none is read outside its bytes.
  EXPECT_GT(passed, 0u);
}

}  // namespace
}  // namespace kvstash::transport
