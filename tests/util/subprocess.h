// Runs a program to completion for tests: argv, optional standard input, captured output.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace kvstash::testing {

struct ProcessResult {
  int exit_code = -1;  // the exit status, or 128 + signal number
  std::string out;
  std::string err;
};

// Runs argv[0] (a path) with `argv`, feeding `input` on standard input, and waits for it.
// Output goes through temporary files, so large outputs cannot deadlock.
ProcessResult RunProcess(const std::vector<std::string>& argv, const std::string& input = "");

// A child process whose standard output the test reads line by line while it runs, and whose
// standard input it writes (standard error is inherited). Killed with SIGKILL and reaped when
// destroyed.
class ChildProcess {
 public:
  // Starts argv[0] (a path). pid() is -1 if it could not start.
  explicit ChildProcess(const std::vector<std::string>& argv);
  ~ChildProcess();
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  int pid() const { return pid_; }
  // The next line of output without its newline, or nullopt at end of output or after
  // `timeout_ms` without a complete line.
  std::optional<std::string> ReadLine(int timeout_ms);
  // Writes `line` and a newline to its standard input; false if it cannot.
  bool WriteLine(const std::string& line);
  // Sends `signal`, then waits; returns the exit status as RunProcess does.
  int Kill(int signal);
  // Waits for exit; returns the exit status as RunProcess does.
  int Wait();

 private:
  int pid_ = -1;
  int out_fd_ = -1;
  int in_fd_ = -1;
  std::string buffer_;
  int status_ = -1;
};

}  // namespace kvstash::testing
