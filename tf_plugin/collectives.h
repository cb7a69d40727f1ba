// Collectives (MultiWorkerMirroredStrategy's all-reduce, broadcast, gather)
// over the transport: the server's collective_mgr_func.
//
// TF's collective algorithms (ring reducer/gatherer, tree broadcaster) move
// chunks between devices through CollectiveRemoteAccess: the sender calls
// PostToPeer(key, chunk), the receiver RecvFromPeer(key, to_tensor). Stock
// TF (CollectiveRemoteAccessDistributed) parks the sender's chunk in a
// BufRendezvous and the receiver pulls it with a RecvBuf RPC. Here a chunk
// between two tasks our transport serves is pushed instead: PostToPeer is
// rdev_send, RecvFromPeer is rdev_recv, under the same transport key and
// step, so the chunk is written one-sided into a slot the receiver placed
// for that key, completed by the write's immediate. Peers the transport
// does not serve, and chunks in device (non-CPU) memory, take the stock
// path, counted as fallbacks (an error in strict mode).
//
// Keys and steps. TF names a chunk "group:instance:frame:iter" plus the
// algorithm's part (ring: "pass:section:rank"). MultiWorkerMirroredStrategy
// draws a new instance key for every call (measured: 104, 105, 106, ... one
// per training step), and eager runs every collective under one executor,
// step 0. The transport edge (its slots) is therefore the key without the
// instance, plus the chunk's size: the same chunk of the same collective
// is the same edge every step, so it is placed on the first step and every
// later chunk is one write with no negotiation; collectives of different
// sizes never share (and re-place) an edge. The instance goes into the
// transport step: the n-th transfer of a buffer key from a sender to a
// receiver on this executor is step
//   mix(executor step id, executor generation, "group:instance:frame:iter") + n
// on sender and receiver alike (both run the same collectives in the same
// order, as TF requires). n matters where instance keys repeat (V1
// collective ops, and MWMS created again, whose instance keys start
// over): the transport refuses a second arrival for an unclaimed (key,
// step), and a broadcast root may run ahead of its leaves. It counts per
// peer (collective_steps.h): when the group changes, a key goes to a new
// neighbour, which has seen it as often as the sender has sent it there.
// Use counts of keys unused for 65536 other keys are forgotten (they would
// restart at 0 on one side only if such a key came back: not seen in TF's
// algorithms, whose keys either repeat every step or never).
//
// Aborts and cancellation. The executor's StartAbort (a failed or
// cancelled collective, TF's collective timeout, abort_collective_ops)
// fails every later transfer of this executor at once, completes its sends
// still in flight (one queued while the transport reconnects to a dead
// peer waits for that attempt, which rdev_abort_step does not cut short),
// and fails its own transfers in flight here (locally). Peers learn of it
// through one step: every executor waits, per peer it exchanges chunks
// with, on a sentinel receive (its own step) that no one sends, posted
// before its first transfer with that peer. An abort aborts the sentinel
// step with propagation (one message per link), which fails the peers'
// sentinels from us, and a failed sentinel (that, or the transport losing
// the peer) aborts the executor, failing its receives, including those of
// an instance we never reached: the reach of stock TF, where an aborted
// BufRendezvous fails every RecvBuf sent to it and a dead peer fails them
// all. (Aborting every remembered key's steps with propagation instead
// sent 126-176 messages per worker after 20 all-reduces on 3 workers.)
// Measured: a SIGKILLed worker fails the others' step in 0.03-0.08 s over
// 32 observations (before the sentinel, 2 of 14 waited about 4.5 s, for
// TF's coordination service heartbeat). The op's CancellationManager
// aborts the receive's step. An ended executor
// withdraws its sentinels without propagation, and the next executor of
// the same step id gets a new generation (fresh steps).
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
// `done` run on the thread that called RecvFromPeer when the chunk was
// already there, else on the plugin's pool, never on a transport progress
// thread. Aborts reach the transport from the plugin's pool (StartAbort
// may be called under TF locks). No lock of ours is held while TF's
// `done` runs.
//
// Server definition changes. GrpcServer::UpdateServerDef (a second
// experimental_connect_to_cluster, MultiWorkerMirroredStrategy created
// again, a dynamic cluster) replaces the server's collective manager with
// TF's stock one on that task only, while its peers keep pushing chunks
// through the transport and it pulls with RecvBuf: the collective would
// hang. So the manager is kept instead: the server holds it (Collectives),
// worker_env's collective_executor_mgr is only a handle on it, and after
// UpdateServerDef the server puts a new handle where TF put its stock
// manager (destroying that one). The kept manager and its executors
// (their use counts and generations, which peers agree on) stay; it
// reaches peers through a worker cache the server switches to the new
// cluster's. Its param and device resolvers are built anew, from the new
// definition's config, as in the manager TF builds there: the group
// leader may have changed (a chief joined), and a group key may come back
// with other members (MWMS created again over more workers starts its
// keys over). Kept, the resolvers answered with the old group ("is
// joining a group with size3, but that group has size 2") or asked the
// old leader (a hang). Caches and resolvers switched away from live as
// long as the manager (a call may still be in one): one of each per
// UpdateServerDef. The step-id sequences of graph-mode collectives
// (RpcCollectiveExecutorMgr's group leader) keep Init's leader. For the
// moment between TF's install and ours (inside UpdateServerDef, before it
// returns) a peer's RPC could still reach TF's manager, as with TF's own
// replacement of its manager there.
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

// One server's collective manager, kept for the server's life.
class Collectives {
 public:
  // For GrpcServerOptions::collective_mgr_func. `worker_cache` is the
  // collectives' own (not the session manager's default cache, which
  // UpdateServerDef deletes). `transport` may be null: every chunk then
  // goes over stock gRPC. Null (logged) when no local device names the
  // task.
  static std::shared_ptr<Collectives> Create(
      const tensorflow::ConfigProto& config, const tensorflow::WorkerEnv* env,
      std::unique_ptr<tensorflow::WorkerCacheInterface> worker_cache,
      std::shared_ptr<Transport> transport);

  // For worker_env's collective_executor_mgr: forwards every call to the
  // kept manager; deleting it leaves the manager alone.
  std::unique_ptr<tensorflow::CollectiveExecutorMgrInterface> NewHandle();

  // The cluster changed: peers are reached through `worker_cache` from now
  // on, and groups and instances are resolved afresh under `config` (the
  // new server definition's: its group leader). The manager and its
  // executors stay.
  void Update(const tensorflow::ConfigProto& config,
              std::unique_ptr<tensorflow::WorkerCacheInterface> worker_cache);

  ~Collectives();

 private:
  class Cache;
  class Handle;
  Collectives() = default;

  // Declared so that the manager (which uses the cache) goes first.
  std::unique_ptr<Cache> cache_;
  std::unique_ptr<tensorflow::CollectiveExecutorMgrInterface> mgr_;
  std::weak_ptr<Collectives> self_;
};

}  // namespace rdma_device

#endif  // RDMA_DEVICE_TF_PLUGIN_COLLECTIVES_H_
