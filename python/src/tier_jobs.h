#pragma once

// TierJobs: the vLLM tier's store and load jobs (python/kvstash/vllm.py), run in C++ so that
// neither a job nor its completion ever takes the GIL: vLLM's scheduler thread holds it most of
// a step, and a Python job thread waited for it at every job's start and end (up to the
// interpreter's 5 ms switch interval each time).

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <thread>
#include <vector>

#include "kvstash/common/block_key.h"
#include "kvstash/common/mutex.h"
#include "kvstash/common/status.h"
#include "kvstash/connector/node_client.h"

namespace kvstash::python {

// The rows of vLLM's primary tier: `count` rows of `bytes` each, `stride` bytes apart.
struct Rows {
  std::byte* base = nullptr;
  size_t count = 0;
  size_t stride = 0;
  size_t bytes = 0;
};

// Moves blocks between the rows of vLLM's primary tier (one block per row) and the nodes: a store
// job puts rows to the nodes, a load job gets blocks into rows. Jobs run on up to `threads`
// threads, started as jobs come, each job's blocks all in flight at once (one NodeClient call), and
// as many jobs at once as threads; loads go before queued stores. A finished job waits in a list
// that TakeFinished empties; nothing here calls back.
//
// Owns its threads and shares the client. Borrows `rows`: the caller keeps them mapped until
// Close returned true (a job still running when Close gave up uses them until it ends; the
// threads own what they use, so this object may go first). Thread-safe.
class TierJobs {
 public:
  struct Finished {
    uint64_t ticket = 0;
    Status status;  // OK, or why the job failed (a load that read short: DataLoss)
  };

  TierJobs(std::shared_ptr<connector::NodeClient> client, Rows rows, size_t threads);
  // Close() without waiting: a job still running ends on its own.
  ~TierJobs();
  TierJobs(const TierJobs&) = delete;
  TierJobs& operator=(const TierJobs&) = delete;

  // Queues the job `ticket` (the caller's id): keys[i] from or into row rows[i]. InvalidArgument
  // naming the value for a row outside the rows or a count mismatch; FailedPrecondition once
  // closed. Never waits.
  Status Submit(uint64_t ticket, bool is_load, std::vector<BlockKey> keys,
                std::vector<size_t> rows);
  // The jobs finished since the last call, in the order they finished.
  std::vector<Finished> TakeFinished();
  // Jobs queued or running.
  size_t Busy() const;
  // Waits until no job is queued or running.
  void WaitIdle() const;
  // Stops taking jobs: queued ones finish as Cancelled; waits until `deadline` for the running
  // ones. True when none runs any more (the rows are no longer used). Idempotent.
  bool Close(std::chrono::steady_clock::time_point deadline);

 private:
  struct Job {
    uint64_t ticket = 0;
    bool is_load = false;
    std::vector<BlockKey> keys;
    std::vector<size_t> rows;
  };
  // What the threads share; they hold it, so that it outlives this object if Close gave up.
  struct State {
    std::shared_ptr<connector::NodeClient> client;
    Rows rows;
    mutable Mutex mu;
    CondVar work;          // a job queued, or closing
    mutable CondVar idle;  // a job finished
    std::deque<Job> loads GUARDED_BY(mu);
    std::deque<Job> stores GUARDED_BY(mu);
    std::vector<Finished> finished GUARDED_BY(mu);
    size_t running GUARDED_BY(mu) = 0;
    size_t waiting_threads GUARDED_BY(mu) = 0;  // threads waiting for a job
    size_t threads GUARDED_BY(mu) = 0;          // threads started
    bool closing GUARDED_BY(mu) = false;
  };

  static void Serve(const std::shared_ptr<State>& state);
  static Status Run(const State& state, const Job& job);

  const std::shared_ptr<State> state_;
  const size_t max_threads_;
  Mutex threads_mu_;
  std::vector<std::thread> threads_ GUARDED_BY(threads_mu_);
};

}  // namespace kvstash::python
