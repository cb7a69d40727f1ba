// Rendezvous for protocol "grpc+rdma_device".
//
// RdmaRendezvousMgr is an RpcRendezvousMgr whose per-step rendezvous push
// cross-process tensors through the Rust transport (librdma_device.so) to
// peers it serves, and keeps a stock gRPC rendezvous (obtained from the
// protected RpcRendezvousMgr::Create) for every other peer. Protocol
// decisions live in Rust; this layer only translates TF calls.
#ifndef RDMA_DEVICE_TF_PLUGIN_RENDEZVOUS_H_
#define RDMA_DEVICE_TF_PLUGIN_RENDEZVOUS_H_

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

  // TF's end of a step on this task (CleanupGraph, an eager function's
  // cleanup): the step ends in the transport too, whether or not one of
  // its rendezvous is still alive.
  void Cleanup(int64_t step_id) override;

 protected:
  tsl::core::RefCountPtr<tensorflow::BaseRemoteRendezvous> Create(
      int64_t step_id, const tensorflow::WorkerEnv* worker_env) override;

 private:
  std::shared_ptr<Transport> transport_;
};

}  // namespace rdma_device

#endif  // RDMA_DEVICE_TF_PLUGIN_RENDEZVOUS_H_
