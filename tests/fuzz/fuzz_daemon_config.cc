// Fuzz target `daemon_config`: the TOML file of `kvstashd --config` (node/daemon/daemon_config.cc):
// CLI11's reader and the daemon's validation of every setting (sizes, ports, quotas, the etcd
// registration). A config is the operator's, not the network's, but a bad one must be refused
// with a message (exit 2), never crash the daemon.
//
// Input: the file's text.
//
// Checked besides the sanitizers: nothing throws past ParseDaemonConfig (kvstashd's main catches
// CLI11's parse errors only), and a refusal says why.

#include <cstddef>
#include <cstdint>
#include <span>

#include "daemon_config.h"
#include "fuzz_check.h"

namespace kvstash::node {
namespace {

void FuzzConfig(std::span<const uint8_t> input) {
  DaemonFlags flags;
  const Status parsed = ParseDaemonConfig(fuzz::AsText(input), &flags);
  if (!parsed.ok()) {
    KVSTASH_FUZZ_CHECK(parsed.code() == StatusCode::kInvalidArgument);
    KVSTASH_FUZZ_CHECK(!parsed.message().empty());
    return;
  }
  // The token files name paths to read (the fuzzer could name /dev/zero): they are read files,
  // not parsed text, so they are left out.
  flags.auth_token_file.clear();
  flags.namespace_token_file.clear();
  Result<NodeOptions> options = ToNodeOptions(flags);
  if (!options.ok()) {
    KVSTASH_FUZZ_CHECK(!options.status().message().empty());
    return;
  }
  KVSTASH_FUZZ_CHECK(options->store.block_bytes >= 4096);
  KVSTASH_FUZZ_CHECK(options->store.cpu_capacity_blocks >= 1);
  auto registration = RegistrationOf(flags, *options, static_cast<uint16_t>(flags.port));
  if (!registration.ok()) KVSTASH_FUZZ_CHECK(!registration.status().message().empty());
  (void)MetricsAddress(flags);
}

}  // namespace
}  // namespace kvstash::node

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kvstash::node::FuzzConfig(std::span<const uint8_t>(data, size));
  return 0;
}
