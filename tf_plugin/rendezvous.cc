#include "rendezvous.h"

#include <atomic>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "tensorflow/core/common_runtime/device.h"
#include "tensorflow/core/common_runtime/device_mgr.h"
#include "tensorflow/core/distributed_runtime/worker_session.h"
#include "tensorflow/core/framework/device_base.h"
#include "tensorflow/core/platform/logging.h"
#include "pool.h"
#include "recv_call.h"
#include "recycle.h"
#include "transport.h"
#include "trace.h"

namespace rdma_device {

namespace tf = ::tensorflow;

namespace {

// TF's Cleanup(step) aborts the step's rendezvous, if one is alive, on the
// thread that calls it (RendezvousCache::RemoveAndAbort), with a status
// told from a failure by its text only. The manager marks the step on that
// thread for the time of the call, and StartAbort knows a cleanup by that.
struct CleanupMark {
  bool active = false;
  int64_t step_id = 0;
};

class CleanupScope {
 public:
  explicit CleanupScope(int64_t step_id) : saved_(current_) { current_ = {true, step_id}; }
  ~CleanupScope() { current_ = saved_; }
  CleanupScope(const CleanupScope&) = delete;
  CleanupScope& operator=(const CleanupScope&) = delete;

  static bool Covers(int64_t step_id) { return current_.active && current_.step_id == step_id; }

 private:
  static inline thread_local CleanupMark current_;
  const CleanupMark saved_;
};

// One per step on this task. Tensors whose peer our transport serves are
// pushed by the sender (Send override) and claimed by the receiver
// (RecvFromRemoteAsync); all others go through `stock_`, the gRPC
// rendezvous kept inside (RpcRemoteRendezvous is private to TF, so we hold
// one instead of deriving from it). Sends that stay on gRPC use our own
// base Send: the peer's RecvTensor RPC is routed by the RendezvousMgr to
// *this* rendezvous (BaseRendezvousMgr::RecvLocalAsync), so the tensor must
// sit in our table.
class RdmaRemoteRendezvous : public tf::BaseRemoteRendezvous {
 public:
  RdmaRemoteRendezvous(const tf::WorkerEnv* env, int64_t step_id,
                       tsl::core::RefCountPtr<tf::BaseRemoteRendezvous> stock,
                       std::shared_ptr<Transport> transport,
                       std::shared_ptr<const std::atomic<bool>> closing)
      : BaseRemoteRendezvous(env, step_id),
        stock_(std::move(stock)),
        transport_(std::move(transport)),
        closing_(std::move(closing)) {}

  absl::Status Initialize(tf::WorkerSession* session) override {
    TF_RETURN_IF_ERROR(BaseRemoteRendezvous::Initialize(session));
    // An earlier rendezvous of this step may have gone (see the
    // destructor): the step is running here again.
    if (transport_ != nullptr) transport_->StepActive(step_id_);
    // The client's own eager context: TF creates its rendezvous for step
    // `context_id` in session "eager_<context_id>" and, unlike the remote
    // contexts' (SetRemoteEagerContextDefault), does not mark it; it lives
    // as long as the context all the same.
    if (session != nullptr &&
        session->session_name() == absl::StrCat("eager_", static_cast<uint64_t>(step_id_))) {
      client_eager_context_ = true;
    }
    return stock_->Initialize(session);
  }

  // A rendezvous that lives as long as an eager context (the remote
  // contexts' default, or the client's own): one failed or cancelled op
  // must not end it.
  bool EagerContextStep() { return IsRemoteEagerContextDefault() || client_eager_context_; }

  void SetRemoteEagerContextDefault() override {
    BaseRemoteRendezvous::SetRemoteEagerContextDefault();
    stock_->SetRemoteEagerContextDefault();
  }

  absl::Status Send(const ParsedKey& parsed, const Args& args, const tf::Tensor& val,
                    bool is_dead) override {
    if (transport_ == nullptr || tsl::DeviceNameUtils::IsSameAddressSpace(parsed.src, parsed.dst) ||
        IsThisTask(parsed.dst)) {
      return BaseRemoteRendezvous::Send(parsed, args, val, is_dead);
    }
    // This thread's scratch name: the send path allocates nothing per tensor.
    thread_local std::string peer_scratch;
    TaskOfInto(parsed.dst, &peer_scratch);
    return SendRouted(parsed, args, peer_scratch, val, is_dead);
  }

