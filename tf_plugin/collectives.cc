#include "collectives.h"

#include <algorithm>
#include <cstring>
#include <deque>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tensorflow/core/common_runtime/base_collective_executor.h"
#include "tensorflow/core/common_runtime/device.h"
#include "tensorflow/core/common_runtime/device_mgr.h"
#include "tensorflow/core/distributed_runtime/collective_param_resolver_distributed.h"
#include "tensorflow/core/distributed_runtime/collective_rma_distributed.h"
#include "tensorflow/core/distributed_runtime/device_resolver_distributed.h"
#include "tensorflow/core/distributed_runtime/rpc_collective_executor_mgr.h"
#include "tensorflow/core/distributed_runtime/worker_env.h"
#include "tensorflow/core/framework/cancellation.h"
#include "tensorflow/core/nccl/collective_communicator.h"
#include "tensorflow/core/platform/logging.h"
#include "tensorflow/core/protobuf/config.pb.h"
#include "tensorflow/core/util/device_name_utils.h"
#include "pool.h"
#include "transport.h"

namespace rdma_device {

namespace tf = ::tensorflow;

namespace {

uint64_t Mix(uint64_t x) {  // splitmix64's finalizer
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

uint64_t Fnv1a(const std::string& s) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ULL;
  return h;
}

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

SplitKey Split(const std::string& key) {
  std::vector<size_t> colons;
  for (size_t i = 0; i < key.size() && colons.size() < 4; ++i) {
    if (key[i] == ':') colons.push_back(i);
  }
  if (colons.size() < 4) return {key, key};
  return {key.substr(0, colons[3]),
          absl::StrCat(key.substr(0, colons[0]), key.substr(colons[1], colons[3] - colons[1]),
                       key.substr(colons[3]))};
}

bool IsCpu(const std::string& device_name) {
  tsl::DeviceNameUtils::ParsedName parsed;
  return tsl::DeviceNameUtils::ParseFullName(device_name, &parsed) && parsed.has_type &&
         parsed.type == "CPU";
}

// The transport's key for a chunk: rendezvous-key-shaped
// ("src;incarnation;dst;name;frame:iter"), the name reserved for
// collectives and carrying the chunk's size, so that collectives of
// different sizes never share (and re-place) an edge.
std::string WireKey(const std::string& src_device, const std::string& dst_device,
                    const std::string& edge, uint64_t bytes) {
  return absl::StrCat(src_device, ";0;", dst_device, ";__collective/", edge, "/", bytes, "B;0:0");
}

// The per-peer abort sentinel's key (see Steps::WatchPeer).
std::string SentinelKey(const std::string& peer_task, const std::string& self_task) {
  return absl::StrCat(peer_task, ";0;", self_task, ";__collective_abort;0:0");
}

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
  // Every key currently remembered with its count.
  template <typename F>
  void ForEach(F f) const {
    for (const auto& [k, n] : old_) f(k, n);
    for (const auto& [k, n] : cur_) f(k, n);
  }

