#include "tier_jobs.h"

#include <fmt/format.h>

#include <optional>
#include <system_error>
#include <utility>

#include "kvstash/transport/channel.h"

namespace kvstash::python {

TierJobs::TierJobs(std::shared_ptr<connector::NodeClient> client, Rows rows, size_t threads)
    : state_(std::make_shared<State>()), max_threads_(std::max<size_t>(1, threads)) {
  state_->client = std::move(client);
  state_->rows = rows;
}

TierJobs::~TierJobs() { Close(std::chrono::steady_clock::now()); }

Status TierJobs::Submit(uint64_t ticket, bool is_load, std::vector<BlockKey> keys,
                        std::vector<size_t> rows) {
  if (keys.size() != rows.size()) {
    return InvalidArgumentError("{} keys but {} rows", keys.size(), rows.size());
  }
  for (size_t row : rows) {
    if (row >= state_->rows.count) {
      return InvalidArgumentError("row {} outside the primary's {} rows", row, state_->rows.count);
    }
  }
  bool start_thread = false;
  {
    MutexLock lock(&state_->mu);
    if (state_->closing) return FailedPreconditionError("the tier's jobs are closed");
    (is_load ? state_->loads : state_->stores)
        .push_back(Job{ticket, is_load, std::move(keys), std::move(rows)});
    // A thread per job, up to the limit: a job never waits behind another while fewer than
    // max_threads_ run. Each waiting thread takes one queued job (a thread signalled but not
    // yet awake still counts as waiting), so more queued jobs than that need more threads.
    const size_t queued = state_->loads.size() + state_->stores.size();
    if (queued > state_->waiting_threads && state_->threads < max_threads_) {
      ++state_->threads;
      start_thread = true;
    } else {
      state_->work.Signal();
    }
  }
  if (start_thread) {
    MutexLock lock(&threads_mu_);
    try {
      threads_.emplace_back([state = state_] { Serve(state); });
    } catch (const std::system_error& e) {
      // The threads there are take the job; with none, it is refused.
      MutexLock state_lock(&state_->mu);
      if (--state_->threads == 0) {
        std::deque<Job>& queue = is_load ? state_->loads : state_->stores;
        std::erase_if(queue, [ticket](const Job& job) { return job.ticket == ticket; });
        return ResourceExhaustedError("no thread for the job: {}", e.what());
      }
      state_->work.Signal();
    }
  }
  return Status::OK();
}

std::vector<TierJobs::Finished> TierJobs::TakeFinished() {
  MutexLock lock(&state_->mu);
  return std::exchange(state_->finished, {});
}

size_t TierJobs::Busy() const {
  MutexLock lock(&state_->mu);
  return state_->loads.size() + state_->stores.size() + state_->running;
}

void TierJobs::WaitIdle() const {
  MutexLock lock(&state_->mu);
  while (!state_->loads.empty() || !state_->stores.empty() || state_->running != 0) {
    state_->idle.Wait(&state_->mu);
  }
}

bool TierJobs::Close(std::chrono::steady_clock::time_point deadline) {
  bool done = true;
  {
    MutexLock lock(&state_->mu);
    state_->closing = true;
    for (std::deque<Job>* queue : {&state_->loads, &state_->stores}) {
      for (const Job& job : *queue) {
        state_->finished.push_back(
            {job.ticket, CancelledError("the tier shut down before the job started")});
      }
      queue->clear();
    }
    state_->work.SignalAll();
    while (state_->running != 0) {
      const auto now = std::chrono::steady_clock::now();
      if (now >= deadline) {
        done = false;
        break;
      }
      (void)state_->idle.WaitFor(&state_->mu, deadline - now);
    }
  }
  MutexLock lock(&threads_mu_);
  for (std::thread& t : threads_) {
    // A thread still in a job holds the state; it ends after the job.
    if (done) {
      t.join();
    } else {
      t.detach();
    }
  }
  threads_.clear();
  return done;
}

void TierJobs::Serve(const std::shared_ptr<State>& state) {
  std::optional<Finished> done;  // the job this thread ran last, not yet recorded
  while (true) {
    Job job;
    {
      MutexLock lock(&state->mu);
      if (done) {
        --state->running;
        state->finished.push_back(std::move(*done));
        done.reset();
        state->idle.SignalAll();
      }
      while (state->loads.empty() && state->stores.empty() && !state->closing) {
        ++state->waiting_threads;
        state->work.Wait(&state->mu);
        --state->waiting_threads;
      }
      if (state->closing) return;
      std::deque<Job>& queue = state->loads.empty() ? state->stores : state->loads;
      job = std::move(queue.front());
      queue.pop_front();
      ++state->running;
    }
    done = Finished{job.ticket, Run(*state, job)};
  }
}

Status TierJobs::Run(const State& state, const Job& job) {
  const Rows& rows = state.rows;
  auto row = [&rows](size_t r) { return rows.base + r * rows.stride; };
  if (!job.is_load) {
    std::vector<transport::Bytes> blocks;
    blocks.reserve(job.rows.size());
    for (size_t r : job.rows) blocks.emplace_back(row(r), rows.bytes);
    return state.client->Put(job.keys, blocks);
  }
  std::vector<transport::MutableBytes> outs;
  outs.reserve(job.rows.size());
  for (size_t r : job.rows) outs.emplace_back(row(r), rows.bytes);
  const std::vector<Result<size_t>> got = state.client->Get(job.keys, outs);
  for (size_t i = 0; i < got.size(); ++i) {
    if (!got[i].ok()) {
      return Status(got[i].status().code(),
                    fmt::format("key {} of {}: {}", i, got.size(), got[i].status().message()));
    }
    if (*got[i] != rows.bytes) {
      return DataLossError("key {} of {}: read {} of {} bytes", i, got.size(), *got[i], rows.bytes);
    }
  }
  return Status::OK();
}

}  // namespace kvstash::python
