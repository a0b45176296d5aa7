#pragma once

// What every kvstash program (kvstash, kvstashd, kvstash-engine) agrees on when it fails: the
// exit codes, which status becomes which code, and how the error is printed, a bad command line
// included (ParseCommandLine). One place, so a script that runs any of them reads their failures
// the same way.

#include <optional>
#include <string>
#include <string_view>

#include "kvstash/common/status.h"

// Declared, not included: every program declares its flags with CLI11, and only they need its
// header (the libraries below them do not).
namespace CLI {
class App;
}  // namespace CLI

namespace kvstash::cli {

inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;  // the operation failed (I/O, an unreachable node, ...)
inline constexpr int kExitUsage = 2;    // bad arguments or malformed input

// kExitUsage for InvalidArgument (a bad argument, malformed input), else kExitFailure (a file
// that cannot be read, a node that refuses or cannot be reached, ...).
int ExitCodeFor(const Status& status);

// Prints the errors of one program or subcommand as "NAME: message" on standard error.
// Thread-safe (one write per line).
class ErrorReporter {
 public:
  explicit ErrorReporter(std::string name) : name_(std::move(name)) {}
  // Prints `message` and returns `code`.
  int Fail(int code, std::string_view message) const;
  // Prints the status's message and returns ExitCodeFor(status).
  int Fail(const Status& status) const;

 private:
  std::string name_;
};

// Parses the command line into `app`, the flags every kvstash program declares with CLI11 (a
// subcommand's callback, if it has one, runs here). nullopt when the program goes on; else the
// code it exits with: kExitOk after --help (printed on standard output), kExitUsage for a bad
// argument, printed as the program's other errors are: "NAME: message (see NAME SUBCOMMAND
// --help)" on standard error, NAME the app's name.
std::optional<int> ParseCommandLine(CLI::App& app, int argc, const char* const* argv);

}  // namespace kvstash::cli
