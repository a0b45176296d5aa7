#include "kvstash/bench/harness.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <fstream>
#include <limits>
#include <numeric>
#include <thread>

#include "fmt/format.h"

extern char** environ;

namespace kvstash::bench {

double Gbps(uint64_t bytes, std::chrono::steady_clock::duration elapsed) {
  const double seconds = std::chrono::duration<double>(elapsed).count();
  return seconds > 0 ? static_cast<double>(bytes) / seconds / 1e9 : 0.0;
}

double CopyLimitGbps(size_t block_bytes, size_t working_set_bytes, int rounds) {
  if (block_bytes == 0) return 0;
  const size_t slots =
      std::max<size_t>(1, std::min(working_set_bytes, size_t{1} << 30) / block_bytes);
  std::vector<std::byte> region(slots * block_bytes, std::byte{1});  // touched: no page faults
  std::vector<std::byte> source(block_bytes, std::byte{2});
  // A fixed scattered order over the slots (a stride coprime with their count).
  size_t stride = slots / 2 + 1;
  while (std::gcd(stride, slots) != 1) ++stride;
  // Each round copies the working set, and at least 64 MiB, so it is long enough to time.
  const size_t copies = std::max(slots, (size_t{64} << 20) / block_bytes);
  std::vector<double> rates;
  size_t slot = 0;
  for (int r = 0; r < std::max(rounds, 1); ++r) {
    const auto start = std::chrono::steady_clock::now();
    for (size_t i = 0; i < copies; ++i) {
      std::memcpy(region.data() + slot * block_bytes, source.data(), block_bytes);
      slot = (slot + stride) % slots;
    }
    rates.push_back(Gbps(copies * block_bytes, std::chrono::steady_clock::now() - start));
  }
  // Keeps the copies from being optimised away.
  volatile std::byte sink = region[slot * block_bytes];
  (void)sink;
  return Median(rates);
}

double Median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 == 1 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2;
}

double Percentile(std::vector<double> values, double p) {
  const size_t n = values.size();
  const double rank = std::ceil(p / 100.0 * static_cast<double>(n));
  const size_t index = std::clamp<size_t>(rank < 1 ? 0 : static_cast<size_t>(rank) - 1, 0, n - 1);
  std::nth_element(values.begin(), values.begin() + static_cast<std::ptrdiff_t>(index),
                   values.end());
  return values[index];
}

std::optional<double> Ratio(double value, std::optional<double> reference) {
  if (!reference.has_value() || !(*reference > 0)) return std::nullopt;
  return value / *reference;
}

Json OrNull(std::optional<double> v) { return v.has_value() ? Json(*v) : Json(nullptr); }

std::string Fixed(std::optional<double> v) {
  return v.has_value() ? fmt::format("{:.2f}", *v) : std::string("-");
}

}  // namespace kvstash::bench
