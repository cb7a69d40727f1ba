// The worker of protocol "grpc+rdma_device": TF's own GrpcWorker, plus
// static placement when a TF1 session registers a graph partition here.
#ifndef RDMA_DEVICE_TF_PLUGIN_WORKER_H_
#define RDMA_DEVICE_TF_PLUGIN_WORKER_H_

#include <memory>

#include "tensorflow/core/distributed_runtime/rpc/grpc_worker_service.h"

namespace rdma_device {

class Transport;

class RdmaWorker : public tensorflow::GrpcWorker {
 public:
  RdmaWorker(tensorflow::WorkerEnv* env, const tensorflow::ConfigProto& config,
             std::shared_ptr<Transport> transport);

  // The master registers each partition before the session's first step
  // with it, and waits for `done`: the edges this partition sends to other
  // tasks are placed on their receivers before `done` runs. Placement never
  // fails the registration.
  void RegisterGraphAsync(const tensorflow::RegisterGraphRequest* request,
                          tensorflow::RegisterGraphResponse* response,
                          tensorflow::StatusCallback done) override;

  // As GrpcWorker's, with a span per call in the transport's timeline (the
  // per-step worker RPCs: where a step's time goes).
  void RunGraphAsync(tensorflow::CallOptions* opts, tensorflow::RunGraphRequestWrapper* request,
                     tensorflow::MutableRunGraphResponseWrapper* response,
                     tensorflow::StatusCallback done) override;
  void CleanupGraphAsync(const tensorflow::CleanupGraphRequest* request,
                         tensorflow::CleanupGraphResponse* response,
                         tensorflow::StatusCallback done) override;

 private:
  const std::shared_ptr<Transport> transport_;
};

}  // namespace rdma_device

#endif  // RDMA_DEVICE_TF_PLUGIN_WORKER_H_
