// The C++ face of the Rust transport (include/rdma_device.h).
//
// Owns one rdev_context per TensorFlow server and translates between TF
// types (Tensor, Status, task names) and the C ABI. Only transport*.cc and
// transport_status.h include rdma_device.h (transport.cc: the context and
// tensors; transport_routes.cc: peers and routes; transport_calls.cc: calls
// and counters; transport_status.cc: statuses); protocol decisions (slots,
// credits, routes, demotion, strict mode) stay in Rust: the shim keeps no
// route table and no strict flag, asks the transport how a peer's tensors
// travel (RouteTo), and takes the stock path on a NotViable status only.
#ifndef RDMA_DEVICE_TF_PLUGIN_TRANSPORT_H_
#define RDMA_DEVICE_TF_PLUGIN_TRANSPORT_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/platform/mutex.h"
#include "tensorflow/core/protobuf/cluster.pb.h"

struct rdev_context;

namespace rdma_device {

// Empty when the running TensorFlow is the one the shim was built against,
// else the message to show (server.cc). Nothing version-specific (servers,
// graph passes) is registered when it is not empty.
const std::string& TensorFlowVersionError();

// "/job:<job>/replica:<replica>/task:<task>": the name both the transport and
// the cluster spec use for a task.
std::string TaskName(absl::string_view job, int replica, int task);

// How tensors to or from one peer travel, as the transport answers now.
struct Route {
  // kDevice: over the transport, or its route is still being chosen (work
  // for the peer then waits in the transport, and fails NotViable if the
  // peer ends up on gRPC).
  enum Kind { kDevice, kGrpc };
  Kind kind = kGrpc;
  // Why kGrpc (for stats and logs); empty for kDevice.
  std::string reason;
};

class Transport : public std::enable_shared_from_this<Transport> {
 public:
  using SendDone = std::function<void(const absl::Status&)>;
  using RecvDone = std::function<void(const absl::Status&,
                                      const tensorflow::Tensor&, bool is_dead)>;

  Transport() = default;
  ~Transport();
  Transport(const Transport&) = delete;
  Transport& operator=(const Transport&) = delete;

  // Whether the RDMA_DEVICE_* settings are valid (a bad value: the error
  // naming the variable). Checked before the server binds its port, so a
  // bad setting fails server creation before anything is registered.
  static absl::Status CheckConfig();

  // Creates the rdev_context for `self_task` listening at `addr` (this
  // task's host:port as the cluster spec spells it) and starts choosing
  // the routes of the peers recorded so far. Until then every route is
  // gRPC.
  absl::Status Start(const std::string& self_task, const std::string& addr);

  // Tells the transport of every task of `cluster` (but this one);
  // idempotent. Called for each worker cache TF builds, so clusters that
  // grow (eager clients joining) are seen too. Never waits: the route of
  // each new (or moved) peer is *pending* while the transport chooses it
  // (name resolution, rdma_cm probing; all peers at once, on its own
  // threads), and work that meets a pending route waits in the transport
  // (rdev_context_set_peer). Before Start, the peers are kept for it.
  void AddPeers(const tensorflow::ClusterDef& cluster);

  // RDMA_DEVICE_STATIC_PLACEMENT: place edges with static shapes when a
  // graph is registered (false until Start).
  bool static_placement() {
    tensorflow::tf_shared_lock l(mu_);
    return static_placement_;
  }

  // This task's name ("" until Start).
  std::string self_task() {
    tensorflow::tf_shared_lock l(mu_);
    return self_task_;
  }

  // The started transport of task `task` in this process, or null. Graph
  // passes, which TF runs without naming a server, find theirs here.
  static std::shared_ptr<Transport> ForTask(const std::string& task);
  // A started transport of this process with static placement on, or null.
  static std::shared_ptr<Transport> AnyWithStaticPlacement();

