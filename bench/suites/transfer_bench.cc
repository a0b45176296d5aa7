// Block gather/scatter between a paged device cache and pinned host memory
// (kernels::cuda::IssueTransfer) against this machine's own limit, measured in the same run: one
// plain cudaMemcpyAsync of the same bytes between a contiguous device buffer and the same pinned
// host buffer, in the same direction, on the same stream.
//  - Gather/<page>/f<factor>: device-to-host; Scatter/<page>/f<factor>: host-to-device.
//  - A job moves 256 device blocks (pages) chosen at random from a pool of 1024, to or from host
//    blocks of `factor` pages in random order, as one plan (PlanTransfer) issued on a stream of
//    our own (one batched copy where the runtime has them).
//  - Each iteration times (cudaEvents, so GPU time) enough jobs back to back to move about
//    64 MiB, then as many plain copies, the two halves alternating which goes first and each
//    starting on an idle stream. Counters: `transfer_GBps`, `plain_GBps` and `ratio` =
//    transfer / plain (goal >= 0.8); the report gives each one's median over the repetitions
//    (the ratio's: the median of each repetition's own).
// Before timing, each case checks that one job moved the first and last byte of every block to
// the right place, so the numbers cannot come from a transfer that moved nothing. The report is
// the benchmark harness's (suite.h): every case's figures as a table or --json.
//
// `transfer_bench --smoke` runs tiny jobs (ctest does, so it cannot rot). Exits 1 when a case
// failed (a transfer refused, or the check above), never for a timing. Without a CUDA device it
// prints that nothing was measured and exits 0.
#include <benchmark/benchmark.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "kvstash/kernels/cuda_transfer.h"
#include "kvstash/kernels/transfer_plan.h"
#include "suite.h"

namespace kvstash::kernels {
namespace {

bool g_smoke = false;

// One benchmark: a job of `blocks` pages out of a device pool of `pool_blocks`.
struct Case {
  std::string name;
  TransferDirection direction = TransferDirection::kDeviceToHost;
  size_t page_bytes = 0;
  uint32_t factor = 1;
  size_t blocks = 0;
  size_t pool_blocks = 0;
};

std::vector<Case> g_cases;  // in registration order

// The memory and CUDA handles every case shares, sized for the largest case and allocated once:
// pinning hundreds of MiB takes long, and Google Benchmark calls each benchmark function several
// times. Owns what it allocated (freed by the destructor). Not thread-safe: benchmarks run one at
// a time.
struct Buffers {
  std::byte* pool = nullptr;        // the paged device cache
  std::byte* contiguous = nullptr;  // device side of the plain copy
  std::byte* host = nullptr;        // pinned; host side of both
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr;
  cudaEvent_t stop = nullptr;

