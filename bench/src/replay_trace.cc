#include "replay_trace.h"

#include <fmt/format.h>

#include <nlohmann/json.hpp>
#include <string>

namespace kvstash::bench {

Result<std::vector<TraceRequest>> ParseReplayTrace(std::istream& in, std::string_view name,
                                                   int64_t limit) {
  using Json = nlohmann::ordered_json;
  std::vector<TraceRequest> requests;
  std::string line;
  for (size_t number = 1; std::getline(in, line); ++number) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    if (limit > 0 && static_cast<int64_t>(requests.size()) >= limit) break;
    const Json doc = Json::parse(line, nullptr, /*allow_exceptions=*/false);
    auto bad = [&](std::string_view why) {
      return InvalidArgumentError("{}:{}: {}", name, number, why);
    };
    if (doc.is_discarded()) return bad("not a JSON object");
    if (!doc.is_object()) return bad("not a JSON object");
    TraceRequest r;
    for (const char* field : {"timestamp", "input_length", "output_length", "hash_ids"}) {
      if (!doc.contains(field)) return bad(fmt::format("no \"{}\"", field));
    }
    if (!doc["timestamp"].is_number() || doc["timestamp"].get<double>() < 0) {
      return bad("\"timestamp\" is not a number of milliseconds >= 0");
    }
    r.timestamp_ms = doc["timestamp"].get<double>();
    for (const char* field : {"input_length", "output_length"}) {
      if (!doc[field].is_number_unsigned()) {
        return bad(fmt::format("\"{}\" is not a count >= 0", field));
      }
    }
    r.input_length = doc["input_length"].get<uint64_t>();
    r.output_length = doc["output_length"].get<uint64_t>();
    if (!doc["hash_ids"].is_array()) return bad("\"hash_ids\" is not a list");
    r.hash_ids.reserve(doc["hash_ids"].size());
    for (const Json& id : doc["hash_ids"]) {
      if (!id.is_number_unsigned()) return bad("\"hash_ids\" holds something not an id >= 0");
      r.hash_ids.push_back(id.get<uint64_t>());
    }
    requests.push_back(std::move(r));
  }
  if (in.bad()) return InternalError("reading trace '{}' failed", name);
  return requests;
}

}  // namespace kvstash::bench
