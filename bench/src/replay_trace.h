#pragma once

// The request trace `kvstash bench replay` replays: Mooncake's public JSONL format. Apart from
// the benchmark so that its fuzz target (tests/fuzz/fuzz_traces.cc) reads traces without the
// benchmark's clients.

#include <cstdint>
#include <istream>
#include <string_view>
#include <vector>

#include "kvstash/common/status.h"

namespace kvstash::bench {

// One request of the trace.
struct TraceRequest {
  double timestamp_ms = 0;
  uint64_t input_length = 0;
  uint64_t output_length = 0;
  std::vector<uint64_t> hash_ids;
};

// Reads a trace from `in`: one JSON object per line with timestamp (ms), input_length,
// output_length and hash_ids (block ids; equal leading ids are a shared prefix). Blank lines are
// skipped; at most `limit` requests are read (0: all). InvalidArgument "NAME:LINE: why" for a
// malformed line (`name` says where the text came from); Internal when reading fails.
Result<std::vector<TraceRequest>> ParseReplayTrace(std::istream& in, std::string_view name,
                                                   int64_t limit);

}  // namespace kvstash::bench