  Buffers() = default;
  Buffers(const Buffers&) = delete;
  Buffers& operator=(const Buffers&) = delete;
  ~Buffers() {
    if (stop != nullptr) cudaEventDestroy(stop);
    if (start != nullptr) cudaEventDestroy(start);
    if (stream != nullptr) cudaStreamDestroy(stream);
    if (host != nullptr) cudaFreeHost(host);
    if (contiguous != nullptr) cudaFree(contiguous);
    if (pool != nullptr) cudaFree(pool);
  }
};

Buffers* g_buffers = nullptr;

std::string CudaError(const char* what, cudaError_t err) {
  return std::string(what) + ": " + cudaGetErrorString(err);
}

// Allocates the shared buffers; on failure returns null and says which call failed in *error.
std::unique_ptr<Buffers> AllocateBuffers(size_t pool_bytes, size_t job_bytes, std::string* error) {
  auto b = std::make_unique<Buffers>();
  cudaError_t err = cudaMalloc(reinterpret_cast<void**>(&b->pool), pool_bytes);
  if (err == cudaSuccess) err = cudaMalloc(reinterpret_cast<void**>(&b->contiguous), job_bytes);
  if (err == cudaSuccess) err = cudaMallocHost(reinterpret_cast<void**>(&b->host), job_bytes);
  if (err == cudaSuccess) err = cudaStreamCreateWithFlags(&b->stream, cudaStreamNonBlocking);
  if (err == cudaSuccess) err = cudaEventCreate(&b->start);
  if (err == cudaSuccess) err = cudaEventCreate(&b->stop);
  // Touch everything once so that no first-use cost lands in a timed iteration.
  if (err == cudaSuccess) err = cudaMemsetAsync(b->pool, 0, pool_bytes, b->stream);
  if (err == cudaSuccess) err = cudaMemsetAsync(b->contiguous, 0, job_bytes, b->stream);
  if (err == cudaSuccess) err = cudaStreamSynchronize(b->stream);
  if (err != cudaSuccess) {
    *error = CudaError("allocating the benchmark's buffers", err);
    return nullptr;
  }
  std::memset(b->host, 0, job_bytes);
  return b;
}

// One job's plan: the case's blocks at random out of the device pool, to or from host blocks of
// `factor` pages in random order. One tensor whose device pages are adjacent, as in a paged
// cache of one layer's K or V.
Result<TransferPlan> MakePlan(const Case& c) {
  std::mt19937_64 rng(c.page_bytes * 31 + c.factor);  // the same plan on every call
  std::vector<uint32_t> device(c.pool_blocks), host(c.blocks / c.factor);
  std::iota(device.begin(), device.end(), 0u);
  std::iota(host.begin(), host.end(), 0u);
  std::shuffle(device.begin(), device.end(), rng);
  std::shuffle(host.begin(), host.end(), rng);
  TransferSpec spec;
  spec.direction = c.direction;
  spec.factor = c.factor;
  spec.group_sizes = {static_cast<uint32_t>(c.blocks)};
  spec.block_indices = {0};
  spec.refs = {{0}};
  spec.device_blocks.assign(device.begin(), device.begin() + static_cast<std::ptrdiff_t>(c.blocks));
  spec.host_blocks = host;
  const TransferTensor tensor{c.page_bytes, c.page_bytes, c.page_bytes * c.factor};
  return PlanTransfer(spec, {&tensor, 1});
}

// Moves one job with the first and last byte of every source block set to a value of its own and
// those of the destination to something else, and checks that each value arrived where the plan
// says. Empty string when it did, else what went wrong.
std::string CheckOneJob(const TransferPlan& plan, std::span<std::byte* const> device,
                        std::span<std::byte* const> host) {
  Buffers& b = *g_buffers;
  const bool to_host = plan.direction == TransferDirection::kDeviceToHost;
  auto value = [](size_t i) { return static_cast<uint8_t>(i * 7 + 1); };
  auto ends = [](const CopyOp& op) { return std::array<uint64_t, 2>{0, op.bytes - 1}; };
  cudaError_t err = cudaSuccess;
  for (size_t i = 0; i < plan.ops.size() && err == cudaSuccess; ++i) {
    const CopyOp& op = plan.ops[i];
    const uint8_t src = value(i), dst = static_cast<uint8_t>(~value(i));
    for (uint64_t at : ends(op)) {
      std::byte* d = device[op.tensor] + op.device_offset + at;
      std::byte* h = host[op.tensor] + op.host_offset + at;
      *h = std::byte{to_host ? dst : src};
      err = cudaMemsetAsync(d, to_host ? src : dst, 1, b.stream);
      if (err != cudaSuccess) break;
    }
  }
  if (err == cudaSuccess) err = cudaStreamSynchronize(b.stream);
  if (err != cudaSuccess) return CudaError("setting up the check", err);
  if (Status s = cuda::IssueTransfer(plan, device, host, b.stream); !s.ok()) return s.ToString();
  if (err = cudaStreamSynchronize(b.stream); err != cudaSuccess) {
    return CudaError("the checked transfer", err);
  }
  for (size_t i = 0; i < plan.ops.size(); ++i) {
    const CopyOp& op = plan.ops[i];
    for (uint64_t at : ends(op)) {
      std::byte got = host[op.tensor][op.host_offset + at];
      if (!to_host) {
        err =
            cudaMemcpy(&got, device[op.tensor] + op.device_offset + at, 1, cudaMemcpyDeviceToHost);
        if (err != cudaSuccess) return CudaError("reading the device back", err);
      }
      if (got != std::byte{value(i)}) {
        return "block " + std::to_string(i) + " byte " + std::to_string(at) + ": " +
               std::to_string(static_cast<int>(got)) + " where " + std::to_string(value(i)) +
               " was sent";
      }
    }
  }
  return {};
}

// A case's figure, its limit and their ratio: counters of the case and the suite's ratio.
bench::RatioSpec TransferRatio() {
  return bench::RatioOf("ratio", "transfer_GBps", "plain_GBps",
                        "scattered blocks against one contiguous copy", 0.8);
}

void BM_Transfer(benchmark::State& state, const Case& c) {
  Buffers& b = *g_buffers;
  auto fail = [&](const std::string& why) { state.SkipWithError(why.c_str()); };
  auto plan = MakePlan(c);
  if (!plan.ok()) return fail(plan.status().ToString());
  const size_t job_bytes = plan->transfer_bytes;
  std::byte* device_base[] = {b.pool};
  std::byte* host_base[] = {b.host};
  const std::span<std::byte* const> device(device_base);
  const std::span<std::byte* const> host(host_base);
  if (std::string error = CheckOneJob(*plan, device, host); !error.empty()) return fail(error);

  const bool to_host = c.direction == TransferDirection::kDeviceToHost;
  const size_t iteration_bytes = g_smoke ? 0 : (size_t{64} << 20);
  const size_t jobs = std::max<size_t>(1, iteration_bytes / job_bytes);
  // Queues `jobs` of one kind between the two events, waits for them, and returns the GPU
  // milliseconds between the events, or a negative value after reporting the failure.
  auto timed = [&](bool transfer) -> double {
    cudaError_t err = cudaEventRecord(b.start, b.stream);
    for (size_t j = 0; j < jobs && err == cudaSuccess; ++j) {
      if (transfer) {
        if (Status s = cuda::IssueTransfer(*plan, device, host, b.stream); !s.ok()) {
          fail(s.ToString());
          return -1;
        }
      } else if (to_host) {
        err = cudaMemcpyAsync(b.host, b.contiguous, job_bytes, cudaMemcpyDeviceToHost, b.stream);
      } else {
        err = cudaMemcpyAsync(b.contiguous, b.host, job_bytes, cudaMemcpyHostToDevice, b.stream);
      }
    }
    if (err == cudaSuccess) err = cudaEventRecord(b.stop, b.stream);
    if (err == cudaSuccess) err = cudaEventSynchronize(b.stop);
    float ms = 0;
    if (err == cudaSuccess) err = cudaEventElapsedTime(&ms, b.start, b.stop);
    if (err != cudaSuccess) {
      fail(CudaError(transfer ? "timed transfer" : "timed plain copy", err));
      return -1;
    }
    return ms;
  };
  if (timed(false) < 0) return;  // warm-up of the plain copy (CheckOneJob warmed the transfer)

  double transfer_ms = 0, plain_ms = 0;
  bool transfer_first = true;
  for (auto _ : state) {
    double ms[2] = {0, 0};  // transfer, plain
    for (bool transfer : {transfer_first, !transfer_first}) {
      ms[transfer ? 0 : 1] = timed(transfer);
      if (ms[transfer ? 0 : 1] < 0) break;
    }
    if (ms[0] < 0 || ms[1] < 0) break;
    transfer_first = !transfer_first;
    transfer_ms += ms[0];
    plain_ms += ms[1];
    state.SetIterationTime(ms[0] / 1e3);
  }
  if (state.error_occurred() || transfer_ms <= 0 || plain_ms <= 0) return;
  const double bytes = static_cast<double>(state.iterations()) * static_cast<double>(jobs) *
                       static_cast<double>(job_bytes);
  bench::SetRatioCounters(state, TransferRatio(), bytes / (transfer_ms / 1e3) / 1e9,
                          bytes / (plain_ms / 1e3) / 1e9);
  state.counters["job_MiB"] = static_cast<double>(job_bytes) / (1 << 20);
  state.counters["copies_per_job"] = static_cast<double>(plan->ops.size());
  state.counters["jobs_per_iter"] = static_cast<double>(jobs);
}

std::string SizeName(size_t bytes) {
  if (bytes % (size_t{1} << 20) == 0) return std::to_string(bytes >> 20) + "MiB";
  return std::to_string(bytes >> 10) + "KiB";
}

void MakeCases() {
  const size_t blocks = g_smoke ? 16 : 256;
  const std::vector<size_t> pages = g_smoke
                                        ? std::vector<size_t>{size_t{16} << 10, size_t{64} << 10}
                                        : std::vector<size_t>{size_t{16} << 10, size_t{64} << 10,
                                                              size_t{256} << 10, size_t{2} << 20};
  constexpr size_t kFactor4Page = size_t{16} << 10;
  for (TransferDirection dir :
       {TransferDirection::kDeviceToHost, TransferDirection::kHostToDevice}) {
    for (size_t page : pages) {
      for (uint32_t factor : {1u, 4u}) {
        if (factor != 1 && page != kFactor4Page) continue;
        Case c;
        c.name = std::string(dir == TransferDirection::kDeviceToHost ? "Gather/" : "Scatter/") +
                 SizeName(page) + "/f" + std::to_string(factor);
        c.direction = dir;
        c.page_bytes = page;
        c.factor = factor;
        c.blocks = blocks;
        c.pool_blocks = 4 * blocks;
        g_cases.push_back(c);
      }
    }
  }
}

void Register() {
  for (const Case& c : g_cases) {
    benchmark::RegisterBenchmark(c.name.c_str(), [c](benchmark::State& s) { BM_Transfer(s, c); })
        ->UseManualTime()
        ->Unit(benchmark::kMicrosecond);
  }
}

bench::SuiteSpec TransferSuite() {
  using bench::Better;
  bench::SuiteSpec spec;
  spec.name = "transfer_bench";
  spec.title =
      "block gather/scatter between a paged device cache and pinned host memory against "
      "one plain cudaMemcpyAsync of the same bytes";
  spec.usage =
      "Cases: Gather/<page>/f<factor> (device to host) and Scatter/<page>/f<factor> (host to "
      "device): jobs of 256 pages taken at random from a device pool of 1024, to or from pinned "
      "host blocks of factor pages, issued as one plan with kernels::cuda::IssueTransfer and "
      "timed with CUDA events, interleaved with plain copies of the same bytes. Without a CUDA "
      "device it says so and exits 0.";
  spec.counters = {
      {.counter = "transfer_GBps",
       .figure = "",
       .unit = "GB/s",
       .better = Better::kHigher,
       .scale = 1,
       .help = "the transfer: job bytes / GPU time of the jobs"},
      {.counter = "plain_GBps",
       .figure = "",
       .unit = "GB/s",
       .better = Better::kHigher,
       .scale = 1,
       .help = "the limit: one cudaMemcpyAsync of the same bytes between a contiguous device "
               "buffer and the same pinned buffer, same direction, same stream"},
      {.counter = "job_MiB",
       .figure = "",
       .unit = "MiB",
       .better = Better::kHigher,
       .scale = 1,
       .help = "bytes one job moves"},
      {.counter = "copies_per_job",
       .figure = "",
       .unit = "copies",
       .better = Better::kHigher,
       .scale = 1,
       .help = "copies in a job's plan"},
      {.counter = "jobs_per_iter",
       .figure = "",
       .unit = "jobs",
       .better = Better::kHigher,
       .scale = 1,
       .help = "jobs timed per iteration"},
  };
  spec.ratios = {TransferRatio()};
  return spec;
}

// Runs the registered cases over freshly allocated buffers. 1 when they cannot be allocated or a
// case failed; timings never do.
int RunAll(const bench::SuiteSpec& spec, const bench::SuiteOptions& options) {
  size_t pool_bytes = 0, job_bytes = 0;
  for (const Case& c : g_cases) {
    pool_bytes = std::max(pool_bytes, c.pool_blocks * c.page_bytes);
    job_bytes = std::max(job_bytes, c.blocks * c.page_bytes);
  }
  std::string error;
  std::unique_ptr<Buffers> buffers = AllocateBuffers(pool_bytes, job_bytes, &error);
  if (buffers == nullptr) {
    std::fprintf(stderr, "transfer_bench: %s\n", error.c_str());
    return 1;
  }
  g_buffers = buffers.get();
  Register();
  const int rc = bench::RunSuite(spec, options);
  g_buffers = nullptr;
  return rc;
}

}  // namespace
}  // namespace kvstash::kernels

int main(int argc, char** argv) {
  const kvstash::bench::SuiteSpec spec = kvstash::kernels::TransferSuite();
  kvstash::bench::SuiteOptions options;
  if (auto code = kvstash::bench::InitSuite(argc, argv, spec, &options)) return *code;
  kvstash::kernels::g_smoke = options.smoke;
  if (kvstash::kernels::cuda::DeviceCount() == 0) {
    return kvstash::bench::ReportNothing(spec, options, "no CUDA device; nothing measured");
  }
  kvstash::kernels::MakeCases();
  return kvstash::kernels::RunAll(spec, options);
}
