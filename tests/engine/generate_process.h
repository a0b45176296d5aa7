#pragma once

// `kvstash-engine generate` as a child process, for the multi-process engine tests: its tokens
// and its --stats line.

#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "subprocess.h"

namespace kvstash::engine {

// The built-ins' page (4096 bytes) plus the block trailer.
inline constexpr const char* kNodeBlockBytes = "4152";

// A generate run: its exit code, its tokens and the key=value pairs of its --stats line.
struct WorkerRun {
  int exit_code = -1;
  std::vector<uint32_t> tokens;  // the last line
  std::map<std::string, uint64_t> stats;
  std::string err;
};

// n prompt tokens of the built-ins' vocabulary, drawn from `seed`.
inline std::string Prompt(size_t n, uint64_t seed) {
  std::string s;
  for (size_t i = 0; i < n; ++i) s += (i ? " " : "") + std::to_string((i * 37 + seed * 11) % 256);
  return s;
}

inline std::string Join(const std::vector<uint32_t>& t) {
  std::string s;
  for (size_t i = 0; i < t.size(); ++i) s += (i ? " " : "") + std::to_string(t[i]);
  return s;
}

// `kvstash-engine generate --stats` of 8 new tokens on a built-in model, with --nodes and
// --role when `nodes` is not empty, and `extra` arguments.
inline WorkerRun Generate(const std::string& model, const std::string& prompt,
                          const std::string& role, const std::string& nodes,
                          std::vector<std::string> extra = {}) {
  std::vector<std::string> argv = {KVSTASH_ENGINE_PATH, "generate", "--model",
                                   "builtin:" + model,  "--prompt", prompt,
                                   "--max-new-tokens",  "8",        "--stats"};
  if (!nodes.empty()) argv.insert(argv.end(), {"--nodes", nodes, "--role", role});
  argv.insert(argv.end(), extra.begin(), extra.end());
  const auto r = ::kvstash::testing::RunProcess(argv);
  WorkerRun run;
  run.exit_code = r.exit_code;
  run.err = r.err;
  std::istringstream in(r.out);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  if (lines.size() < 2) return run;
  std::istringstream last(lines.back());
  for (uint32_t t; last >> t;) run.tokens.push_back(t);
  std::istringstream stats(lines[lines.size() - 2]);
  for (std::string kv; stats >> kv;) {
    const size_t eq = kv.find('=');
    if (eq != std::string::npos) run.stats[kv.substr(0, eq)] = std::stoull(kv.substr(eq + 1));
  }
  return run;
}

}  // namespace kvstash::engine
