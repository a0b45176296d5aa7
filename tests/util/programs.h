#pragma once

// The programs multi-process tests start. Each path is the one this build made, unless the
// environment names another: KVSTASH_TEST_KVSTASHD, KVSTASH_TEST_ENGINE and KVSTASH_TEST_CLI
// run a test against other binaries (the adversarial suite is checked this way against the
// commit before a fix: the test must fail there).

#include <cstdlib>
#include <string>

namespace kvstash::testing {

// `variable`'s value when it is set and not empty, else `built`.
inline std::string ProgramPath(const char* variable, const char* built) {
  const char* chosen = std::getenv(variable);
  return chosen != nullptr && *chosen != '\0' ? std::string(chosen) : std::string(built);
}

#ifdef KVSTASHD_PATH
inline std::string KvstashdPath() { return ProgramPath("KVSTASH_TEST_KVSTASHD", KVSTASHD_PATH); }
#endif
#ifdef KVSTASH_ENGINE_PATH
inline std::string EnginePath() { return ProgramPath("KVSTASH_TEST_ENGINE", KVSTASH_ENGINE_PATH); }
#endif
#ifdef KVSTASH_CLI_PATH
inline std::string CliPath() { return ProgramPath("KVSTASH_TEST_CLI", KVSTASH_CLI_PATH); }
#endif

}  // namespace kvstash::testing
