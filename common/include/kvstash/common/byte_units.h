// Byte counts as people write them on command lines and in config files.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "kvstash/common/status.h"

namespace kvstash {

// Parses "262144", "256K", "2MiB", "1G", "1TiB": an integer with an optional power-of-two
// suffix. InvalidArgument naming `what` (a flag or setting) otherwise.
Result<uint64_t> ParseBytes(std::string_view what, std::string_view text);

// "256 KiB", "2 MiB", "1 GiB" for whole multiples, else "1000 B".
std::string FormatBytes(uint64_t bytes);

}  // namespace kvstash
