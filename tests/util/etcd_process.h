#pragma once

// A real etcd (Debian's etcd-server) for multi-process tests: one member on loopback ports it
// picks, its data in a temporary directory. Stop() and Start() again keep the data, as an etcd
// restarted by its operator does.

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <thread>

#include "subprocess.h"
#include "temp_dir.h"

namespace kvstash::testing {

inline const std::string kEtcd = "/usr/bin/etcd";

// A free loopback TCP port (bound and released: a tiny window for another process to take it).
inline uint16_t FreeLoopbackPort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = 0;
  socklen_t length = sizeof(address);
  uint16_t port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) == 0) {
    port = ntohs(address.sin_port);
  }
  ::close(fd);
  return port;
}

// A free loopback TCP port below the kernel's ephemeral range, for a server that must get the
// same port back when it restarts: a port of the ephemeral range may meanwhile be another
// connection's local port (etcd's restart failed with "address already in use" that way).
inline uint16_t StableLoopbackPort() {
  int ephemeral_low = 32768;
  std::ifstream("/proc/sys/net/ipv4/ip_local_port_range") >> ephemeral_low;
  const int low = 10000, high = std::max(low + 1000, ephemeral_low);
  std::random_device random;
  for (int attempt = 0; attempt < 100; ++attempt) {
    const uint16_t port = static_cast<uint16_t>(low + random() % (high - low));
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    address.sin_port = htons(port);
    const bool free = ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0;
    ::close(fd);
    if (free) return port;
  }
  return FreeLoopbackPort();
}

class EtcdProcess {
 public:
  EtcdProcess() : client_port_(StableLoopbackPort()), peer_port_(StableLoopbackPort()) {}
  ~EtcdProcess() { Stop(); }

  static bool Installed() { return std::filesystem::exists(kEtcd); }

  // Start() for a test's set-up: the failure says why (not installed, or etcd's log).
  ::testing::AssertionResult Started() {
    if (!Installed()) {
      return ::testing::AssertionFailure()
             << "etcd-server is not installed (scripts/lib/setup.sh installs it)";
    }
    if (!Start()) return ::testing::AssertionFailure() << "etcd did not start: " << log();
    return ::testing::AssertionSuccess();
  }

  // Starts etcd and waits until it answers; false when it did not.
  bool Start() {
    const std::string client = "http://127.0.0.1:" + std::to_string(client_port_);
    const std::string peer = "http://127.0.0.1:" + std::to_string(peer_port_);
    ChildOptions options;
    options.output = ChildOptions::Output::kMemory;
    options.merge_stderr = true;
    auto child =
        ChildProcess::Create({kEtcd, "--name", "kvstash-test", "--data-dir", dir_ / "data",
                              "--listen-client-urls", client, "--advertise-client-urls", client,
                              "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                              "--initial-cluster", "kvstash-test=" + peer, "--log-level", "error"},
                             options);
    if (!child.ok()) return false;
    child_ = std::move(*child);
    // Ready once a read through the gateway answers.
    for (int i = 0; i < 200; ++i) {
      auto out = RunProgram(
          {"curl", "-sf", "-m", "1", client + "/v3/kv/range", "-d", R"({"key":"AA=="})"});
      if (out.ok() && out->exit_code == 0) return true;
      if (child_->Exited()) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return false;
  }
  void Stop() {
    if (child_ != nullptr) child_->Kill(SIGTERM);
    child_.reset();
  }
  std::string endpoint() const { return "http://127.0.0.1:" + std::to_string(client_port_); }
  std::string log() const { return child_ != nullptr ? child_->Output() : std::string(); }

 private:
  TempDir dir_;
  uint16_t client_port_;
  uint16_t peer_port_;
  std::unique_ptr<ChildProcess> child_;
};

}  // namespace kvstash::testing
