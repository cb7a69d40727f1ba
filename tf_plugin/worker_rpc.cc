#include "worker_rpc.h"

#include <atomic>
#include <map>
#include <set>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "tensorflow/core/distributed_runtime/call_options.h"
#include "tensorflow/core/distributed_runtime/message_wrappers.h"
#include "tensorflow/core/distributed_runtime/worker.h"
#include "tensorflow/core/platform/logging.h"
#include "tensorflow/core/platform/mutex.h"
#include "tensorflow/core/platform/status.h"
#include "tensorflow/core/protobuf/worker.pb.h"
#include "pool.h"
#include "trace.h"
#include "transport.h"

namespace rdma_device {

namespace tf = ::tensorflow;

namespace {

// Method ids on the wire (never renumbered).
constexpr uint32_t kRunGraph = 1;
constexpr uint32_t kCleanupGraph = 2;

// A remote worker: RunGraph and CleanupGraph over the transport when there
// is a connection with its task, all else (and those without one) through
// TF's gRPC worker.
class TransportWorker : public tf::WorkerInterface {
 public:
  TransportWorker(std::string target, tf::WorkerInterface* stock,
                  std::shared_ptr<Transport> transport)
      : target_(std::move(target)), stock_(stock), transport_(std::move(transport)) {}

  tf::WorkerInterface* stock() const { return stock_; }

  void RunGraphAsync(tf::CallOptions* opts, tf::RunGraphRequestWrapper* request,
                     tf::MutableRunGraphResponseWrapper* response,
                     tf::StatusCallback done) override {
    std::string body;
    // A response kept in memory (what an in-process worker creates) has no
    // proto to parse a reply into: TF's own call only (its get_proto()
    // aborts the process).
    if (!Direct() || dynamic_cast<tf::InMemoryRunGraphResponse*>(response) != nullptr ||
        !request->ToProto().SerializeToString(&body)) {
      OverGrpc();
      stock_->RunGraphAsync(opts, request, response, std::move(done));
      return;
    }
    // The cancel callback is in place before the call can complete; it
    // cancels the call once its id is known.
    struct Ctl {
      std::atomic<uint64_t> id{0};
      std::atomic<bool> cancelled{false};
    };
    auto ctl = std::make_shared<Ctl>();
    std::shared_ptr<Transport> transport = transport_;
    if (opts != nullptr) {
      opts->SetCancelCallback([transport, ctl] {
        ctl->cancelled = true;
        if (uint64_t id = ctl->id.load()) transport->CancelCall(id);
      });
    }
    const int64_t traced = TraceStart();
    const uint64_t step = static_cast<uint64_t>(request->step_id());
    tf::RunGraphResponse* proto = get_proto_from_wrapper(response);
    auto finish = [opts, proto, done, traced, step](const absl::Status& s, const std::string& reply) {
      if (opts != nullptr) opts->ClearCancelCallback();
      absl::Status status = s;
      if (status.ok() && !proto->ParseFromString(reply)) {
        status = absl::InternalError("rdma_device: a RunGraph response that does not parse");
      }
      TraceEnd("call:RunGraph", traced, step);
      done(status);
    };
    auto on_reply = [finish](const absl::Status& s, std::string reply) {
      if (reply.size() > kParseReplyInlineMax) {
        Transport::RecordLargeReply(reply.size());
        // A large reply (step stats, cost graphs, partition graphs) is
        // parsed on the plugin's data-path pool, not on rdev-callbacks,
        // which runs every other completion of this transport.
        auto owned = std::make_shared<std::string>(std::move(reply));
        Schedule([finish, s, owned] { finish(s, *owned); });
        return;
      }
      finish(s, reply);
    };
    uint64_t id = 0;
    // on_reply parses a small response and hands it to TF's master, which
    // only counts it down: fit for the transport's thread that reads the
    // reply.
    absl::Status started =
        transport_->Call(target_, kRunGraph, body, opts != nullptr ? opts->GetTimeout() : 0,
                         /*inline_ok=*/true, on_reply, &id);
    if (!started.ok()) {
      // Nothing reached the peer: the call goes over gRPC.
      if (opts != nullptr) opts->ClearCancelCallback();
      if (ctl->cancelled) {
        // TF's RunManyGraphs cancels each call once: that cancel already
        // came (to our callback), so a call over gRPC now would never see
        // it and could hold the step. It ends here, as gRPC ends a
        // cancelled call.
        done(tf::StatusGroup::MakeDerived(
            absl::CancelledError("rdma_device: RunGraph cancelled before it started")));
        return;
      }
      VLOG(1) << "rdma_device: RunGraph on " << target_ << " over gRPC: " << started;
      // No connection with the peer yet (no tensor crossed between us):
      // make one, so that the next steps' calls go over the transport.
      if (Transport::IsNotViable(started)) transport_->ConnectSoon(target_);
      OverGrpc();
      stock_->RunGraphAsync(opts, request, response, std::move(done));
      return;
    }
    ctl->id = id;
    if (ctl->cancelled) transport_->CancelCall(id);
  }
  using tf::WorkerInterface::RunGraphAsync;

