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

Result<ProcessOutput> RunProgram(const std::vector<std::string>& argv,
                                 const RunProgramOptions& options) {
  int out_pipe[2];
  int err_pipe[2];
  if (pipe2(out_pipe, O_CLOEXEC) != 0) return FromErrno(errno, "pipe");
  if (pipe2(err_pipe, O_CLOEXEC) != 0) {
    const int e = errno;
    close(out_pipe[0]);
    close(out_pipe[1]);
    return FromErrno(e, "pipe");
  }
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_adddup2(&actions, out_pipe[1], 1);
  posix_spawn_file_actions_adddup2(&actions, err_pipe[1], 2);
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  std::vector<char*> env;
  for (const std::string& e : options.env) env.push_back(const_cast<char*>(e.c_str()));
  env.push_back(nullptr);
  pid_t pid = -1;
  const int rc = posix_spawnp(&pid, args[0], &actions, nullptr, args.data(),
                              options.env.empty() ? environ : env.data());
  posix_spawn_file_actions_destroy(&actions);
  close(out_pipe[1]);
  close(err_pipe[1]);
  if (rc != 0) {
    close(out_pipe[0]);
    close(err_pipe[0]);
    if (rc == ENOENT) return NotFoundError("{} is not installed (not found on PATH)", argv[0]);
    return FromErrno(rc, fmt::format("cannot run {}", argv[0]));
  }

  // Both pipes at once: a child blocked on a full stderr pipe would never finish its stdout.
  using Clock = std::chrono::steady_clock;
  const bool bounded = options.timeout.count() > 0;
  const Clock::time_point deadline = Clock::now() + options.timeout;
  bool timed_out = false;
  ProcessOutput result;
  pollfd fds[2] = {{out_pipe[0], POLLIN, 0}, {err_pipe[0], POLLIN, 0}};
  std::string* sinks[2] = {&result.out, &result.err};
  int open_fds = 2;
  char buf[65536];
  while (open_fds > 0) {
    int wait_ms = -1;
    if (bounded) {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      if (left <= 0) {
        timed_out = true;
        break;
      }
      wait_ms = static_cast<int>(std::min<int64_t>(left, std::numeric_limits<int>::max()));
    }
    const int ready = poll(fds, 2, wait_ms);
    if (ready < 0) {
      if (errno == EINTR) continue;
      break;
    }
    for (int i = 0; i < 2; ++i) {
      if (fds[i].fd < 0 || fds[i].revents == 0) continue;
      const ssize_t n = read(fds[i].fd, buf, sizeof(buf));
      if (n > 0) {
        sinks[i]->append(buf, static_cast<size_t>(n));
      } else if (n == 0 || errno != EINTR) {
        close(fds[i].fd);
        fds[i].fd = -1;
        --open_fds;
      }
    }
  }
  for (pollfd& p : fds) {
    if (p.fd >= 0) close(p.fd);
  }
  if (timed_out) kill(pid, SIGKILL);
  int wstatus = 0;
  while (waitpid(pid, &wstatus, 0) < 0) {
    if (errno != EINTR) return FromErrno(errno, fmt::format("waitpid for {}", argv[0]));
  }
  if (timed_out) {
    return DeadlineExceededError("{} did not finish within {} s and was killed; its output: {}",
                                 argv[0], options.timeout.count() / 1000.0,
                                 result.err.empty() ? result.out : result.err);
  }
  result.exit_code = WIFEXITED(wstatus) ? WEXITSTATUS(wstatus) : 128 + WTERMSIG(wstatus);
  return result;
}

std::vector<std::string> EnvironmentWith(std::string_view name, std::string_view value) {
  std::vector<std::string> env;
  const std::string prefix = fmt::format("{}=", name);
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    const std::string_view entry(*e);
    if (entry.substr(0, prefix.size()) != prefix) env.emplace_back(entry);
  }
  env.push_back(prefix + std::string(value));
  return env;
}

int ReapChild(pid_t pid, std::chrono::milliseconds timeout) {
  using Clock = std::chrono::steady_clock;
  const Clock::time_point deadline = Clock::now() + timeout;
  int wstatus = 0;
  for (;;) {
    const pid_t done = waitpid(pid, &wstatus, WNOHANG);
    if (done == pid) break;
    if (done < 0 && errno != EINTR) return -1;
    if (Clock::now() >= deadline) {
      kill(pid, SIGKILL);
      while (waitpid(pid, &wstatus, 0) < 0) {
        if (errno != EINTR) return -1;
      }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return WIFEXITED(wstatus) ? WEXITSTATUS(wstatus) : 128 + WTERMSIG(wstatus);
}

}  // namespace kvstash::bench
