#pragma once

// What the transport tests do with a Channel: start a call and take its outcome once through a
// future, wait for it or for a condition under a deadline (never a bare sleep), and bytes as
// text. Shared by the contract suite and stream_test.

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <future>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <thread>

#include "kvstash/common/status.h"
#include "kvstash/transport/channel.h"

namespace kvstash::transport::test_calls {

inline Bytes AsBytes(std::string_view s) { return std::as_bytes(std::span(s)); }
inline std::string AsString(Bytes b) {
  return std::string(reinterpret_cast<const char*>(b.data()), b.size());
}

struct Outcome {
  Status status;
  std::string message;
  size_t payload_bytes = 0;
};

inline CallOptions Within(std::chrono::milliseconds timeout) {
  CallOptions options;
  options.deadline = Clock::now() + timeout;
  return options;
}

// Starts a call; its outcome, once, through the future. A second completion fails the test.
inline std::future<Outcome> Start(Channel& channel, uint16_t method, std::string_view request,
                                  CallOptions options, uint64_t* id = nullptr) {
  auto promise = std::make_shared<std::promise<Outcome>>();
  auto completions = std::make_shared<std::atomic<int>>(0);
  std::future<Outcome> future = promise->get_future();
  const uint64_t call_id =
      channel.Call(method, AsBytes(request), options, [promise, completions](const Response& r) {
        if (completions->fetch_add(1) != 0) {
          ADD_FAILURE() << "a call completed twice, the second time with " << r.status.ToString();
          return;
        }
        promise->set_value(Outcome{r.status, AsString(r.message), r.payload_bytes});
      });
  if (id != nullptr) *id = call_id;
  return future;
}

// Waits for a call's outcome, at most `wait`: a call that never completes fails the test
// instead of hanging it.
inline Outcome Await(std::future<Outcome> future,
                     std::chrono::seconds wait = std::chrono::seconds(20)) {
  if (future.wait_for(wait) != std::future_status::ready) {
    ADD_FAILURE() << "a call did not complete within " << wait.count() << " s";
    return Outcome{DeadlineExceededError("the test gave up waiting"), {}, 0};
  }
  return future.get();
}

inline Outcome CallAndWait(Channel& channel, uint16_t method, std::string_view request,
                           CallOptions options = Within(std::chrono::seconds(10))) {
  return Await(Start(channel, method, request, options));
}

// Waits until `condition` holds, at most `wait`.
inline bool WaitFor(const std::function<bool()>& condition,
                    std::chrono::milliseconds wait = std::chrono::seconds(20)) {
  const auto give_up = Clock::now() + wait;
  while (!condition()) {
    if (Clock::now() > give_up) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return true;
}

}  // namespace kvstash::transport::test_calls
