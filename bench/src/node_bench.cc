// `kvstash bench node`: a load generator against running offload nodes. N clients (threads,
// each with its own connections, sharing the process's UCX worker) store and read blocks for a
// while; every block read is checked against what was stored (see "Block content" below). A
// progress line on stderr each second, a summary at the end.

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <atomic>
#include <cstring>
#include <iostream>
#include <random>
#include <thread>

#include "commands.h"
#include "kvstash/bench/harness.h"
#include "kvstash/common/hash.h"
#include "kvstash/connector/node_client.h"

namespace kvstash::bench {
namespace {
using connector::NodeClient;
using Clock = std::chrono::steady_clock;

struct BenchNodeFlags {
  connector::NodeSource source;
  std::string key_namespace = "bench";
  std::string token;
  std::string tls;
  int clients = 8;
  double seconds = 10;
  double read_share = 0.5;
  int keys_per_client = 64;
  int workers = 0;
  int spin_us = 200;
  int batch = 1;
  int check_every = 8;
  int rounds = 1;
  OutputOptions output;
};

// Block content. Each client keeps --batch send buffers; buffer j holds a pattern (64-bit
// words start + i * step, start drawn from the client and j), and a put of key k goes from
// buffer k % batch after the key is stamped into the first word of every 4 KiB page. So a put
// writes only the stamps. Every read checks every page's stamp and last word (a block read
// back under the wrong key, stale, shifted, or torn at any page fails: 2 words of 512); every
// --check-every'th read checks every word (a byte corrupted anywhere fails). A check of every
// word of every read would cost more than half a copy, whose bytes it reads again.
constexpr uint64_t kStep = 0x9e3779b97f4a7c15ULL;
constexpr size_t kPageWords = 512;

// Four words at a time in GCC/Clang vector types: -O2's cost model does not vectorise these
// loops by itself, and at 1 word per step the generator would cost as much as the transfer.
using Words4 = uint64_t __attribute__((vector_size(32)));
constexpr Words4 kStep4 = {4 * kStep, 4 * kStep, 4 * kStep, 4 * kStep};

uint64_t PatternStart(uint64_t key, size_t batch) {
  return Mix64(((key >> 40) << 20) ^ (key % batch) ^ 0x6b76737461736800ULL);
}
uint64_t Stamp(uint64_t key, size_t page) { return Mix64(key + page * kStep); }

// Words [from, to) of the pattern that starts at `start`.
void FillPattern(uint64_t start, uint64_t* words, size_t from, size_t to) {
  size_t i = from;
  Words4 v = {start + i * kStep, start + (i + 1) * kStep, start + (i + 2) * kStep,
              start + (i + 3) * kStep};
  for (; i + 4 <= to; i += 4, v += kStep4) std::memcpy(words + i, &v, sizeof v);
  for (; i < to; ++i) words[i] = start + i * kStep;
}

// OR of the differences between words [from, to) and the pattern.
uint64_t PatternDiff(uint64_t start, const uint64_t* words, size_t from, size_t to) {
  size_t i = from;
  Words4 v = {start + i * kStep, start + (i + 1) * kStep, start + (i + 2) * kStep,
              start + (i + 3) * kStep};
  Words4 diff = {0, 0, 0, 0};
  for (; i + 4 <= to; i += 4, v += kStep4) {
    Words4 got;
    std::memcpy(&got, words + i, sizeof got);
    diff |= got ^ v;
  }
  uint64_t rest = diff[0] | diff[1] | diff[2] | diff[3];
  for (; i < to; ++i) rest |= words[i] ^ (start + i * kStep);
  return rest;
}

// A send buffer's pattern (once per buffer), then per put: the key's stamps.
void FillBuffer(uint64_t any_key_of_buffer, size_t batch, std::span<uint64_t> words) {
  FillPattern(PatternStart(any_key_of_buffer, batch), words.data(), 0, words.size());
}
void StampKey(uint64_t key, std::span<uint64_t> words) {
  for (size_t p = 0; p * kPageWords < words.size(); ++p) words[p * kPageWords] = Stamp(key, p);
}

// Every page's stamp and last word.
bool StampsMatch(uint64_t key, size_t batch, std::span<const uint64_t> words) {
  const uint64_t start = PatternStart(key, batch);
  uint64_t diff = 0;
  for (size_t p = 0; p * kPageWords < words.size(); ++p) {
    const size_t first = p * kPageWords;
    const size_t last = std::min(words.size(), first + kPageWords) - 1;
    diff |= words[first] ^ Stamp(key, p);
    if (last != first) diff |= words[last] ^ (start + last * kStep);
  }
  return diff == 0;
}

// Every word.
bool Matches(uint64_t key, size_t batch, std::span<const uint64_t> words) {
  const uint64_t start = PatternStart(key, batch);
  uint64_t diff = 0;
  for (size_t p = 0; p * kPageWords < words.size(); ++p) {
    const size_t first = p * kPageWords;
    diff |= words[first] ^ Stamp(key, p);
    diff |= PatternDiff(start, words.data(), first + 1, std::min(words.size(), first + kPageWords));
  }
  return diff == 0;
}

struct ClientTotals {
  uint64_t puts = 0, gets = 0, misses = 0, errors = 0, mismatches = 0;
  std::vector<double> put_us, get_us;
};

struct Shared {
  std::atomic<uint64_t> puts{0}, gets{0}, errors{0}, mismatches{0};
  std::atomic<bool> stop{false};
};

// The options of every bench client but its worker; InvalidArgument for a bad node source.
Result<connector::NodeClientOptions> ClientOptions(const BenchNodeFlags& flags) {
  connector::NodeClientOptions options;
  KVSTASH_RETURN_IF_ERROR(connector::ApplyNodeSource(flags.source, &options));
  options.key_namespace = flags.key_namespace;
  options.auth_token = flags.token;
  options.transport.tls = flags.tls;
  return options;
}

// The client's live nodes, "HOST:PORT HOST:PORT".
std::string NodeList(const connector::NodeClient& client) {
  std::string out;
  for (const connector::NodeAddress& node : client.nodes()) {
    out += (out.empty() ? "" : " ") + node.ToString();
  }
  return out;
}

ClientTotals RunClient(const BenchNodeFlags& flags, connector::NodeClientOptions options, int id,
                       uint64_t block_bytes, std::shared_ptr<transport::ClientWorker> worker,
                       Shared& shared, std::string* failure) {
  ClientTotals totals;
  options.worker = std::move(worker);
  auto client = NodeClient::Create(std::move(options));
  if (!client.ok()) {
    *failure = std::string(client.status().message());
    return totals;
  }
  std::mt19937_64 random(static_cast<uint64_t>(id) * 7919 + 1);
  const size_t batch = static_cast<size_t>(flags.batch);
  // --batch send buffers (patterns made once, stamped per put) and --batch receive buffers,
  // in whole words (block sizes are multiples of 4 KiB).
  const size_t words_per_block = block_bytes / 8;
  std::vector<uint64_t> send_words(words_per_block * batch), recv_words(words_per_block * batch);
  std::vector<std::span<uint64_t>> sends, recvs;
  std::vector<transport::MutableBytes> outs;
  std::vector<transport::Bytes> ins;
  const uint64_t first_key = static_cast<uint64_t>(id + 1) << 40;
  for (size_t b = 0; b < batch; ++b) {
    sends.push_back(std::span(send_words).subspan(b * words_per_block, words_per_block));
    recvs.push_back(std::span(recv_words).subspan(b * words_per_block, words_per_block));
    ins.push_back(std::as_bytes(sends.back()));
    outs.push_back(std::as_writable_bytes(recvs.back()));
  }
  // Buffer j holds the pattern of the keys k with k % batch == j.
  for (size_t b = 0; b < batch; ++b) {
    FillBuffer(first_key + b, batch, sends[(first_key + b) % batch]);
  }
  std::vector<BlockKey> keys(batch);
  // The client's most recent --keys-per-client stored keys (a ring): reads pick among them.
  std::vector<uint64_t> stored;
  size_t next_slot = 0;
  uint64_t sequence = 0;
  uint64_t reads = 0;  // blocks read back, for --check-every
  while (!shared.stop.load(std::memory_order_relaxed)) {
    const bool read =
        !stored.empty() && std::uniform_real_distribution<double>(0, 1)(random) < flags.read_share;
    const auto start = Clock::now();
    if (read) {
      for (BlockKey& key : keys) key.hash.lo = stored[random() % stored.size()];
      const std::vector<Result<size_t>> got = (*client)->Get(keys, outs);
      const double us = std::chrono::duration<double, std::micro>(Clock::now() - start).count();
      uint64_t read_ok = 0;
      for (size_t b = 0; b < batch; ++b) {
        if (!got[b].ok()) {
          // An evicted block is a miss, not an error: the nodes are caches.
          if (got[b].status().code() == StatusCode::kNotFound) {
            ++totals.misses;
          } else {
            ++totals.errors;
            shared.errors.fetch_add(1);
          }
          continue;
        }
        const bool whole = ++reads % static_cast<uint64_t>(flags.check_every) == 0;
        if (*got[b] != block_bytes || !(whole ? Matches(keys[b].hash.lo, batch, recvs[b])
                                              : StampsMatch(keys[b].hash.lo, batch, recvs[b]))) {
          ++totals.mismatches;
          shared.mismatches.fetch_add(1);
        }
        ++read_ok;
      }
      totals.gets += read_ok;
      shared.gets.fetch_add(read_ok);
      totals.get_us.push_back(us);
    } else {
      // New keys every time, as an engine offloads new blocks: every put moves its bytes, and
      // the nodes evict the oldest when full.
      // Keys first_key + sequence, batch at a time: key k goes from buffer k % batch.
      std::vector<transport::Bytes> order(batch);
      for (size_t b = 0; b < batch; ++b) {
        keys[b].hash.lo = first_key | sequence++;
        const size_t buffer = keys[b].hash.lo % batch;
        StampKey(keys[b].hash.lo, sends[buffer]);
        order[b] = ins[buffer];
      }
      const Status put = (*client)->Put(keys, order);
      const double us = std::chrono::duration<double, std::micro>(Clock::now() - start).count();
      if (!put.ok()) {
        ++totals.errors;
        shared.errors.fetch_add(1);
        continue;
      }
      for (const BlockKey& key : keys) {
        if (stored.size() < static_cast<size_t>(flags.keys_per_client)) {
          stored.push_back(key.hash.lo);
        } else {
          stored[next_slot++ % stored.size()] = key.hash.lo;
        }
      }
      totals.puts += batch;
      shared.puts.fetch_add(batch);
      totals.put_us.push_back(us);
    }
  }
  return totals;
}

BenchSpec NodeSpec() {
  BenchSpec spec;
  spec.name = "node";
  spec.command = "kvstash bench node";
  spec.title =
      "load on running offload nodes, every block read checked, against this machine's "
      "copy rate for their block size";
  spec.limit = "memcpy";
  spec.figures = {
      Higher("gbps", "GB/s", "kvstash: put_gbps + get_gbps, the bytes the nodes took and gave"),
      Higher("put_gbps", "GB/s",
             "bytes of the blocks stored / the round's --seconds, over all clients"),
      Higher("get_gbps", "GB/s", "bytes of the blocks read back, the same way"),
      Higher("ops_per_s", "blocks/s", "blocks stored and read per second, over all clients"),
      Lower("put_p50_us", "us",
            "median latency of a put operation (--batch blocks, all in flight)"),
      Lower("put_p99_us", "us", "its 99th percentile"),
      Lower("get_p50_us", "us",
            "median latency of a read operation (--batch blocks, all in flight); null "
            "without reads"),
      Lower("get_p99_us", "us", "its 99th percentile"),
      Higher("copy_limit_gbps", "GB/s",
             "the limit: one thread of this process copying blocks of the nodes' size into a "
             "region the size of their CPU tiers (at most 1 GiB) in a scattered order, as a "
             "node's tier receives them (on one host the transport copies blocks straight "
             "into the node's slots)"),
  };
  spec.ratios = {RatioOf("ratio", "gbps", "copy_limit_gbps",
                         "how much of this machine's copy rate the nodes deliver to "
                         "--clients clients")};
  return spec;
}

// What the clients did over all rounds.
struct Outcome {
  uint64_t puts = 0, gets = 0, misses = 0, errors = 0, mismatches = 0;
  double seconds = 0;
};

int RunBenchNode(const BenchNodeFlags& flags) {
  const cli::ErrorReporter reporter("kvstash bench node");
  auto fail = [&reporter](int code, std::string_view message) {
    return reporter.Fail(code, message);
  };
  const Result<connector::NodeClientOptions> options = ClientOptions(flags);
  if (!options.ok()) return fail(kExitUsage, options.status().message());
  if (flags.clients < 1 || flags.clients > 1024) {
    return fail(kExitUsage, fmt::format("--clients: {} is outside 1..1024", flags.clients));
  }
  if (!(flags.seconds > 0) || flags.seconds > 86400) {
    return fail(kExitUsage, fmt::format("--seconds: {} is outside (0, 86400]", flags.seconds));
  }
  if (!(flags.read_share >= 0 && flags.read_share <= 1)) {
    return fail(kExitUsage, fmt::format("--read-share: {} is outside 0..1", flags.read_share));
  }
  if (flags.workers < 0 || flags.workers > flags.clients) {
    return fail(kExitUsage, fmt::format("--workers: {} is outside 0..--clients ({})", flags.workers,
                                        flags.clients));
  }
  if (flags.keys_per_client < 1) {
    return fail(kExitUsage,
                fmt::format("--keys-per-client: {} is not positive", flags.keys_per_client));
  }
  // The nodes' block size and the CPU tiers the limit copies into.
  uint64_t block_bytes = 0;
  uint64_t capacity_blocks = 0;
  std::string node_list;
  {
    auto probe = NodeClient::Create(*options);
    if (!probe.ok()) return fail(kExitFailure, probe.status().message());
    const std::vector<connector::NodeAddress> nodes = (*probe)->nodes();
    if (nodes.empty()) {
      return fail(kExitFailure, fmt::format("cluster {} has no live offload nodes in etcd",
                                            flags.source.cluster));
    }
    node_list = NodeList(**probe);
    auto bytes = (*probe)->BlockBytes(nodes.front());
    if (!bytes.ok()) return fail(kExitFailure, bytes.status().message());
    block_bytes = *bytes;
    for (const connector::NodeAddress& node : nodes) {
      auto counters = (*probe)->Stats(node);
      if (!counters.ok()) return fail(kExitFailure, counters.status().message());
      if (auto it = counters->find("cpu.capacity_blocks"); it != counters->end()) {
        capacity_blocks += it->second;
      }
    }
  }

  {
    // The content check itself must catch a wrong key and a flipped byte anywhere.
    std::vector<uint64_t> words(block_bytes / 8);
    FillBuffer(41, 1, words);
    StampKey(41, words);
    bool sound = Matches(41, 1, words) && !Matches(42, 1, words) && StampsMatch(41, 1, words) &&
                 !StampsMatch(42, 1, words);
    const auto bytes = std::as_writable_bytes(std::span(words));
    for (size_t at : {size_t{0}, size_t{9}, block_bytes / 2, block_bytes - 1}) {
      bytes[at] ^= std::byte{1};
      sound = sound && !Matches(41, 1, words);
      bytes[at] ^= std::byte{1};
    }
    if (!sound) return fail(kExitFailure, "internal error: the block content check is broken");
  }

  // The clients' UCX workers: --workers shared ones, clients spread over them round-robin; 0:
  // as many as a process's connectors spread their connections over (one per core, at most 4;
  // transport::ClientWorkerPool).
  const int worker_count =
      flags.workers != 0
          ? flags.workers
          : std::min(flags.clients,
                     static_cast<int>(transport::ClientWorkerPool::Create({})->size()));
  std::vector<std::shared_ptr<transport::ClientWorker>> workers;
  for (int i = 0; i < worker_count; ++i) {
    transport::TransportOptions transport;
    transport.tls = flags.tls;
    transport.spin_before_sleep = std::chrono::microseconds(flags.spin_us);
    auto worker = transport::ClientWorker::Create(transport);
    if (!worker.ok()) return fail(kExitFailure, worker.status().message());
    workers.push_back(std::move(*worker));
  }
  auto worker_of = [&](int client) {
    return workers.empty() ? nullptr : workers[client % workers.size()];
  };

  Result<std::unique_ptr<Report>> created = Report::Create(NodeSpec());
  if (!created.ok()) return fail(kExitFailure, created.status().ToString());
  Report& report = **created;
  Progress progress = Progress::ToStderr(flags.output.progress);
  Outcome outcome;
  RoundSides sides;
  // --seconds of load from --clients clients.
  sides.measure = [&](Round& round) -> Status {
    Shared shared;
    std::vector<ClientTotals> totals(flags.clients);
    std::vector<std::string> failures(flags.clients);
    std::vector<std::thread> threads;
    const auto start = Clock::now();
    for (int i = 0; i < flags.clients; ++i) {
      threads.emplace_back([&, i] {
        totals[i] = RunClient(flags, *options, i, block_bytes, worker_of(i), shared, &failures[i]);
      });
    }
    const auto end = start + std::chrono::duration_cast<Clock::duration>(
                                 std::chrono::duration<double>(flags.seconds));
    uint64_t last_puts = 0, last_gets = 0;
    auto last = start;
    while (Clock::now() < end) {
      std::this_thread::sleep_until(std::min(end, Clock::now() + std::chrono::milliseconds(100)));
      const auto now = Clock::now();
      const uint64_t puts = shared.puts.load(), gets = shared.gets.load();
      const bool shown = progress.Update(
          fmt::format("{} clients  put {:.2f} GB/s  get {:.2f} GB/s  errors {}  mismatches {}",
                      flags.clients, Gbps((puts - last_puts) * block_bytes, now - last),
                      Gbps((gets - last_gets) * block_bytes, now - last), shared.errors.load(),
                      shared.mismatches.load()));
      if (shown) {
        last_puts = puts;
        last_gets = gets;
        last = now;
      }
    }
    shared.stop = true;
    for (std::thread& t : threads) t.join();
    const auto elapsed = Clock::now() - start;
    for (const std::string& f : failures) {
      if (!f.empty()) return UnavailableError("{}", f);
    }
    ClientTotals sum;
    for (ClientTotals& t : totals) {
      sum.puts += t.puts;
      sum.gets += t.gets;
      sum.misses += t.misses;
      sum.errors += t.errors;
      sum.mismatches += t.mismatches;
      sum.put_us.insert(sum.put_us.end(), t.put_us.begin(), t.put_us.end());
      sum.get_us.insert(sum.get_us.end(), t.get_us.begin(), t.get_us.end());
    }
    const double put_gbps = Gbps(sum.puts * block_bytes, elapsed);
    const double get_gbps = Gbps(sum.gets * block_bytes, elapsed);
    const double secs = std::chrono::duration<double>(elapsed).count();
    round.Set("gbps", put_gbps + get_gbps);
    round.Set("put_gbps", put_gbps);
    round.Set("get_gbps", get_gbps);
    round.Set("ops_per_s", secs > 0 ? static_cast<double>(sum.puts + sum.gets) / secs : 0.0);
    round.Set("put_p50_us", Percentile(sum.put_us, 50));
    round.Set("put_p99_us", Percentile(sum.put_us, 99));
    round.Set("get_p50_us", Percentile(sum.get_us, 50));
    round.Set("get_p99_us", Percentile(sum.get_us, 99));
    outcome.puts += sum.puts;
    outcome.gets += sum.gets;
    outcome.misses += sum.misses;
    outcome.errors += sum.errors;
    outcome.mismatches += sum.mismatches;
    outcome.seconds += secs;
    return Status::OK();
  };
  sides.limit = [&](Round& round) -> Status {
    round.Set("copy_limit_gbps",
              CopyLimitGbps(block_bytes, std::max<uint64_t>(capacity_blocks, 1) * block_bytes));
    return Status::OK();
  };
  if (Status s = RunRounds(report, flags.rounds, sides, progress); !s.ok()) {
    return fail(kExitFailure, s.ToString());
  }

  report.Set("clients", flags.clients);
  report.Set("seconds", outcome.seconds);
  report.Set("block_bytes", block_bytes);
  report.Set("batch", flags.batch);
  report.Set("read_share", flags.read_share);
  report.Set("workers", worker_count);
  report.Set("puts", outcome.puts);
  report.Set("gets", outcome.gets);
  report.Set("get_misses", outcome.misses);
  report.Set("errors", outcome.errors);
  report.Set("mismatches", outcome.mismatches);
  report.Heading("nodes", fmt::format("{}, blocks of {}, CPU tiers of {} blocks in all", node_list,
                                      FormatBytes(block_bytes), capacity_blocks));
  report.Heading("clients",
                 fmt::format("{} on {} UCX worker(s), {} block(s) per operation, {:.0f}% reads",
                             flags.clients, worker_count, flags.batch, 100 * flags.read_share));
  report.Heading("seconds", fmt::format("{} per round", flags.seconds));
  report.Footing("blocks", fmt::format("{} stored, {} read, {} evicted before their read (misses)",
                                       outcome.puts, outcome.gets, outcome.misses));
  report.Footing("errors",
                 fmt::format("{}, content mismatches {}", outcome.errors, outcome.mismatches));
  Print(report, flags.output, std::cout);
  return outcome.mismatches == 0 && outcome.errors == 0 ? kExitOk : kExitFailure;
}

}  // namespace

void AddBenchNodeCommand(CLI::App& bench, int* exit_code) {
  auto flags = std::make_shared<BenchNodeFlags>();
  const BenchSpec spec = NodeSpec();
  CLI::App* cmd = bench.add_subcommand(
      "node",
      "Load running offload nodes against this machine's copy rate: --clients clients "
      "(threads, each with its own connections, sharing --workers UCX progress threads) store "
      "and read blocks of the nodes' block size for --seconds; every block read back is "
      "checked against what was stored: every read, for the right key at every 4 KiB page "
      "(a block stored under another key, stale, shifted or torn at any page fails), and "
      "every --check-every'th read word for word (a byte corrupted anywhere fails). These "
      "checks cost a small share of the copies they check. A progress line on stderr each "
      "second; the summary gives GB/s, blocks/s, p50/p99 latency per operation, errors and content "
      "mismatches "
      "(exit 1 if any). Reads of blocks the nodes evicted count as misses, not errors.");
  cmd->add_option("--node", flags->source.nodes, "An offload node as HOST:PORT; repeat for many");
  cmd->add_option("--etcd", flags->source.etcd, connector::kEtcdHelp);
  cmd->add_option("--cluster", flags->source.cluster, connector::kClusterHelp);
  cmd->add_option("--replicas", flags->source.replicas, connector::kReplicasHelp)
      ->capture_default_str();
  cmd->add_option("--clients", flags->clients, "Concurrent clients (1..1024)")
      ->capture_default_str();
  cmd->add_option("--seconds", flags->seconds, "How long each round loads the nodes")
      ->capture_default_str();
  cmd->add_option("--read-share", flags->read_share,
                  "Share of operations that read a block the client stored (0..1)")
      ->capture_default_str();
  cmd->add_option("--keys-per-client", flags->keys_per_client,
                  "Reads pick among each client's last this many stored blocks (every put stores "
                  "a new key; the nodes evict the oldest when full, and reads of evicted blocks "
                  "count as misses)")
      ->capture_default_str();
  cmd->add_option("--workers", flags->workers,
                  "UCX workers (each with its progress thread) the clients share, round-robin; "
                  "0: as a process's connectors run, one per core (at most 4, and at most "
                  "--clients); --clients: one per client")
      ->capture_default_str();
  cmd->add_option("--check-every", flags->check_every,
                  "Check every word of every this many'th block read (1: of every read; each "
                  "such check reads the whole block again, about half a copy's cost)")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  cmd->add_option("--batch", flags->batch,
                  "Blocks per operation: a put stores this many new blocks, a read reads this "
                  "many, all in flight at once (as an engine moves a step's blocks); latency is "
                  "per operation")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  cmd->add_option("--spin-us", flags->spin_us,
                  "How long each worker's progress thread polls before it sleeps (us)")
      ->check(CLI::Range(0, 100000))
      ->capture_default_str();
  cmd->add_option("--namespace", flags->key_namespace, "Key namespace")->capture_default_str();
  cmd->add_option("--token", flags->token, "The nodes' auth token");
  cmd->add_option("--tls", flags->tls, "UCX transports (as UCX_TLS)");
  AddRoundsFlag(*cmd, &flags->rounds, spec);
  AddOutputFlags(*cmd, &flags->output);
  cmd->footer(FiguresHelp(spec) +
              "GB/s is 1e9 bytes/s. --json also carries clients, seconds (of load, all rounds), "
              "block_bytes, batch, read_share, workers, and over all rounds puts and gets "
              "(blocks), get_misses (reads of blocks evicted since), errors and mismatches.\n"
              "Exits 0 on success, 1 on any error or content mismatch or when the nodes cannot "
              "be reached, 2 for bad arguments.");
  cmd->callback([flags, exit_code] { *exit_code = RunBenchNode(*flags); });
}

}  // namespace kvstash::bench
