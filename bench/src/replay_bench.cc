// `kvstash bench replay`: replays a request trace in Mooncake's public format against live
// offload nodes and measures them as a cache: block and token hit ratios next to what the
// node's own policy would reach in-process on the same trace at the same capacity (the model)
// and what an unbounded cache would (the trace's own reuse), with throughput and latencies.
//
// Per request, as an engine's connector drives the nodes (docs/semantics.md §7.3, §7.6):
//   1. a lookup of the request's block keys; the hit is the run of leading hits;
//   2. a touch of every key (the lookup's touch, the first key most recent);
//   3. a read of the hit blocks, each checked against the content its id defines;
//   4. a store of the full blocks after the hit (a node skips, and touches, those it holds): a
//      request's last block is full when input_length reaches its end (--store-partial stores
//      every block);
//   5. a touch of the hit blocks (the store decision's touch, without the keys just offered),
//      sent as the same request's touch after its stores (AF-LRU counts no second use).
// Touches are sent asynchronously, as the connector sends them.

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <thread>
#include <unordered_set>

#include "commands.h"
#include "kvstash/bench/harness.h"
#include "kvstash/common/hash.h"
#include "kvstash/common/token_file.h"
#include "kvstash/connector/node_client.h"
#include "kvstash/store/block_manager.h"
#include "replay_model.h"
#include "replay_trace.h"

namespace kvstash::bench {
namespace {
using connector::NodeClient;
using Clock = std::chrono::steady_clock;

struct BenchReplayFlags {
  std::string trace;
  connector::NodeSource source;
  std::string key_namespace = "replay";
  std::string token;
  std::string token_file;
  std::string tls;
  int concurrency = 1;
  double speed = 0;   // 0: as fast as possible
  int64_t limit = 0;  // 0: every request
  int block_tokens = 512;
  bool store_partial = false;  // store a request's last block even when it is not full
  std::string layout = "full";
  bool group_blind = false;
  // --model-only: the in-process model alone, over policies x capacities, no nodes.
  bool model_only = false;
  std::vector<std::string> policies;
  std::vector<size_t> capacities;
  std::vector<double> shares;
  std::string admission = "all";
  int timeout_ms = 5000;
  int lookup_budget_ms = 50;
  OutputOptions output;
};

// The trace at `path` (ParseReplayTrace); NotFound when the file cannot be read.
Result<std::vector<TraceRequest>> ReadTrace(const std::string& path, int64_t limit) {
  std::ifstream in(path);
  if (!in) return NotFoundError("cannot read trace '{}'", path);
  return ParseReplayTrace(in, path, limit);
}

// A block's content: 64-bit words start + i * step, start drawn from the id. A block read back
// under another id, shifted, torn or with any byte changed does not match.
constexpr uint64_t kStep = 0x9e3779b97f4a7c15ULL;
uint64_t ContentStart(uint64_t id) { return Mix64(id ^ 0x7265706c61790000ULL); }
void FillContent(uint64_t id, std::span<std::byte> block) {
  uint64_t word = ContentStart(id);
  size_t at = 0;
  for (; at + 8 <= block.size(); at += 8, word += kStep) std::memcpy(&block[at], &word, 8);
  for (size_t i = 0; at < block.size(); ++at, ++i) block[at] = std::byte(word >> (8 * i));
}
bool ContentMatches(uint64_t id, std::span<const std::byte> block) {
  uint64_t word = ContentStart(id);
  size_t at = 0;
  uint64_t diff = 0;
  for (; at + 8 <= block.size(); at += 8, word += kStep) {
    uint64_t got;
    std::memcpy(&got, &block[at], 8);
    diff |= got ^ word;
  }
  for (size_t i = 0; at < block.size(); ++at, ++i) {
    diff |= static_cast<uint64_t>(block[at] ^ std::byte(word >> (8 * i)));
  }
  return diff == 0;
}

// What every replaying thread adds up; the progress line reads it while they run.
struct Totals {
  std::atomic<uint64_t> requests{0}, block_refs{0}, blocks_hit{0}, tokens{0}, tokens_hit{0};
  std::atomic<uint64_t> blind_tokens_hit{0};
  std::atomic<uint64_t> blocks_read{0}, blocks_stored{0}, read_misses{0}, retries{0};
  std::atomic<uint64_t> errors{0}, mismatches{0};
};

// Per-thread latencies, merged at the end.
struct Latencies {
  std::vector<double> lookup_us, read_us, store_us;
};

class Replayer {
 public:
  Replayer(const BenchReplayFlags& flags, const ReplaySettings& settings,
           const std::vector<TraceRequest>& trace, uint64_t block_bytes, Totals* totals)
      : flags_(flags),
        settings_(settings),
        trace_(trace),
        block_bytes_(block_bytes),
        totals_(totals) {}

