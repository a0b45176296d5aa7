#include "kvstash/transport/fault_channel.h"

#include <atomic>
#include <cstring>
#include <map>
#include <unordered_map>
#include <vector>

#include "executor.h"
#include "kvstash/common/mutex.h"

namespace kvstash::transport {
namespace {

// Ids of calls this channel holds back (dropped or delayed), apart from the wrapped channel's.
constexpr uint64_t kHeldIdBase = uint64_t{1} << 62;

// A call held back: completed once, by a timer, by Cancel, or by the reply of the request once
// it went (a delayed call). A delayed call's payload travels as a copy and its reply lands in
// scratch first: the caller's buffers are only valid until its call completes.
struct Held {
  std::atomic<bool> completed{false};
  ResponseCallback done;
  std::vector<std::byte> payload;
  std::vector<std::byte> reply;
  MutableBytes recv;
  void Complete(const Status& status) {
    if (completed.exchange(true)) return;
    Response response;
    response.status = status;
    done(response);
  }
};

}  // namespace

class FaultChannel::Impl {
 public:
  Impl(FaultPlan plan, std::function<void()> disconnect)
      : plan_(std::move(plan)), disconnect_(std::move(disconnect)) {}

  Fault Decide(uint16_t method) {
    uint64_t index = 0;
    {
      MutexLock lock(&mu_);
      index = calls_[method]++;
    }
    return plan_ ? plan_(method, index) : Fault{};
  }

  uint64_t Hold(std::shared_ptr<Held> held) {
    MutexLock lock(&mu_);
    const uint64_t id = kHeldIdBase + next_held_++;
    held_[id] = std::move(held);
    return id;
  }
  std::shared_ptr<Held> Release(uint64_t id) {
    MutexLock lock(&mu_);
    auto it = held_.find(id);
    if (it == held_.end()) return nullptr;
    std::shared_ptr<Held> held = std::move(it->second);
    held_.erase(it);
    return held;
  }

  std::vector<std::shared_ptr<Held>> ReleaseAll() {
    MutexLock lock(&mu_);
    std::vector<std::shared_ptr<Held>> all;
    for (auto& [id, held] : held_) all.push_back(std::move(held));
    held_.clear();
    return all;
  }

  void Count(Fault::Kind kind) {
    MutexLock lock(&mu_);
    switch (kind) {
      case Fault::Kind::kDrop:
        ++counts_.dropped;
        break;
      case Fault::Kind::kDelay:
        ++counts_.delayed;
        break;
      case Fault::Kind::kCorruptRequest:
      case Fault::Kind::kCorruptPayload:
        ++counts_.corrupted;
        break;
      case Fault::Kind::kDisconnectAfterRequest:
        ++counts_.disconnects;
        break;
      case Fault::Kind::kNone:
        break;
    }
  }
  FaultCounts counts() const {
    MutexLock lock(&mu_);
    return counts_;
  }

  void Disconnect() {
    if (disconnect_) disconnect_();
  }
  Executor& timers() { return timers_; }

