// The bookkeeping behind collectives over the transport (collectives.h):
// how a TF buffer key becomes a transport edge and step, the per-executor
// use counts and abort state, and the generations of executors that TF
// creates again for the same step id. No TF callbacks run under these
// locks; nothing here waits.
#ifndef RDMA_DEVICE_TF_PLUGIN_COLLECTIVE_STEPS_H_
#define RDMA_DEVICE_TF_PLUGIN_COLLECTIVE_STEPS_H_

#include <algorithm>
#include <cstdint>
#include <deque>
#include <memory>
#include <set>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "tensorflow/core/framework/collective.h"
#include "tensorflow/core/platform/mutex.h"

namespace rdma_device {

namespace tf = ::tensorflow;

class Transport;

uint64_t Mix(uint64_t x);  // splitmix64's finalizer
uint64_t Fnv1a(const std::string& s);

// A buffer key split as TF writes it: "group:instance:frame:iter" then the
// algorithm's part (ring: "pass:section:rank"). `edge` is the key without
// the instance, which MultiWorkerMirroredStrategy draws anew for every
// call: the same chunk of the same collective is the same transport edge
// every step (its slots are placed once); `instance` names the execution.
// A key of another shape is all instance (a fresh edge per key).
struct SplitKey {
  std::string instance;  // "group:instance:frame:iter"
  std::string edge;      // "group:frame:iter:<algorithm part>"
};

SplitKey Split(const std::string& key);

bool IsCpu(const std::string& device_name);

// The transport's key for a chunk: rendezvous-key-shaped
// ("src;incarnation;dst;name;frame:iter"), the name reserved for
// collectives and carrying the chunk's size, so that collectives of
// different sizes never share (and re-place) an edge.
std::string WireKey(const std::string& src_device, const std::string& dst_device,
                    const std::string& edge, uint64_t bytes);

// The per-peer abort sentinel's key (see Steps::WatchPeer).
std::string SentinelKey(const std::string& peer_task, const std::string& self_task);

// Counts per key, forgetting keys unused for a while: MWMS draws a new
// instance (so new keys) every call, which would otherwise grow without
// bound. A key still in use is refreshed on every use; only a key unused
// for kKeep other keys is forgotten (and would restart at 0 if it came
// back: documented in collectives.h).
class Counts {
 public:
  static constexpr size_t kKeep = 1 << 16;
  uint64_t Next(const std::string& key) {
    auto it = cur_.find(key);
    uint64_t n = 0;
    if (it != cur_.end()) {
      n = it->second;
    } else if (auto old = old_.find(key); old != old_.end()) {
      n = old->second;
      old_.erase(old);
    }
    cur_[key] = n + 1;
    if (cur_.size() >= kKeep) {
      old_ = std::move(cur_);
      cur_.clear();
    }
    return n;
  }

 private:
  std::unordered_map<std::string, uint64_t> cur_, old_;
};

// The state of one executor's transfers, shared by the RMA and its
// in-flight callbacks: use counts, the transport steps they map to,
// sends in flight, the abort. O(1) per transfer under its lock; no
// callbacks run under it.
//
// Transport steps: the n-th transfer of a key between this task and one
// peer (in one direction) is step mix(seed, instance) + n; the seed mixes
// the executor's step id and how often it was aborted here (Generations).
// Counted per peer, not per key: a group that changes under a kept
// executor (a task joins, MultiWorkerMirroredStrategy created again,
// whose instance keys start over) sends a key to another peer than
// before, and the two ends of each transfer count only what passed
// between them, so they agree (counted per key, a worker that sent a key
// to its old neighbour gave it step n + 1 where the new neighbour, which
// never saw it, expected n: the all-reduce hung). In a fixed group a key
// and direction always mean the same peer: the same counts as per key.
//
// Aborting the executor fails its own transfers in flight here (the
// latest use of each key, without propagation) and aborts, with
// propagation, one step: the sentinel. Every executor waits,
// per peer it exchanges chunks with, on a receive of `sentinel_step()`
// that no peer ever sends, posted before its first transfer with that
// peer. It fails when that peer aborts its executor or when the transport
// loses the peer, and its failure aborts this executor, which fails its
// own receives in turn: so a peer waiting on a chunk from us, of an
// instance we ran or one we never reached, fails, with one abort message
// per link and executor (aborting every key's steps with propagation, as
// before, sent 2 messages per remembered key on every link, and every
// peer repeated it). The same reach as stock TF, where a peer's aborted
// BufRendezvous fails every RecvBuf sent to it, and a dead peer fails
// them all.
class Steps {
 public:
  Steps(int64_t exec_step, uint64_t generation)
      : seed_(Mix(static_cast<uint64_t>(exec_step)) ^ Mix(~generation)),
        sentinel_(Mix(seed_ ^ 0x5e17e1ULL)) {}

  uint64_t sentinel_step() const { return sentinel_; }

  // The transport step of the next use of `key` in one direction; an
  // error once the executor is aborted. `*new_peer`: first transfer with
  // `peer` (the caller posts its sentinel).
  absl::Status Next(const std::string& key, const std::string& instance, bool recv,
                    const std::string& peer, uint64_t* step, bool* new_peer) {
    tf::mutex_lock l(mu_);
    if (!aborted_.ok()) return aborted_;
    const uint64_t n = uses_[recv ? 1 : 0].Next(absl::StrCat(key, "|", peer));
    *step = Mix(seed_ ^ Fnv1a(instance)) + n;
    // u64::MAX is reserved by the transport (placement ahead of a step).
    if (*step == ~uint64_t{0}) *step = 0;
    *new_peer = peers_.insert(peer).second;
    if (recv) recvs_.insert(*step);
    return absl::OkStatus();
  }