  // The route for tensors exchanged with `peer_task` (rdev_route). In
  // strict mode a gRPC route is an error instead (FailedPrecondition); a
  // route pending for 20 s is DeadlineExceeded. Never waits.
  absl::Status RouteTo(const std::string& peer_task, Route* route);
  // Whether a tensor with `peer_task` may take the stock path for a reason
  // the shim found (`why`, e.g. it is in device memory): OK, or the strict
  // mode's error (rdev_grpc_fallback).
  absl::Status GrpcFallback(const std::string& peer_task, const std::string& why);

  // Pushes `val` for (key, step) to `peer_task`; never blocks (it does not
  // connect or wait for room on this thread). On OK, `done` runs exactly
  // once (any thread, possibly before this returns) when the transport no
  // longer needs the tensor's memory; on error it never runs and nothing
  // was sent. `*refused` tells the one error the caller can route around:
  // the peer does not take this transport from us (it runs plain gRPC, or
  // routes this task over gRPC) and will pull the tensor. The same refusal
  // can also reach `done` (IsNotViable), when it is learnt while connecting.
  absl::Status Send(const std::string& peer_task, absl::string_view key,
                    int64_t step_id, const tensorflow::Tensor& val,
                    bool is_dead, SendDone done, bool* refused);

  // Receives (key, step) from `peer_task`. On OK, `done` runs exactly once
  // (any thread, possibly before this returns); on error it never runs.
  // The tensor wraps the receive slot without a copy when it can. With
  // `on_event_thread`, a successful `done` runs on the transport's thread
  // that saw the tensor land (rdev_recv_inline): it must return within
  // microseconds and wait for nothing (THREADS.md).
  absl::Status Recv(const std::string& peer_task, absl::string_view key,
                    int64_t step_id, RecvDone done, bool on_event_thread = false);

  // true when tensors with `peer_task` travel over this transport (never
  // an error, even in strict mode: for callers that only optimise; false
  // while the route is pending).
  bool Serves(const std::string& peer_task);

  // True for the error of a peer whose tensors go over stock gRPC (it
  // does not run this transport, or does not take it from this task): take
  // the stock path. The transport has routed the peer over gRPC for good;
  // in strict mode it answers with FailedPrecondition instead, never this.
  static bool IsNotViable(const absl::Status& status);

  // Connects to `peer_task` now rather than at its first tensor. Blocks up
  // to RDMA_DEVICE_CONNECT_TIMEOUT_MS: call it from the plugin's pool only.
  absl::Status ConnectPeer(const std::string& peer_task);
  // ConnectPeer on the control pool, returning at once: for a peer this
  // task calls (per-step worker RPCs) but exchanges no tensor with, so no
  // transfer connects them. One attempt per peer at a time, at most one
  // every kConnectRetryMs.
  void ConnectSoon(const std::string& peer_task) TF_LOCKS_EXCLUDED(mu_);

  // Sender side, before the edge's first step: asks `peer_task` to place
  // the edge `key` for `bytes` bytes and waits up to `timeout_ms` (plus a
  // connect) until it has; from the plugin's pool only. `*placed` is false when the peer had no arena room (the edge then
  // takes the slower path; not an error).
  absl::Status PlaceEdge(const std::string& peer_task, absl::string_view key, uint64_t bytes,
                         uint64_t timeout_ms, bool* placed);

  // Static placement on behalf of another task: asks `sender_task` to do
  // what PlaceEdge(receiver_task, key, bytes) does there, and waits up to
  // `timeout_ms` for the outcome (same `*placed` semantics). For graphs
  // partitioned in this process and run in others (tf.function).
  absl::Status RequestPlacement(const std::string& sender_task, const std::string& receiver_task,
                                absl::string_view key, uint64_t bytes, uint64_t timeout_ms,
                                bool* placed);

  // Fails the step's pending receives and queued sends with `status`;
  // with `propagate`, peers fail their receives of the step from this task
  // too (false for TF's normal end-of-step cleanup).
  void AbortStep(int64_t step_id, const absl::Status& status, bool propagate);
  // Fails the one pending receive of (key, step) with `status`; the step
  // goes on (the eager context's step, which one failed op must not end).
  void CancelRecv(const std::string& key, int64_t step_id, const absl::Status& status);
  // The step is over on this task: unclaimed arrivals are released.
  void StepDone(int64_t step_id);
  // The step's last rendezvous on this task is gone, but TF may make
  // another for it: arrivals are kept until StepDone, or until it has
  // been idle a while (rdev_step_idle).
  void StepIdle(int64_t step_id);
  // A rendezvous of the step exists (again): it is not idle.
  void StepActive(int64_t step_id);
  // Counts a tensor that went over stock gRPC.
  void RecordFallback(uint64_t bytes, const std::string& reason);