 private:
  std::unordered_map<std::string, uint64_t> cur_, old_;
};

// The state of one executor's transfers, shared by the RMA and its
// in-flight callbacks: use counts, the transport steps they map to,
// sends in flight, the abort. O(1) per transfer under its lock; no
// callbacks run under it.
//
// Transport steps: the n-th use of a key is step mix(seed, instance) + n;
// the seed mixes the executor's step id and how often it was aborted
// here (Generations). Aborting the executor aborts, with propagation,
// every step of its recent instances and the next use of each, so
// receivers waiting on chunks from us fail. Receivers waiting on an
// instance we never saw (the abort came before we started it) learn it
// from the sentinel: every executor waits, per peer it exchanges chunks
// with, on a receive of `sentinel_step()` that no peer ever sends. It
// fails when that peer aborts its executor (it aborts the sentinel step
// with propagation) or when the transport loses the peer, and its failure
// aborts this executor: the same reach as stock TF, where a peer's aborted
// BufRendezvous fails every RecvBuf sent to it, and a dead peer fails them
// all.
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
    const uint64_t n = uses_[recv ? 1 : 0].Next(key);
    *step = Mix(seed_ ^ Fnv1a(instance)) + n;
    // u64::MAX is reserved by the transport (placement ahead of a step).
    if (*step == ~uint64_t{0}) *step = 0;
    *new_peer = peers_.insert(peer).second;
    return absl::OkStatus();
  }

  // Marks the executor aborted (`*first`: by this call); returns the
  // steps to abort with propagation (see the class comment) and the sends
  // still in flight, to complete with the abort.
  std::vector<uint64_t> Abort(const absl::Status& status, bool* first,
                              std::vector<tf::StatusCallback>* sends) {
    tf::mutex_lock l(mu_);
    *first = aborted_.ok();
    if (!*first) return {};
    aborted_ = status;
    std::vector<uint64_t> steps{sentinel_};
    for (const Counts& counts : uses_) {
      counts.ForEach([&](const std::string& key, uint64_t uses) {
        const uint64_t base = Mix(seed_ ^ Fnv1a(Split(key).instance));
        steps.push_back(base + uses - 1);  // the latest use (maybe in flight)
        steps.push_back(base + uses);      // the next (a peer may wait for it)
      });
    }
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
  Counts uses_[2] TF_GUARDED_BY(mu_);  // [sent, received]
  std::set<std::string> peers_ TF_GUARDED_BY(mu_);
  uint64_t last_send_ TF_GUARDED_BY(mu_) = 0;
  std::unordered_map<uint64_t, tf::StatusCallback> sends_ TF_GUARDED_BY(mu_);
};

// Aborts the executor's transfers: completes its sends in flight, fails
// its receives and (propagate) peers' receives of its steps. From any
// thread; the work runs on the plugin's pool.
void AbortTransfers(const std::shared_ptr<Transport>& transport,
                    const std::shared_ptr<Steps>& steps, const absl::Status& s, bool* first) {
  std::vector<tf::StatusCallback> sends;
  std::vector<uint64_t> ids = steps->Abort(s, first, &sends);
  if (!*first) return;
  VLOG(1) << "rdma_device: collective executor aborts " << ids.size() << " transport steps and "
          << sends.size() << " sends: " << s;
  Schedule([transport, ids = std::move(ids), sends = std::move(sends), s] {
    // Sends the transport still holds end now; their bytes stay referenced
    // by the transport until it lets go, and whatever it still delivers is
    // for a step the receivers drop.
    for (const auto& done : sends) done(s);
    if (transport != nullptr) {
      for (uint64_t step : ids) transport->AbortStep(step, s, /*propagate=*/true);
    }
  });
}

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

class RdmaCollectiveRemoteAccess : public tf::CollectiveRemoteAccessDistributed {
 public:
  RdmaCollectiveRemoteAccess(const tf::DeviceMgr* dev_mgr, tf::DeviceResolverInterface* dev_resolver,
                             std::shared_ptr<tsl::UnboundedWorkQueue> work_queue,
                             tf::WorkerCacheInterface* worker_cache, int64_t step_id,
                             std::string task_name, std::shared_ptr<Transport> transport,
                             std::shared_ptr<Generations> generations)
      : CollectiveRemoteAccessDistributed(dev_mgr, dev_resolver, std::move(work_queue),
                                          worker_cache, step_id, std::move(task_name)),
        transport_(std::move(transport)),
        generations_(std::move(generations)),
        steps_(std::make_shared<Steps>(step_id, generations_->Get(step_id))) {}

  ~RdmaCollectiveRemoteAccess() override {
    // Executors end with their step (or the eager context): withdraw the
    // sentinels quietly (no propagation; not an abort).
    steps_->Close();
    generations_->Bump(step_id_);
    if (transport_ != nullptr) {
      transport_->AbortStep(steps_->sentinel_step(), absl::CancelledError("collective executor done"),
                            /*propagate=*/false);
    }
  }

