// `kvstash bench ssd`: the SSD tier's write and read throughput next to fio's on the same
// directory, so the figure reads as a fraction of what the drive can do.
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "commands.h"
#include "fmt/format.h"
#include "kvstash/bench/harness.h"
#include "kvstash/common/block_key.h"
#include "kvstash/common/logging.h"
#include "kvstash/common/status.h"
#include "kvstash/common/subprocess.h"
#include "kvstash/store/block_slab.h"
#include "kvstash/store/ssd_tier.h"
#include "nlohmann/json.hpp"

namespace kvstash::bench {
namespace {

constexpr uint64_t kMinBlockBytes = 4096;
constexpr uint64_t kMaxBlockBytes = uint64_t{1} << 30;
// O_DIRECT needs block sizes (and so offsets) that are multiples of the logical sector; 4 KiB
// covers every drive we run on, and is what the tier rounds its slots to.
constexpr uint64_t kIoAlignment = 4096;
constexpr char kTierSubdir[] = "kvstash-bench-ssd";
constexpr char kFioFile[] = "kvstash-bench-fio.dat";

// Block memory as the CPU tier holds it: a BlockSlab (page-aligned, prefaulted, transparent huge
// pages where the kernel allows). Direct I/O pins the buffer's pages for every call; from 4 KiB
// pages that costs this machine a third of the disk's rate at 2 MiB blocks, and the tier's real
// cascades and promotions use slab slots.
using AlignedBuffer = std::unique_ptr<store::BlockSlab>;

Result<AlignedBuffer> AllocateAligned(size_t block_bytes, size_t blocks) {
  store::BlockSlabOptions options;
  options.slot_bytes = block_bytes;
  options.slot_count = blocks;
  return store::BlockSlab::Create(options);
}

// Removes a path (file or tree) when it goes out of scope, so a failed round leaves nothing.
class ScopedRemove {
 public:
  explicit ScopedRemove(std::filesystem::path path) : path_(std::move(path)) { Remove(); }
  ~ScopedRemove() { Remove(); }
  ScopedRemove(const ScopedRemove&) = delete;
  ScopedRemove& operator=(const ScopedRemove&) = delete;

