// The per-step worker RPCs over the transport.
//
// A TF1 step is RunGraph to every partition's task, then CleanupGraph: over
// gRPC that is a request, a round of gRPC's threads and a response per
// remote partition per step, and `python -m rdma_device.bench trace`
// measured it as the largest part of a small step. Between tasks that have
// a transport connection, these two calls go over the transport's message
// channel instead (Transport::Call: serialized protos, the same error codes
// and wording, cancellation through CallOptions, operation_timeout_in_ms as
// a deadline). Everything else (set-up RPCs, tensors pulled over gRPC,
// collectives' RecvBuf) and every peer without a connection yet stays on
// stock gRPC, counted (worker_rpcs_over_transport / _over_grpc).
//
// How: the server's worker caches are wrapped (NewTransportWorkerCache):
// each remote worker they hand out sends RunGraph and CleanupGraph over the
// transport when it can and delegates everything else to TF's own gRPC
// worker. The callee serves them with the server's own Worker
// (ServeWorkerRpcs), exactly as TF's gRPC worker service does.
//
// Threads: a call is written to the connection from the caller's thread
// (TF's master); a successful reply of at most 64 KiB completes on the
// transport's thread that read it (rdev_call_inline), anything else on its
// callback thread. A served call starts on the thread that read it
// (rdev_serve_inline: RunGraphAsync only prepares the partition and queues
// its first ops on TF's pool) and its reply is written by the thread that
// finished the call (for RunGraph, TF's executor thread that finished the
// partition): one non-blocking send.
#ifndef RDMA_DEVICE_TF_PLUGIN_WORKER_RPC_H_
#define RDMA_DEVICE_TF_PLUGIN_WORKER_RPC_H_

#include <memory>

#include "tensorflow/core/distributed_runtime/worker_cache.h"
#include "tensorflow/core/distributed_runtime/worker_interface.h"

namespace rdma_device {

class Transport;

// Wraps `stock` (owned from now on).
tensorflow::WorkerCacheInterface* NewTransportWorkerCache(
    tensorflow::WorkerCacheInterface* stock, std::shared_ptr<Transport> transport);

// Serves peers' worker RPCs over the transport with `worker` (the server's
// own, which outlives the transport).
void ServeWorkerRpcs(const std::shared_ptr<Transport>& transport,
                     tensorflow::WorkerInterface* worker);

}  // namespace rdma_device

#endif  // RDMA_DEVICE_TF_PLUGIN_WORKER_RPC_H_
