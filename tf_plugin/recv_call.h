// The rendezvous' small parts (rendezvous.cc): task names, where a tensor
// lives, the copy of a received tensor to its device, and a receive in
// flight as TF's base rendezvous tracks it for aborts and cancellation.
#ifndef RDMA_DEVICE_TF_PLUGIN_RECV_CALL_H_
#define RDMA_DEVICE_TF_PLUGIN_RECV_CALL_H_

#include <functional>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "tensorflow/core/common_runtime/device.h"
#include "tensorflow/core/common_runtime/device_mgr.h"
#include "tensorflow/core/distributed_runtime/base_rendezvous_mgr.h"
#include "tensorflow/core/distributed_runtime/worker_session.h"
#include "tensorflow/core/framework/rendezvous.h"
#include "tensorflow/core/platform/mutex.h"
#include "tsl/platform/thread_annotations.h"
#include "transport.h"

namespace rdma_device {

namespace tf = ::tensorflow;

inline std::string TaskOf(const tsl::DeviceNameUtils::ParsedName& device) {
  return TaskName(device.job, device.replica, device.task);
}

// TaskOf into `out`, reusing its capacity (no allocation per tensor).
inline void TaskOfInto(const tsl::DeviceNameUtils::ParsedName& device, std::string* out) {
  out->clear();
  absl::StrAppend(out, "/job:", device.job, "/replica:", device.replica, "/task:", device.task);
}

// Tensors on a device other than host memory are staged through host
// memory: the transport only ever sees host bytes.
inline bool OnHost(const tsl::DeviceNameUtils::ParsedName& device,
                   const tf::Rendezvous::Args& args) {
  return args.alloc_attrs.on_host() || device.type == "CPU" || args.device_context == nullptr;
}

// A device of this very task under another name: the implicit
// "/job:localhost" of an eager context, or this task's own name (stock
// rendezvous treats both as local; a route to ourselves is never needed).
// In a cluster whose own job is named "localhost" (create_local_server's
// spec, or a user's), a device of that job is this task only if it names
// this task: its other tasks are peers like any other. `transport` may be
// null (no transport: only "localhost" is this task).
inline bool NamesThisTask(const tsl::DeviceNameUtils::ParsedName& device, Transport* transport) {
  if (transport == nullptr) return device.has_job && device.job == "localhost";
  const std::string& self = transport->self_task();
  if (device.has_job && device.job == "localhost" &&
      !absl::StartsWith(self, "/job:localhost/")) {
    return true;
  }
  thread_local std::string scratch;
  TaskOfInto(device, &scratch);
  return scratch == self;
}

// Host tensor from the transport -> the receiving device's memory, then
// `done` (on the device's copy completion).
inline void CopyToDevice(tf::WorkerSession* session, const tf::Rendezvous::ParsedKey& parsed,
                         const tf::Rendezvous::Args& recv_args, const tf::Tensor& host,
                         const tf::Rendezvous::DoneCallback& done) {
  tf::Device* device = nullptr;
  absl::Status s = session->device_mgr()->LookupDevice(parsed.dst_device, &device);
  if (!s.ok()) {
    done(s, tf::Rendezvous::Args(), recv_args, tf::Tensor(), false);
    return;
  }
  auto* out = new tf::Tensor(device->GetAllocator(recv_args.alloc_attrs), host.dtype(),
                             host.shape());
  recv_args.device_context->CopyCPUTensorToDevice(
      &host, device, out, [out, host, recv_args, done](const absl::Status& copied) {
        done(copied, tf::Rendezvous::Args(), recv_args, copied.ok() ? *out : tf::Tensor(), false);
        delete out;
      });
}

// A receive in flight through the transport, registered with the base
// rendezvous so that step aborts and cancellation reach it.
//
// TF calls StartAbort() while holding the rendezvous' call lock, and our
// completion path takes that lock (DeregisterCall); the transport may run
// completions on the calling thread. So StartAbort() never calls into the
// transport directly: it records the status and hands the abort to the
// plugin's pool.
class RecvCall : public tf::BaseRecvTensorCall {
 public:
  RecvCall(std::function<void(const absl::Status&)> abort_async)
      : abort_async_(std::move(abort_async)) {}

  void Start(std::function<void()> recv_done) override {}  // driven by the transport

  void StartAbort(const absl::Status& s) override {
    {
      tf::mutex_lock l(mu_);
      if (!status_.ok()) return;
      status_ = s;
    }
    abort_async_(s);
  }

  absl::Status status() const override {
    tf::mutex_lock l(mu_);
    return status_;
  }

 private:
  mutable tf::mutex mu_;
  absl::Status status_ TF_GUARDED_BY(mu_);
  const std::function<void(const absl::Status&)> abort_async_;
};

}  // namespace rdma_device

#endif  // RDMA_DEVICE_TF_PLUGIN_RECV_CALL_H_