  void CleanupGraphAsync(const tf::CleanupGraphRequest* request,
                         tf::CleanupGraphResponse* response, tf::StatusCallback done) override {
    std::string body;
    if (!Direct() || !request->SerializeToString(&body)) {
      OverGrpc();
      stock_->CleanupGraphAsync(request, response, std::move(done));
      return;
    }
    uint64_t id = 0;
    // TF's `done` here counts the step's cleanup down (MasterSession marks
    // the run complete): fit for the thread that reads the reply.
    absl::Status started = transport_->Call(
        target_, kCleanupGraph, body, 0, /*inline_ok=*/true,
        [response, done](const absl::Status& s, std::string reply) {
          absl::Status status = s;
          if (status.ok() && !response->ParseFromString(reply)) {
            status = absl::InternalError("rdma_device: a CleanupGraph response that does not parse");
          }
          done(status);
        },
        &id);
    if (!started.ok()) {
      OverGrpc();
      stock_->CleanupGraphAsync(request, response, std::move(done));
    }
  }

  // Everything else: TF's gRPC worker.
  void GetStatusAsync(tf::CallOptions* opts, const tf::GetStatusRequest* request,
                      tf::GetStatusResponse* response, bool fail_fast,
                      tf::StatusCallback done) override {
    stock_->GetStatusAsync(opts, request, response, fail_fast, std::move(done));
  }
  void CreateWorkerSessionAsync(const tf::CreateWorkerSessionRequest* request,
                                tf::CreateWorkerSessionResponse* response,
                                tf::StatusCallback done) override {
    stock_->CreateWorkerSessionAsync(request, response, std::move(done));
  }
  void DeleteWorkerSessionAsync(tf::CallOptions* opts,
                                const tf::DeleteWorkerSessionRequest* request,
                                tf::DeleteWorkerSessionResponse* response,
                                tf::StatusCallback done) override {
    stock_->DeleteWorkerSessionAsync(opts, request, response, std::move(done));
  }
  void RegisterGraphAsync(const tf::RegisterGraphRequest* request,
                          tf::RegisterGraphResponse* response, tf::StatusCallback done) override {
    stock_->RegisterGraphAsync(request, response, std::move(done));
  }
  void DeregisterGraphAsync(const tf::DeregisterGraphRequest* request,
                            tf::DeregisterGraphResponse* response,
                            tf::StatusCallback done) override {
    stock_->DeregisterGraphAsync(request, response, std::move(done));
  }
  tf::MutableRunGraphRequestWrapper* CreateRunGraphRequest() override {
    return stock_->CreateRunGraphRequest();
  }
  tf::MutableRunGraphResponseWrapper* CreateRunGraphResponse() override {
    return stock_->CreateRunGraphResponse();
  }
  void CleanupAllAsync(const tf::CleanupAllRequest* request, tf::CleanupAllResponse* response,
                       tf::StatusCallback done) override {
    stock_->CleanupAllAsync(request, response, std::move(done));
  }
  void RecvTensorAsync(tf::CallOptions* opts, const tf::RecvTensorRequest* request,
                       tf::TensorResponse* response, tf::StatusCallback done) override {
    stock_->RecvTensorAsync(opts, request, response, std::move(done));
  }
  void LoggingAsync(const tf::LoggingRequest* request, tf::LoggingResponse* response,
                    tf::StatusCallback done) override {
    stock_->LoggingAsync(request, response, std::move(done));
  }
  void TracingAsync(const tf::TracingRequest* request, tf::TracingResponse* response,
                    tf::StatusCallback done) override {
    stock_->TracingAsync(request, response, std::move(done));
  }
  void RecvBufAsync(tf::CallOptions* opts, const tf::RecvBufRequest* request,
                    tf::RecvBufResponse* response, tf::StatusCallback done) override {
    stock_->RecvBufAsync(opts, request, response, std::move(done));
  }
  void CompleteGroupAsync(tf::CallOptions* opts, const tf::CompleteGroupRequest* request,
                          tf::CompleteGroupResponse* response, tf::StatusCallback done) override {
    stock_->CompleteGroupAsync(opts, request, response, std::move(done));
  }
  void CompleteInstanceAsync(tf::CallOptions* opts, const tf::CompleteInstanceRequest* request,
                             tf::CompleteInstanceResponse* response,
                             tf::StatusCallback done) override {
    stock_->CompleteInstanceAsync(opts, request, response, std::move(done));
  }
  void GetStepSequenceAsync(const tf::GetStepSequenceRequest* request,
                            tf::GetStepSequenceResponse* response,
                            tf::StatusCallback done) override {
    stock_->GetStepSequenceAsync(request, response, std::move(done));
  }

