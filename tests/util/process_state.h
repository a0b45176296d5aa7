#pragma once

// Waiting for a signal to take effect: kill() returns before the target takes it (a thread
// running on another CPU takes it when the kernel next stops it), and until then the target can
// still answer a request.

#include <sys/types.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>

namespace kvstash::testing {

// Whether every thread of `pid` shows as stopped (SIGSTOP), within `timeout`.
inline bool WaitUntilStopped(pid_t pid, std::chrono::milliseconds timeout) {
  const auto all_stopped = [pid] {
    std::error_code error;
    const std::filesystem::path tasks = "/proc/" + std::to_string(pid) + "/task";
    for (const auto& task : std::filesystem::directory_iterator(tasks, error)) {
      std::ifstream stat(task.path() / "stat");
      const std::string text((std::istreambuf_iterator<char>(stat)),
                             std::istreambuf_iterator<char>());
      const size_t paren = text.rfind(')');
      if (paren == std::string::npos || paren + 2 >= text.size()) return false;
      if (text[paren + 2] != 'T' && text[paren + 2] != 't') return false;
    }
    return !error;
  };
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!all_stopped()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return true;
}

}  // namespace kvstash::testing