  // A receive `Next` returned ended (completed, failed or never posted):
  // an abort no longer needs to fail its step.
  void RecvDone(uint64_t step) {
    tf::mutex_lock l(mu_);
    auto it = recvs_.find(step);
    if (it != recvs_.end()) recvs_.erase(it);
  }

  // Marks the executor aborted (`*first`: by this call); returns the
  // steps of its receives in flight here (every one `Next` handed out and
  // `RecvDone` did not end: a key forgotten by the use counts while its
  // receive waits is still among them), to fail locally, and the sends
  // still in flight, to complete with the abort. Peers learn of it from the sentinel step alone (see
  // the class comment): one message per link, whatever the number of keys.
  std::vector<uint64_t> Abort(const absl::Status& status, bool* first,
                              std::vector<tf::StatusCallback>* sends) {
    tf::mutex_lock l(mu_);
    *first = aborted_.ok();
    if (!*first) return {};
    aborted_ = status;
    std::vector<uint64_t> steps(recvs_.begin(), recvs_.end());
    recvs_.clear();
    std::sort(steps.begin(), steps.end());
    steps.erase(std::unique(steps.begin(), steps.end()), steps.end());
    for (auto& [id, done] : sends_) sends->push_back(std::move(done));
    sends_.clear();
    return steps;
  }

  absl::Status aborted() {
    tf::mutex_lock l(mu_);
    return aborted_;
  }

  // Sends in flight, so that an abort completes them at once: the
  // transport fails a send queued while it (re)connects to a peer only when
  // the connection attempt gives up, not on rdev_abort_step. Returns 0 (and
  // keeps nothing) once aborted.
  uint64_t AddSend(tf::StatusCallback done) {
    tf::mutex_lock l(mu_);
    if (!aborted_.ok()) return 0;
    sends_.emplace(++last_send_, std::move(done));
    return last_send_;
  }
  // The send's `done`, if nobody completed it yet (exactly once).
  bool TakeSend(uint64_t id, tf::StatusCallback* done) {
    tf::mutex_lock l(mu_);
    auto it = sends_.find(id);
    if (it == sends_.end()) return false;
    *done = std::move(it->second);
    sends_.erase(it);
    return true;
  }

  // The executor is gone (TF cleaned it up): a sentinel failing now is
  // not an abort.
  void Close() {
    tf::mutex_lock l(mu_);
    closed_ = true;
  }
  bool closed() {
    tf::mutex_lock l(mu_);
    return closed_;
  }

 private:
  const uint64_t seed_;
  const uint64_t sentinel_;
  tf::mutex mu_;
  absl::Status aborted_ TF_GUARDED_BY(mu_);
  bool closed_ TF_GUARDED_BY(mu_) = false;
  Counts uses_[2] TF_GUARDED_BY(mu_);  // [sent, received], by "key|peer"
  std::set<std::string> peers_ TF_GUARDED_BY(mu_);
  // Steps of receives in flight (one entry per receive).
  std::unordered_multiset<uint64_t> recvs_ TF_GUARDED_BY(mu_);
  uint64_t last_send_ TF_GUARDED_BY(mu_) = 0;
  std::unordered_map<uint64_t, tf::StatusCallback> sends_ TF_GUARDED_BY(mu_);
};

// Aborts the executor's transfers: completes its sends in flight, fails
// its receives, and aborts its sentinel step on the peers (which abort
// their executors). From any thread; the work runs on the plugin's
// data-path pool.
void AbortTransfers(const std::shared_ptr<Transport>& transport,
                    const std::shared_ptr<Steps>& steps, const absl::Status& s, bool* first);

// How many executors of each step id ended on this task. An executor TF
// creates again for the same step id (eager runs every collective under
// step 0; after an abort it must be cleaned up and created anew) must not
// reuse the previous one's transport steps: the transport fails receives
// of a step it has seen end. Tasks clean executors up together (a step
// ends everywhere; an abort propagates), so they agree on the count. The
// newest kKeep step ids are remembered (graph mode draws a new step id per
// step; the transport remembers a similar number of ended steps).
class Generations {
 public:
  static constexpr size_t kKeep = 4096;
  uint64_t Get(int64_t step_id) {
    tf::mutex_lock l(mu_);
    auto it = ended_.find(step_id);
    return it == ended_.end() ? 0 : it->second;
  }
  void Bump(int64_t step_id) {
    tf::mutex_lock l(mu_);
    if (ended_[step_id]++ == 0) order_.push_back(step_id);
    while (order_.size() > kKeep) {
      ended_.erase(order_.front());
      order_.pop_front();
    }
  }

 private:
  tf::mutex mu_;
  std::unordered_map<int64_t, uint64_t> ended_ TF_GUARDED_BY(mu_);
  std::deque<int64_t> order_ TF_GUARDED_BY(mu_);
};

}  // namespace rdma_device

#endif  // RDMA_DEVICE_TF_PLUGIN_COLLECTIVE_STEPS_H_