 private:
  void Remove() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  std::filesystem::path path_;
};

struct BenchConfig {
  std::filesystem::path dir;
  uint64_t block_bytes = 0;
  uint64_t block_count = 0;
  uint64_t total_bytes = 0;  // block_count * block_bytes: what both sides move
  uint64_t capacity_bytes = 0;
  uint64_t batch = 8;  // blocks per PrepareStore/WriteAndCommit
  bool fio = true;
};

struct TierFigures {
  double write_gbps = 0;
  double read_gbps = 0;
  bool direct_io = false;
};

struct FioFigures {
  double write_gbps = 0;
  double read_gbps = 0;
};

// One write pass and one read pass through a fresh SsdTier.
Result<TierFigures> RunTier(const BenchConfig& config, AlignedBuffer& src, AlignedBuffer& dst,
                            size_t dst_bytes) {
  const std::filesystem::path dir = config.dir / kTierSubdir;
  ScopedRemove cleanup(dir);
  store::SsdTierOptions options;
  options.dir = dir.string();
  options.block_bytes = config.block_bytes;
  options.capacity_bytes = config.capacity_bytes;
  KVSTASH_ASSIGN_OR_RETURN(std::unique_ptr<store::SsdTier> tier, store::SsdTier::Create(options));
  if (tier->capacity_blocks() < config.block_count) {
    return InternalError("SSD tier has {} slots for {} blocks", tier->capacity_blocks(),
                         config.block_count);
  }

  auto key_of = [](uint64_t i) {
    BlockKey key;
    key.hash = {.lo = i + 1, .hi = 0x6b767374617368ULL};  // "kvstash": any constant would do
    return key;
  };
  TierFigures figures;
  figures.direct_io = tier->direct_io();
  std::vector<BlockKey> keys;
  std::vector<store::SsdWrite> writes;
  store::StorePlan plan;
  const auto write_start = std::chrono::steady_clock::now();
  for (uint64_t first = 0; first < config.block_count; first += config.batch) {
    const uint64_t n = std::min<uint64_t>(config.batch, config.block_count - first);
    keys.clear();
    for (uint64_t i = first; i < first + n; ++i) keys.push_back(key_of(i));
    KVSTASH_RETURN_IF_ERROR(tier->PrepareStore(keys, &plan));
    writes.clear();
    for (uint64_t j = 0; j < n; ++j) {
      std::byte* block = src->Slot(static_cast<store::SlotId>(j)).data();
      // A distinct head per block, so no layer below can deduplicate or compress the blocks.
      const uint64_t i = first + j;
      std::memcpy(block, &i, sizeof(i));
      writes.push_back({plan.keys_to_store[j], plan.slots[j], {block, config.block_bytes}});
    }
    KVSTASH_RETURN_IF_ERROR(tier->WriteAndCommit(writes));
  }
  figures.write_gbps = Gbps(config.total_bytes, std::chrono::steady_clock::now() - write_start);

  std::vector<store::SlotId> slots;
  const std::span<std::byte> out(dst->Slot(0).data(), dst_bytes);
  const auto read_start = std::chrono::steady_clock::now();
  for (uint64_t i = 0; i < config.block_count; ++i) {
    const BlockKey key[] = {key_of(i)};
    Status s = tier->PrepareLoad(key, &slots);
    if (!s.ok()) return s;
    Result<size_t> n = tier->Read(key[0], slots[0], out);
    Status done = tier->CompleteLoad(key);
    if (!n.ok()) return n.status();
    if (!done.ok()) return done;
    if (*n != config.block_bytes) {
      return DataLossError("block {} read back {} bytes, wrote {}", key[0].ToString(), *n,
                           config.block_bytes);
    }
  }
  figures.read_gbps = Gbps(config.total_bytes, std::chrono::steady_clock::now() - read_start);
  return figures;
}

// One fio job (`rw` is "write" or "read") over `file`; returns its bandwidth in GB/s.
Result<double> RunFioJob(const BenchConfig& config, const std::string& file, std::string_view rw) {
  const std::vector<std::string> argv = {
      "fio",
      "--name=kvstash-bench",
      "--filename=" + file,
      fmt::format("--rw={}", rw),
      fmt::format("--bs={}", config.block_bytes),
      fmt::format("--size={}", config.total_bytes),
      "--direct=1",
      "--ioengine=psync",
      "--output-format=json",
  };
  KVSTASH_ASSIGN_OR_RETURN(ProcessOutput run, RunProgram(argv));
  if (run.exit_code != 0) {
    return UnavailableError("fio --rw={} exited with {}: {}", rw, run.exit_code,
                            run.err.empty() ? run.out : run.err);
  }
  // fio prints notes ("fio: ...") ahead of the JSON on some versions; the object starts at '{'.
  const size_t start = run.out.find('{');
  if (start == std::string::npos) return InternalError("fio --rw={} printed no JSON", rw);
  const nlohmann::json doc = nlohmann::json::parse(run.out.substr(start), nullptr, false);
  if (doc.is_discarded()) return InternalError("fio --rw={} printed malformed JSON", rw);
  const nlohmann::json* bw = nullptr;
  if (doc.contains("jobs") && doc["jobs"].is_array() && !doc["jobs"].empty()) {
    const nlohmann::json& job = doc["jobs"][0];
    if (job.contains(rw) && job[rw].contains("bw_bytes")) bw = &job[rw]["bw_bytes"];
  }
  if (bw == nullptr || !bw->is_number()) {
    return InternalError("fio --rw={} JSON has no jobs[0].{}.bw_bytes", rw, rw);
  }
  const double bytes_per_second = bw->get<double>();
  if (!(bytes_per_second > 0)) {
    return InternalError("fio --rw={} reported a bandwidth of {} bytes/s", rw, bytes_per_second);
  }
  return bytes_per_second / 1e9;
}

// fio's sequential write then read of the same bytes, direct I/O, one block per call: the same
// pattern the tier issues, without the tier's index and checksums.
Result<FioFigures> RunFio(const BenchConfig& config) {
  const std::filesystem::path file = config.dir / kFioFile;
  ScopedRemove cleanup(file);
  FioFigures figures;
  KVSTASH_ASSIGN_OR_RETURN(figures.write_gbps, RunFioJob(config, file.string(), "write"));
  KVSTASH_ASSIGN_OR_RETURN(figures.read_gbps, RunFioJob(config, file.string(), "read"));
  return figures;
}

BenchSpec SsdSpec() {
  BenchSpec spec;
  spec.name = "ssd";
  spec.command = "kvstash bench ssd";
  spec.title = "the SSD tier's write and read throughput against fio's on the same directory";
  spec.limit = "fio";
  spec.figures = {
      Higher("write_gbps", "GB/s",
             "kvstash: --total bytes written through the SSD tier, PrepareStore and "
             "WriteAndCommit per --batch blocks (the slots' direct writes and one index "
             "commit), over their wall time"),
      Higher("read_gbps", "GB/s",
             "kvstash: the same blocks read back, PrepareLoad, Read and CompleteLoad per "
             "block (the slot's read and its checksum check)"),
      Higher("fio_write_gbps", "GB/s",
             "the limit: fio's bw_bytes writing the same bytes to a file in --dir "
             "(sequential, direct I/O, psync, one block per call: the tier's pattern without "
             "its index and checksums); null with --no-fio"),
      Higher("fio_read_gbps", "GB/s",
             "the limit: fio reading them back the same way; null with --no-fio"),
  };
  spec.ratios = {
      RatioOf("write_ratio", "write_gbps", "fio_write_gbps",
              "the share of the drive's raw write throughput the tier delivers"),
      RatioOf("read_ratio", "read_gbps", "fio_read_gbps", "the same for reads"),
  };
  return spec;
}

struct BenchSsdFlags {
  std::string dir;
  std::string block_size;
  std::string total;
  std::string capacity;
  int rounds = 3;
  int batch = 8;
  bool no_fio = false;
  OutputOptions output;
};

int Fail(int code, std::string_view message) {
  return cli::ErrorReporter("kvstash bench ssd").Fail(code, message);
}

int RunBenchSsd(const BenchSsdFlags& flags) {
  BenchConfig config;
  Result<uint64_t> block = ParseBytes("--block-size", flags.block_size);
  if (!block.ok()) return Fail(kExitUsage, block.status().message());
  Result<uint64_t> total = ParseBytes("--total", flags.total);
  if (!total.ok()) return Fail(kExitUsage, total.status().message());
  if (*block < kMinBlockBytes || *block > kMaxBlockBytes) {
    return Fail(kExitUsage,
                fmt::format("--block-size: {} bytes is outside 4096..1073741824 (1 GiB)", *block));
  }
  if (*block % kIoAlignment != 0) {
    return Fail(kExitUsage,
                fmt::format("--block-size: {} bytes is not a multiple of 4096, which direct I/O "
                            "needs",
                            *block));
  }
  if (*total < *block) {
    return Fail(kExitUsage,
                fmt::format("--total: {} bytes is less than one block of {}", *total, *block));
  }
  if (flags.batch < 1 || flags.batch > 1024) {
    return Fail(kExitUsage, fmt::format("--batch: {} is outside 1..1024", flags.batch));
  }
  std::error_code ec;
  if (!std::filesystem::is_directory(flags.dir, ec)) {
    return Fail(kExitUsage,
                fmt::format("--dir: '{}' does not exist or is not a directory", flags.dir));
  }
  config.dir = flags.dir;
  config.block_bytes = *block;
  config.block_count = *total / *block;
  config.total_bytes = config.block_count * config.block_bytes;
  config.batch = static_cast<uint64_t>(flags.batch);
  config.fio = !flags.no_fio;
  if (config.total_bytes != *total) {
    std::cerr << fmt::format(
        "kvstash bench ssd: --total {} is not a whole number of blocks; using {} bytes\n", *total,
        config.total_bytes);
  }
  uint64_t capacity = config.total_bytes;
  if (!flags.capacity.empty()) {
    Result<uint64_t> c = ParseBytes("--capacity", flags.capacity);
    if (!c.ok()) return Fail(kExitUsage, c.status().message());
    capacity = std::max(capacity, *c);
  }
  // Block sizes are 4 KiB multiples, so a slot is exactly one block: total bytes of capacity
  // hold every block and no eviction runs inside the timed loop.
  config.capacity_bytes = std::max(capacity, config.block_count * config.block_bytes);

  // The tier's per-open info line would interleave with the table; warnings (such as a fallback
  // to buffered I/O) still show, on stderr.
  if (spdlog::get_level() < spdlog::level::warn) SetLogLevel("warn").IgnoreError();

  Result<AlignedBuffer> src = AllocateAligned(config.block_bytes, config.batch);
  if (!src.ok()) return Fail(kExitFailure, src.status().ToString());
  Result<AlignedBuffer> dst = AllocateAligned(config.block_bytes, 1);
  if (!dst.ok()) return Fail(kExitFailure, dst.status().ToString());
  // Non-constant bytes, so neither a compressing drive nor a deduplicating file system can
  // shortcut the writes.
  uint64_t x = 0x9e3779b97f4a7c15ULL;
  for (uint64_t i = 0; i < config.block_bytes * config.batch; i += sizeof(x)) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    std::memcpy((*src)->Slot(0).data() + i, &x, sizeof(x));
  }

