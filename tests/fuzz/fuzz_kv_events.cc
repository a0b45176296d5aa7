// Fuzz target `kv_events`: a KV event batch as a router or any subscriber decodes it from the
// network (events/src/kv_events.cc: DecodeBatch, its shape check before msgpack-c allocates).
//
// Input: the batch's bytes.
//
// Checked besides the sanitizers: a batch DecodeBatch accepts encodes (EncodeBatch, in vLLM's
// array layout) to bytes that decode to the same batch.

#include <cstddef>
#include <cstdint>
#include <span>

#include "fuzz_check.h"
#include "kvstash/events/kv_events.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvstash::events;
  const auto bytes = std::as_bytes(std::span(data, size));
  kvstash::Result<KvEventBatch> batch = DecodeBatch(bytes, 1 << 20);
  if (!batch.ok()) return 0;
  const std::string again = EncodeBatch(*batch);
  kvstash::Result<KvEventBatch> back = DecodeBatch(std::as_bytes(std::span(again)), 64 << 20);
  KVSTASH_FUZZ_CHECK(back.ok());
  // NaN timestamps compare unequal to themselves; everything else must match.
  if (batch->ts == batch->ts) KVSTASH_FUZZ_CHECK(*back == *batch);
  return 0;
}
