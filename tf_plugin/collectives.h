// Collectives (MultiWorkerMirroredStrategy's all-reduce, broadcast, gather)
// over the transport: the server's collective_mgr_func.
//
// TF's collective algorithms (ring reducer/gatherer, tree broadcaster) move
// chunks between devices through CollectiveRemoteAccess: the sender calls
// PostToPeer(key, chunk), the receiver RecvFromPeer(key, to_tensor). Stock
// TF (CollectiveRemoteAccessDistributed) parks the sender's chunk in a
// BufRendezvous and the receiver pulls it with a RecvBuf RPC. Here a chunk
// between two tasks our transport serves is pushed instead: PostToPeer is
// rdev_send, RecvFromPeer is rdev_recv, both under the same key, so the
// chunk is written one-sided into a slot the receiver placed for that key
// (the key is stable from step to step, so placement happens on the first
// step and every later chunk is one write with no request). Peers the
// transport does not serve, and chunks in device (non-CPU) memory, take
// the stock path, counted as fallbacks (an error in strict mode).
//
// Keys and steps. TF names a chunk by a string that is the same in every
// step ("group:instance:frame:iter" plus the algorithm's pass/section/rank)
// and eager runs every collective under one executor, step 0. The
// transport matches (key, step) and refuses a second arrival for a pair
// that is still unclaimed, and a sender's chunk may arrive before the
// receiver has consumed the previous use of the same key (a broadcast root
// runs ahead of its leaves). So both sides number the uses of each key on
// this executor, and the transport's step is
//   mix(executor step id, "group:instance:frame:iter") + n
// for the n-th use: the same on sender and receiver (both run the same
// collectives in the same order, as TF requires), distinct per instance
// and execution, and shared by all chunks of one execution of one
// instance, so that an abort names few steps. An executor TF creates again
// for a step id after an abort also mixes in how often that step id was
// aborted here, so it never reuses the steps the abort ended.
//
// Aborts and cancellation. The executor's StartAbort (a failed or
// cancelled collective, TF's collective timeout, abort_collective_ops)
// fails every later transfer of this executor at once, and aborts with
// propagation the steps peers may be waiting on from us (each instance's
// current and next execution), so their receives fail too, as the stock
// RecvBuf RPCs would; sends still in flight (one queued while the
// transport reconnects to a dead peer waits for that attempt, which
// rdev_abort_step does not cut short) complete with the abort at once. The
// op's CancellationManager aborts the receive's step. A dead peer fails pending receives and sends within milliseconds
// (the transport reports the lost connection).
//
// Zero-copy where TF allows it. TF allocates each receive's destination
// before the data moves. A scratch destination that nothing else
// references (the ring reducer's first pass receives into such a buffer
// and only reads it) is replaced by the receive slot the peer wrote into:
// no copy. A destination that aliases the collective's output (the ring's
// second pass, gathers, broadcasts) gets one copy out of the slot, which
// then goes back to the sender at once.
//
// Threads. Nothing here waits. A receive's copy into `to_tensor` and its
// `done` run on
// the thread that called RecvFromPeer when the chunk was already there,
// else on the plugin's pool, never on a transport progress thread. Aborts
// reach the transport from the plugin's pool (StartAbort may be called
// under TF locks). No lock of ours is held while TF's `done` runs.
//
// Not covered: GrpcServer::UpdateServerDef (a cluster changed after the
// server started) installs TF's stock collective manager; collectives go
// over gRPC from then on (logged).
#ifndef RDMA_DEVICE_TF_PLUGIN_COLLECTIVES_H_
#define RDMA_DEVICE_TF_PLUGIN_COLLECTIVES_H_

#include <memory>

#include "tensorflow/core/framework/collective.h"

namespace tensorflow {
class ConfigProto;
class WorkerCacheInterface;
struct WorkerEnv;
}  // namespace tensorflow

namespace rdma_device {

class Transport;

// For GrpcServerOptions::collective_mgr_func. `transport` may be null:
// every chunk then goes over stock gRPC.
tensorflow::CollectiveExecutorMgrInterface* NewCollectiveExecutorMgr(
    const tensorflow::ConfigProto& config, const tensorflow::WorkerEnv* env,
    tensorflow::WorkerCacheInterface* worker_cache, std::shared_ptr<Transport> transport);

}  // namespace rdma_device

#endif  // RDMA_DEVICE_TF_PLUGIN_COLLECTIVES_H_
