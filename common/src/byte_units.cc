#include "kvstash/common/byte_units.h"

#include <fmt/format.h>

#include <limits>

namespace kvstash {

Result<uint64_t> ParseBytes(std::string_view what, std::string_view text) {
  auto bad = [&](std::string_view why) {
    return InvalidArgumentError(
        "{}: '{}' {} (expected an integer with an optional suffix K, M, G, T, KiB, MiB, GiB or "
        "TiB, "
        "e.g. 256K or 2MiB)",
        what, text, why);
  };
  size_t digits = 0;
  while (digits < text.size() && text[digits] >= '0' && text[digits] <= '9') ++digits;
  if (digits == 0) return bad("is not a byte count");
  uint64_t value = 0;
  for (size_t i = 0; i < digits; ++i) {
    const uint64_t d = static_cast<uint64_t>(text[i] - '0');
    if (value > (std::numeric_limits<uint64_t>::max() - d) / 10) return bad("is too large");
    value = value * 10 + d;
  }
  const std::string_view suffix = text.substr(digits);
  int shift = 0;
  if (suffix.empty()) {
    shift = 0;
  } else if (suffix == "K" || suffix == "k" || suffix == "KiB") {
    shift = 10;
  } else if (suffix == "M" || suffix == "MiB") {
    shift = 20;
  } else if (suffix == "G" || suffix == "GiB") {
    shift = 30;
  } else if (suffix == "T" || suffix == "TiB") {
    shift = 40;
  } else {
    return bad(fmt::format("has an unknown suffix '{}'", suffix));
  }
  if (shift > 0 && value > (std::numeric_limits<uint64_t>::max() >> shift)) {
    return bad("is too large");
  }
  return value << shift;
}

std::string FormatBytes(uint64_t bytes) {
  if (bytes != 0 && bytes % (uint64_t{1} << 40) == 0) return fmt::format("{} TiB", bytes >> 40);
  if (bytes != 0 && bytes % (uint64_t{1} << 30) == 0) return fmt::format("{} GiB", bytes >> 30);
  if (bytes != 0 && bytes % (uint64_t{1} << 20) == 0) return fmt::format("{} MiB", bytes >> 20);
  if (bytes != 0 && bytes % (uint64_t{1} << 10) == 0) return fmt::format("{} KiB", bytes >> 10);
  return fmt::format("{} B", bytes);
}

}  // namespace kvstash