  void RecvFromPeer(const std::string& peer_device, const std::string& peer_task,
                    bool peer_is_local, const std::string& key, tf::Device* to_device,
                    tf::DeviceContext* to_device_ctx, const tf::AllocatorAttributes& to_alloc_attr,
                    tf::Tensor* to_tensor, const tf::DeviceLocality& client_locality,
                    int dev_to_dev_stream_index, tf::CancellationManager* cancellation_manager,
                    const tf::StatusCallback& done) override {
    auto stock = [=](std::string reason) {
      RecvOverGrpc(peer_device, peer_task, key, to_device, to_device_ctx, to_alloc_attr, to_tensor,
                   client_locality, dev_to_dev_stream_index, cancellation_manager, done,
                   std::move(reason));
    };
    if (peer_is_local || transport_ == nullptr || peer_task == task_name_) {
      CollectiveRemoteAccessDistributed::RecvFromPeer(
          peer_device, peer_task, peer_is_local, key, to_device, to_device_ctx, to_alloc_attr,
          to_tensor, client_locality, dev_to_dev_stream_index, cancellation_manager, done);
      return;
    }
    if (!IsCpu(peer_device) || !IsCpu(to_device->name())) {
      absl::Status strict = NotOnCpu(peer_task);
      if (!strict.ok()) return done(strict);
      return stock("collective chunk in device memory");
    }
    Route route;
    absl::Status s = transport_->RouteTo(peer_task, &route);
    if (!s.ok()) return done(s);
    if (route.kind == Route::kGrpc) return stock(route.reason);

    const SplitKey split = Split(key);
    uint64_t step = 0;
    bool new_peer = false;
    s = steps_->Next(key, split.instance, /*recv=*/true, peer_task, &step, &new_peer);
    if (!s.ok()) return done(s);
    if (new_peer) WatchPeer(peer_task);

    // The op's cancellation aborts this receive's step (on the plugin's
    // pool: TF may cancel under its own locks).
    tf::CancellationToken token = tf::CancellationManager::kInvalidToken;
    if (cancellation_manager != nullptr) {
      token = cancellation_manager->get_cancellation_token();
      std::shared_ptr<Transport> transport = transport_;
      const bool registered = cancellation_manager->RegisterCallback(token, [transport, step] {
        Schedule([transport, step] {
          transport->AbortStep(step, absl::CancelledError("collective receive cancelled"),
                               /*propagate=*/true);
        });
      });
      if (!registered) return done(absl::CancelledError("collective receive cancelled"));
    }

    const std::thread::id caller = std::this_thread::get_id();
    std::shared_ptr<Transport> transport = transport_;
    const std::string wire_key =
        WireKey(peer_device, to_device->name(), split.edge, to_tensor->TotalBytes());
    VLOG(2) << "collective recv " << wire_key << " step " << step;
    s = transport_->Recv(
        peer_task, wire_key, step,
        [=](const absl::Status& status, const tf::Tensor& tensor, bool is_dead) {
          if (cancellation_manager != nullptr) cancellation_manager->TryDeregisterCallback(token);
          if (!status.ok() && Transport::IsNotViable(status)) {
            // The sender does not push to us: pull over gRPC (the RMA
            // lives until `done`, which has not run).
            absl::Status strict = transport->Demote(peer_task, status);
            if (!strict.ok()) return done(strict);
            return stock(std::string(status.message()));
          }
          auto finish = [transport, status, tensor, is_dead, to_tensor, done, wire_key] {
            done(CopyInto(transport.get(), status, tensor, is_dead, to_tensor, wire_key));
          };
          if (std::this_thread::get_id() == caller) {
            finish();  // the chunk was already there: on RecvFromPeer's caller
          } else {
            Schedule(std::move(finish));  // never copy on a transport thread
          }
        });
    if (!s.ok()) {
      if (cancellation_manager != nullptr) cancellation_manager->TryDeregisterCallback(token);
      if (Transport::IsNotViable(s)) {
        absl::Status strict = transport_->Demote(peer_task, s);
        if (!strict.ok()) return done(strict);
        return stock(std::string(s.message()));
      }
      done(s);
    }
  }