  // Calls over the transport's message channel (worker_rpc.h): the
  // per-step worker RPCs with a peer this task has a connection with.
  // RDMA_DEVICE_WORKER_RPCS: whether to make them so (false until Start).
  bool worker_rpcs() {
    tensorflow::tf_shared_lock l(mu_);
    return worker_rpcs_;
  }
  using CallDone = std::function<void(const absl::Status&, std::string body)>;
  // Calls `method` on `peer_task` with `body`; `done` runs exactly once on
  // the transport's callback thread with TF's status (errors worded as
  // gRPC's, naming the peer) and the response. `timeout_ms` 0: none.
  // `inline_ok`: `done` returns within microseconds and never waits, so a
  // successful reply of at most 64 KiB may run it on the transport's
  // thread that read the reply (rdev_call_inline), one wake-up sooner.
  // Not OK: the call could not start (no connection with the peer yet):
  // nothing was sent, `done` never runs, make the call over gRPC. Does not
  // block (the message is written to the connection's socket).
  absl::Status Call(const std::string& peer_task, uint32_t method, const std::string& body,
                    int64_t timeout_ms, bool inline_ok, CallDone done, uint64_t* id);
  // Gives up call `id` (done runs with CANCELLED unless it ran).
  void CancelCall(uint64_t id);
  // Serves peers' calls: `call(handle, method, body)` on the transport's
  // callback thread, to be answered once with Reply(handle, ...) from any
  // thread; `cancel(handle)` when the caller gave up or left. Set once.
  using ServeCall = std::function<void(uint64_t handle, uint32_t method, std::string body)>;
  using ServeCancel = std::function<void(uint64_t handle)>;
  void Serve(ServeCall call, ServeCancel cancel);
  // Calls of `method` (< 64) reach `call` on the transport's thread that
  // read them instead (rdev_serve_inline): `call` must return within
  // microseconds and never wait. Call before Serve.
  void ServeInline(uint32_t method);
  void Reply(uint64_t handle, const absl::Status& status, const std::string& body);
  void RecordWorkerRpcOverGrpc();
  // Counts a peer's worker RPC served where it ran (worker_rpc.cc).
  enum class ServedOn { kReaderThread, kComputePool };
  void RecordWorkerRpcServed(ServedOn where);
  // Counts a RunGraph reply too large to parse on the completion thread
  // (a process-wide counter: no transport needed).
  static void RecordLargeReply(uint64_t bytes);
  // Counts a collective chunk (collectives.h): received or sent over the
  // transport, or received over stock gRPC because of `reason`.
  enum class CollectiveEvent { kReceived, kSent, kFallback };
  void RecordCollective(CollectiveEvent event, uint64_t bytes, const std::string& reason = "");

 private:
  std::atomic<rdev_context*> ctx_{nullptr};
  tensorflow::mutex mu_;
  // ConnectSoon: when each peer's last attempt started.
  std::map<std::string, std::chrono::steady_clock::time_point> connect_tried_ TF_GUARDED_BY(mu_);
  std::string self_task_ TF_GUARDED_BY(mu_);
  // The transport's settings (rdev_settings_get, one call at Start).
  bool static_placement_ TF_GUARDED_BY(mu_) = false;
  bool worker_rpcs_ TF_GUARDED_BY(mu_) = false;
  std::atomic<bool> serving_{false};
  // Peer task -> address, from cluster specs seen before Start (which
  // hands them to the transport); empty after it.
  std::map<std::string, std::string> early_peers_ TF_GUARDED_BY(mu_);
};

}  // namespace rdma_device

#endif  // RDMA_DEVICE_TF_PLUGIN_TRANSPORT_H_
