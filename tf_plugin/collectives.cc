#include "collectives.h"

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "collective_rma.h"
#include "collective_steps.h"
#include "tensorflow/core/common_runtime/base_collective_executor.h"
#include "tensorflow/core/common_runtime/device.h"
#include "tensorflow/core/common_runtime/device_mgr.h"
#include "tensorflow/core/distributed_runtime/collective_param_resolver_distributed.h"
#include "tensorflow/core/distributed_runtime/device_resolver_distributed.h"
#include "tensorflow/core/distributed_runtime/rpc_collective_executor_mgr.h"
#include "tensorflow/core/distributed_runtime/worker_cache.h"
#include "tensorflow/core/distributed_runtime/worker_env.h"
#include "tensorflow/core/nccl/collective_communicator.h"
#include "tensorflow/core/platform/logging.h"
#include "tensorflow/core/platform/mutex.h"
#include "tensorflow/core/protobuf/config.pb.h"
#include "tensorflow/core/util/device_name_utils.h"
#include "transport.h"

namespace rdma_device {

namespace {

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
        generations_(std::make_shared<Generations>()),
        devices_(this) {}

  // The cluster changed (UpdateServerDef): groups and instances are
  // resolved afresh from now on, under the new definition's config (its
  // group leader), as by the manager TF builds there; the executors stay.
  // The resolvers replaced stay alive (a call may still be in one): one
  // pair per UpdateServerDef.
  void RenewResolvers(const tf::ConfigProto& config) {
    auto dev = std::make_unique<tf::DeviceResolverDistributed>(dev_mgr_);
    auto param = std::make_unique<tf::CollectiveParamResolverDistributed>(
        config, dev_mgr_, dev.get(), nccl_communicator_.get(), worker_cache_, task_name_);
    tf::mutex_lock l(mu_);
    dev_now_ = dev.get();
    param_now_ = param.get();
    devs_.push_back(std::move(dev));
    params_.push_back(std::move(param));
  }

  tf::ParamResolverInterface* GetParamResolver() const override {
    tf::tf_shared_lock l(mu_);
    return param_now_ != nullptr ? param_now_ : param_resolver_.get();
  }
  tf::DeviceResolverInterface* GetDeviceResolver() const override {
    tf::tf_shared_lock l(mu_);
    return dev_now_ != nullptr ? dev_now_ : dev_resolver_.get();
  }

 protected:
  // As RpcCollectiveExecutorMgr::Create, with our remote access (which
  // reaches the current device resolver through `devices_`).
  tf::CollectiveExecutor* Create(int64_t step_id) override {
    auto* rma = NewRdmaCollectiveRemoteAccess(dev_mgr_, &devices_, work_queue_, worker_cache_,
                                              step_id, task_name_, transport_, generations_);
    return new tf::BaseCollectiveExecutor(this, rma, step_id, dev_mgr_, work_queue_);
  }

 private:
  // The manager's current device resolver, for executors that outlive a
  // RenewResolvers.
  class Devices : public tf::DeviceResolverInterface {
   public:
    explicit Devices(RdmaCollectiveExecutorMgr* mgr) : mgr_(mgr) {}
    absl::Status GetDeviceAttributes(const std::string& device,
                                     tf::DeviceAttributes* attributes) override {
      return mgr_->GetDeviceResolver()->GetDeviceAttributes(device, attributes);
    }
    absl::Status GetAllDeviceAttributes(const std::string& task,
                                        std::vector<tf::DeviceAttributes>* attributes) override {
      return mgr_->GetDeviceResolver()->GetAllDeviceAttributes(task, attributes);
    }
    absl::Status UpdateDeviceAttributes(
        const std::vector<tf::DeviceAttributes>& attributes) override {
      return mgr_->GetDeviceResolver()->UpdateDeviceAttributes(attributes);
    }

   private:
    RdmaCollectiveExecutorMgr* const mgr_;
  };

