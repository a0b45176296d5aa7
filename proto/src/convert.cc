#include "kvstash/proto/convert.h"

namespace kvstash::wire {

Key ToWire(const BlockKey& key) {
  Key out;
  ToWire(key, &out);
  return out;
}

void ToWire(const BlockKey& key, Key* out) {
  out->set_hash_lo(key.hash.lo);
  out->set_hash_hi(key.hash.hi);
  out->set_group(key.group);
}

BlockKey FromWire(const Key& key, NamespaceId namespace_id) {
  BlockKey out;
  out.hash.lo = key.hash_lo();
  out.hash.hi = key.hash_hi();
  out.group = key.group();
  out.namespace_id = namespace_id;
  return out;
}

wire::LookupResult ToWire(kvstash::LookupResult result) {
  switch (result) {
    case kvstash::LookupResult::kHit:
      return LOOKUP_HIT;
    case kvstash::LookupResult::kRetry:
      return LOOKUP_RETRY;
    case kvstash::LookupResult::kMiss:
      break;
  }
  return LOOKUP_MISS;
}

kvstash::LookupResult FromWire(wire::LookupResult result) {
  switch (result) {
    case LOOKUP_HIT:
      return kvstash::LookupResult::kHit;
    case LOOKUP_RETRY:
      return kvstash::LookupResult::kRetry;
    default:
      return kvstash::LookupResult::kMiss;
  }
}

}  // namespace kvstash::wire