  void StartAbort(const absl::Status& status) override {
    // TF only aborts with an error; the base CHECKs it, and the shim must
    // never take the process down.
    if (status.ok()) return;
    // TF's normal end of the step, known by where the call comes from, not
    // by its message: its Cleanup of the step, or the manager's teardown.
    const bool cleanup =
        CleanupScope::Covers(step_id_) || closing_->load(std::memory_order_acquire);
    // The eager context's default rendezvous lives as long as the context:
    // TF itself never aborts it for one failed op (base_rendezvous_mgr.h),
    // so neither do we; the error reaches the op that failed.
    if (EagerContextStep() && !cleanup) {
      VLOG(1) << "rdma_device: not aborting the eager context's rendezvous: " << status;
      return;
    }
    VLOG(2) << (cleanup ? "cleanup" : "abort") << " step " << step_id_ << ": " << status;
    bool first = false;
    {
      tf::mutex_lock l(mu_);
      first = abort_status_.ok();
      if (first) abort_status_ = status;
    }
    BaseRemoteRendezvous::StartAbort(status);
    stock_->StartAbort(status);
    // Not under any TF lock here: completions may run on this thread. A
    // failed step is failed on the peers too: their receives from us would
    // otherwise wait for pushes that never come (TF's own cancellation does
    // not reach remote RunGraph calls). Only the first abort counts, as in
    // TF: a later one (an op failed by the cleanup) ends nothing new.
    if (transport_ != nullptr) transport_->AbortStep(step_id_, status, /*propagate=*/first && !cleanup);
  }

 protected:
  void RecvFromRemoteAsync(const ParsedKey& parsed, const Args& recv_args,
                           DoneCallback done) override {
    const std::string peer = TaskOf(parsed.src);
    if (IsThisTask(parsed.src)) {
      // Another name of this task (e.g. /job:localhost): stock handles it.
      stock_->RecvAsync(parsed, recv_args, std::move(done));
      return;
    }
    RecvRouted(parsed, recv_args, peer, std::move(done));
  }

 private:
  // RecvFromRemoteAsync() by the route to `peer` (a route still being
  // chosen waits in the transport, which fails the receive NotViable if
  // the peer ends up on gRPC: it is then pulled over gRPC).
  void RecvRouted(const ParsedKey& parsed, const Args& recv_args, const std::string& peer,
                  DoneCallback done) {
    Route route;
    if (transport_ != nullptr) {
      absl::Status s = transport_->RouteTo(peer, &route);
      if (!s.ok()) {
        done(s, Args(), recv_args, tf::Tensor(), false);
        return;
      }
    } else {
      route.reason = "transport disabled";
    }
    if (route.kind == Route::kGrpc) {
      RecvOverGrpc(parsed, recv_args, std::move(route.reason), std::move(done));
      return;
    }

    std::shared_ptr<Transport> transport = transport_;
    const int64_t step_id = step_id_;
    const bool eager_default = EagerContextStep();
    auto* call = new RecvCall([this, transport, step_id, eager_default,
                               key = std::string(parsed.FullKey())](const absl::Status& s) {
      // A cancelled receive fails the whole step in the transport: TF
      // cancels per step (or per function call), so nothing of it survives.
      // The eager context's default step lives as long as the context and
      // TF never aborts it for one op: there only this receive is cancelled.
      // TF calls this from its abort of this rendezvous, from a receive
      // registered after it, or from the step's cancellation, so `this` is
      // alive here: aborted with the rendezvous, the receive fails here
      // only (the rendezvous' abort tells the peers if the step failed).
      const bool propagate = abort_status().ok();
      // On the plugin's pool, never a TF pool (pool.h).
      Schedule([transport, step_id, eager_default, propagate, key, s] {
        if (eager_default) {
          transport->CancelRecv(key, step_id, s);
        } else {
          transport->AbortStep(step_id, s, propagate);
        }
      });
    });
    RegisterCall(call, recv_args);
    if (!call->status().ok()) {  // the step was aborted already
      absl::Status s = call->status();
      DeregisterCall(call, recv_args);
      delete call;
      done(s, Args(), recv_args, tf::Tensor(), false);
      return;
    }
    // As TF's RPC rendezvous does: hold a reference on `this` until `done`
    // has run, whatever the caller holds.
    this->Ref();
    VLOG(2) << "recv step " << step_id_ << " " << parsed.FullKey();
    const int64_t traced = TraceStart();
    // A tensor for host memory goes straight to TF's `done`: the executor
    // queues the consumer on its pool and returns (TF's own gRPC client
    // runs it on its completion-queue thread too), so it may run on the
    // transport's thread that saw the tensor land, one wake-up sooner. A
    // copy to a device may not (THREADS.md).
    const bool on_event_thread = OnHost(parsed.dst, recv_args);
    absl::Status s = transport_->Recv(
        peer, parsed.FullKey(), step_id_,
        [this, call, peer, parsed, recv_args, done, traced](
            const absl::Status& status, const tf::Tensor& tensor, bool is_dead) {
          VLOG(2) << "recv done step " << step_id_ << " " << parsed.FullKey() << ": " << status;
          TraceEnd("tf:RecvFromRemote", traced, step_id_, is_dead ? 0 : tensor.TotalBytes(),
                   parsed.FullKey());
          DeregisterCall(call, recv_args);
          // The call's own abort status (cancellation, step abort) wins over
          // both a completion that raced with it and the transport's echo of
          // it, as in TF's RPC path.
          absl::Status s = call->status().ok() ? status : call->status();
          delete call;
          if (!s.ok() && Transport::IsNotViable(s)) {
            // The sender does not push to us (plain gRPC, or it routes us
            // over gRPC): pull this tensor over gRPC instead, at once.
            RecvOverGrpc(parsed, recv_args, std::string(s.message()), done);
          } else if (!s.ok()) {
            done(s, Args(), recv_args, tf::Tensor(), false);
          } else if (is_dead || OnHost(parsed.dst, recv_args)) {
            done(s, Args(), recv_args, tensor, is_dead);
          } else {
            // The copy into the device's memory is queued on the data-path
            // pool: staging a large copy can hold its thread for
            // milliseconds, and rdev-callbacks serves every completion.
            this->Ref();
            if (recv_args.device_context != nullptr) recv_args.device_context->Ref();
            Schedule([this, parsed, recv_args, tensor, done] {
              CopyToDevice(session(), parsed, recv_args, tensor, done);
              if (recv_args.device_context != nullptr) recv_args.device_context->Unref();
              Unref();  // may destroy the rendezvous
            });
          }
          Unref();  // may destroy the rendezvous: nothing of `this` after it
        },
        on_event_thread);
    if (!s.ok()) {
      DeregisterCall(call, recv_args);
      delete call;
      if (Transport::IsNotViable(s)) {
        RecvOverGrpc(parsed, recv_args, std::string(s.message()), std::move(done));
      } else {
        done(s, Args(), recv_args, tf::Tensor(), false);
      }
      Unref();
    }
  }