  Result<std::unique_ptr<Report>> created = Report::Create(SsdSpec());
  if (!created.ok()) return Fail(kExitFailure, created.status().ToString());
  Report& report = **created;
  bool direct_io = true;
  RoundSides sides;
  sides.measure = [&](Round& round) -> Status {
    KVSTASH_ASSIGN_OR_RETURN(TierFigures tier, RunTier(config, *src, *dst, config.block_bytes));
    round.Set("write_gbps", tier.write_gbps);
    round.Set("read_gbps", tier.read_gbps);
    direct_io = direct_io && tier.direct_io;
    return Status::OK();
  };
  if (config.fio) {
    sides.limit = [&](Round& round) -> Status {
      Result<FioFigures> fio = RunFio(config);
      if (!fio.ok()) {
        return Status(
            fio.status().code(),
            fmt::format("fio: {} (pass --no-fio to measure only kvstash)", fio.status().message()));
      }
      round.Set("fio_write_gbps", fio->write_gbps);
      round.Set("fio_read_gbps", fio->read_gbps);
      return Status::OK();
    };
  }
  Progress progress = Progress::ToStderr(flags.output.progress);
  if (Status s = RunRounds(report, flags.rounds, sides, progress); !s.ok()) {
    return Fail(kExitFailure, s.ToString());
  }
  if (!direct_io) {
    std::cerr << "kvstash bench ssd: warning: the file system refused direct I/O; the kvstash "
                 "figures include the page cache\n";
  }

