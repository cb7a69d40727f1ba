#include "rendezvous.h"

#include <utility>

#include "tensorflow/core/distributed_runtime/worker_session.h"

namespace rdma_device {

namespace tf = ::tensorflow;

namespace {

// One per step on this task. Tensors whose peer our transport serves go
// through it; all others are handed to `stock_`, the gRPC rendezvous kept
// inside (RpcRemoteRendezvous is private to TF, so we hold one instead of
// deriving from it). Sends that stay on gRPC use our own base Send: the
// peer's RecvTensor RPC is routed by the RendezvousMgr to *this* rendezvous
// (BaseRendezvousMgr::RecvLocalAsync), so the tensor must sit in our table.
class RdmaRemoteRendezvous : public tf::BaseRemoteRendezvous {
 public:
  RdmaRemoteRendezvous(const tf::WorkerEnv* env, int64_t step_id,
                       tsl::core::RefCountPtr<tf::BaseRemoteRendezvous> stock,
                       std::shared_ptr<Transport> transport)
      : BaseRemoteRendezvous(env, step_id),
        stock_(std::move(stock)),
        transport_(std::move(transport)) {}

  absl::Status Initialize(tf::WorkerSession* session) override {
    TF_RETURN_IF_ERROR(BaseRemoteRendezvous::Initialize(session));
    return stock_->Initialize(session);
  }

  void SetRemoteEagerContextDefault() override {
    BaseRemoteRendezvous::SetRemoteEagerContextDefault();
    stock_->SetRemoteEagerContextDefault();
  }

  void StartAbort(const absl::Status& status) override {
    // TF only ever aborts with a non-OK status; guard anyway, the base
    // CHECKs it and the shim must never abort the process.
    if (status.ok()) return;
    BaseRemoteRendezvous::StartAbort(status);
    stock_->StartAbort(status);
  }

 protected:
  void RecvFromRemoteAsync(const tf::Rendezvous::ParsedKey& parsed,
                           const tf::Rendezvous::Args& recv_args,
                           DoneCallback done) override {
    stock_->RecvAsync(parsed, recv_args, std::move(done));
  }

 private:
  ~RdmaRemoteRendezvous() override = default;

  const tsl::core::RefCountPtr<tf::BaseRemoteRendezvous> stock_;
  const std::shared_ptr<Transport> transport_;
};

}  // namespace

RdmaRendezvousMgr::RdmaRendezvousMgr(const tf::WorkerEnv* env,
                                     std::shared_ptr<Transport> transport)
    : RpcRendezvousMgr(env), transport_(std::move(transport)) {}

tsl::core::RefCountPtr<tf::BaseRemoteRendezvous> RdmaRendezvousMgr::Create(
    int64_t step_id, const tf::WorkerEnv* worker_env) {
  return tsl::core::RefCountPtr<tf::BaseRemoteRendezvous>(
      new RdmaRemoteRendezvous(worker_env, step_id,
                               RpcRendezvousMgr::Create(step_id, worker_env),
                               transport_));
}

}  // namespace rdma_device
