// Rendezvous for protocol "grpc+rdma_device".
//
// RdmaRendezvousMgr is an RpcRendezvousMgr whose per-step rendezvous push
// cross-process tensors through the Rust transport (librdma_device.so) to
// peers it serves, and keeps a stock gRPC rendezvous (obtained from the
// protected RpcRendezvousMgr::Create) for every other peer. Protocol
// decisions live in Rust; this layer only translates TF calls.
#ifndef RDMA_DEVICE_TF_PLUGIN_RENDEZVOUS_H_
#define RDMA_DEVICE_TF_PLUGIN_RENDEZVOUS_H_

#include <atomic>
#include <cstdint>
#include <memory>

#include "tensorflow/core/distributed_runtime/rpc/rpc_rendezvous_mgr.h"

namespace rdma_device {

class Transport;

class RdmaRendezvousMgr : public tensorflow::RpcRendezvousMgr {
 public:
  // `transport` may be null: every tensor then goes over stock gRPC.
  RdmaRendezvousMgr(const tensorflow::WorkerEnv* env,
                    std::shared_ptr<Transport> transport);

  // TF's cache, destroyed after this, aborts the rendezvous left with
  // "Shutdown": they know it is no failure by `closing_`.
  ~RdmaRendezvousMgr() override;

  // TF's end of a step on this task (CleanupGraph, an eager function's
  // cleanup, an eager context's update or end): the step's rendezvous, if
  // one is alive, is aborted as a cleanup, never told to peers; the step
  // ends in the transport either way.
  void Cleanup(int64_t step_id) override;

 protected:
  tsl::core::RefCountPtr<tensorflow::BaseRemoteRendezvous> Create(
      int64_t step_id, const tensorflow::WorkerEnv* worker_env) override;

 private:
  std::shared_ptr<Transport> transport_;
  const std::shared_ptr<std::atomic<bool>> closing_;
};

}  // namespace rdma_device

#endif  // RDMA_DEVICE_TF_PLUGIN_RENDEZVOUS_H_
