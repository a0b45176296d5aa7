#include "kvstash/connector/block_transfer.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "kvstash/common/hash.h"
#include "kvstash/common/logging.h"
#include "kvstash/kernels/block_copy.h"

namespace kvstash::connector {

using Clock = std::chrono::steady_clock;

struct BlockTransfer::Pending {
  BlockJob job;
  bool touch = false;        // a touch of job.keys, not a transfer
  bool after_store = false;  // that touch is the step's touch after its stores
  // A store's blocks, encoded at submit: pages then trailer, block_bytes each.
  std::vector<std::byte> staged;
};

size_t BlockJobResult::num_ok() const {
  return static_cast<size_t>(std::count(ok.begin(), ok.end(), true));
}

Result<std::unique_ptr<BlockTransfer>> BlockTransfer::Create(BlockTransferOptions options) {
  if (options.client == nullptr) return InvalidArgumentError("block transfer needs a node client");
  if (options.pool.base == nullptr || options.pool.page_bytes == 0 || options.pool.num_pages == 0) {
    return InvalidArgumentError("block transfer needs a pool (base, page bytes, pages)");
  }
  if (options.pages_per_block == 0) {
    return InvalidArgumentError("an offloaded block needs at least one page");
  }
  const size_t block_bytes = OffloadedBlockBytes(options.pages_per_block, options.pool.page_bytes);
  for (const NodeAddress& node : options.client->nodes()) {
    auto bytes = options.client->BlockBytes(node);
    const StatusCode code = bytes.status().code();
    const std::string hint = fmt::format(
        "this engine's offloaded block is {} bytes ({} page(s) of {} + a {}-byte trailer): start "
        "kvstashd with --block-bytes {}",
        block_bytes, options.pages_per_block, options.pool.page_bytes, sizeof(BlockTrailer),
        block_bytes);
    if (code == StatusCode::kFailedPrecondition) {
      // Its block size is not the client's (NodeClientOptions::block_bytes): left out.
      return FailedPreconditionError("{}; {}", bytes.status().message(), hint);
    }
    if (!bytes.ok() && code != StatusCode::kUnavailable && code != StatusCode::kDeadlineExceeded) {
      // Refused (a wrong token, a namespace not served, another protocol): an error in the
      // set-up, not a node that happens to be down, so the engine must not start on misses.
      return Status(code, fmt::format("offload node {} refused this engine: {}", node.ToString(),
                                      bytes.status().message()));
    }
    if (!bytes.ok()) {
      // Down or slow now: its keys are misses (the engine recomputes them), never an error
      // that stops the engine. Its size is checked by every block that comes back from it.
      KVSTASH_LOG_WARN("offload node {} does not answer ({}); its blocks count as misses",
                       node.ToString(), bytes.status().ToString());
      continue;
    }
    if (*bytes != block_bytes) {
      return FailedPreconditionError("node {} stores blocks of {} bytes; {}", node.ToString(),
                                     *bytes, hint);
    }
  }
  return std::unique_ptr<BlockTransfer>(new BlockTransfer(options, block_bytes));
}

BlockTransfer::BlockTransfer(BlockTransferOptions options, size_t block_bytes)
    : options_(options), block_bytes_(block_bytes), thread_([this] { Run(); }) {}

BlockTransfer::~BlockTransfer() {
  {
    MutexLock lock(&mu_);
    stop_ = true;
  }
  cv_.SignalAll();
  thread_.join();
}

Status BlockTransfer::Submit(BlockJob job) {
  if (job.pages.size() != job.keys.size()) {
    return InvalidArgumentError("job {}: {} keys but {} page lists", job.id, job.keys.size(),
                                job.pages.size());
  }
  if (!job.metas.empty() && job.metas.size() != job.keys.size()) {
    return InvalidArgumentError("job {}: {} keys but {} block metadata", job.id, job.keys.size(),
                                job.metas.size());
  }
  for (size_t i = 0; i < job.pages.size(); ++i) {
    if (job.pages[i].size() != options_.pages_per_block) {
      return InvalidArgumentError("job {}: block {} has {} pages, not {}", job.id, i,
                                  job.pages[i].size(), options_.pages_per_block);
    }
    for (uint32_t p : job.pages[i]) {
      if (p == 0 || p >= options_.pool.num_pages) {
        return InvalidArgumentError("job {}: page {} is not a pool page (1..{})", job.id, p,
                                    options_.pool.num_pages - 1);
      }
    }
  }
  auto pending = std::make_unique<Pending>();
  if (job.kind == BlockJob::Kind::kStore) {
    // Snapshot now: the engine may reuse these pages the moment this returns.
    const size_t payload = options_.pages_per_block * options_.pool.page_bytes;
    pending->staged.resize(job.keys.size() * block_bytes_);
    for (size_t i = 0; i < job.keys.size(); ++i) {
      std::byte* block = pending->staged.data() + i * block_bytes_;
      kernels::GatherBlocks(options_.pool.base, options_.pool.page_bytes, job.pages[i], block);
      BlockTrailer t;
      t.pages = static_cast<uint32_t>(options_.pages_per_block);
      t.key_lo = job.keys[i].hash.lo;
      t.key_hi = job.keys[i].hash.hi;
      t.group = job.keys[i].group;
      t.fingerprint = options_.fingerprint;
      t.checksum = Xxh3Hash64({block, payload}, options_.fingerprint);
      std::memcpy(block + payload, &t, sizeof t);
    }
  }
  pending->job = std::move(job);
  {
    MutexLock lock(&mu_);
    in_flight_.push_back(pending->job.id);
    (pending->job.kind == BlockJob::Kind::kLoad ? loads_ : stores_).push_back(std::move(pending));
  }
  cv_.SignalAll();
  return Status::OK();
}

void BlockTransfer::SubmitTouch(std::vector<BlockKey> keys, bool after_store) {
  if (keys.empty()) return;
  auto pending = std::make_unique<Pending>();
  pending->touch = true;
  pending->after_store = after_store;
  pending->job.keys = std::move(keys);
  {
    MutexLock lock(&mu_);
    ++touches_in_flight_;
    stores_.push_back(std::move(pending));
  }
  cv_.SignalAll();
}

std::vector<BlockJobResult> BlockTransfer::Poll() {
  MutexLock lock(&mu_);
  return std::exchange(finished_, {});
}

void BlockTransfer::Wait(std::span<const uint64_t> ids) {
  MutexLock lock(&mu_);
  for (;;) {
    bool running = false;
    for (uint64_t id : ids) {
      running = running || std::find(in_flight_.begin(), in_flight_.end(), id) != in_flight_.end();
    }
    if (!running) return;
    cv_.Wait(&mu_);
  }
}

void BlockTransfer::WaitAll() {
  MutexLock lock(&mu_);
  while (!in_flight_.empty() || touches_in_flight_ != 0) cv_.Wait(&mu_);
}

void BlockTransfer::Run() {
  while (true) {
    std::unique_ptr<Pending> next;
    {
      MutexLock lock(&mu_);
      while (!stop_ && loads_.empty() && stores_.empty()) cv_.Wait(&mu_);
      auto& queue = !loads_.empty() ? loads_ : stores_;
      if (queue.empty()) return;  // stopping with nothing left
      next = std::move(queue.front());
      queue.pop_front();
    }
    if (next->touch) {
      // Asynchronous: the client sends it and counts its outcome; nothing waits for the nodes.
      if (next->after_store) {
        options_.client->TouchAfterStore(next->job.keys);
      } else {
        options_.client->Touch(next->job.keys);
      }
      {
        MutexLock lock(&mu_);
        --touches_in_flight_;
      }
      cv_.SignalAll();
      continue;
    }
    BlockJobResult result = Execute(*next);
    {
      MutexLock lock(&mu_);
      std::erase(in_flight_, result.id);
      finished_.push_back(std::move(result));
    }
    cv_.SignalAll();
  }
}

BlockJobResult BlockTransfer::Execute(Pending& pending) {
  const BlockJob& job = pending.job;
  BlockJobResult r;
  r.id = job.id;
  r.kind = job.kind;
  r.ok.assign(job.keys.size(), false);
  const auto start = Clock::now();
  const size_t payload = options_.pages_per_block * options_.pool.page_bytes;
  if (job.kind == BlockJob::Kind::kStore) {
    std::vector<std::span<const std::byte>> blocks;
    for (size_t i = 0; i < job.keys.size(); ++i) {
      blocks.emplace_back(pending.staged.data() + i * block_bytes_, block_bytes_);
    }
    r.status = job.metas.empty() ? options_.client->Put(job.keys, blocks)
                                 : options_.client->PutWithMeta(job.keys, blocks, job.metas);
    // Put stores every block it can and reports the first failure: count them all as failed
    // then, it only means fewer blocks offloaded.
    if (r.status.ok()) {
      r.ok.assign(job.keys.size(), true);
      r.bytes = job.keys.size() * payload;
    }
  } else {
    std::vector<std::byte> staged(job.keys.size() * block_bytes_);
    std::vector<std::span<std::byte>> outs;
    for (size_t i = 0; i < job.keys.size(); ++i) {
      outs.emplace_back(staged.data() + i * block_bytes_, block_bytes_);
    }
    std::vector<Result<size_t>> got = options_.client->Get(job.keys, outs);
    for (size_t i = 0; i < job.keys.size(); ++i) {
      const std::byte* block = staged.data() + i * block_bytes_;
      Status bad;
      if (!got[i].ok()) {
        bad = got[i].status();
      } else if (*got[i] != block_bytes_) {
        bad = DataLossError("block {} came back with {} bytes, not {}", job.keys[i].ToString(),
                            *got[i], block_bytes_);
      } else {
        BlockTrailer t;
        std::memcpy(&t, block + payload, sizeof t);
        if (t.magic != BlockTrailer::kMagic || t.pages != options_.pages_per_block ||
            t.key_lo != job.keys[i].hash.lo || t.key_hi != job.keys[i].hash.hi ||
            t.group != job.keys[i].group) {
          bad = DataLossError("block {} from the node is not that block", job.keys[i].ToString());
        } else if (t.fingerprint != options_.fingerprint) {
          bad = DataLossError("block {} was computed by another model or layout",
                              job.keys[i].ToString());
        } else if (t.checksum != Xxh3Hash64({block, payload}, options_.fingerprint)) {
          bad = DataLossError("block {} fails its checksum", job.keys[i].ToString());
        }
      }
      if (!bad.ok()) {
        if (r.status.ok()) r.status = bad;
        continue;
      }
      kernels::ScatterBlocks(block, options_.pool.base, options_.pool.page_bytes, job.pages[i]);
      r.ok[i] = true;
      r.bytes += payload;
    }
  }
  r.elapsed = Clock::now() - start;
  return r;
}

}  // namespace kvstash::connector