 private:
  bool Local() { return target_ == transport_->self_task(); }

  // Whether to try the transport for a per-step call to this task.
  bool Direct() { return transport_->worker_rpcs() && !Local() && transport_->Serves(target_); }

  // A per-step call to another task goes over gRPC (counted; this task's
  // own partition is called in-process, no RPC at all).
  void OverGrpc() {
    if (!Local()) transport_->RecordWorkerRpcOverGrpc();
  }

  const std::string target_;
  tf::WorkerInterface* const stock_;
  const std::shared_ptr<Transport> transport_;
};

class TransportWorkerCache : public tf::WorkerCacheInterface {
 public:
  TransportWorkerCache(tf::WorkerCacheInterface* stock, std::shared_ptr<Transport> transport)
      : stock_(stock), transport_(std::move(transport)) {}
  ~TransportWorkerCache() override { delete stock_; }

  void ListWorkers(std::vector<std::string>* workers) const override {
    stock_->ListWorkers(workers);
  }
  void ListWorkersInJob(const std::string& job_name,
                        std::vector<std::string>* workers) const override {
    stock_->ListWorkersInJob(job_name, workers);
  }
  tf::WorkerInterface* GetOrCreateWorker(const std::string& target) override {
    tf::WorkerInterface* w = stock_->GetOrCreateWorker(target);
    if (w == nullptr) return nullptr;
    // This process's own worker, called in-process (no RPC at all), under
    // whatever name the cache knows it by: a session's ClusterDef may name
    // this task otherwise than the server does (ClusterSpec propagation).
    if (dynamic_cast<tf::Worker*>(w) != nullptr) return w;
    return new TransportWorker(target, w, transport_);
  }
  void ReleaseWorker(const std::string& target, tf::WorkerInterface* worker) override {
    auto* ours = dynamic_cast<TransportWorker*>(worker);
    if (ours == nullptr) {
      stock_->ReleaseWorker(target, worker);
      return;
    }
    stock_->ReleaseWorker(target, ours->stock());
    delete ours;
  }
  bool GetDeviceLocalityNonBlocking(const std::string& device,
                                    tf::DeviceLocality* locality) override {
    return stock_->GetDeviceLocalityNonBlocking(device, locality);
  }
  void GetDeviceLocalityAsync(const std::string& device, tf::DeviceLocality* locality,
                              tf::StatusCallback done) override {
    stock_->GetDeviceLocalityAsync(device, locality, std::move(done));
  }
  absl::Status GetEagerClientCache(
      std::unique_ptr<tf::eager::EagerClientCache>* eager_client_cache) override {
    return stock_->GetEagerClientCache(eager_client_cache);
  }
  absl::Status GetCoordinationClientCache(
      std::unique_ptr<tsl::CoordinationClientCache>* coordination_client_cache) override {
    return stock_->GetCoordinationClientCache(coordination_client_cache);
  }
  void SetLogging(bool active) override { stock_->SetLogging(active); }
  void ClearLogs() override { stock_->ClearLogs(); }
  bool RetrieveLogs(int64_t step_id, tf::StepStats* ss) override {
    return stock_->RetrieveLogs(step_id, ss);
  }

