#pragma once

// A test's subscriber of a node's KV events (docs/semantics.md §19): a ZMQ SUB socket, each
// batch decoded (events::DecodeBatch), and what the events said of each block stored: its
// parent and block size as vLLM's BlockStored chains them. Link kvstash::events and
// PkgConfig::ZMQ.

#include <gtest/gtest.h>
#include <zmq.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <map>
#include <optional>
#include <ostream>
#include <span>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "kvstash/events/kv_events.h"

namespace kvstash::testing {

class KvEventWatch {
 public:
  // What the events said of one stored block: its parent (the event's for its first block,
  // else the block before it in the event) and its event's block size.
  struct Said {
    std::optional<events::ExternalHash> parent;
    int64_t block_size = 0;
    std::string medium;
    bool operator==(const Said&) const = default;
    friend void PrintTo(const Said& s, std::ostream* os) {
      *os << "{parent=";
      if (!s.parent) {
        *os << "None";
      } else if (const auto* n = std::get_if<uint64_t>(&*s.parent)) {
        *os << *n;
      } else {
        *os << "0x";
        for (unsigned char c : std::get<std::string>(*s.parent)) {
          *os << "0123456789abcdef"[c >> 4] << "0123456789abcdef"[c & 15];
        }
      }
      *os << ", block_size=" << s.block_size << ", medium=" << s.medium << "}";
    }
  };

  explicit KvEventWatch(const std::string& endpoint) {
    ctx_ = zmq_ctx_new();
    sub_ = zmq_socket(ctx_, ZMQ_SUB);
    const int linger = 0;
    zmq_setsockopt(sub_, ZMQ_LINGER, &linger, sizeof(linger));
    zmq_setsockopt(sub_, ZMQ_SUBSCRIBE, "", 0);
    EXPECT_EQ(zmq_connect(sub_, endpoint.c_str()), 0) << endpoint;
  }
  ~KvEventWatch() {
    zmq_close(sub_);
    zmq_ctx_term(ctx_);
  }
  KvEventWatch(const KvEventWatch&) = delete;
  KvEventWatch& operator=(const KvEventWatch&) = delete;

  // A SUB socket joins asynchronously: calls probe(0), probe(1), ... (each making the node
  // publish something) until a batch arrives, then drops what is queued. False after 10 s.
  bool Join(const std::function<void(int)>& probe) {
    SetTimeout(50);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    bool joined = false;
    for (int i = 0; !joined && std::chrono::steady_clock::now() < deadline; ++i) {
      probe(i);
      joined = Receive().has_value();
    }
    while (joined && Receive()) {
    }
    SetTimeout(10000);
    return joined;
  }

  // The next batch, its topic and events; none after the timeout (10 s once joined).
  std::optional<std::pair<std::string, std::vector<events::KvEvent>>> Receive() {
    std::vector<std::string> frames;
    for (int more = 1; more != 0;) {
      zmq_msg_t msg;
      zmq_msg_init(&msg);
      if (zmq_msg_recv(&msg, sub_, 0) < 0) {
        zmq_msg_close(&msg);
        return std::nullopt;
      }
      frames.emplace_back(static_cast<const char*>(zmq_msg_data(&msg)), zmq_msg_size(&msg));
      more = zmq_msg_more(&msg);
      zmq_msg_close(&msg);
    }
    EXPECT_EQ(frames.size(), 3u);
    if (frames.size() != 3) return std::nullopt;
    auto batch = events::DecodeBatch(std::as_bytes(std::span(frames[2])));
    EXPECT_TRUE(batch.ok()) << batch.status().ToString();
    if (!batch.ok()) return std::nullopt;
    return std::make_pair(frames[0], std::move(batch->events));
  }

  // Reads `topic`'s batches until each of `hashes` was stored (other blocks' events skipped):
  // what the events said of each. Blocks are followed rather than batches, as the stores of one
  // call may be published over more than one round.
  std::map<events::ExternalHash, Said> Stored(const std::string& topic,
                                              const std::vector<events::ExternalHash>& hashes) {
    std::map<events::ExternalHash, Said> out;
    auto wanted = [&](const events::ExternalHash& h) {
      return std::find(hashes.begin(), hashes.end(), h) != hashes.end();
    };
    while (out.size() < hashes.size()) {
      auto batch = Receive();
      if (!batch) {
        ADD_FAILURE() << "no event for " << hashes.size() - out.size() << " of the blocks";
        break;
      }
      if (batch->first != topic) continue;
      for (const events::KvEvent& event : batch->second) {
        const auto* stored = std::get_if<events::BlockStored>(&event);
        if (stored == nullptr) continue;
        EXPECT_TRUE(stored->token_ids.empty());
        std::optional<events::ExternalHash> parent = stored->parent_block_hash;
        for (const events::ExternalHash& h : stored->block_hashes) {
          if (wanted(h)) out[h] = Said{parent, stored->block_size, stored->medium.value_or("")};
          // Within one event each block hangs from the one before, as vLLM chains them; an
          // event of blocks without metadata (size 0) says no parent for any.
          if (stored->block_size != 0) parent = h;
        }
      }
    }
    return out;
  }

 private:
  void SetTimeout(int ms) { zmq_setsockopt(sub_, ZMQ_RCVTIMEO, &ms, sizeof(ms)); }

  void* ctx_ = nullptr;
  void* sub_ = nullptr;
};

}  // namespace kvstash::testing