  void PostToPeer(const std::string& peer_device, const std::string& peer_task,
                  const std::string& key, tf::Device* from_device,
                  tf::DeviceContext* from_device_ctx, const tf::AllocatorAttributes& from_alloc_attr,
                  const tf::Tensor* from_tensor, const tf::DeviceLocality& client_locality,
                  tf::CancellationManager* cancellation_manager,
                  const tf::StatusCallback& done) override {
    // Stock: the chunk waits in our BufRendezvous for the peer's RecvBuf
    // pull (the receiver counts the fallback).
    auto stock = [=] {
      CollectiveRemoteAccessLocal::PostToPeer(peer_device, peer_task, key, from_device,
                                              from_device_ctx, from_alloc_attr, from_tensor,
                                              client_locality, cancellation_manager, done);
    };
    if (transport_ == nullptr || peer_task == task_name_ || !IsCpu(peer_device) ||
        !IsCpu(from_device->name())) {
      return stock();
    }
    Route route;
    absl::Status s = transport_->RouteTo(peer_task, &route);
    if (!s.ok()) return done(s);
    if (route.kind == Route::kGrpc) return stock();
    const SplitKey split = Split(key);
    uint64_t step = 0;
    bool new_peer = false;
    s = steps_->Next(key, split.instance, /*recv=*/false, peer_task, &step, &new_peer);
    if (!s.ok()) return done(s);
    if (new_peer) WatchPeer(peer_task);

    std::shared_ptr<Transport> transport = transport_;
    std::shared_ptr<Steps> steps = steps_;
    const uint64_t bytes = from_tensor->TotalBytes();
    const std::string wire_key = WireKey(from_device->name(), peer_device, split.edge, bytes);
    const uint64_t id = steps->AddSend(done);
    if (id == 0) return done(steps->aborted());
    VLOG(2) << "collective send " << wire_key << " step " << step;
    bool refused = false;
    s = transport_->Send(
        peer_task, wire_key, step, *from_tensor, /*is_dead=*/false,
        [transport, steps, id, peer_task, bytes, stock](const absl::Status& sent) {
          tf::StatusCallback done;
          if (!steps->TakeSend(id, &done)) return;  // an abort completed it
          if (sent.ok()) {
            transport->RecordCollective(Transport::CollectiveEvent::kSent, bytes);
            return done(sent);
          }
          if (Transport::IsNotViable(sent)) {
            // Learnt while connecting: the receiver will pull it.
            absl::Status strict = transport->Demote(peer_task, sent);
            if (!strict.ok()) return done(strict);
            return stock();
          }
          done(sent);
        },
        &refused);
    if (!s.ok()) {
      tf::StatusCallback mine;
      if (!steps->TakeSend(id, &mine)) return;  // an abort completed it
      if (refused) {
        absl::Status strict = transport_->Demote(peer_task, s);
        if (!strict.ok()) return done(strict);
        return stock();
      }
      done(s);
    }
  }

  void StartAbort(const absl::Status& s) override {
    CollectiveRemoteAccessDistributed::StartAbort(s);
    bool first = false;
    AbortTransfers(transport_, steps_, s, &first);
  }

