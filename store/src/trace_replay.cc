#include "kvstash/store/trace_replay.h"

#include <charconv>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "fmt/format.h"
#include "kvstash/store/block_manager.h"

namespace kvstash::store {
namespace {

std::vector<std::string_view> Split(std::string_view line) {
  std::vector<std::string_view> words;
  size_t i = 0;
  while (i < line.size()) {
    while (i < line.size() && (line[i] == ' ' || line[i] == '\t' || line[i] == '\r')) ++i;
    size_t j = i;
    while (j < line.size() && line[j] != ' ' && line[j] != '\t' && line[j] != '\r') ++j;
    if (j > i) words.push_back(line.substr(i, j - i));
    i = j;
  }
  return words;
}

std::optional<uint64_t> ParseNumber(std::string_view word) {
  uint64_t value = 0;
  if (word.empty() || word[0] < '0' || word[0] > '9') return std::nullopt;
  auto [end, ec] = std::from_chars(word.data(), word.data() + word.size(), value);
  if (ec != std::errc() || end != word.data() + word.size()) return std::nullopt;
  return value;
}

// A trace key is block hash K (low 64 bits), group 0, namespace 0.
BlockKey TraceKey(uint64_t k) { return BlockKey{BlockHash{k, 0}, 0, 0}; }

std::string JoinKeys(const std::vector<BlockKey>& keys) {
  std::string out;
  for (size_t i = 0; i < keys.size(); ++i) {
    if (i > 0) out += ',';
    out += std::to_string(keys[i].hash.lo);
  }
  return out;
}

std::string JoinBlocks(const std::vector<BlockInfo>& blocks, char separator) {
  std::string out;
  for (size_t i = 0; i < blocks.size(); ++i) {
    if (i > 0) out += separator;
    out += fmt::format("{}:{}", blocks[i].key.hash.lo, blocks[i].ref_count);
  }
  return out;
}

char ResultChar(LookupResult r) {
  switch (r) {
    case LookupResult::kHit:
      return '1';
    case LookupResult::kRetry:
      return '?';
    case LookupResult::kMiss:
      break;
  }
  return '0';
}

std::string ScanString(const ScanResult& r) { return r ? std::to_string(*r) : "?"; }

class Replayer {
 public:
  explicit Replayer(std::ostream& out) : out_(out) {}

  Status Line(size_t number, std::string_view text) {
    line_ = number;
    if (size_t hash = text.find('#'); hash != std::string_view::npos) text = text.substr(0, hash);
    std::vector<std::string_view> words = Split(text);
    if (words.empty()) return Status::OK();
    const std::string_view op = words[0];
    std::span<const std::string_view> args(words.begin() + 1, words.end());
    if (op == "policy" || op == "capacity" || op == "threshold" || op == "tracker") {
      return Header(op, args);
    }
    if (!manager_) KVSTASH_RETURN_IF_ERROR(Start(op));
    return Operation(op, args);
  }

 private:
  template <typename... Args>
  Status Error(fmt::format_string<Args...> format, Args&&... args) {
    return InvalidArgumentError("line {}: {}", line_,
                                fmt::format(format, std::forward<Args>(args)...));
  }

  Status Header(std::string_view name, std::span<const std::string_view> args) {
    if (manager_) return Error("'{}' must come before the first operation", name);
    if (args.size() != 1) return Error("'{}' takes exactly one value", name);
    if (name == "policy") {
      auto policy = ParseEvictionPolicy(args[0]);
      if (!policy.ok()) return Error("{}", policy.status().message());
      options_.policy = *policy;
      have_policy_ = true;
      return Status::OK();
    }
    std::optional<uint64_t> value = ParseNumber(args[0]);
    if (!value) return Error("'{}' needs an unsigned integer, not '{}'", name, args[0]);
    if (name == "capacity") {
      options_.capacity_blocks = *value;
      have_capacity_ = true;
    } else if (name == "threshold") {
      if (*value > UINT32_MAX) return Error("threshold {} is too large", *value);
      options_.store_threshold = static_cast<uint32_t>(*value);
    } else {
      options_.max_tracker_size = *value;
    }
    return Status::OK();
  }

  Status Start(std::string_view op) {
    if (!have_policy_) {
      return Error("'policy lru|arc|aflru' must come before the first operation");
    }
    if (!have_capacity_) return Error("'capacity N' must come before the first operation");
    options_.enable_events = true;
    auto manager = BlockManager::Create(options_);
    if (!manager.ok()) return Error("{}", manager.status().message());
    manager_ = std::move(manager).value();
    return Status::OK();
  }

  Status ParseKeys(std::span<const std::string_view> words, std::vector<BlockKey>* keys) {
    keys->clear();
    for (std::string_view w : words) {
      std::optional<uint64_t> k = ParseNumber(w);
      if (!k) return Error("'{}' is not a key (an unsigned 64-bit decimal integer)", w);
      keys->push_back(TraceKey(*k));
    }
    return Status::OK();
  }

  Status NoArguments(std::string_view op, std::span<const std::string_view> args) {
    if (!args.empty()) return Error("'{}' takes no arguments", op);
    return Status::OK();
  }