  // Replays requests taken in file order from `next` until none is left (with --speed, each
  // no earlier than its timestamp, scaled, after `start`). Returns the thread's latencies.
  Latencies Run(NodeClient& client, std::atomic<size_t>* next, Clock::time_point start) {
    Latencies latencies;
    std::vector<std::byte> scratch;
    for (size_t i; (i = next->fetch_add(1)) < trace_.size();) {
      if (flags_.speed > 0) {
        const auto due =
            start +
            std::chrono::duration_cast<Clock::duration>(
                std::chrono::duration<double, std::milli>(trace_[i].timestamp_ms / flags_.speed));
        std::this_thread::sleep_until(due);
      }
      ReplayOne(client, trace_[i], &latencies, &scratch);
    }
    return latencies;
  }

 private:
  static double Micros(Clock::time_point since) {
    return std::chrono::duration<double, std::micro>(Clock::now() - since).count();
  }

  // Whether the lookup must be asked again: a RETRY (a block being written or promoted from
  // SSD) where it decides the hit, as the connector defers a request. With one full group, a
  // RETRY that ends the leading run; with several groups, any RETRY.
  bool MustRetry(const std::vector<LookupResult>& states) const {
    if (settings_.layout.hybrid()) {
      return std::find(states.begin(), states.end(), LookupResult::kRetry) != states.end();
    }
    for (LookupResult s : states) {
      if (s != LookupResult::kHit) return s == LookupResult::kRetry;
    }
    return false;
  }

  void ReplayOne(NodeClient& client, const TraceRequest& r, Latencies* latencies,
                 std::vector<std::byte>* scratch) {
    RequestPlan plan(r, settings_);

    // 1. Lookup (asked again while a block that decides the hit is being written or promoted).
    const auto lookup_start = Clock::now();
    const auto give_up = lookup_start + std::chrono::milliseconds(flags_.timeout_ms);
    std::vector<LookupResult> states;
    for (auto pause = std::chrono::microseconds(100);;
         pause = std::min(pause * 2, std::chrono::microseconds(10000))) {
      states = client.Lookup(plan.lookup());
      if (!MustRetry(states)) break;
      totals_->retries.fetch_add(1, std::memory_order_relaxed);
      if (Clock::now() + pause > give_up) break;  // the RETRY counts as a miss
      std::this_thread::sleep_for(pause);
    }
    latencies->lookup_us.push_back(Micros(lookup_start));
    plan.Decide(states);

    // 2. The lookup's touch.
    client.Touch(plan.touch());

    // 3. Read the hit's blocks (every group's that the hit needs) and check them.
    const std::vector<BlockKey>& needed = plan.refresh();
    if (!needed.empty()) {
      scratch->resize(needed.size() * block_bytes_);
      std::vector<transport::MutableBytes> outs;
      for (size_t i = 0; i < needed.size(); ++i) {
        outs.push_back(std::span(*scratch).subspan(i * block_bytes_, block_bytes_));
      }
      const auto read_start = Clock::now();
      const std::vector<Result<size_t>> got =
          client.Get(needed, std::span<const transport::MutableBytes>(outs));
      latencies->read_us.push_back(Micros(read_start));
      uint64_t read = 0;
      for (size_t i = 0; i < needed.size(); ++i) {
        if (!got[i].ok()) {
          // Evicted since the lookup (by another thread's stores): a miss, not an error. Any
          // other failure is counted by the client as a call error.
          if (got[i].status().code() == StatusCode::kNotFound) {
            totals_->read_misses.fetch_add(1, std::memory_order_relaxed);
          }
          continue;
        }
        ++read;
        const uint64_t id = needed[i].hash.lo;
        if (*got[i] != block_bytes_ || !ContentMatches(id, outs[i])) {
          if (totals_->mismatches.fetch_add(1) == 0) {
            std::cerr << fmt::format(
                "\nkvstash bench replay: block {}{} read back wrong\n", id,
                needed[i].group == 0 ? "" : fmt::format(" of group {}", needed[i].group));
          }
        }
      }
      totals_->blocks_read.fetch_add(read, std::memory_order_relaxed);
    }

    // 4. Store the full blocks after the hit: the node skips (and touches) those it holds.
    const std::vector<BlockKey>& keys = plan.store();
    if (!keys.empty()) {
      scratch->resize(keys.size() * block_bytes_);
      std::vector<transport::Bytes> blocks;
      for (size_t i = 0; i < keys.size(); ++i) {
        auto block = std::span(*scratch).subspan(i * block_bytes_, block_bytes_);
        FillContent(plan.store_ids()[i], block);
        blocks.push_back(block);
      }
      const auto store_start = Clock::now();
      const Status put = plan.metas().empty() ? client.Put(keys, blocks)
                                              : client.PutWithMeta(keys, blocks, plan.metas());
      latencies->store_us.push_back(Micros(store_start));
      if (put.ok()) totals_->blocks_stored.fetch_add(keys.size(), std::memory_order_relaxed);
      // A failed put was counted by the client (a refusal or an unreachable node).
    }

    // 5. The store decision's touch: the hit's blocks without those just offered, sent as the
    // same request's touch after its stores.
    if (!needed.empty()) client.TouchAfterStore(needed);

    totals_->block_refs.fetch_add(plan.block_refs(), std::memory_order_relaxed);
    totals_->blocks_hit.fetch_add(plan.blocks_hit(), std::memory_order_relaxed);
    totals_->tokens.fetch_add(r.input_length, std::memory_order_relaxed);
    totals_->tokens_hit.fetch_add(plan.hit_tokens(), std::memory_order_relaxed);
    totals_->blind_tokens_hit.fetch_add(plan.blind_tokens(), std::memory_order_relaxed);
    totals_->requests.fetch_add(1, std::memory_order_relaxed);
  }