 private:
  // Posts this executor's sentinel receive from `peer_task` (Steps): it
  // fails, aborting this executor, when the peer aborts its executor or
  // the transport loses the peer.
  void WatchPeer(const std::string& peer_task) {
    std::shared_ptr<Transport> transport = transport_;
    std::shared_ptr<Steps> steps = steps_;
    absl::Status s = transport_->Recv(
        peer_task, SentinelKey(peer_task, task_name_), steps->sentinel_step(),
        [transport, steps, peer_task](const absl::Status& status, const tf::Tensor&, bool) {
          // A peer that does not push to us is the data path's business
          // (it falls back); an ended executor withdrew its sentinels.
          if (Transport::IsNotViable(status) || steps->closed()) return;
          absl::Status why =
              status.ok() ? absl::InternalError(absl::StrCat(
                                "rdma_device: ", peer_task, " sent a collective abort sentinel"))
                          : status;
          VLOG(1) << "rdma_device: collective sentinel from " << peer_task << ": " << why;
          bool first = false;
          AbortTransfers(transport, steps, why, &first);
        });
    if (!s.ok() && !Transport::IsNotViable(s)) {
      LOG(WARNING) << "rdma_device: cannot watch " << peer_task << " for collective aborts: " << s;
    }
  }

  // The received chunk -> the collective's destination (one copy: TF
  // allocated `to_tensor`, usually an alias into the op's output).
  static absl::Status CopyInto(Transport* transport, const absl::Status& status,
                               const tf::Tensor& tensor, bool is_dead, tf::Tensor* to_tensor,
                               const std::string& wire_key) {
    if (!status.ok()) return status;
    if (is_dead || tensor.dtype() != to_tensor->dtype() ||
        tensor.TotalBytes() != to_tensor->TotalBytes()) {
      return absl::InternalError(absl::StrCat(
          "rdma_device: collective chunk ", wire_key, " arrived as ",
          is_dead ? "a dead tensor" : absl::StrCat(tensor.TotalBytes(), " bytes of ",
                                                    tf::DataTypeString(tensor.dtype())),
          " where ", to_tensor->TotalBytes(), " bytes of ",
          tf::DataTypeString(to_tensor->dtype()), " were expected"));
    }
    const size_t n = tensor.TotalBytes();
    if (n > 0 && to_tensor->RefCountIsOne() && tensor.shape() == to_tensor->shape()) {
      // Nobody else references the destination's memory (a scratch chunk,
      // e.g. the ring reducer's first-pass receive buffer, which it only
      // reads): hand over the receive slot itself instead of copying. The
      // slot is read-only to TF (SlotBuffer::OwnsMemory is false, so no
      // kernel forwards it as an output) and returns to the sender when TF
      // drops the chunk.
      *to_tensor = tensor;
    } else if (n > 0) {
      std::memcpy(const_cast<char*>(to_tensor->tensor_data().data()), tensor.tensor_data().data(),
                  n);
    }
    transport->RecordCollective(Transport::CollectiveEvent::kReceived, n);
    return absl::OkStatus();
  }

  // In strict mode, the error for a chunk that cannot use the transport.
  absl::Status NotOnCpu(const std::string& peer_task) {
    if (!transport_->strict()) return absl::OkStatus();
    return absl::FailedPreconditionError(absl::StrCat(
        "rdma_device: RDMA_DEVICE_STRICT is set but a collective chunk with ", peer_task,
        " is in device memory and would use stock gRPC"));
  }

  // Stock RecvBuf pull, counted as a collective fallback with its reason.
  void RecvOverGrpc(const std::string& peer_device, const std::string& peer_task,
                    const std::string& key, tf::Device* to_device,
                    tf::DeviceContext* to_device_ctx, const tf::AllocatorAttributes& to_alloc_attr,
                    tf::Tensor* to_tensor, const tf::DeviceLocality& client_locality,
                    int dev_to_dev_stream_index, tf::CancellationManager* cancellation_manager,
                    const tf::StatusCallback& done, std::string reason) {
    std::shared_ptr<Transport> transport = transport_;
    const uint64_t bytes = to_tensor->TotalBytes();
    CollectiveRemoteAccessDistributed::RecvFromPeer(
        peer_device, peer_task, /*peer_is_local=*/false, key, to_device, to_device_ctx,
        to_alloc_attr, to_tensor, client_locality, dev_to_dev_stream_index, cancellation_manager,
        [transport, bytes, reason = std::move(reason), done](const absl::Status& s) {
          if (s.ok() && transport != nullptr) {
            transport->RecordCollective(Transport::CollectiveEvent::kFallback, bytes,
                                        absl::StrCat("collective: ", reason));
          }
          done(s);
        });
  }