 private:
  const FaultPlan plan_;
  const std::function<void()> disconnect_;
  mutable Mutex mu_;
  std::map<uint16_t, uint64_t> calls_ GUARDED_BY(mu_);
  std::unordered_map<uint64_t, std::shared_ptr<Held>> held_ GUARDED_BY(mu_);
  uint64_t next_held_ GUARDED_BY(mu_) = 0;
  FaultCounts counts_ GUARDED_BY(mu_);
  Executor timers_;  // last: stops first
};

FaultChannel::FaultChannel(std::unique_ptr<Channel> inner, FaultPlan plan,
                           std::function<void()> disconnect)
    : inner_(std::move(inner)),
      impl_(std::make_shared<Impl>(std::move(plan), std::move(disconnect))) {}

FaultChannel::~FaultChannel() {
  // Timers first (their tasks use the wrapped channel), then the channel.
  impl_.reset();
  inner_.reset();
}

uint64_t FaultChannel::Call(uint16_t method, Bytes request, const CallOptions& options,
                            ResponseCallback done) {
  const Fault fault = impl_->Decide(method);
  impl_->Count(fault.kind);
  switch (fault.kind) {
    case Fault::Kind::kNone:
      return inner_->Call(method, request, options, std::move(done));
    case Fault::Kind::kDrop: {
      auto held = std::make_shared<Held>();
      held->done = std::move(done);
      const uint64_t id = impl_->Hold(held);
      impl_->timers().RunAt(options.deadline, [impl = impl_.get(), id] {
        if (auto h = impl->Release(id)) {
          h->Complete(DeadlineExceededError("call {} was dropped on its way (a fault)", id));
        }
      });
      return id;
    }
    case Fault::Kind::kDelay: {
      auto held = std::make_shared<Held>();
      held->done = std::move(done);
      held->payload.assign(options.send_payload.begin(), options.send_payload.end());
      held->reply.resize(options.recv_payload.size());
      held->recv = options.recv_payload;
      const uint64_t id = impl_->Hold(held);
      // The caller's deadline holds whatever the network does.
      impl_->timers().RunAt(options.deadline, [held, id] {
        held->Complete(DeadlineExceededError("call {} passed its deadline (a delayed frame)", id));
      });
      impl_->timers().RunAt(Clock::now() + fault.delay,
                            [this, impl = impl_.get(), id, method, options,
                             bytes = std::vector<std::byte>(request.begin(), request.end())] {
                              std::shared_ptr<Held> h = impl->Release(id);
                              if (!h) return;  // cancelled meanwhile
                              CallOptions late = options;
                              late.send_payload = h->payload;
                              late.send_region = nullptr;
                              late.recv_payload = h->reply;
                              late.recv_region = nullptr;
                              inner_->Call(method, bytes, late, [h](const Response& response) {
                                if (h->completed.exchange(true)) {
                                  return;  // the caller gave up: the reply goes nowhere
                                }
                                if (response.status.ok() && response.payload_bytes > 0) {
                                  std::memcpy(h->recv.data(), h->reply.data(),
                                              response.payload_bytes);
                                }
                                h->done(response);
                              });
                            });
      return id;
    }
    case Fault::Kind::kCorruptRequest: {
      std::vector<std::byte> bytes(request.begin(), request.end());
      // Field 0 of wire type 7: no protobuf parser accepts it.
      if (!bytes.empty()) bytes[0] = std::byte{0xff};
      return inner_->Call(method, bytes, options, std::move(done));
    }
    case Fault::Kind::kCorruptPayload: {
      auto copy = std::make_shared<std::vector<std::byte>>(options.send_payload.begin(),
                                                           options.send_payload.end());
      if (!copy->empty()) (*copy)[copy->size() / 2] ^= std::byte{0x01};
      CallOptions corrupted = options;
      corrupted.send_payload = *copy;
      corrupted.send_region = nullptr;
      return inner_->Call(method, request, corrupted,
                          [copy, done = std::move(done)](const Response& r) { done(r); });
    }
    case Fault::Kind::kDisconnectAfterRequest:
      impl_->Disconnect();
      return inner_->Call(method, request, options, std::move(done));
  }
  return inner_->Call(method, request, options, std::move(done));
}

void FaultChannel::Cancel(uint64_t id) {
  if (id >= kHeldIdBase) {
    if (auto held = impl_->Release(id)) held->Complete(CancelledError("call {} cancelled", id));
    return;
  }
  inner_->Cancel(id);
}

void FaultChannel::Reset(const Status& why) {
  for (const std::shared_ptr<Held>& held : impl_->ReleaseAll()) {
    held->Complete(Status(StatusCode::kUnavailable, std::string(why.message())));
  }
  inner_->Reset(why);
}

void FaultChannel::ConnectAsync(std::function<void(const Status&)> done) {
  inner_->ConnectAsync(std::move(done));
}

std::optional<ServerLimits> FaultChannel::server_limits() const { return inner_->server_limits(); }

FaultCounts FaultChannel::counts() const { return impl_->counts(); }

}  // namespace kvstash::transport