  // TF's cache holds rendezvous weakly (rendezvous_cache.h): a step's may be
  // destroyed and made again by a later Find() while the step runs, e.g.
  // for an eager function's second component on this task (one per
  // device) when the first has finished, or a partial run's next call. So
  // the end of one that was initialized only makes the step idle in the
  // transport: what peers push for it is kept for the next one, and the
  // step ends at TF's Cleanup(step) (RdmaRendezvousMgr::Cleanup), or on
  // its own after a linger (rdev_step_idle). One made only to be looked
  // up or cleaned up does nothing.
  ~RdmaRemoteRendezvous() override {
    if (transport_ == nullptr || !is_initialized()) return;
    VLOG(2) << "step " << step_id_ << " idle";
    transport_->StepIdle(step_id_);
  }

  absl::Status abort_status() {
    tf::mutex_lock l(mu_);
    return abort_status_;
  }

  // Send() by the route to `peer` (a route still being chosen: the push
  // waits in the transport, and a peer that ends up on gRPC fails it
  // NotViable in PushDone, which then leaves the tensor for its pull).
  absl::Status SendRouted(const ParsedKey& parsed, const Args& args, const std::string& peer,
                          const tf::Tensor& val, bool is_dead) {
    Route route;
    TF_RETURN_IF_ERROR(transport_->RouteTo(peer, &route));
    if (route.kind == Route::kGrpc) {
      // The receiver pulls it over gRPC (and counts it as a fallback).
      return BaseRemoteRendezvous::Send(parsed, args, val, is_dead);
    }
    TF_RETURN_IF_ERROR(abort_status());
    VLOG(2) << "push step " << step_id_ << " " << parsed.FullKey() << (is_dead ? " (dead)" : "");
    const int64_t traced = TraceStart();
    if (!is_dead && !OnHost(parsed.src, args)) return StageAndPush(parsed, args, peer, val);
    bool refused = false;
    absl::Status s = Push(peer, parsed.FullKey(), val, is_dead, &refused, &args, nullptr);
    TraceEnd("tf:Send", traced, step_id_, is_dead ? 0 : val.TotalBytes(), parsed.FullKey());
    if (refused) {
      // The receiver does not take pushes from us (plain gRPC, or it routes
      // us over gRPC): leave the tensor for its pull (it counts the
      // fallback). In strict mode the transport fails it instead.
      VLOG(1) << "rdma_device: " << peer << " refuses pushes, " << parsed.FullKey()
              << " goes over gRPC: " << s;
      return BaseRemoteRendezvous::Send(parsed, args, val, is_dead);
    }
    return s;
  }