  const std::shared_ptr<Transport> transport_;
  const std::shared_ptr<Generations> generations_;
  const std::shared_ptr<Steps> steps_;
};

class RdmaCollectiveExecutorMgr : public tf::RpcCollectiveExecutorMgr {
 public:
  RdmaCollectiveExecutorMgr(const tf::ConfigProto& config, const tf::DeviceMgr* dev_mgr,
                            std::unique_ptr<tf::DeviceResolverDistributed> dev_resolver,
                            std::unique_ptr<tf::CollectiveParamResolverDistributed> param_resolver,
                            std::unique_ptr<tf::NcclCommunicatorInterface> nccl_communicator,
                            tf::WorkerCacheInterface* worker_cache, const std::string& task_name,
                            std::shared_ptr<Transport> transport)
      : RpcCollectiveExecutorMgr(config, dev_mgr, std::move(dev_resolver),
                                 std::move(param_resolver), std::move(nccl_communicator),
                                 worker_cache, task_name),
        transport_(std::move(transport)),
        generations_(std::make_shared<Generations>()) {}

 protected:
  // As RpcCollectiveExecutorMgr::Create, with our remote access.
  tf::CollectiveExecutor* Create(int64_t step_id) override {
    auto* rma = new RdmaCollectiveRemoteAccess(dev_mgr_, dev_resolver_.get(), work_queue_,
                                               worker_cache_, step_id, task_name_, transport_,
                                               generations_);
    return new tf::BaseCollectiveExecutor(this, rma, step_id, dev_mgr_, work_queue_);
  }

 private:
  const std::shared_ptr<Transport> transport_;
  const std::shared_ptr<Generations> generations_;
};

}  // namespace

tf::CollectiveExecutorMgrInterface* NewCollectiveExecutorMgr(
    const tf::ConfigProto& config, const tf::WorkerEnv* env, tf::WorkerCacheInterface* worker_cache,
    std::shared_ptr<Transport> transport) {
  // The task name as GrpcServer::Init derives it (from a local device).
  std::string task_name, unused;
  std::vector<tf::Device*> devices = env->device_mgr->ListDevices();
  if (devices.empty() ||
      !tsl::DeviceNameUtils::SplitDeviceName(devices[0]->name(), &task_name, &unused)) {
    LOG(ERROR) << "rdma_device: no local device to name this task; collectives unavailable";
    return nullptr;  // GrpcServer::Init fails with "did not return CollectiveExecutorMgr"
  }
  // As GrpcServer::Init + CreateProdRpcCollectiveExecutorMgr: the same NCCL
  // communicator TF would use (null on a CPU-only build, or with
  // device_count {GPU: 0}), handed to the param resolver (which picks NCCL
  // for GPU collectives only when it has one) and owned by the manager.
  // Passing null here made a CUDA build's NcclReducer dereference it.
  std::unique_ptr<tf::NcclCommunicatorInterface> nccl = tf::MaybeCreateNcclCommunicator(config);
  auto dev_resolver = std::make_unique<tf::DeviceResolverDistributed>(env->device_mgr);
  auto param_resolver = std::make_unique<tf::CollectiveParamResolverDistributed>(
      config, env->device_mgr, dev_resolver.get(), nccl.get(), worker_cache, task_name);
  return new RdmaCollectiveExecutorMgr(config, env->device_mgr, std::move(dev_resolver),
                                       std::move(param_resolver), std::move(nccl), worker_cache,
                                       task_name, std::move(transport));
}

}  // namespace rdma_device