  Status Operation(std::string_view op, std::span<const std::string_view> args) {
    std::vector<BlockKey> keys;
    if (op == "lookup") {
      KVSTASH_RETURN_IF_ERROR(ParseKeys(args, &keys));
      std::string line;
      for (size_t i = 0; i < keys.size(); ++i) {
        if (i > 0) line += ' ';
        line += ResultChar(manager_->Lookup(keys[i]));
      }
      return Print(line);
    }
    if (op == "prefix") {
      KVSTASH_RETURN_IF_ERROR(ParseKeys(args, &keys));
      return Print(ScanString(manager_->LookupPrefix(keys)));
    }
    if (op == "window") {
      std::optional<uint64_t> window = args.empty() ? std::nullopt : ParseNumber(args[0]);
      if (!window || *window == 0) return Error("'window' needs a window size W >= 1 first");
      KVSTASH_RETURN_IF_ERROR(ParseKeys(args.subspan(1), &keys));
      return Print(ScanString(manager_->LookupWindow(keys, *window)));
    }
    if (op == "store") {
      KVSTASH_RETURN_IF_ERROR(ParseKeys(args, &keys));
      StorePlan plan;
      Status status = manager_->PrepareStore(keys, &plan);
      if (status.code() == StatusCode::kResourceExhausted) return Print("refused");
      if (!status.ok()) return Error("{}", status.ToString());
      return Print(
          fmt::format("store={} evict={}", JoinKeys(plan.keys_to_store), JoinKeys(plan.evicted)));
    }
    if (op == "commit" || op == "abort") {
      KVSTASH_RETURN_IF_ERROR(ParseKeys(args, &keys));
      manager_->CompleteStore(keys, op == "commit");
      return Print("ok");
    }
    if (op == "load" || op == "unload") {
      KVSTASH_RETURN_IF_ERROR(ParseKeys(args, &keys));
      std::vector<SlotId> slots;
      Status status =
          op == "load" ? manager_->PrepareLoad(keys, &slots) : manager_->CompleteLoad(keys);
      return Print(status.ok() ? std::string("ok") : fmt::format("error {}", status.message()));
    }
    if (op == "touch" || op == "refresh") {
      KVSTASH_RETURN_IF_ERROR(ParseKeys(args, &keys));
      manager_->Touch(keys, op == "touch" ? TouchKind::kUse : TouchKind::kRefresh);
      return Print("ok");
    }
    if (op == "events") {
      KVSTASH_RETURN_IF_ERROR(NoArguments(op, args));
      std::string line;
      for (const OffloadEvent& e : manager_->TakeEvents()) {
        if (!line.empty()) line += ' ';
        line += e.kind == OffloadEvent::Kind::kStored ? "stored:" : "removed:";
        line += JoinKeys(e.keys);
      }
      return Print(line.empty() ? "-" : line);
    }
    if (op == "state") {
      KVSTASH_RETURN_IF_ERROR(NoArguments(op, args));
      BlockManagerState s = manager_->DebugState();
      if (s.policy == EvictionPolicy::kLru) {
        std::string blocks = JoinBlocks(s.lru, ' ');
        return Print(blocks.empty() ? "lru" : "lru " + blocks);
      }
      if (s.policy == EvictionPolicy::kAfLru) {
        std::string line = fmt::format("aflru clock={}", s.af_clock);
        for (size_t k = 0; k < 3; ++k) {
          line += fmt::format(" c{}=", k + 1);
          for (size_t i = 0; i < s.af[k].size(); ++i) {
            if (i > 0) line += ',';
            line += fmt::format("{}:{}@{}", s.af[k][i].key.hash.lo, s.af[k][i].ref_count,
                                s.af_touched[k][i]);
          }
        }
        return Print(line + fmt::format(" ghosts={}", s.af_ghosts.size()));
      }
      return Print(fmt::format("arc p={:.6f} t1={} t2={} b1={} b2={}", s.arc_target,
                               JoinBlocks(s.t1, ','), JoinBlocks(s.t2, ','), JoinKeys(s.b1),
                               JoinKeys(s.b2)));
    }
    if (op == "reset") {
      KVSTASH_RETURN_IF_ERROR(NoArguments(op, args));
      manager_->Reset();
      return Print("ok");
    }
    return Error("unknown operation '{}'", op);
  }

  Status Print(std::string_view line) {
    out_ << line << '\n';
    if (!out_) return InternalError("line {}: writing the transcript failed", line_);
    return Status::OK();
  }

  std::ostream& out_;
  size_t line_ = 0;
  BlockManagerOptions options_;
  bool have_policy_ = false;
  bool have_capacity_ = false;
  std::unique_ptr<BlockManager> manager_;
};

}  // namespace

Status ReplayTrace(std::istream& in, std::ostream& out) {
  Replayer replayer(out);
  std::string line;
  size_t number = 0;
  while (std::getline(in, line)) {
    KVSTASH_RETURN_IF_ERROR(replayer.Line(++number, line));
  }
  if (in.bad()) return InternalError("reading the trace failed after line {}", number);
  return Status::OK();
}

}  // namespace kvstash::store