  const std::shared_ptr<Transport> transport_;
  const std::shared_ptr<Generations> generations_;
  Devices devices_;
  mutable tf::mutex mu_;
  tf::DeviceResolverDistributed* dev_now_ TF_GUARDED_BY(mu_) = nullptr;
  tf::CollectiveParamResolverDistributed* param_now_ TF_GUARDED_BY(mu_) = nullptr;
  std::vector<std::unique_ptr<tf::DeviceResolverDistributed>> devs_ TF_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<tf::CollectiveParamResolverDistributed>> params_ TF_GUARDED_BY(mu_);
};
}  // namespace

// The worker cache the kept manager, its param resolver and its executors
// hold (a pointer each, for the server's life): it forwards to the newest
// cluster's cache. A worker goes back to the cache that handed it out, so
// older caches stay alive (one per UpdateServerDef).
class Collectives::Cache : public tf::WorkerCacheInterface {
 public:
  explicit Cache(std::unique_ptr<tf::WorkerCacheInterface> first) {
    caches_.push_back(std::move(first));
  }

  void Use(std::unique_ptr<tf::WorkerCacheInterface> next) {
    tf::mutex_lock l(mu_);
    caches_.push_back(std::move(next));
  }

  void ListWorkers(std::vector<std::string>* workers) const override {
    current()->ListWorkers(workers);
  }
  void ListWorkersInJob(const std::string& job_name,
                        std::vector<std::string>* workers) const override {
    current()->ListWorkersInJob(job_name, workers);
  }
  tf::WorkerInterface* GetOrCreateWorker(const std::string& target) override {
    tf::WorkerCacheInterface* cache = current();
    tf::WorkerInterface* worker = cache->GetOrCreateWorker(target);
    if (worker != nullptr) {
      tf::mutex_lock l(mu_);
      auto& [from, uses] = lent_[worker];
      from = cache;
      ++uses;
    }
    return worker;
  }
  void ReleaseWorker(const std::string& target, tf::WorkerInterface* worker) override {
    tf::WorkerCacheInterface* cache = nullptr;
    {
      tf::mutex_lock l(mu_);
      auto it = lent_.find(worker);
      if (it != lent_.end()) {
        cache = it->second.first;
        if (--it->second.second == 0) lent_.erase(it);
      }
    }
    (cache != nullptr ? cache : current())->ReleaseWorker(target, worker);
  }
  bool GetDeviceLocalityNonBlocking(const std::string& device,
                                    tf::DeviceLocality* locality) override {
    return current()->GetDeviceLocalityNonBlocking(device, locality);
  }
  void GetDeviceLocalityAsync(const std::string& device, tf::DeviceLocality* locality,
                              tf::StatusCallback done) override {
    current()->GetDeviceLocalityAsync(device, locality, std::move(done));
  }
  absl::Status GetEagerClientCache(
      std::unique_ptr<tf::eager::EagerClientCache>* eager_client_cache) override {
    return current()->GetEagerClientCache(eager_client_cache);
  }
  absl::Status GetCoordinationClientCache(
      std::unique_ptr<tsl::CoordinationClientCache>* coordination_client_cache) override {
    return current()->GetCoordinationClientCache(coordination_client_cache);
  }
  void SetLogging(bool active) override { current()->SetLogging(active); }
  void ClearLogs() override { current()->ClearLogs(); }
  bool RetrieveLogs(int64_t step_id, tf::StepStats* ss) override {
    return current()->RetrieveLogs(step_id, ss);
  }

 private:
  tf::WorkerCacheInterface* current() const {
    tf::tf_shared_lock l(mu_);
    return caches_.back().get();
  }

  mutable tf::mutex mu_;
  std::vector<std::unique_ptr<tf::WorkerCacheInterface>> caches_ TF_GUARDED_BY(mu_);
  std::map<tf::WorkerInterface*, std::pair<tf::WorkerCacheInterface*, int>> lent_
      TF_GUARDED_BY(mu_);
};

// What worker_env holds: the kept manager's calls, and a reference on it.
class Collectives::Handle : public tf::CollectiveExecutorMgrInterface {
 public:
  explicit Handle(std::shared_ptr<Collectives> owner)
      : owner_(std::move(owner)), mgr_(owner_->mgr_.get()) {}

