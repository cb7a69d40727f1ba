#include "collective_rma.h"

#include <cstring>
#include <string>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "collective_steps.h"
#include "pool.h"
#include "tensorflow/core/common_runtime/device.h"
#include "tensorflow/core/framework/cancellation.h"
#include "tensorflow/core/platform/logging.h"
#include "transport.h"

namespace rdma_device {

namespace {

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
      const std::string why = "a collective chunk in device memory";
      absl::Status strict = transport_->GrpcFallback(peer_task, why);
      if (!strict.ok()) return done(strict);
      return stock(why);
    }
    // A route still being chosen: the receive waits in the transport (and
    // fails NotViable, pulled below, if the peer ends up on gRPC).
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
      if (!registered) {
        steps_->RecvDone(step);
        return done(absl::CancelledError("collective receive cancelled"));
      }
    }

    const std::thread::id caller = std::this_thread::get_id();
    std::shared_ptr<Transport> transport = transport_;
    std::shared_ptr<Steps> steps = steps_;
    const std::string wire_key =
        WireKey(peer_device, to_device->name(), split.edge, to_tensor->TotalBytes());
    VLOG(2) << "collective recv " << wire_key << " step " << step;
    s = transport_->Recv(
        peer_task, wire_key, step,
        [=](const absl::Status& status, const tf::Tensor& tensor, bool is_dead) {
          steps->RecvDone(step);
          if (cancellation_manager != nullptr) cancellation_manager->TryDeregisterCallback(token);
          if (!status.ok() && Transport::IsNotViable(status)) {
            // The sender does not push to us: pull over gRPC (the RMA
            // lives until `done`, which has not run).
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
      steps_->RecvDone(step);
      if (cancellation_manager != nullptr) cancellation_manager->TryDeregisterCallback(token);
      if (Transport::IsNotViable(s)) return stock(std::string(s.message()));
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
    // A route still being chosen: the push waits in the transport.
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
        [transport, steps, id, bytes, stock](const absl::Status& sent) {
          tf::StatusCallback done;
          if (!steps->TakeSend(id, &done)) return;  // an abort completed it
          if (sent.ok()) {
            transport->RecordCollective(Transport::CollectiveEvent::kSent, bytes);
            return done(sent);
          }
          if (Transport::IsNotViable(sent)) {
            // Learnt while connecting, or once the route was chosen: the
            // receiver will pull it.
            return stock();
          }
          done(sent);
        },
        &refused);
    if (!s.ok()) {
      tf::StatusCallback mine;
      if (!steps->TakeSend(id, &mine)) return;  // an abort completed it
      if (refused) return stock();
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

}  // namespace

tf::CollectiveRemoteAccessDistributed* NewRdmaCollectiveRemoteAccess(
    const tf::DeviceMgr* dev_mgr, tf::DeviceResolverInterface* dev_resolver,
    std::shared_ptr<tsl::UnboundedWorkQueue> work_queue, tf::WorkerCacheInterface* worker_cache,
    int64_t step_id, std::string task_name, std::shared_ptr<Transport> transport,
    std::shared_ptr<Generations> generations) {
  return new RdmaCollectiveRemoteAccess(dev_mgr, dev_resolver, std::move(work_queue), worker_cache,
                                        step_id, std::move(task_name), std::move(transport),
                                        std::move(generations));
}

}  // namespace rdma_device
