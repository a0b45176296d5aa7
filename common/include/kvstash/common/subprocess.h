#pragma once

// Running other programs: to completion with their output collected (RunProgram: the tools a
// benchmark compares against, the programs a test runs), or alongside (ChildProcess: a daemon a
// test talks to, a ucx_perftest server). The one place kvstash forks and execs.
//
// Exit statuses are the program's exit code, or 128 + the signal that ended it.

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kvstash/common/status.h"

namespace kvstash {

struct ProcessOutput {
  int exit_code = -1;  // the exit status, or 128 + signal number
  std::string out;
  std::string err;
};

struct RunOptions {
  // The child's environment as NAME=VALUE strings; empty: this process's environment.
  std::vector<std::string> env;
  // The child is killed (SIGKILL) and the run fails with DeadlineExceeded after this long;
  // zero: no limit.
  std::chrono::milliseconds timeout{0};
  // Its standard input (empty: nothing, as /dev/null).
  std::string input;
};

// Runs `argv` (argv[0] looked up on PATH unless it holds a '/', no shell) and collects both
// outputs (read together, so a full stderr never blocks a long stdout). NotFound when the
// program does not exist; DeadlineExceeded past options.timeout.
Result<ProcessOutput> RunProgram(const std::vector<std::string>& argv,
                                 const RunOptions& options = {});

// This process's environment with `name` set to `value` (replaced if present).
std::vector<std::string> EnvironmentWith(std::string_view name, std::string_view value);

// Waits up to `timeout` for child `pid` to exit, then kills it (SIGKILL) and reaps it. Its exit
// status, or -1 if it could not be reaped.
int ReapChild(pid_t pid, std::chrono::milliseconds timeout);

struct ChildOptions {
  std::vector<std::string> env;  // as RunOptions::env
  // Where standard output (and, with merge_stderr, standard error) goes: a pipe read line by
  // line (ReadLine), or memory kept for Output() (a child nobody reads while it runs).
  enum class Output : uint8_t { kLines, kMemory };
  Output output = Output::kLines;
  bool merge_stderr = false;  // else standard error is this process's
};

// A program running alongside this process: its standard input written line by line, its
// output read as ChildOptions says. Killed (SIGKILL) and reaped when destroyed, and killed by
// the kernel if this process dies first, so a crashed test or tool leaves no process behind.
// Not thread-safe.
class ChildProcess {
 public:
  // Starts `argv` (looked up as RunProgram does). NotFound when the program does not exist.
  static Result<std::unique_ptr<ChildProcess>> Create(const std::vector<std::string>& argv,
                                                      const ChildOptions& options = {});
  ~ChildProcess();
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  pid_t pid() const { return pid_; }
  // The next line of output without its newline, or nullopt at the end of output or after
  // `timeout_ms` without a complete line (Output::kLines).
  std::optional<std::string> ReadLine(int timeout_ms);
  // Everything printed so far (Output::kMemory).
  std::string Output() const;
  // Writes `line` and a newline to its standard input; false if it cannot.
  bool WriteLine(const std::string& line);
  // True once it has exited (reaping it), without waiting.
  bool Exited();
  // Sends `signal`, then waits: its exit status.
  int Kill(int signal);
  // Waits for it to exit: its exit status.
  int Wait();
  // Waits up to `timeout`, then kills it: its exit status.
  int Wait(std::chrono::milliseconds timeout);

 private:
  ChildProcess() = default;

  pid_t pid_ = -1;
  int out_fd_ = -1;  // the read end of its output pipe, or its memory file
  int in_fd_ = -1;
  bool memory_ = false;
  std::string buffer_;
  int status_ = -1;
};

}  // namespace kvstash
