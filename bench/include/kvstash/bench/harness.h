// Helpers shared by the `kvstash bench` subcommands: byte-count flags, medians and ratios, JSON
// and table formatting. (The external tools each bench compares against run through
// kvstash/common/subprocess.h.)
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kvstash/common/byte_units.h"
#include "kvstash/common/cli.h"
#include "kvstash/common/status.h"
#include "kvstash/common/subprocess.h"
#include "nlohmann/json.hpp"

namespace kvstash::bench {

using cli::kExitFailure;
using cli::kExitOk;
using cli::kExitUsage;

// GB/s (1e9 bytes/s) for `bytes` moved in `elapsed`; 0 for an empty interval.
double Gbps(uint64_t bytes, std::chrono::steady_clock::duration elapsed);

// This machine's own limit for moving blocks through memory: GB/s of one thread copying
// `block_bytes` blocks into the slots of a region of `working_set_bytes` (at most 1 GiB), in a
// scattered order, as a node's tier receives them. The median of `rounds` rounds.
double CopyLimitGbps(size_t block_bytes, size_t working_set_bytes, int rounds = 5);

// The median; the mean of the middle two for an even count. Preconditions: !values.empty().
double Median(std::vector<double> values);

// The value at rank ceil(p/100 * n) of the sorted values (nearest-rank percentile), for p in
// (0, 100]. Preconditions: !values.empty().
double Percentile(std::vector<double> values, double p);

// value / reference, or nullopt when there is no positive reference.
std::optional<double> Ratio(double value, std::optional<double> reference);

// Ordered, so a bench's JSON lists its fields in the order its table shows them.
using Json = nlohmann::ordered_json;

Json OrNull(std::optional<double> v);

// "1.23", or "-" for a missing figure.
std::string Fixed(std::optional<double> v);

}  // namespace kvstash::bench
