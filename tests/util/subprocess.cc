#include "subprocess.h"

#include <gtest/gtest.h>

namespace kvstash::testing {

ProcessResult RunProcess(const std::vector<std::string>& argv, const std::string& input) {
  RunOptions options;
  options.input = input;
  Result<ProcessOutput> run = RunProgram(argv, options);
  if (!run.ok()) {
    ProcessResult failed;
    failed.err = run.status().ToString();
    return failed;
  }
  return std::move(run).value();
}

std::unique_ptr<ChildProcess> StartChild(const std::vector<std::string>& argv) {
  Result<std::unique_ptr<ChildProcess>> child = ChildProcess::Create(argv);
  if (!child.ok()) {
    ADD_FAILURE() << child.status().ToString();
    return nullptr;
  }
  return std::move(child).value();
}

}  // namespace kvstash::testing
