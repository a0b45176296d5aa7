#include "kvstash/store/offload_key.h"

#include "fmt/format.h"

namespace kvstash::store {

std::string OffloadKey::ToString() const {
  if (hash.hi == 0) return fmt::format("ns{}/g{}/0x{:x}", namespace_id, group, hash.lo);
  return fmt::format("ns{}/g{}/0x{:x}{:016x}", namespace_id, group, hash.hi, hash.lo);
}

}  // namespace kvstash::store
