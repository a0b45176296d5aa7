#include "kvstash/common/block_key.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <utility>

namespace kvstash {

std::string BlockKey::ToString() const {
  std::string text = hash.hi != 0 ? fmt::format("0x{:x}{:016x}", hash.hi, hash.lo)
                                  : fmt::format("0x{:x}", hash.lo);
  if (group != 0) text += fmt::format("/g{}", group);
  if (namespace_id != 0) text += fmt::format("@ns{}", namespace_id);
  return text;
}

Result<BlockKey> ParseBlockKey(std::string_view text) {
  auto bad = [&](std::string_view why) {
    return InvalidArgumentError(
        "key '{}' {} (expected a hash in hex 0x... or decimal, optionally /gGROUP)", text, why);
  };
  BlockKey key;
  std::string_view hash = text;
  if (const size_t slash = text.find('/'); slash != std::string_view::npos) {
    hash = text.substr(0, slash);
    std::string_view group = text.substr(slash + 1);
    if (!group.starts_with("g")) return bad("has a group without the g prefix");
    group.remove_prefix(1);
    auto [end, ec] = std::from_chars(group.data(), group.data() + group.size(), key.group);
    if (ec != std::errc() || end != group.data() + group.size() || group.empty()) {
      return bad("has a group that is not a number");
    }
  }
  if (hash.starts_with("0x") || hash.starts_with("0X")) {
    hash.remove_prefix(2);
    if (hash.empty() || hash.size() > 32) return bad("is not a hex hash of 1 to 32 digits");
    const size_t lo_digits = std::min<size_t>(hash.size(), 16);
    const std::string_view lo = hash.substr(hash.size() - lo_digits);
    const std::string_view hi = hash.substr(0, hash.size() - lo_digits);
    for (auto [part, out] : {std::pair{lo, &key.hash.lo}, std::pair{hi, &key.hash.hi}}) {
      if (part.empty()) continue;
      auto [end, ec] = std::from_chars(part.data(), part.data() + part.size(), *out, 16);
      if (ec != std::errc() || end != part.data() + part.size()) return bad("is not hex");
    }
    return key;
  }
  auto [end, ec] = std::from_chars(hash.data(), hash.data() + hash.size(), key.hash.lo);
  if (hash.empty() || ec != std::errc() || end != hash.data() + hash.size()) {
    return bad("is not a number");
  }
  return key;
}

}  // namespace kvstash
