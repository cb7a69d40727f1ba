// Threads the plugin owns, and the rule that keeps TensorFlow alive.
//
// THE RULE. No thread of TensorFlow's (the worker env's compute_pool, the
// inter-op and executor pools, gRPC handler threads) ever waits for work
// queued on its own pool, or for a network round trip without a deadline:
// - work that waits on the network (placement round trips, connects) runs
//   here, on the plugin's pool, never on a TF pool;
// - a TF thread that must wait for such work (RegisterGraph waiting for
//   placement) waits with a short, documented deadline
//   (kRegisterPlacementWaitMs in worker.cc); what is not done by then is
//   simply done later (its edges are placed on first use);
// - a task on the plugin's pool never waits for another task of the pool:
//   work that fans out schedules its parts and counts them down
//   (Completion), and only threads outside the pool wait for the count;
// - TF's Rendezvous::Send never blocks (the transport queues the push and
//   connects in the background), and RecvFromRemoteAsync never waits.
//
// Blocking calls in the shim and the threads they run on:
// | call | thread | bound |
// |---|---|---|
// | Transport::PlaceEdge / RequestPlacement (rdev_place_edge, rdev_request_placement) | plugin pool | kPlaceTimeoutMs (placement.cc) |
// | Transport::ConnectPeer (rdev_connect_peer) | plugin pool | RDMA_DEVICE_CONNECT_TIMEOUT_MS |
// | PlacementRun::WaitUntil | RegisterGraph caller; the tf.function pass's caller | kRegisterPlacementWaitMs |
// | shape inference of a registered partition (CPU only) | RegisterGraph caller | graph size |
// | Transport::Call for RunGraph / CleanupGraph (worker_rpc.h: rdev_call) | TF's master thread | writes the request to the connection's socket (never waits for the reply) |
// | Transport::Reply to a served call | plugin pool | writes the reply to the connection's socket |
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

// Runs `fn` on the plugin's pool: a fixed set of named threads
// ("rdev_plugin"), created on first use and kept for the process's life
// (so no task can ever run while the pool is being destroyed), with an
// unbounded queue in front. Never blocks the caller.
void Schedule(std::function<void()> fn);

// How many threads the pool has: the most tasks that wait at once.
inline constexpr int kPoolThreads = 16;

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
  // Never call this from the plugin's pool.
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
