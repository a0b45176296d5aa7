// The one conversion between the shared vocabulary (kvstash/common/block_key.h) and the wire's
// messages. Every client and server goes through here.
#pragma once

#include "kvstash/common/block_key.h"
#include "kvstash/common/status.h"
#include "kvstash/proto/wire.pb.h"

namespace kvstash::wire {

// The key on the wire: hash and group. The namespace never travels (it is the connection's;
// docs/semantics.md §18).
Key ToWire(const BlockKey& key);
void ToWire(const BlockKey& key, Key* out);
// The key of a request, in the namespace of the connection it came on.
BlockKey FromWire(const Key& key, NamespaceId namespace_id = 0);

// A block's metadata on the wire: its parent named as a key of `group`, the block's own.
void ToWire(const kvstash::BlockMeta& meta, uint32_t group, wire::BlockMeta* out);

wire::LookupResult ToWire(kvstash::LookupResult result);
// Values a newer peer may send read as kMiss, which is never wrong for a cache.
kvstash::LookupResult FromWire(wire::LookupResult result);

// A key's outcome in a batched call (BlockResult's code and message).
void ToWire(const Status& status, BlockResult* out);
// The status a BlockResult states. A code this build does not know (a newer or hostile peer)
// reads as Unknown, with the number in the message.
Status StatusFromWire(const BlockResult& result);

}  // namespace kvstash::wire
