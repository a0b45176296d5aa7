// ServerCall: the handle a handler holds, over whichever transport carries the call.

#include <utility>

#include "kvstash/transport/channel.h"

namespace kvstash::transport {

ServerCall::ServerCall(std::shared_ptr<ServerCallState> state) : state_(std::move(state)) {}

ServerCall& ServerCall::operator=(ServerCall&& other) noexcept {
  if (this != &other) {
    if (state_) std::exchange(state_, nullptr)->Drop();
    state_ = std::move(other.state_);
  }
  return *this;
}

ServerCall::~ServerCall() {
  if (state_) std::exchange(state_, nullptr)->Drop();
}

uint16_t ServerCall::method() const { return state_->method(); }
uint64_t ServerCall::connection_id() const { return state_->connection_id(); }
const std::string& ServerCall::tenant() const { return state_->tenant(); }
Bytes ServerCall::request() const { return state_->request(); }
size_t ServerCall::payload_bytes() const { return state_->payload_bytes(); }
Clock::time_point ServerCall::deadline() const { return state_->deadline(); }
bool ServerCall::cancelled() const { return state_->cancelled(); }

void ServerCall::ReceivePayload(MutableBytes dest, const MemoryRegion* region,
                                std::function<void(Status)> done) {
  state_->ReceivePayload(dest, region, std::move(done));
}

void ServerCall::Reply(Bytes message, Bytes payload, const MemoryRegion* region,
                       std::function<void(Status)> sent) {
  state_->Reply(message, payload, region, std::move(sent));
}

void ServerCall::ReplyError(const Status& status) { state_->ReplyError(status); }

}  // namespace kvstash::transport
