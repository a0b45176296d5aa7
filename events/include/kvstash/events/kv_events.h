// KV events in vLLM's schema (vllm/distributed/kv_events.py): what a cache says it now holds or
// no longer holds, in the batches a ZMQ publisher sends (publisher.h). The one encoding and the
// one decoding of them in kvstash; docs/semantics.md §19 says which fields kvstash fills.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <ostream>
#include <span>
#include <string>
#include <variant>
#include <vector>

#include "kvstash/common/hash.h"
#include "kvstash/common/status.h"

namespace kvstash::events {

// vLLM's ExternalBlockHash: an integer or bytes. An integer is kept as its 64 bits (a negative
// msgpack integer by its two's complement).
using ExternalHash = std::variant<uint64_t, std::string>;

// The media kvstash names: a worker's own prefix cache, a node's CPU tier and its SSD tier.
inline constexpr std::string_view kMediumGpu = "GPU";
inline constexpr std::string_view kMediumCpu = "CPU";
inline constexpr std::string_view kMediumSsd = "SSD";

// Field for field vLLM's BlockStored, in its order.
struct BlockStored {
  std::vector<ExternalHash> block_hashes;
  std::optional<ExternalHash> parent_block_hash;
  std::vector<int64_t> token_ids;
  int64_t block_size = 0;
  std::optional<int64_t> lora_id;
  std::optional<std::string> medium;
  std::optional<std::string> lora_name;
  // vLLM's extra_keys (one entry per block, of any shape) is not kept: it is encoded as nil and
  // skipped when decoded.
  std::optional<int64_t> group_idx;
  std::optional<std::string> kv_cache_spec_kind;
  std::optional<int64_t> kv_cache_spec_sliding_window;

  friend bool operator==(const BlockStored&, const BlockStored&) = default;
};

struct BlockRemoved {
  std::vector<ExternalHash> block_hashes;
  std::optional<std::string> medium;
  std::optional<int64_t> group_idx;

  friend bool operator==(const BlockRemoved&, const BlockRemoved&) = default;
};

struct AllBlocksCleared {
  friend bool operator==(const AllBlocksCleared&, const AllBlocksCleared&) = default;
};

using KvEvent = std::variant<BlockStored, BlockRemoved, AllBlocksCleared>;

// One line for logs and test failures: "BlockStored(hashes=[1, 0x0a0b], medium=CPU, group=2)".
std::string DebugString(const KvEvent& event);
// gtest's printers.
inline void PrintTo(const BlockStored& e, std::ostream* os) { *os << DebugString(KvEvent(e)); }
inline void PrintTo(const BlockRemoved& e, std::ostream* os) { *os << DebugString(KvEvent(e)); }
inline void PrintTo(const AllBlocksCleared& e, std::ostream* os) { *os << DebugString(KvEvent(e)); }

// Seconds since the Unix epoch, as a batch's ts.
double NowSeconds();

// vLLM's KVEventBatch.
struct KvEventBatch {
  double ts = 0;  // seconds since the Unix epoch
  std::vector<KvEvent> events;
  std::optional<int64_t> data_parallel_rank;

  friend bool operator==(const KvEventBatch&, const KvEventBatch&) = default;
};

// msgpack exactly as vLLM's msgspec encoder writes a KVEventBatch: array-like structs (fields in
// declaration order, trailing fields that hold their defaults left out), each event an array
// whose first element is its tag, the class name.
std::string EncodeBatch(const KvEventBatch& batch);

// Reads a batch in that layout, or in the map layout (msgspec structs without array_like: field
// names as keys, the tag under "type"). Every field is checked for its type; unknown map keys
// and extra trailing array fields are skipped. InvalidArgument naming what is wrong otherwise
// (not msgpack, an unknown tag, a field of the wrong type, data after the batch); never aborts,
// whatever the bytes. Input over `max_bytes` is refused unread.
inline constexpr size_t kMaxBatchBytes = 64 << 20;
Result<KvEventBatch> DecodeBatch(std::span<const std::byte> bytes,
                                 size_t max_bytes = kMaxBatchBytes);

// A kvstash key's hash as events name it: an integer when its upper 64 bits are 0, else 16
// bytes, big-endian (docs/semantics.md §19).
ExternalHash ExternalHashOf(const Hash128& hash);

// Blocks of one group a cache stored or removed (or the AllBlocksCleared that starts over), as a
// node's events carry them: for EncodeRuns.
struct BlockRun {
  enum class Kind : uint8_t { kStored, kRemoved, kAllCleared };
  Kind kind = Kind::kStored;
  std::string_view medium;
  int64_t group = 0;
  std::span<const Hash128> hashes;  // ExternalHashOf each
  // A stored run's parent_block_hash (ExternalHashOf it; none: None) and block_size: a chain's,
  // where the client said what its blocks hold; else none and 0.
  std::optional<Hash128> parent;
  int64_t block_size = 0;
};

// The bytes of EncodeBatch for a batch of one event per run, without building the events: a
// stored run is a BlockStored with the run's parent and block size and no tokens, a removed run
// a BlockRemoved, both with `group` as group_idx.
std::string EncodeRuns(double ts, std::span<const BlockRun> runs);

// The 8-byte big-endian sequence number frame of a publisher's messages and replay requests.
std::string EncodeSequence(int64_t sequence);
// InvalidArgument unless exactly 8 bytes.
Result<int64_t> DecodeSequence(std::span<const std::byte> bytes);

}  // namespace kvstash::events
