// The cluster client's counter registry: one complete row per counter, names that every consumer
// can use as keys and metric names, and the snapshot and atomic cells indexed by it.

#include "kvstash/common/client_counters.h"

#include <gtest/gtest.h>

#include <regex>
#include <set>
#include <string>
#include <vector>

namespace kvstash {
namespace {

TEST(ClientCountersTest, EveryRowHasUniqueNamesAndAOneLineHelp) {
  const std::regex snake("^[a-z][a-z0-9_]*$");
  std::set<std::string> names, export_names;
  for (const ClientCounterDef& def : kClientCounterDefs) {
    EXPECT_TRUE(std::regex_match(def.name, snake)) << def.name;
    EXPECT_TRUE(std::regex_match(def.export_name, snake)) << def.export_name;
    EXPECT_TRUE(names.insert(def.name).second) << def.name << " twice";
    EXPECT_TRUE(export_names.insert(def.export_name).second) << def.export_name << " twice";
    const std::string help = def.help;
    EXPECT_FALSE(help.empty()) << def.name;
    EXPECT_EQ(help.find('\n'), std::string::npos) << def.name;
  }
  EXPECT_EQ(names.size(), kClientCounterCount);
}

TEST(ClientCountersTest, NamesUsersReadBeforeTheRegistryAreKept) {
  std::set<std::string> names;
  for (const ClientCounterDef& def : kClientCounterDefs) names.insert(def.name);
  for (const char* name : {"calls", "unreachable", "refused", "touched_keys", "pinned_keys",
                           "unserved_keys", "repaired_blocks", "members_joined", "members_left",
                           "skipped_calls", "late_keys", "probes", "abandoned_calls"}) {
    EXPECT_TRUE(names.count(name)) << name;
  }
  const auto export_name = [](ClientCounter c) {
    return std::string(kClientCounterDefs[static_cast<size_t>(c)].export_name);
  };
  EXPECT_EQ(export_name(ClientCounter::kUnreachable), "node_unreachable");
  EXPECT_EQ(export_name(ClientCounter::kRefused), "node_refusals");
  EXPECT_EQ(export_name(ClientCounter::kTouchedKeys), "touched_keys");
  EXPECT_EQ(export_name(ClientCounter::kUnservedKeys), "node_unserved_keys");
  EXPECT_EQ(export_name(ClientCounter::kMembersJoined), "members_joined");
  EXPECT_EQ(export_name(ClientCounter::kMembersLeft), "members_left");
}

TEST(ClientCountersTest, SnapshotsReadWhatWasAddedAndForEachVisitsEveryRowInOrder) {
  AtomicClientCounters cells;
  cells.Add(ClientCounter::kCalls);
  cells.Add(ClientCounter::kCalls, 2);
  cells.Add(ClientCounter::kLateKeys, 7);
  cells.Add(ClientCounter::kProbes, 0);
  const ClientCounters snapshot = cells.Snapshot();
  EXPECT_EQ(snapshot[ClientCounter::kCalls], 3u);
  EXPECT_EQ(snapshot[ClientCounter::kLateKeys], 7u);
  EXPECT_EQ(snapshot[ClientCounter::kProbes], 0u);
  EXPECT_EQ(cells.Get(ClientCounter::kLateKeys), 7u);

  std::vector<ClientCounter> seen;
  uint64_t sum = 0;
  snapshot.ForEach([&](const ClientCounterDef& def, uint64_t value) {
    seen.push_back(def.id);
    sum += value;
  });
  ASSERT_EQ(seen.size(), kClientCounterCount);
  for (size_t i = 0; i < seen.size(); ++i) EXPECT_EQ(static_cast<size_t>(seen[i]), i);
  EXPECT_EQ(sum, 10u);

  ClientCounters copy = snapshot;
  EXPECT_EQ(copy, snapshot);
  copy[ClientCounter::kAbandonedCalls] = 1;
  EXPECT_NE(copy, snapshot);
}

}  // namespace
}  // namespace kvstash
