#pragma once

// A blocking client of one kvstash engine worker's HTTP API (what `kvstash-engine chat
// --prefill-worker/--decode-worker` drives workers with).

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "kvstash/common/status.h"
#include "kvstash/worker/protocol.h"

namespace kvstash::worker {

// One worker at HOST:PORT, over one kept-alive connection (opened at the first call, opened
// again when the worker closed it). Owned by its caller; not thread-safe (one call at a time).
//
// Every call answers Unavailable when the worker cannot be reached, DeadlineExceeded when it
// has not answered within the timeout, and for an error reply the worker's message with its
// status mapped back (400: InvalidArgument, 404: NotFound, 503: Unavailable, other: Internal);
// Internal for a reply that is not what the API says.
class WorkerClient {
 public:
  // InvalidArgument for an address that is not HOST:PORT. Connects at the first call.
  static Result<std::unique_ptr<WorkerClient>> Create(std::string_view address,
                                                      std::chrono::milliseconds timeout);
  virtual ~WorkerClient() = default;

  // GET /v1/models.
  virtual Result<WorkerInfo> Info() = 0;
  // POST /v1/completions without streaming; `request.stream` is ignored.
  virtual Result<Completion> Complete(const CompletionRequest& request) = 0;
  // POST /v1/completions with streaming: `on_event` gets each Server-Sent Events payload (the
  // text after "data: ", "[DONE]" last) as it arrives, and returns false to stop reading (the
  // connection is then dropped: the worker cancels the request). `*started` (when not null) says
  // whether any event came, so that a caller knows whether the request can still go elsewhere.
  // The errors of Complete; Cancelled when on_event stopped it; Unavailable for a stream cut
  // before "[DONE]".
  virtual Status Stream(const CompletionRequest& request,
                        const std::function<bool(std::string_view event)>& on_event,
                        bool* started) = 0;
  // GET /kvstash/stats.
  virtual Result<WorkerTotals> Totals() = 0;

  // HOST:PORT as given.
  virtual const std::string& address() const = 0;
};

}  // namespace kvstash::worker
