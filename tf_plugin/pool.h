// Threads the plugin owns, and the rule that keeps TensorFlow alive.
//
// THE RULE. No thread of TensorFlow's (the worker env's compute_pool, the
// inter-op and executor pools, gRPC handler threads) ever waits for work
// queued on its own pool, or for a network round trip without a deadline:
// - work that waits on the network (placement round trips, connects) runs
//   on the plugin's control pool, never on a TF pool, and never on the
//   data-path pool where completions and aborts run;
// - a TF thread that must wait for such work (RegisterGraph waiting for
//   placement) waits with a short, documented deadline
//   (kRegisterPlacementWaitMs in worker.cc); what is not done by then is
//   simply done later (its edges are placed on first use);
// - a task on a plugin pool never waits for another task of a pool:
//   work that fans out schedules its parts and counts them down
//   (Completion), and only threads outside the pool wait for the count;
// - TF's Rendezvous::Send never blocks (the transport queues the push and
//   connects in the background), and RecvFromRemoteAsync never waits.
//
// Every thread and pool, what runs on it and what it may wait on:
// THREADS.md. Blocking calls in the shim and the threads they run on:
// | call | thread | bound |
// |---|---|---|
// | Transport::PlaceEdge / RequestPlacement (rdev_place_edge, rdev_request_placement) | control pool | kPlaceTimeoutMs (placement.cc) |
// | Transport::ConnectPeer (rdev_connect_peer) | control pool | RDMA_DEVICE_CONNECT_TIMEOUT_MS |
// | PlacementRun::WaitUntil | RegisterGraph caller; the tf.function pass's caller unless it is a TF pool thread (passes.cc) | kRegisterPlacementWaitMs |
// | shape inference of a registered partition (CPU only) | RegisterGraph caller | graph size |
// | Transport::Call for RunGraph / CleanupGraph (worker_rpc.h: rdev_call_inline) | TF's master thread | writes the request to the connection's socket (never waits for the reply) |
// | Transport::Reply to a served call | the thread that finished the call (RunGraph: an executor thread; CleanupGraph: the transport's thread that read it, rdev_serve_inline) | one non-blocking send; what the socket does not take waits for rdev-shm-send |
// Everything else in tf_plugin/ returns without waiting: Send, Recv,
// StartAbort (its transport call only fails waiters), StepDone, and the
// collectives' PostToPeer/RecvFromPeer/StartAbort (collectives.h).
#ifndef RDMA_DEVICE_TF_PLUGIN_POOL_H_
#define RDMA_DEVICE_TF_PLUGIN_POOL_H_

#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>

namespace rdma_device {

// Runs `fn` on the plugin's data-path pool: a fixed set of named threads
// ("rdev_plugin"), created on first use and kept for the process's life
// (so no task can ever run while the pool is being destroyed), with an
// unbounded queue in front. Never blocks the caller. For work that
// finishes without waiting on the network: completions (copies into TF's
// tensors, TF's `done`), receive cancellations, aborts.
void Schedule(std::function<void()> fn);

// Runs `fn` on the plugin's control pool ("rdev_control"), made like the
// data-path pool but apart from it: for work that waits on the network
// (connects, placement round trips), so that a slow or dead peer never
// holds up a completion or an abort. Never blocks the caller.
void ScheduleControl(std::function<void()> fn);

// How many threads each pool has: the most of its tasks that wait at once
// (the control pool's tasks wait; the data path's only run).
inline constexpr int kPoolThreads = 16;
inline constexpr int kControlThreads = 16;

// A count of outstanding parts of one piece of work. Parts may add parts
// (Add before their own Done, so the count never touches zero early).
class Completion {
 public:
  explicit Completion(int parts) : left_(parts) {}
  void Add(int parts) {
    std::lock_guard<std::mutex> l(mu_);
    left_ += parts;
  }
  // Returns true for the call that finished the work.
  bool Done() {
    std::lock_guard<std::mutex> l(mu_);
    if (--left_ > 0) return false;
    cv_.notify_all();
    return true;
  }
  // Waits until every part is done or `deadline` passes; true when done.
  // Never call this from a plugin pool.
  bool WaitUntil(std::chrono::steady_clock::time_point deadline) {
    std::unique_lock<std::mutex> l(mu_);
    return cv_.wait_until(l, deadline, [this] { return left_ <= 0; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int left_;
};

}  // namespace rdma_device

#endif  // RDMA_DEVICE_TF_PLUGIN_POOL_H_
