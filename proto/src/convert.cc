#include "kvstash/proto/convert.h"

#include <string>

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

void ToWire(const kvstash::BlockMeta& meta, uint32_t group, wire::BlockMeta* out) {
  out->set_tokens(meta.tokens);
  if (meta.parent) ToWire(BlockKey{*meta.parent, group}, out->mutable_parent());
  out->set_kind(static_cast<wire::BlockMeta::Kind>(meta.kind));
  out->set_window_blocks(meta.window_blocks);
  out->set_at_hit_end(meta.at_hit_end);
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

void ToWire(const Status& status, BlockResult* out) {
  out->set_code(static_cast<Code>(status.code()));
  if (!status.ok()) out->set_message(std::string(status.message()));
}

Status StatusFromWire(const BlockResult& result) {
  const int code = static_cast<int>(result.code());
  if (code == 0) return Status::OK();
  if (code < 0 || code > static_cast<int>(StatusCode::kUnauthenticated)) {
    return Status(StatusCode::kUnknown,
                  "status code " + std::to_string(code) + " unknown here: " + result.message());
  }
  return Status(static_cast<StatusCode>(code), result.message());
}

}  // namespace kvstash::wire