  report.Set("block_bytes", config.block_bytes);
  report.Set("total_bytes", config.total_bytes);
  report.Set("block_count", config.block_count);
  report.Set("capacity_bytes", config.capacity_bytes);
  report.Set("batch", config.batch);
  report.Set("direct_io", direct_io);
  report.Heading("block size",
                 fmt::format("{} ({} bytes)", FormatBytes(config.block_bytes), config.block_bytes));
  report.Heading(
      "total", fmt::format("{} ({} blocks)", FormatBytes(config.total_bytes), config.block_count));
  report.Heading("batch", fmt::format("{} blocks per store call", config.batch));
  report.Heading("direct I/O", direct_io ? "yes" : "no (the file system refused it)");
  report.Heading("fio", config.fio ? fmt::format("--rw=write, --rw=read --bs={} --direct=1 "
                                                 "--ioengine=psync",
                                                 config.block_bytes)
                                   : std::string("skipped (--no-fio)"));
  Print(report, flags.output, std::cout);
  return kExitOk;
}

}  // namespace

void AddBenchSsdCommand(CLI::App& bench, int* exit_code) {
  auto flags = std::make_shared<BenchSsdFlags>();
  const BenchSpec spec = SsdSpec();
  CLI::App* ssd = bench.add_subcommand(
      "ssd",
      "Measure the SSD tier's write and read throughput against fio's on the same directory: "
      "write and read back --total bytes through the tier (--batch blocks per store call, as a "
      "cascade job writes them; one block per read), and the same bytes with fio (sequential, "
      "direct I/O, psync, one block per call), in paired rounds.");
  ssd->add_option("--dir", flags->dir,
                  "Existing directory on the drive to measure. The tier uses the subdirectory "
                  "kvstash-bench-ssd and fio the file kvstash-bench-fio.dat; both are removed "
                  "before and after each round")
      ->required();
  ssd->add_option("--block-size", flags->block_size,
                  "Bytes per block (one tier slot, one fio I/O): 4K..1G, a multiple of 4096. "
                  "Accepts an integer or a suffix K, M, G, KiB, MiB, GiB (powers of two)")
      ->required();
  ssd->add_option("--total", flags->total,
                  "Bytes written and read per side and round, rounded down to whole blocks; at "
                  "least one block. Same suffixes as --block-size")
      ->required();
  ssd->add_option("--capacity", flags->capacity,
                  "Tier capacity in bytes (default and minimum: --total, so nothing is evicted "
                  "while timing). Same suffixes as --block-size");
  AddRoundsFlag(*ssd, &flags->rounds, spec);
  ssd->add_option("--batch", flags->batch,
                  "Blocks per store call (1..1024). The tier writes each block with its own "
                  "direct write, one after another, and commits the batch's index records in "
                  "one RocksDB write; 1 commits every block alone")
      ->capture_default_str();
  AddOutputFlags(*ssd, &flags->output);
  ssd->add_flag("--no-fio", flags->no_fio,
                "Skip fio (e.g. where it is not installed); fio figures and ratios are null");
  ssd->footer(FiguresHelp(spec) +
              "GB/s is 1e9 bytes/s. --json also carries block_bytes, total_bytes, block_count, "
              "capacity_bytes, batch and direct_io (false: the file system refused direct I/O "
              "and the kvstash figures include the page cache).\n"
              "Exits 0 on success, 1 if the tier or fio fails (fio missing included, unless "
              "--no-fio), 2 for bad arguments.");
  ssd->callback([flags, exit_code] { *exit_code = RunBenchSsd(*flags); });
}

}  // namespace kvstash::bench