  const BenchReplayFlags& flags_;
  const ReplaySettings& settings_;
  const std::vector<TraceRequest>& trace_;
  const uint64_t block_bytes_;
  Totals* totals_;
};

// One node as the model sees it: its capacity and policy.
struct NodeShape {
  size_t capacity_blocks = 0;
  store::EvictionPolicy policy = store::EvictionPolicy::kLru;
  store::Admission admission = store::Admission::kAll;
  bool has_ssd = false;
};

// The hit ratio of a cache that never evicts: the leading run of ids seen before.
double InfiniteCacheHitRatio(const std::vector<TraceRequest>& trace) {
  std::unordered_set<uint64_t> seen;
  uint64_t refs = 0, hits = 0;
  for (const TraceRequest& r : trace) {
    size_t hit = 0;
    while (hit < r.hash_ids.size() && seen.contains(r.hash_ids[hit])) ++hit;
    refs += r.hash_ids.size();
    hits += hit;
    seen.insert(r.hash_ids.begin(), r.hash_ids.end());
  }
  return refs == 0 ? 0.0 : static_cast<double>(hits) / static_cast<double>(refs);
}

// The options of every replay client but its token and worker; InvalidArgument for a bad
// node source.
Result<connector::NodeClientOptions> ClientOptions(const BenchReplayFlags& flags) {
  connector::NodeClientOptions options;
  KVSTASH_RETURN_IF_ERROR(connector::ApplyNodeSource(flags.source, &options));
  options.key_namespace = flags.key_namespace;
  options.transport.tls = flags.tls;
  options.timeout = std::chrono::milliseconds(flags.timeout_ms);
  options.connect_timeout = std::min(options.timeout, std::chrono::milliseconds(2000));
  options.lookup_budget = std::chrono::milliseconds(flags.lookup_budget_ms);
  return options;
}

BenchSpec ReplaySpec() {
  BenchSpec spec;
  spec.name = "replay";
  spec.command = "kvstash bench replay";
  spec.title =
      "a request trace replayed against running offload nodes, as a cache against the "
      "nodes' own policy in-process and for speed against this machine's copy rate";
  spec.limit = "memcpy";
  spec.figures = {
      Higher("block_hit_ratio", "",
             "blocks hit / block references: per request and group the run of leading hits"),
      Higher("token_hit_ratio", "",
             "prompt tokens hit / prompt tokens: a hit of k blocks covers min(k x "
             "--block-tokens, input_length) tokens; with a hybrid --layout the usable hit, the "
             "longest every group accepts (docs/semantics.md §7.4)"),
      Higher("blind_token_hit_ratio", "",
             "what a group-blind count says: the full-attention group's leading run, in tokens "
             "(equal to token_hit_ratio with one full group)"),
      Higher("model_block_hit_ratio", "",
             "what block_hit_ratio should be: the trace replayed sequentially through a block "
             "manager per node (the policy and CPU capacity each node reports, keys placed as "
             "the client places them); at --concurrency 1 on fresh nodes without an SSD tier "
             "block_hit_ratio matches it, nodes with an SSD tier hit more"),
      Higher("model_token_hit_ratio", "", "the same model's token_hit_ratio"),
      Higher("infinite_cache_hit_ratio", "",
             "the hit ratio of a cache that never evicts: the trace's own reuse"),
      Higher("requests_per_s", "requests/s", "requests replayed per second"),
      Higher("gbps", "GB/s", "block bytes read and stored / the replay's wall time"),
      Lower("lookup_p50_us", "us",
            "median latency of a request's lookup (asked again while it answers RETRY)"),
      Lower("lookup_p99_us", "us", "its 99th percentile"),
      Lower("read_p50_us", "us", "median latency of reading a request's hit blocks"),
      Lower("read_p99_us", "us", "its 99th percentile"),
      Lower("store_p50_us", "us", "median latency of storing the blocks after a request's hit"),
      Lower("store_p99_us", "us", "its 99th percentile"),
      Higher("copy_limit_gbps", "GB/s",
             "the limit: this machine copying blocks of the nodes' size into a region the "
             "size of their CPU tiers (at most 1 GiB) in a scattered order, one thread"),
  };
  spec.ratios = {RatioOf("ratio", "gbps", "copy_limit_gbps")};
  return spec;
}

// The settings of every request's plan; InvalidArgument for an unknown layout.
Result<ReplaySettings> Settings(const BenchReplayFlags& flags) {
  ReplaySettings settings;
  KVSTASH_ASSIGN_OR_RETURN(settings.layout, ParseLayout(flags.layout));
  settings.block_tokens = static_cast<uint64_t>(flags.block_tokens);
  settings.store_partial = flags.store_partial;
  settings.group_blind = flags.group_blind;
  return settings;
}

// --model-only: the trace through the in-process model of one node per policy and capacity,
// printed as a table (or --json). No node is needed.
int RunModelOnly(const BenchReplayFlags& flags, const cli::ErrorReporter& reporter) {
  auto settings = Settings(flags);
  if (!settings.ok()) return reporter.Fail(kExitUsage, settings.status().message());
  if (flags.capacities.empty() && flags.shares.empty()) {
    return reporter.Fail(kExitUsage,
                         "--model-only needs --capacity-blocks or --capacity-share (or both)");
  }
  std::vector<store::EvictionPolicy> policies;
  for (const std::string& name :
       flags.policies.empty() ? std::vector<std::string>{"lru", "arc", "aflru"} : flags.policies) {
    auto policy = store::ParseEvictionPolicy(name);
    if (!policy.ok()) {
      return reporter.Fail(kExitUsage, fmt::format("--policy: {}", policy.status().message()));
    }
    policies.push_back(*policy);
  }
  const Result<store::Admission> admission = store::ParseAdmission(flags.admission);
  if (!admission.ok()) return reporter.Fail(kExitUsage, admission.status().message());
  auto trace = ReadTrace(flags.trace, flags.limit);
  if (!trace.ok()) {
    return reporter.Fail(
        trace.status().code() == StatusCode::kInvalidArgument ? kExitUsage : kExitFailure,
        trace.status().message());
  }
  const uint64_t working_set = WorkingSetBlocks(*trace, *settings);
  std::vector<std::pair<size_t, std::string>> capacities;  // blocks, how they were given
  for (size_t blocks : flags.capacities) capacities.emplace_back(blocks, "");
  for (double share : flags.shares) {
    if (!(share > 0 && share <= 1)) {
      return reporter.Fail(kExitUsage, fmt::format("--capacity-share: {} is not in (0, 1]", share));
    }
    capacities.emplace_back(
        std::max<size_t>(1, static_cast<size_t>(share * static_cast<double>(working_set))),
        fmt::format("{:g} of the working set", share));
  }
  Progress progress = Progress::ToStderr(flags.output.progress);
  nlohmann::json rows = nlohmann::json::array();
  std::string table = fmt::format("{:<7} {:>10}  {:>10} {:>10} {:>10}  {}\n", "policy", "blocks",
                                  "block hit", "token hit", "blind", "");
  const auto everyone = [](const BlockKey&, std::vector<size_t>* at) { *at = {0}; };
  for (const auto& [blocks, given] : capacities) {
    for (store::EvictionPolicy policy : policies) {
      progress.Update(fmt::format("{} at {} blocks", store::EvictionPolicyName(policy), blocks));
      store::BlockManagerOptions options;
      options.capacity_blocks = blocks;
      options.policy = policy;
      store::ApplyAdmission(*admission, &options);
      auto counts = ReplayModel(*trace, std::span(&options, 1), everyone, *settings);
      if (!counts.ok()) return reporter.Fail(kExitUsage, counts.status().message());
      rows.push_back({{"policy", store::EvictionPolicyName(policy)},
                      {"capacity_blocks", blocks},
                      {"block_hit_ratio", counts->block_hit_ratio()},
                      {"token_hit_ratio", counts->token_hit_ratio()},
                      {"blind_token_hit_ratio", counts->blind_token_hit_ratio()}});
      table += fmt::format("{:<7} {:>10}  {:>10.4f} {:>10.4f} {:>10.4f}  {}\n",
                           store::EvictionPolicyName(policy), blocks, counts->block_hit_ratio(),
                           counts->token_hit_ratio(), counts->blind_token_hit_ratio(), given);
    }
  }
  progress.Finish();
  const double infinite = InfiniteCacheHitRatio(*trace);
  if (flags.output.json) {
    nlohmann::json out = {{"bench", "replay-model"},
                          {"trace", flags.trace},
                          {"layout", settings->layout.name},
                          {"groups", DescribeLayout(settings->layout)},
                          {"group_blind", flags.group_blind},
                          {"stored_blocks", flags.store_partial ? "every block" : "full blocks"},
                          {"block_tokens", flags.block_tokens},
                          {"requests", trace->size()},
                          {"working_set_blocks", working_set},
                          {"infinite_cache_hit_ratio", infinite},
                          {"rows", rows}};
    std::cout << out.dump() << "\n";
  } else {
    std::cout << fmt::format(
        "{}: {} requests; layout {} ({}{}), {} stored, working set {} blocks; unbounded "
        "cache block hit ratio {:.4f}\n\n{}",
        flags.trace, trace->size(), settings->layout.name, DescribeLayout(settings->layout),
        flags.group_blind ? ", group-blind" : "",
        flags.store_partial ? "every block" : "full blocks", working_set, infinite, table);
  }
  return kExitOk;
}

int RunBenchReplay(const BenchReplayFlags& flags) {
  const cli::ErrorReporter reporter("kvstash bench replay");
  auto fail = [&reporter](int code, std::string_view message) {
    return reporter.Fail(code, message);
  };
  if (flags.model_only) return RunModelOnly(flags, reporter);
  auto settings = Settings(flags);
  if (!settings.ok()) return fail(kExitUsage, settings.status().message());
  Result<connector::NodeClientOptions> options = ClientOptions(flags);
  if (!options.ok()) return fail(kExitUsage, options.status().message());
  if (!(flags.speed >= 0) || !std::isfinite(flags.speed)) {
    return fail(kExitUsage, fmt::format("--speed: {} is not a factor >= 0", flags.speed));
  }
  if (flags.lookup_budget_ms < 1) {
    return fail(kExitUsage,
                fmt::format("--lookup-budget-ms: {} is not positive", flags.lookup_budget_ms));
  }
  if (flags.timeout_ms < 1) {
    return fail(kExitUsage, fmt::format("--timeout-ms: {} is not positive", flags.timeout_ms));
  }
  auto token = ResolveToken(flags.token, "--token", flags.token_file, "--token-file");
  if (!token.ok()) {
    return fail(token.status().code() == StatusCode::kInvalidArgument ? kExitUsage : kExitFailure,
                token.status().message());
  }
  auto trace = ReadTrace(flags.trace, flags.limit);
  if (!trace.ok()) {
    return fail(trace.status().code() == StatusCode::kInvalidArgument ? kExitUsage : kExitFailure,
                trace.status().message());
  }

  // The clients spread their connections over the process's workers, as connectors do.
  options->auth_token = *token;
  auto probe = NodeClient::Create(*options);
  if (!probe.ok()) return fail(kExitFailure, probe.status().message());
  NodeClient& client = **probe;

  // Every node's block size (they must agree: a block id has one content) and shape.
  uint64_t block_bytes = 0;
  std::vector<NodeShape> shapes;
  uint64_t resident = 0, capacity = 0;
  const std::vector<connector::NodeAddress> nodes = client.nodes();
  if (nodes.empty()) {
    return fail(kExitFailure,
                fmt::format("cluster {} has no live offload nodes in etcd", flags.source.cluster));
  }
  for (size_t n = 0; n < nodes.size(); ++n) {
    auto bytes = client.BlockBytes(nodes[n]);
    if (!bytes.ok()) return fail(kExitFailure, bytes.status().message());
    if (block_bytes != 0 && *bytes != block_bytes) {
      return fail(kExitFailure,
                  fmt::format("node {} stores blocks of {} bytes, node {} of {}: replay needs one "
                              "block size",
                              nodes[0].ToString(), block_bytes, nodes[n].ToString(), *bytes));
    }
    block_bytes = *bytes;
    auto counters = client.Stats(nodes[n]);
    if (!counters.ok()) return fail(kExitFailure, counters.status().message());
    auto value = [&](const char* name) {
      auto it = counters->find(name);
      return it == counters->end() ? uint64_t{0} : it->second;
    };
    NodeShape shape;
    shape.capacity_blocks = value("cpu.capacity_blocks");
    shape.policy = value("cpu.policy_arc") != 0     ? store::EvictionPolicy::kArc
                   : value("cpu.policy_aflru") != 0 ? store::EvictionPolicy::kAfLru
                                                    : store::EvictionPolicy::kLru;
    shape.has_ssd = value("ssd.capacity_blocks") != 0;
    shape.admission = value("cpu.admission_adaptive") != 0 ? store::Admission::kAdaptive
                      : value("cpu.reuse_filter_on") != 0  ? store::Admission::kFilter
                                                           : store::Admission::kAll;
    resident += value("cpu.resident_blocks") + value("ssd.resident_blocks");
    capacity += shape.capacity_blocks;
    shapes.push_back(shape);
  }
  if (resident != 0) {
    std::cerr << fmt::format(
        "kvstash bench replay: warning: the nodes hold {} block(s) already; the model starts "
        "empty, so their hit ratios may differ\n",
        resident);
  }
  const bool any_ssd =
      std::any_of(shapes.begin(), shapes.end(), [](const NodeShape& s) { return s.has_ssd; });
  std::vector<store::BlockManagerOptions> model_nodes;
  for (const NodeShape& shape : shapes) {
    store::BlockManagerOptions o;
    o.capacity_blocks = shape.capacity_blocks;
    o.policy = shape.policy;
    store::ApplyAdmission(shape.admission, &o);
    model_nodes.push_back(o);
  }
  // Each key's nodes (its replicas), as the client places it: indices of `nodes`.
  std::map<std::string, size_t> node_index;
  for (size_t n = 0; n < nodes.size(); ++n) node_index.emplace(nodes[n].ToString(), n);
  const Placement place = [&](const BlockKey& key, std::vector<size_t>* at) {
    at->clear();
    for (const connector::NodeAddress& node : client.PlacesOf(key)) {
      if (auto it = node_index.find(node.ToString()); it != node_index.end()) {
        at->push_back(it->second);
      }
    }
  };
  auto model = ReplayModel(*trace, model_nodes, place, *settings);
  if (!model.ok()) return fail(kExitFailure, model.status().message());
  const double infinite = InfiniteCacheHitRatio(*trace);

  Result<std::unique_ptr<Report>> created = Report::Create(ReplaySpec());
  if (!created.ok()) return fail(kExitFailure, created.status().ToString());
  Report& report = **created;
  Progress progress = Progress::ToStderr(flags.output.progress);
  Totals totals;
  uint64_t errors = 0;
  uint64_t repaired = 0;  // blocks copied to replicas that lacked them
  double seconds = 0;
  RoundSides sides;
  // The replay, once: a second would find the first's blocks.
  sides.measure = [&](Round& round) -> Status {
    Replayer replayer(flags, *settings, *trace, block_bytes, &totals);
    const connector::BlockStoreCounters before = client.counters();
    std::atomic<size_t> next{0};
    std::vector<Latencies> latencies(flags.concurrency);
    std::vector<std::unique_ptr<NodeClient>> clients;
    clients.push_back(std::move(*probe));
    for (int i = 1; i < flags.concurrency; ++i) {
      KVSTASH_ASSIGN_OR_RETURN(auto c, NodeClient::Create(*options));
      clients.push_back(std::move(c));
    }
    const auto start = Clock::now();
    std::vector<std::thread> threads;
    std::atomic<int> running{flags.concurrency};
    // When each thread replayed its last request: the replay's time ends at the last of them,
    // not when the progress loop below next looks (every 50 ms).
    std::vector<Clock::time_point> ended(flags.concurrency, start);
    for (int i = 0; i < flags.concurrency; ++i) {
      threads.emplace_back([&, i] {
        latencies[i] = replayer.Run(*clients[i], &next, start);
        ended[i] = Clock::now();
        running.fetch_sub(1);
      });
    }
    auto errors_now = [&] {
      uint64_t n = 0;
      for (const auto& c : clients) {
        const connector::BlockStoreCounters now = c->counters();
        n += now[ClientCounter::kUnservedKeys] + now[ClientCounter::kRefused];
      }
      return n - (before[ClientCounter::kUnservedKeys] + before[ClientCounter::kRefused]);
    };
    auto last = start;
    uint64_t last_bytes = 0;
    while (running.load() > 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      const auto now = Clock::now();
      const uint64_t bytes = (totals.blocks_read + totals.blocks_stored) * block_bytes;
      const uint64_t refs = totals.block_refs.load();
      const bool shown = progress.Update(fmt::format(
          "{}/{} requests  block hits {:.1f}% ({} of {})  {:.2f} GB/s  errors {}  mismatches {}",
          totals.requests.load(), trace->size(),
          refs == 0 ? 0.0 : 100.0 * static_cast<double>(totals.blocks_hit.load()) / refs,
          totals.blocks_hit.load(), refs, Gbps(bytes - last_bytes, now - last), errors_now(),
          totals.mismatches.load()));
      if (shown) {
        last = now;
        last_bytes = bytes;
      }
    }
    for (std::thread& t : threads) t.join();
    const auto elapsed = *std::max_element(ended.begin(), ended.end()) - start;
    // Touches still in flight land before the counters are read.
    for (const auto& c : clients) c->WaitForTouches();
    errors = errors_now();
    for (const auto& c : clients) repaired += c->counters()[ClientCounter::kRepairedBlocks];

    Latencies all;
    for (Latencies& l : latencies) {
      all.lookup_us.insert(all.lookup_us.end(), l.lookup_us.begin(), l.lookup_us.end());
      all.read_us.insert(all.read_us.end(), l.read_us.begin(), l.read_us.end());
      all.store_us.insert(all.store_us.end(), l.store_us.begin(), l.store_us.end());
    }
    seconds = std::chrono::duration<double>(elapsed).count();
    const uint64_t refs = totals.block_refs.load();
    const uint64_t bytes = (totals.blocks_read.load() + totals.blocks_stored.load()) * block_bytes;
    round.Set("block_hit_ratio", refs == 0 ? 0.0
                                           : static_cast<double>(totals.blocks_hit.load()) /
                                                 static_cast<double>(refs));
    round.Set("token_hit_ratio", totals.tokens.load() == 0
                                     ? 0.0
                                     : static_cast<double>(totals.tokens_hit.load()) /
                                           static_cast<double>(totals.tokens.load()));
    round.Set("model_block_hit_ratio", model->block_hit_ratio());
    round.Set("model_token_hit_ratio", model->token_hit_ratio());
    round.Set("blind_token_hit_ratio", totals.tokens.load() == 0
                                           ? 0.0
                                           : static_cast<double>(totals.blind_tokens_hit.load()) /
                                                 static_cast<double>(totals.tokens.load()));
    round.Set("infinite_cache_hit_ratio", infinite);
    round.Set("requests_per_s",
              seconds > 0 ? static_cast<double>(totals.requests.load()) / seconds : 0.0);
    round.Set("gbps", Gbps(bytes, elapsed));
    round.Set("lookup_p50_us", Percentile(all.lookup_us, 50));
    round.Set("lookup_p99_us", Percentile(all.lookup_us, 99));
    round.Set("read_p50_us", Percentile(all.read_us, 50));
    round.Set("read_p99_us", Percentile(all.read_us, 99));
    round.Set("store_p50_us", Percentile(all.store_us, 50));
    round.Set("store_p99_us", Percentile(all.store_us, 99));
    return Status::OK();
  };
  // The machine's own limit: copying blocks into a region the size of the nodes' CPU tiers.
  sides.limit = [&](Round& round) -> Status {
    round.Set("copy_limit_gbps", CopyLimitGbps(block_bytes, capacity * block_bytes));
    return Status::OK();
  };
  if (Status s = RunRounds(report, 1, sides, progress); !s.ok()) {
    return fail(kExitFailure, s.message());
  }

  const std::string policy(store::EvictionPolicyName(shapes.front().policy));
  const uint64_t bytes_read = totals.blocks_read.load() * block_bytes;
  const uint64_t bytes_stored = totals.blocks_stored.load() * block_bytes;
  report.Set("trace", flags.trace);
  report.Set("nodes", nodes.size());
  report.Set("replicas", flags.source.replicas);
  report.Set("policy", policy);
  report.Set("admission", std::string(store::AdmissionName(shapes.front().admission)));
  report.Set("capacity_blocks", capacity);
  report.Set("block_bytes", block_bytes);
  report.Set("concurrency", flags.concurrency);
  report.Set("stored_blocks", flags.store_partial ? "every block" : "full blocks");
  report.Set("speed", flags.speed);
  report.Set("model_covers", any_ssd ? "cpu tier only" : "every tier");
  report.Set("requests", totals.requests.load());
  report.Set("block_refs", totals.block_refs.load());
  report.Set("blocks_hit", totals.blocks_hit.load());
  report.Set("bytes_stored", bytes_stored);
  report.Set("bytes_read", bytes_read);
  report.Set("seconds", seconds);
  report.Set("read_misses", totals.read_misses.load());
  report.Set("lookup_retries", totals.retries.load());
  report.Set("errors", errors);
  report.Set("repaired_blocks", repaired);
  report.Set("mismatches", totals.mismatches.load());
  report.Heading("trace", fmt::format("{}: {} requests, {} block references", flags.trace,
                                      totals.requests.load(), totals.block_refs.load()));
  report.Heading("nodes",
                 fmt::format("{} of {} blocks of {} in all ({}{}{})", nodes.size(), capacity,
                             FormatBytes(block_bytes), policy,
                             flags.source.replicas > 1
                                 ? fmt::format(", {} replicas of each block", flags.source.replicas)
                                 : "",
                             any_ssd ? ", with SSD: the model covers the CPU tier only" : ""));
  report.Heading("replay",
                 fmt::format("concurrency {}, {}", flags.concurrency,
                             flags.speed > 0 ? fmt::format("{}x the trace's clock", flags.speed)
                                             : std::string("as fast as possible")));
  report.Footing("moved", fmt::format("{} read, {} stored in {:.2f} s", FormatBytes(bytes_read),
                                      FormatBytes(bytes_stored), seconds));
  report.Footing("errors", fmt::format("{}, content mismatches {}, reads evicted since their "
                                       "lookup {}, lookups retried {}",
                                       errors, totals.mismatches.load(), totals.read_misses.load(),
                                       totals.retries.load()));
  Print(report, flags.output, std::cout);
  return errors == 0 && totals.mismatches.load() == 0 ? kExitOk : kExitFailure;
}

}  // namespace

void AddBenchReplayCommand(CLI::App& bench, int* exit_code) {
  auto flags = std::make_shared<BenchReplayFlags>();
  CLI::App* cmd = bench.add_subcommand(
      "replay",
      "Replay a request trace in Mooncake's format against running offload nodes and measure "
      "them as a cache. Per request, as an engine's connector: a lookup of its blocks (the hit "
      "is the run of leading hits), a touch of every key, a read of the hit blocks (each "
      "checked against the content its id defines), a store of the full blocks after the hit "
      "(--store-partial: of every block after it), a touch of the hit blocks. Prints a progress "
      "line on stderr each second and a summary: block and token hit "
      "ratios next to the hit ratio the node's own policy reaches in-process on the same trace "
      "at the nodes' capacity (model_block_hit_ratio) and that of an unbounded cache; GB/s next "
      "to this machine's own copy rate for the block size over a working set the size of the "
      "nodes' CPU tiers, measured in the same run (copy_limit_gbps; ratio = gbps / "
      "copy_limit_gbps); p50/p99 latencies of lookups, reads and stores; errors and content "
      "mismatches.");
  cmd->add_option("--trace", flags->trace,
                  "JSONL, one request per line: timestamp (ms), input_length, output_length, "
                  "hash_ids (block ids; equal leading ids are a shared prefix)")
      ->required();
  cmd->add_option("--node", flags->source.nodes, "An offload node as HOST:PORT; repeat for many");
  cmd->add_option("--etcd", flags->source.etcd, connector::kEtcdHelp);
  cmd->add_option("--cluster", flags->source.cluster, connector::kClusterHelp);
  cmd->add_option("--replicas", flags->source.replicas, connector::kReplicasHelp)
      ->capture_default_str();
  cmd->add_option("--namespace", flags->key_namespace, "Key namespace of the replayed blocks")
      ->capture_default_str();
  cmd->add_option("--token", flags->token, "The nodes' auth token");
  cmd->add_option("--token-file", flags->token_file, "File whose first line is the auth token");
  cmd->add_option("--concurrency", flags->concurrency,
                  "Requests in flight, each on a client of its own; 1 replays in file order "
                  "and is deterministic")
      ->check(CLI::Range(1, 256))
      ->capture_default_str();
  cmd->add_option("--speed", flags->speed,
                  "Follow the trace's timestamps, this many times faster; 0: as fast as possible")
      ->capture_default_str();
  cmd->add_option("--limit", flags->limit, "Replay the first N requests only (0: all)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--block-tokens", flags->block_tokens,
                  "Tokens per block id, for token_hit_ratio (a hit of k blocks covers "
                  "min(k x this, input_length) tokens); Mooncake's traces use 512")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  cmd->add_option("--layout", flags->layout,
                  "Expand each request for a model's KV-cache groups, one key per group and "
                  "block, every group's block one node block: " +
                      LayoutNames() +
                      " (full: the trace as it is). With more than one group the token hit is "
                      "the usable one, next to the group-blind count")
      ->capture_default_str();
  cmd->add_flag("--group-blind", flags->group_blind,
                "With a hybrid --layout, store without block metadata, as a connector that "
                "does not say what its blocks are for (every block stored alike)");
  cmd->add_flag("--model-only", flags->model_only,
                "Run the in-process model alone, no nodes: one node of each --policy at each "
                "--capacity-blocks and --capacity-share, a table of block, token and "
                "group-blind token hit ratios (--json: one object with \"rows\")");
  cmd->add_option("--admission", flags->admission,
                  "With --model-only: all (every block stored), filter (a block stored on its "
                  "second reference) or adaptive (the node switches the filter on and off by "
                  "itself)")
      ->check(CLI::IsMember({"all", "filter", "adaptive"}))
      ->capture_default_str();
  cmd->add_option("--policy", flags->policies,
                  "With --model-only: the policies to model (lru, arc, aflru; default all)")
      ->delimiter(',');
  cmd->add_option("--capacity-blocks", flags->capacities,
                  "With --model-only: node capacities in blocks (comma-separated)")
      ->delimiter(',');
  cmd->add_option("--capacity-share", flags->shares,
                  "With --model-only: node capacities as shares of the working set (the blocks "
                  "of every group the trace stores), e.g. 0.25,0.5")
      ->delimiter(',');
  cmd->add_flag("--store-partial", flags->store_partial,
                "Store a request's last block even when input_length does not fill it (by "
                "default only full blocks are stored, as a connector stores them)");
  cmd->add_option("--timeout-ms", flags->timeout_ms, "Deadline of each call to a node")
      ->capture_default_str();
  cmd->add_option("--lookup-budget-ms", flags->lookup_budget_ms,
                  "How long a lookup waits for the nodes: keys of a node that has not answered "
                  "by then are misses (a stopped node costs each lookup this, then nothing); "
                  "give the timeout to count every hit on a busy machine")
      ->capture_default_str();
  cmd->add_option("--tls", flags->tls, "UCX transports (as UCX_TLS)");
  AddOutputFlags(*cmd, &flags->output);
  cmd->footer(FiguresHelp(ReplaySpec()) +
              "One round: the replay, then the limit (a second replay would find the first's "
              "blocks). --json also carries trace, nodes, policy, admission (all, filter or "
              "adaptive), capacity_blocks, block_bytes, "
              "concurrency, speed, stored_blocks (\"full blocks\" or \"every block\"), "
              "model_covers (\"every tier\", or \"cpu tier only\" with SSD "
              "tiers), requests, block_refs, blocks_hit, bytes_stored, bytes_read, seconds, "
              "read_misses (reads of blocks evicted since their lookup), lookup_retries, errors "
              "(keys of lookups, reads and stores that no node answered, and calls nodes "
              "refused), mismatches and repaired_blocks (blocks a read copied to a replica "
              "that lacked them).\n"
              "Exits 0 on success, 1 on any error or content mismatch, 2 on bad arguments or a "
              "malformed trace.");
  cmd->callback([flags, exit_code] { *exit_code = RunBenchReplay(*flags); });
}

}  // namespace kvstash::bench
