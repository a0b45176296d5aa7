#pragma once

// What the engine tests that compare generated tokens share.

#include <gtest/gtest.h>

#include <vector>

#include "kvstash/engine/engine.h"

namespace kvstash::engine {

using Outputs = std::vector<std::vector<uint32_t>>;

// Runs the prompts, all queued at once, and returns each one's generated tokens.
inline Outputs GenerateAll(Engine& e, const std::vector<std::vector<uint32_t>>& prompts,
                           size_t max_new) {
  auto results = e.Generate(prompts, max_new);
  EXPECT_TRUE(results.ok()) << results.status().ToString();
  Outputs out;
  if (!results.ok()) return out;
  for (const auto& r : *results) out.emplace_back(r->output().begin(), r->output().end());
  return out;
}

}  // namespace kvstash::engine
