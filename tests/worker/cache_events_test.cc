// A worker's KV events (worker/src/cache_events.h) from a real engine's prefix cache, read by a
// real ZMQ subscriber: the first batch starts over, every group's stores say its block size,
// kind and window, a request's blocks chain by their parents, and evictions are removals.
#include "cache_events.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <zmq.h>

#include <chrono>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "kvstash/common/hash.h"
#include "kvstash/engine/engine.h"

namespace kvstash::worker {
namespace {

using engine::Engine;
using engine::EngineOptions;
using engine::ModelConfig;
using events::ExternalHash;
using Clock = std::chrono::steady_clock;

std::vector<uint32_t> Tokens(size_t n, uint64_t seed) {
  std::vector<uint32_t> t(n);
  for (size_t i = 0; i < n; ++i) t[i] = static_cast<uint32_t>(Mix64(seed * 7919 + i) % 200);
  return t;
}

// Every batch of the default topic from sequence `from` on, through the replay socket, as a
// subscriber that joined late reads them.
std::vector<std::pair<int64_t, std::vector<events::KvEvent>>> Replay(const std::string& endpoint,
                                                                     int64_t from) {
  void* ctx = zmq_ctx_new();
  void* s = zmq_socket(ctx, ZMQ_DEALER);
  const int linger = 0, timeout = 10000;
  zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof(linger));
  zmq_setsockopt(s, ZMQ_RCVTIMEO, &timeout, sizeof(timeout));
  EXPECT_EQ(zmq_connect(s, endpoint.c_str()), 0);
  const std::string start = events::EncodeSequence(from);
  zmq_send(s, "", 0, ZMQ_SNDMORE);
  zmq_send(s, start.data(), start.size(), 0);
  std::vector<std::pair<int64_t, std::vector<events::KvEvent>>> out;
  while (true) {
    std::vector<std::string> frames;
    int more = 1;
    bool ok = true;
    while (more != 0) {
      zmq_msg_t m;
      zmq_msg_init(&m);
      if (zmq_msg_recv(&m, s, 0) < 0) {
        zmq_msg_close(&m);
        ok = false;
        break;
      }
      frames.emplace_back(static_cast<const char*>(zmq_msg_data(&m)), zmq_msg_size(&m));
      more = zmq_msg_more(&m);
      zmq_msg_close(&m);
    }
    if (!ok || frames.size() != 3) {
      ADD_FAILURE() << "no replay reply";
      break;
    }
    const int64_t seq = *events::DecodeSequence(std::as_bytes(std::span(frames[1])));
    if (seq == -1) break;
    auto batch = events::DecodeBatch(std::as_bytes(std::span(frames[2])));
    EXPECT_TRUE(batch.ok()) << batch.status().ToString();
    out.emplace_back(seq, batch.ok() ? batch->events : std::vector<events::KvEvent>{});
  }
  zmq_close(s);
  zmq_ctx_term(ctx);
  return out;
}

TEST(CacheEventsTest, AHybridEnginesCacheIsPublishedGroupByGroupWithChainsAndRemovals) {
  auto config = ModelConfig::Load("builtin:tiny-hybrid");
  ASSERT_TRUE(config.ok());
  EngineOptions o;
  o.num_blocks = 48;  // small: the second prompt evicts the first's blocks
  o.record_cache_events = true;
  auto made = Engine::Create(*config, o);
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  std::unique_ptr<Engine> engine = std::move(*made);
  const std::vector<engine::AttentionSpec>& groups = engine->layout().groups;
  ASSERT_GE(groups.size(), 2u);

  events::PublisherOptions options;
  options.endpoint = "tcp://127.0.0.1:*";
  options.replay_endpoint = "tcp://127.0.0.1:*";
  auto publisher = CacheEventPublisher::Create(options, groups);
  ASSERT_TRUE(publisher.ok()) << publisher.status().ToString();
  std::unique_ptr<CacheEventPublisher> live = std::move(*publisher);
  const std::string replay = live->publisher().replay_endpoint();

  // One prompt: every full block of every group is cached, and published.
  const std::vector<uint32_t> prompt = Tokens(16 * 12 + 5, 1);
  ASSERT_TRUE(engine->AddRequest(prompt, 2).ok());
  std::map<int64_t, std::vector<ExternalHash>> stored;  // by group, in order
  std::set<int64_t> groups_seen;
  while (engine->HasUnfinished()) {
    (void)engine->Step();
    live->Publish(engine->TakeCacheEvents());
  }
  live->Flush();
  const auto batches = Replay(replay, 0);
  ASSERT_FALSE(batches.empty());
  // Numbered from 0 without a gap; the first starts over.
  for (size_t i = 0; i < batches.size(); ++i) EXPECT_EQ(batches[i].first, static_cast<int64_t>(i));
  ASSERT_FALSE(batches[0].second.empty());
  EXPECT_EQ(batches[0].second[0], events::KvEvent(events::AllBlocksCleared{}));
  std::vector<events::KvEvent> all;
  for (const auto& [seq, evs] : batches) {
    for (const auto& e : evs) {
      if (!std::holds_alternative<events::AllBlocksCleared>(e)) all.push_back(e);
    }
  }
  ASSERT_FALSE(all.empty());
  std::set<ExternalHash> evicted;  // a sliding window's blocks may go within the request
  for (const events::KvEvent& e : all) {
    if (const auto* r = std::get_if<events::BlockRemoved>(&e)) {
      evicted.insert(r->block_hashes.begin(), r->block_hashes.end());
      continue;
    }
    const auto* s = std::get_if<events::BlockStored>(&e);
    ASSERT_NE(s, nullptr) << events::DebugString(e);
    ASSERT_TRUE(s->group_idx.has_value());
    const auto& spec = groups.at(static_cast<size_t>(*s->group_idx));
    EXPECT_EQ(s->medium, "GPU");
    EXPECT_EQ(s->block_size, spec.block_size);
    EXPECT_EQ(s->kv_cache_spec_kind, std::string(SpecKindName(spec.kind)));
    EXPECT_EQ(s->kv_cache_spec_sliding_window, SpecWindow(spec));
    EXPECT_TRUE(s->token_ids.empty());
    std::vector<ExternalHash>& chain = stored[*s->group_idx];
    // Each event continues its group's chain: its parent is the last hash before it.
    if (chain.empty()) {
      EXPECT_FALSE(s->parent_block_hash.has_value()) << events::DebugString(e);
    } else if (s->parent_block_hash) {
      EXPECT_EQ(*s->parent_block_hash, chain.back()) << events::DebugString(e);
    }
    chain.insert(chain.end(), s->block_hashes.begin(), s->block_hashes.end());
    groups_seen.insert(*s->group_idx);
  }
  // The full-attention group caches all 12 full blocks; every group published some.
  EXPECT_EQ(groups_seen.size(), groups.size());
  for (size_t g = 0; g < groups.size(); ++g) {
    if (groups[g].kind == engine::AttentionSpec::Kind::kFull) {
      EXPECT_EQ(stored[static_cast<int64_t>(g)].size(), prompt.size() / groups[g].block_size);
    }
  }

  // A second, unrelated prompt needs the pool: the first's cached blocks are evicted and
  // published as removed, each a hash published as stored before.
  std::set<ExternalHash> known;
  for (const auto& [g, chain] : stored) known.insert(chain.begin(), chain.end());
  ASSERT_TRUE(engine->AddRequest(Tokens(16 * 20, 2), 2).ok());
  while (engine->HasUnfinished()) {
    (void)engine->Step();
    live->Publish(engine->TakeCacheEvents());
  }
  live->Flush();
  size_t removed = 0;
  for (const auto& [seq, evs] : Replay(replay, static_cast<int64_t>(batches.size()))) {
    for (const auto& e : evs) {
      if (const auto* r = std::get_if<events::BlockRemoved>(&e)) {
        EXPECT_EQ(r->medium, "GPU");
        for (const ExternalHash& h : r->block_hashes) {
          EXPECT_TRUE(known.count(h)) << events::DebugString(e);
          ++removed;
        }
      } else if (const auto* s = std::get_if<events::BlockStored>(&e)) {
        known.insert(s->block_hashes.begin(), s->block_hashes.end());
      }
    }
  }
  EXPECT_GT(removed, 0u);
}

}  // namespace
}  // namespace kvstash::worker
