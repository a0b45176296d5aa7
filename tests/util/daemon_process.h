#pragma once

// A `kvstashd` child process for multi-process tests: on a port it picks (--port 0, read back
// from its start line), with small test sizes unless told otherwise.

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "programs.h"
#include "subprocess.h"

namespace kvstash::testing {

inline const std::string kKvstashd = KvstashdPath();

// A kvstashd child; port() is 0 when it did not start.
class Daemon {
 public:
  // With `sizes`, small test sizes (64 KiB blocks, 4 MiB of CPU tier) come before `args`.
  explicit Daemon(std::vector<std::string> args, bool sizes = true) {
    std::vector<std::string> argv = {kKvstashd,     "--port",      "0",   "--metrics-address",
                                     "127.0.0.1:0", "--log-level", "warn"};
    if (sizes) argv.insert(argv.end(), {"--block-bytes", "64KiB", "--cpu-bytes", "4MiB"});
    argv.insert(argv.end(), args.begin(), args.end());
    child_ = StartChild(argv);
    if (child_ == nullptr) return;
    // UCX may log on stdout first; the start line is the one that names the port.
    const std::string prefix = "kvstashd listening on 127.0.0.1:";
    for (int i = 0; i < 50; ++i) {
      std::optional<std::string> line = child_->ReadLine(10000);
      if (!line) break;
      if (line->rfind(prefix, 0) == 0) {
        port_ = static_cast<uint16_t>(std::stoi(line->substr(prefix.size())));
        const std::string metrics = "kvstashd metrics on http://127.0.0.1:";
        std::optional<std::string> next = child_->ReadLine(10000);
        if (next && next->rfind(metrics, 0) == 0) {
          metrics_port_ = static_cast<uint16_t>(std::stoi(next->substr(metrics.size())));
        }
        break;
      }
    }
  }
  uint16_t port() const { return port_; }
  uint16_t metrics_port() const { return metrics_port_; }
  ChildProcess& process() { return *child_; }

 private:
  std::unique_ptr<ChildProcess> child_;
  uint16_t port_ = 0;
  uint16_t metrics_port_ = 0;
};

}  // namespace kvstash::testing
