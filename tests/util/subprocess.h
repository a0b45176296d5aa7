// Runs a program to completion for tests: argv, optional standard input, captured output.
#pragma once

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

}  // namespace kvstash::testing