 private:
  tf::WorkerCacheInterface* const stock_;
  const std::shared_ptr<Transport> transport_;
};

// Served RunGraph calls, from their arrival to their reply, for their
// callers' cancellations. A cancel may come before TF's RunGraphAsync
// installed its callback on the call's options (the call waits for a
// compute-pool thread, or TF has not reached that point yet), and
// CallOptions::StartCancel forgets a cancel made before its callback is
// set: so a cancel is also kept as a flag, checked when the call starts
// and again once RunGraphAsync returned.
class Served {
 public:
  // The call arrived (on the thread that read it: before its cancel can).
  void Arrived(uint64_t handle) {
    tf::mutex_lock l(mu_);
    Entry& e = calls_[handle];
    // Its link was lost while it was handed over: the cancel came first.
    e.cancelled = early_.erase(handle) > 0;
  }
  // It starts: false when it was cancelled meanwhile (then it is dropped;
  // its reply would go nowhere).
  bool Start(uint64_t handle, std::shared_ptr<tf::CallOptions> opts) {
    tf::mutex_lock l(mu_);
    auto it = calls_.find(handle);
    if (it == calls_.end()) return false;
    if (it->second.cancelled) {
      calls_.erase(it);
      return false;
    }
    it->second.opts = std::move(opts);
    return true;
  }
  // RunGraphAsync returned: a cancel that came before TF set its callback
  // reaches it now.
  void Started(uint64_t handle) {
    std::shared_ptr<tf::CallOptions> opts;
    {
      tf::mutex_lock l(mu_);
      auto it = calls_.find(handle);
      if (it == calls_.end() || !it->second.cancelled) return;
      opts = it->second.opts;
    }
    if (opts != nullptr) opts->StartCancel();
  }
  void Remove(uint64_t handle) {
    tf::mutex_lock l(mu_);
    calls_.erase(handle);
  }
  // Not under the lock: cancellation may complete the call on this thread.
  void Cancel(uint64_t handle) {
    std::shared_ptr<tf::CallOptions> opts;
    {
      tf::mutex_lock l(mu_);
      auto it = calls_.find(handle);
      if (it == calls_.end()) {
        // Not arrived yet (a lost link cancels on another thread than the
        // one handing the call over), or answered already: kept, a few.
        early_.insert(handle);
        if (early_.size() > kEarlyCancels) early_.erase(early_.begin());
        return;
      }
      it->second.cancelled = true;
      opts = it->second.opts;
    }
    if (opts != nullptr) opts->StartCancel();
  }

