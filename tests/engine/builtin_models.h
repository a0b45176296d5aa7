#pragma once

// The built-in models as a test parameter: INSTANTIATE_TEST_SUITE_P(Builtins, SomeTest,
// BuiltinModels(), BuiltinModelName) runs SomeTest once per built-in, named tiny_full and so on.

#include <gtest/gtest.h>

#include <string>

#include "kvstash/engine/model.h"

namespace kvstash::engine {

inline auto BuiltinModels() { return ::testing::ValuesIn(ModelConfig::BuiltinNames()); }

// "tiny-state-hybrid" -> "tiny_state_hybrid" (gtest names allow no dashes).
inline std::string BuiltinModelName(const ::testing::TestParamInfo<std::string>& param_info) {
  std::string name = param_info.param;
  for (char& c : name) {
    if (c == '-') c = '_';
  }
  return name;
}

}  // namespace kvstash::engine
