// One collective executor's remote access over the transport: TF's
// PostToPeer/RecvFromPeer become pushes and receives of transport steps
// (collectives.h explains the scheme; collective_steps.h holds the
// bookkeeping). Peers and chunks the transport does not serve take TF's
// stock path (RecvBuf over gRPC), counted as fallbacks.
#ifndef RDMA_DEVICE_TF_PLUGIN_COLLECTIVE_RMA_H_
#define RDMA_DEVICE_TF_PLUGIN_COLLECTIVE_RMA_H_

#include <memory>
#include <string>

#include "tensorflow/core/distributed_runtime/collective_rma_distributed.h"

namespace rdma_device {

class Generations;
class Transport;

// For RpcCollectiveExecutorMgr::Create's subclass: as TF's
// CollectiveRemoteAccessDistributed, with chunks between tasks the
// transport serves pushed through it. `transport` may be null (all stock).
tensorflow::CollectiveRemoteAccessDistributed* NewRdmaCollectiveRemoteAccess(
    const tensorflow::DeviceMgr* dev_mgr, tensorflow::DeviceResolverInterface* dev_resolver,
    std::shared_ptr<tsl::UnboundedWorkQueue> work_queue,
    tensorflow::WorkerCacheInterface* worker_cache, int64_t step_id, std::string task_name,
    std::shared_ptr<Transport> transport, std::shared_ptr<Generations> generations);

}  // namespace rdma_device

#endif  // RDMA_DEVICE_TF_PLUGIN_COLLECTIVE_RMA_H_
