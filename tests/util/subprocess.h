// Running programs from tests, over the one subprocess utility (kvstash/common/subprocess.h):
// to completion with their output (RunProcess), or alongside (StartChild).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "kvstash/common/subprocess.h"

namespace kvstash::testing {

using ProcessResult = ::kvstash::ProcessOutput;
using ::kvstash::ChildProcess;

// Runs argv[0] with `argv`, feeding `input` on standard input, and waits for it. A program that
// cannot run gives exit_code -1 with the reason in `err`.
ProcessResult RunProcess(const std::vector<std::string>& argv, const std::string& input = "");

// Starts argv[0] with its output read line by line (standard error inherited). A test failure
// and nullptr when it cannot start.
std::unique_ptr<ChildProcess> StartChild(const std::vector<std::string>& argv);

}  // namespace kvstash::testing
