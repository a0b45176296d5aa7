// Fuzz target `traces`: the two trace readers, each on every input: the policy trace of
// `kvstash trace` (store/src/trace_replay.cc, which also replays it through a BlockManager) and
// the Mooncake JSONL trace of `kvstash bench replay` (bench/src/replay_trace.cc). A trace is a
// user's file, not the network's, but a malformed one must be refused naming its line, never
// crash the tool.
//
// Input: the trace's text.
//
// Checked besides the sanitizers: a refusal names its line (a policy trace's error, "line N:",
// is the first malformed line, after the transcript of those before it), and a JSONL trace read
// whole has a request for every line that is not blank.

#include <charconv>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>

#include "fuzz_check.h"
#include "kvstash/store/trace_replay.h"
#include "replay_trace.h"

namespace kvstash {
namespace {

// The most blocks a fuzzed policy trace may ask for (`capacity N`, `tracker N`): `kvstash trace`
// builds the manager it is asked for (up to 2^31 blocks), which would spend the fuzzer's memory
// rather than test the reader.
constexpr uint64_t kMaxBlocks = 1 << 16;

bool AsksForALargeManager(std::string_view text) {
  std::istringstream words{std::string(text)};
  std::string word, previous;
  while (words >> word) {
    if (previous == "capacity" || previous == "tracker") {
      uint64_t value = 0;
      const auto [end, error] = std::from_chars(word.data(), word.data() + word.size(), value);
      if (error != std::errc() || value > kMaxBlocks) return true;
    }
    previous = word;
  }
  return false;
}

void PolicyTrace(std::string_view text) {
  if (AsksForALargeManager(text)) return;
  std::istringstream in{std::string(text)};
  std::ostringstream transcript;
  const Status replayed = store::ReplayTrace(in, transcript);
  if (!replayed.ok()) {
    KVSTASH_FUZZ_CHECK(replayed.code() == StatusCode::kInvalidArgument);
    KVSTASH_FUZZ_CHECK(replayed.message().starts_with("line "));
  }
}

void MooncakeTrace(std::string_view text) {
  std::istringstream in{std::string(text)};
  Result<std::vector<bench::TraceRequest>> trace = bench::ParseReplayTrace(in, "fuzz", 0);
  if (!trace.ok()) {
    KVSTASH_FUZZ_CHECK(trace.status().code() == StatusCode::kInvalidArgument);
    KVSTASH_FUZZ_CHECK(trace.status().message().starts_with("fuzz:"));
    return;
  }
  size_t lines = 0;
  std::istringstream again{std::string(text)};
  for (std::string line; std::getline(again, line);) {
    if (line.find_first_not_of(" \t\r") != std::string::npos) ++lines;
  }
  KVSTASH_FUZZ_CHECK(trace->size() == lines);
  for (const bench::TraceRequest& request : *trace) KVSTASH_FUZZ_CHECK(request.timestamp_ms >= 0);
}

}  // namespace
}  // namespace kvstash

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  kvstash::PolicyTrace(text);
  kvstash::MooncakeTrace(text);
  return 0;
}