 private:
  struct Entry {
    std::shared_ptr<tf::CallOptions> opts;
    bool cancelled = false;
  };
  static constexpr size_t kEarlyCancels = 1024;
  tf::mutex mu_;
  std::map<uint64_t, Entry> calls_ TF_GUARDED_BY(mu_);
  std::set<uint64_t> early_ TF_GUARDED_BY(mu_);
};

// Answer a served call: its serialized response, or the call's error. A
// response that does not serialize (protobuf refuses past 2 GiB) is an
// error, as under stock gRPC, never an OK with an empty body.
template <typename Response>
void ReplyWith(Transport& t, uint64_t handle, const absl::Status& s, const Response& resp,
               const char* what) {
  if (!s.ok()) {
    t.Reply(handle, s, "");
    return;
  }
  std::string out;
  if (!resp.SerializeToString(&out)) {
    t.Reply(handle,
            absl::ResourceExhaustedError(absl::StrCat(
                "rdma_device: the ", what, " response (", resp.ByteSizeLong(),
                " bytes) cannot be serialized: protobuf messages are limited to 2 GiB")),
            "");
    return;
  }
  t.Reply(handle, s, out);
}

}  // namespace

tf::WorkerCacheInterface* NewTransportWorkerCache(tf::WorkerCacheInterface* stock,
                                                  std::shared_ptr<Transport> transport) {
  return new TransportWorkerCache(stock, std::move(transport));
}

void ServeWorkerRpcs(const std::shared_ptr<Transport>& transport, tf::WorkerInterface* worker,
                     tsl::thread::ThreadPool* compute_pool) {
  auto served = std::make_shared<Served>();
  std::weak_ptr<Transport> weak = transport;
  // The call arrives on the transport's thread that read it (both methods
  // are declared inline); all but a small RunGraph move to the compute
  // pool before anything is parsed (see worker_rpc.h).
  transport->ServeInline(kRunGraph);
  transport->ServeInline(kCleanupGraph);
  auto serve = [weak, worker, served](uint64_t handle, uint32_t method, const std::string& body) {
    std::shared_ptr<Transport> t = weak.lock();
    if (t == nullptr) return;
    if (method == kRunGraph) {
      auto req = std::make_shared<tf::RunGraphRequest>();
      if (!req->ParseFromString(body)) {
        served->Remove(handle);
        t->Reply(handle, absl::InvalidArgumentError("rdma_device: a RunGraph request that does not parse"), "");
        return;
      }
      auto resp = std::make_shared<tf::RunGraphResponse>();
      auto opts = std::make_shared<tf::CallOptions>();
      if (!served->Start(handle, opts)) return;
      // The reply is written on the thread that finished the call (an
      // executor thread): writing never waits on the peer (one
      // non-blocking send; what the connection does not take at once
      // is queued for the transport's send thread), and a hop to a
      // pool would put a thread wake-up on every step's critical path.
      worker->RunGraphAsync(opts.get(), req.get(), resp.get(),
                            [t, served, handle, req, resp, opts](const absl::Status& s) {
                              served->Remove(handle);
                              ReplyWith(*t, handle, s, *resp, "RunGraph");
                            });
      served->Started(handle);
    } else if (method == kCleanupGraph) {
      auto req = std::make_shared<tf::CleanupGraphRequest>();
      if (!req->ParseFromString(body)) {
        t->Reply(handle, absl::InvalidArgumentError("rdma_device: a CleanupGraph request that does not parse"), "");
        return;
      }
      auto resp = std::make_shared<tf::CleanupGraphResponse>();
      worker->CleanupGraphAsync(req.get(), resp.get(), [t, handle, req, resp](const absl::Status& s) {
        ReplyWith(*t, handle, s, *resp, "CleanupGraph");
      });
    } else {
      t->Reply(handle, absl::UnimplementedError(absl::StrCat("rdma_device: no worker method ", method)), "");
    }
  };
  transport->Serve(
      [weak, serve, served, compute_pool](uint64_t handle, uint32_t method, std::string body) {
        if (method == kRunGraph) served->Arrived(handle);
        const bool here =
            (method == kRunGraph && body.size() <= kServeInlineMax) || compute_pool == nullptr;
        if (std::shared_ptr<Transport> t = weak.lock()) {
          t->RecordWorkerRpcServed(here ? Transport::ServedOn::kReaderThread
                                        : Transport::ServedOn::kComputePool);
        }
        if (here) {
          serve(handle, method, body);
          return;
        }
        auto owned = std::make_shared<std::string>(std::move(body));
        compute_pool->Schedule([serve, handle, method, owned] { serve(handle, method, *owned); });
      },
      [served](uint64_t handle) { served->Cancel(handle); });
}

}  // namespace rdma_device
