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
// callback thread, and a reply larger than that is parsed on the plugin's
// data-path pool (pool.h), never on either. A served call runs where TF's
// gRPC worker service runs it, on the worker's compute pool: the parse of
// its body (a TF1 feed can be hundreds of MB) and CleanupGraph's teardown
// (pending receives' callbacks, collective executors' destructors) never
// hold up the thread that reads the connection. Only a RunGraph of at most
// kServeInlineMax bytes starts on that thread (rdev_serve_inline: its parse
// takes microseconds, and RunGraphAsync only prepares the partition and
// queues its first ops on TF's pool), one thread wake-up fewer per step.
// The reply is written by the thread that finished the call (for RunGraph,
// TF's executor thread that finished the partition): one non-blocking send.
// A response that cannot be serialized (past protobuf's 2 GiB) is
// an error reply, never an empty OK.
#ifndef RDMA_DEVICE_TF_PLUGIN_WORKER_RPC_H_
#define RDMA_DEVICE_TF_PLUGIN_WORKER_RPC_H_

#include <memory>

#include "tensorflow/core/distributed_runtime/worker_cache.h"
#include "tensorflow/core/distributed_runtime/worker_interface.h"
#include "tsl/platform/threadpool.h"

namespace rdma_device {

class Transport;

// Wraps `stock` (owned from now on).
tensorflow::WorkerCacheInterface* NewTransportWorkerCache(
    tensorflow::WorkerCacheInterface* stock, std::shared_ptr<Transport> transport);

// Serves peers' worker RPCs over the transport with `worker` (the server's
// own, by raw pointer): call it from the server's Start() only. TF never
// frees a started server, but frees one never started (server.cc), and
// the transport can outlive the server's session manager there.
// Calls larger than `kServeInlineMax` bytes, and every CleanupGraph, are
// handed to `compute_pool` (the worker env's, as stock's service does).
void ServeWorkerRpcs(const std::shared_ptr<Transport>& transport,
                     tensorflow::WorkerInterface* worker,
                     tsl::thread::ThreadPool* compute_pool);

// The largest RunGraph request served on the thread that read it.
inline constexpr size_t kServeInlineMax = 16 << 10;

// The largest RunGraph reply parsed on the transport's thread that
// completed the call; a larger one is parsed on the plugin's data-path pool.
inline constexpr size_t kParseReplyInlineMax = 64 << 10;

}  // namespace rdma_device

#endif  // RDMA_DEVICE_TF_PLUGIN_WORKER_RPC_H_