  // A send that failed after Send() returned: the step fails (the eager
  // context's default rendezvous only logs it: TF never aborts that one
  // for one op).
  void FailLate(const absl::Status& failed, absl::string_view key, const std::string& peer) {
    if (absl::IsAborted(failed) || absl::IsCancelled(failed)) return;
    if (EagerContextStep()) {
      LOG(WARNING) << "rdma_device: push of " << key << " to " << peer << " failed: " << failed;
    } else {
      StartAbort(failed);
    }
  }

  bool IsThisTask(const tsl::DeviceNameUtils::ParsedName& device) {
    return NamesThisTask(device, transport_.get());
  }

  // `args`: the Send's arguments, for a refusal learnt after Send returned
  // (the tensor then goes to our table for the receiver's gRPC pull).
  // `device_val`: for a staged push, the device tensor `val` was copied
  // from: that one, not the host copy, is what the pull takes (TF's
  // RecvTensor handler copies it off the device with `args`' context).
  absl::Status Push(const std::string& peer, absl::string_view key, const tf::Tensor& val,
                    bool is_dead, bool* refused, const Args* args, const tf::Tensor* device_val) {
    // The rendezvous (hence the step) stays alive until the transport is
    // done with the tensor. A failed push fails the step here too, so the
    // sender learns of a lost peer without waiting for the receiver.
    this->Ref();
    PushCtx* c = PushCtxs().Get().release();
    c->rendezvous = this;
    c->peer.assign(peer);
    c->key.assign(key.data(), key.size());
    c->val = val;
    c->is_dead = is_dead;
    c->has_args = args != nullptr;
    if (args != nullptr) c->args = *args;
    c->staged = device_val != nullptr;
    if (c->staged) {
      c->device_val = *device_val;
      if (c->args.device_context != nullptr) c->args.device_context->Ref();
    }
    // One pointer: the callback fits std::function's inline storage.
    absl::Status s = transport_->Send(
        peer, key, step_id_, val, is_dead,
        [c](const absl::Status& sent) { c->rendezvous->PushDone(c, sent); }, refused);
    if (!s.ok()) {
      Recycle(c);  // the callback will not run
      Unref();
    }
    return s;
  }

  // What a push's completion needs; recycled (recycle.h), so a push
  // allocates nothing once warm.
  struct PushCtx {
    RdmaRemoteRendezvous* rendezvous = nullptr;
    std::string peer;
    std::string key;
    tf::Tensor val;
    bool is_dead = false;
    bool has_args = false;
    Args args;
    // A staged push: the device tensor, and a reference on args' context.
    bool staged = false;
    tf::Tensor device_val;
  };

  static FreeList<PushCtx>& PushCtxs() {
    static auto* list = new FreeList<PushCtx>();  // never destroyed (recycle.h)
    return *list;
  }

  static void Recycle(PushCtx* c) {
    c->rendezvous = nullptr;
    if (c->staged && c->args.device_context != nullptr) c->args.device_context->Unref();
    c->staged = false;
    c->device_val = tf::Tensor();
    c->val = tf::Tensor();
    c->args = Args();
    PushCtxs().Put(std::unique_ptr<PushCtx>(c));
  }

  void PushDone(PushCtx* c, const absl::Status& sent) {
    absl::Status failed = sent;
    if (!sent.ok() && Transport::IsNotViable(sent) && c->has_args) {
      // Learnt while connecting, or once the route was chosen: the
      // receiver will pull it over gRPC.
      Rendezvous::ParsedKey parsed;
      failed = Rendezvous::ParseKey(c->key, &parsed);
      if (failed.ok()) {
        failed = BaseRemoteRendezvous::Send(parsed, c->args, c->staged ? c->device_val : c->val,
                                            c->is_dead);
      }
    }
    if (!failed.ok()) FailLate(failed, c->key, c->peer);
    Recycle(c);
    Unref();  // may destroy the rendezvous
  }