  tf::CollectiveExecutor* FindOrCreate(int64_t step_id) override {
    return mgr_->FindOrCreate(step_id);
  }
  void Cleanup(int64_t step_id) override { mgr_->Cleanup(step_id); }
  void CleanupAll() override { mgr_->CleanupAll(); }
  tf::ParamResolverInterface* GetParamResolver() const override {
    return mgr_->GetParamResolver();
  }
  tf::DeviceResolverInterface* GetDeviceResolver() const override {
    return mgr_->GetDeviceResolver();
  }
  tf::NcclCommunicatorInterface* GetNcclCommunicator() const override {
    return mgr_->GetNcclCommunicator();
  }
  void GetStepSequenceAsync(const tf::GetStepSequenceRequest* request,
                            tf::GetStepSequenceResponse* response,
                            const tf::StatusCallback& done) override {
    mgr_->GetStepSequenceAsync(request, response, done);
  }
  void RefreshStepIdSequenceAsync(int64_t graph_key, const tf::StatusCallback& done) override {
    mgr_->RefreshStepIdSequenceAsync(graph_key, done);
  }
  int64_t NextStepId(int64_t graph_key) override { return mgr_->NextStepId(graph_key); }
  void RetireStepId(int64_t graph_key, int64_t step_id) override {
    mgr_->RetireStepId(graph_key, step_id);
  }

 private:
  const std::shared_ptr<Collectives> owner_;
  tf::CollectiveExecutorMgrInterface* const mgr_;
};

std::shared_ptr<Collectives> Collectives::Create(
    const tf::ConfigProto& config, const tf::WorkerEnv* env,
    std::unique_ptr<tf::WorkerCacheInterface> worker_cache, std::shared_ptr<Transport> transport) {
  // The task name as GrpcServer::Init derives it (from a local device).
  std::string task_name, unused;
  std::vector<tf::Device*> devices = env->device_mgr->ListDevices();
  if (devices.empty() ||
      !tsl::DeviceNameUtils::SplitDeviceName(devices[0]->name(), &task_name, &unused)) {
    LOG(ERROR) << "rdma_device: no local device to name this task; collectives unavailable";
    return nullptr;  // GrpcServer::Init fails with "did not return CollectiveExecutorMgr"
  }
  std::shared_ptr<Collectives> out(new Collectives());
  out->self_ = out;
  out->cache_ = std::make_unique<Cache>(std::move(worker_cache));
  // As GrpcServer::Init + CreateProdRpcCollectiveExecutorMgr: the same NCCL
  // communicator TF would use (null on a CPU-only build, or with
  // device_count {GPU: 0}), handed to the param resolver (which picks NCCL
  // for GPU collectives only when it has one) and owned by the manager.
  // Passing null here made a CUDA build's NcclReducer dereference it.
  std::unique_ptr<tf::NcclCommunicatorInterface> nccl = tf::MaybeCreateNcclCommunicator(config);
  auto dev_resolver = std::make_unique<tf::DeviceResolverDistributed>(env->device_mgr);
  auto param_resolver = std::make_unique<tf::CollectiveParamResolverDistributed>(
      config, env->device_mgr, dev_resolver.get(), nccl.get(), out->cache_.get(), task_name);
  out->mgr_ = std::make_unique<RdmaCollectiveExecutorMgr>(
      config, env->device_mgr, std::move(dev_resolver), std::move(param_resolver),
      std::move(nccl), out->cache_.get(), task_name, std::move(transport));
  return out;
}

std::unique_ptr<tf::CollectiveExecutorMgrInterface> Collectives::NewHandle() {
  return std::make_unique<Handle>(self_.lock());
}

void Collectives::Update(const tf::ConfigProto& config,
                         std::unique_ptr<tf::WorkerCacheInterface> worker_cache) {
  cache_->Use(std::move(worker_cache));
  static_cast<RdmaCollectiveExecutorMgr*>(mgr_.get())->RenewResolvers(config);
}

Collectives::~Collectives() = default;

}  // namespace rdma_device
