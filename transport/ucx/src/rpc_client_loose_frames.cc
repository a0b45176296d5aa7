// RpcClient::Impl: frames with no call behind them (cancel and control frames, and the raw
// frames of fuzz tests).

#include <future>
#include <memory>

#include "kvstash/transport/frame.h"
#include "rpc_client_impl.h"

namespace kvstash::transport {

// ---- loose frames (cancel, tests) ------------------------------------------------------------

Status RpcClient::Impl::SendRaw(Bytes header, Bytes data, std::function<void(Status)> sent) {
  auto send = std::make_shared<LooseSend>();
  send->header.assign(header.begin(), header.end());
  send->data.assign(data.begin(), data.end());
  send->sent = std::move(sent);
  std::promise<Status> promise;
  auto future = promise.get_future();
  worker_->Run([this, send, &promise] {
    if (!ep_) {
      promise.set_value(UnavailableError("not connected"));
      return;
    }
    SendLoose(std::move(*send));
    promise.set_value(Status::OK());
  });
  return future.get();
}

void RpcClient::Impl::SendCancelFrame(uint64_t id) { SendControl(FrameKind::kCancel, id); }

void RpcClient::Impl::SendLoose(LooseSend send) {
  if (!ep_) return;
  auto* owned = new LooseSend(std::move(send));
  ucp_request_param_t param{};
  param.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_DATATYPE;
  param.cb.send = [](void* request, ucs_status_t status, void* user_data) {
    ucp_request_free(request);
    std::unique_ptr<LooseSend> done(static_cast<LooseSend*>(user_data));
    if (done->sent) done->sent(FromUcs(status, "sending a raw frame"));
  };
  param.user_data = owned;
  param.datatype = ucp_dt_make_contig(1);
  FromThisEndpoint(&param);
  ucs_status_ptr_t request =
      ucp_am_send_nbx(ep_.get(), kRpcAmId, owned->header.data(), owned->header.size(),
                      owned->data.data(), owned->data.size(), &param);
  if (request == nullptr || UCS_PTR_IS_ERR(request)) {
    std::unique_ptr<LooseSend> done(owned);
    if (done->sent) {
      done->sent(request == nullptr ? Status::OK()
                                    : FromUcs(UCS_PTR_STATUS(request), "sending a raw frame"));
    }
  }
}

}  // namespace kvstash::transport