  // Device tensor -> host copy -> push. Send() must return at once, so the
  // push starts from the copy's completion. The staging tensor is pinned
  // host memory (gpu_compatible: the device's host allocator), so the copy
  // is a DMA and verbs can register it. A receiver that refuses pushes
  // (learnt now or while connecting) gets the device tensor through its
  // gRPC pull, and the peer is demoted so later steps skip the staging; in
  // strict mode, or when the copy fails, the step fails.
  absl::Status StageAndPush(const ParsedKey& parsed, const Args& args, const std::string& peer,
                            const tf::Tensor& val) {
    tf::Device* device = nullptr;
    TF_RETURN_IF_ERROR(session()->device_mgr()->LookupDevice(parsed.src_device, &device));
    tf::AllocatorAttributes host_attrs;
    host_attrs.set_on_host(true);
    host_attrs.set_gpu_compatible(true);
    auto* host = new tf::Tensor(device->GetAllocator(host_attrs), val.dtype(), val.shape());
    this->Ref();
    args.device_context->Ref();
    args.device_context->CopyDeviceTensorToCPU(
        &val, parsed.edge_name, device, host,
        [this, host, peer, args, val, key = std::string(parsed.FullKey())](const absl::Status& copied) {
          bool refused = false;
          absl::Status s =
              copied.ok() ? Push(peer, key, *host, false, &refused, &args, &val) : copied;
          delete host;  // Push holds its own reference to the buffer
          if (refused) {
            // Refused at once: the receiver pulls the device tensor.
            Rendezvous::ParsedKey parsed;
            s = Rendezvous::ParseKey(key, &parsed);
            if (s.ok()) s = BaseRemoteRendezvous::Send(parsed, args, val, false);
          }
          if (!s.ok()) StartAbort(s);
          args.device_context->Unref();
          Unref();
        });
    return absl::OkStatus();
  }

  // Stock pull over gRPC, counted as a fallback with its reason.
  void RecvOverGrpc(const ParsedKey& parsed, const Args& recv_args, std::string reason,
                    DoneCallback done) {
    std::shared_ptr<Transport> transport = transport_;
    stock_->RecvAsync(
        parsed, recv_args,
        [transport, reason = std::move(reason), done = std::move(done)](
            const absl::Status& s, const Args& send_args, const Args& recv_args,
            const tf::Tensor& val, bool is_dead) {
          if (s.ok() && transport != nullptr) {
            transport->RecordFallback(is_dead ? 0 : val.TotalBytes(), reason);
          }
          done(s, send_args, recv_args, val, is_dead);
        });
  }

  const tsl::core::RefCountPtr<tf::BaseRemoteRendezvous> stock_;
  const std::shared_ptr<Transport> transport_;
  // Set once the manager goes (its cache then aborts us with "Shutdown").
  const std::shared_ptr<const std::atomic<bool>> closing_;
  tf::mutex mu_;
  absl::Status abort_status_ TF_GUARDED_BY(mu_);
  std::atomic<bool> client_eager_context_{false};
};

}  // namespace

RdmaRendezvousMgr::RdmaRendezvousMgr(const tf::WorkerEnv* env,
                                     std::shared_ptr<Transport> transport)
    : RpcRendezvousMgr(env),
      transport_(std::move(transport)),
      closing_(std::make_shared<std::atomic<bool>>(false)) {}

RdmaRendezvousMgr::~RdmaRendezvousMgr() { closing_->store(true, std::memory_order_release); }

void RdmaRendezvousMgr::Cleanup(int64_t step_id) {
  {
    // Aborts the step's live rendezvous, on this thread: as a cleanup.
    CleanupScope cleanup(step_id);
    RpcRendezvousMgr::Cleanup(step_id);
  }
  // With no rendezvous alive, nothing above ended the step: end it here.
  if (transport_ != nullptr) {
    VLOG(2) << "end of step " << step_id;
    transport_->StepDone(step_id);
  }
}

tsl::core::RefCountPtr<tf::BaseRemoteRendezvous> RdmaRendezvousMgr::Create(
    int64_t step_id, const tf::WorkerEnv* worker_env) {
  return tsl::core::RefCountPtr<tf::BaseRemoteRendezvous>(
      new RdmaRemoteRendezvous(worker_env, step_id,
                               RpcRendezvousMgr::Create(step_id, worker_env), transport_,
                               closing_));
}

}  // namespace rdma_device
