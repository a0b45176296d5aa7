// UcxCall: one request on the UCX server, as its ServerCall handle sees it.

#include "rpc_server_impl.h"
#include "worker.h"

namespace kvstash::transport {

// ---- UcxCall ---------------------------------------------------------------------------------

void UcxCall::ReleasePayload() {
  if (payload_consumed || payload_size == 0) return;
  payload_consumed = true;
  if (payload_held) return;  // the client lets go of it when the call completes
  if (payload_rndv) {
    worker->DiscardRendezvous(payload_data, payload_size);  // within limits: checked
  } else if (payload_persistent) {
    ucp_am_data_release(worker->ucp(), payload_data);
  }
}

uint64_t UcxCall::connection_id() const { return connection->id; }
const std::string& UcxCall::key_namespace() const { return connection->key_namespace; }

void UcxCall::ReceivePayload(MutableBytes dest, const MemoryRegion* region,
                             std::function<void(Status)> done) {
  server->ReceivePayload(shared_from_this(), dest, region, std::move(done));
}

void UcxCall::Reply(Bytes message, Bytes payload, const MemoryRegion* region,
                    std::function<void(Status)> sent) {
  if (replied.exchange(true)) {
    if (sent) sent(FailedPreconditionError("call {} already replied", request_id));
    return;
  }
  server->Reply(shared_from_this(), StatusCode::kOk, message, payload, region, std::move(sent));
}

void UcxCall::ReplyError(const Status& status) {
  if (replied.exchange(true)) return;
  server->ReplyStatus(shared_from_this(),
                      status.ok() ? InternalError("ReplyError with OK") : status);
}

void UcxCall::Drop() { server->Drop(shared_from_this()); }

}  // namespace kvstash::transport
