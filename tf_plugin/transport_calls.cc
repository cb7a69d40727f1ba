// The transport's calls (worker_rpc.h) and counters: Transport's members
// for them.
#include <memory>
#include <string>
#include <utility>

#include "tensorflow/core/platform/logging.h"
#include "tensorflow/core/platform/status.h"
#include "transport.h"
#include "transport_status.h"

namespace rdma_device {

namespace {

struct CallState {
  std::string peer;
  Transport::CallDone done;
};

// On the transport's callback thread (or, for an inline call's success,
// the thread that read the reply): TF's status, worded as gRPC's.
void OnCallDone(void* userdata, uint32_t code, const uint8_t* body, size_t len) {
  std::unique_ptr<CallState> state(static_cast<CallState*>(userdata));
  std::string bytes(reinterpret_cast<const char*>(body), len);
  if (code == 0) {
    state->done(absl::OkStatus(), std::move(bytes));
    return;
  }
  absl::Status s(static_cast<absl::StatusCode>(code), bytes);
  // A cancelled call is derived, as TF's gRPC client marks it
  // (grpc_state.h): TF's master prefers the failure that caused it.
  if (s.code() == absl::StatusCode::kCancelled) s = tensorflow::StatusGroup::MakeDerived(s);
  state->done(WithPeer(s, state->peer), std::string());
}

struct Served {
  Transport::ServeCall call;
  Transport::ServeCancel cancel;
};

void OnServeCall(void* userdata, uint64_t handle, uint32_t method, const uint8_t* body,
                 size_t len) {
  static_cast<Served*>(userdata)->call(handle, method,
                                       std::string(reinterpret_cast<const char*>(body), len));
}

void OnServeCancel(void* userdata, uint64_t handle) {
  auto* served = static_cast<Served*>(userdata);
  if (served->cancel) served->cancel(handle);
}

}  // namespace

absl::Status Transport::Call(const std::string& peer_task, uint32_t method,
                             const std::string& body, int64_t timeout_ms, bool inline_ok,
                             CallDone done, uint64_t* id) {
  rdev_context* ctx = ctx_.load();
  if (ctx == nullptr) return FromRdev(RDEV_NOT_VIABLE, "transport not started");
  auto* state = new CallState{peer_task, std::move(done)};
  rdev_status rc = (inline_ok ? rdev_call_inline : rdev_call)(
      ctx, peer_task.data(), peer_task.size(), method,
      reinterpret_cast<const uint8_t*>(body.data()), body.size(),
      timeout_ms > 0 ? static_cast<uint64_t>(timeout_ms) : 0, &OnCallDone, state, id);
  if (rc != RDEV_OK) {
    delete state;  // the callback will not run
    return CallStatus(rc);
  }
  return absl::OkStatus();
}

void Transport::CancelCall(uint64_t id) {
  rdev_context* ctx = ctx_.load();
  if (ctx != nullptr) rdev_call_cancel(ctx, id);
}

void Transport::Serve(ServeCall call, ServeCancel cancel) {
  rdev_context* ctx = ctx_.load();
  if (ctx == nullptr || serving_.exchange(true)) return;
  // Never freed: a callback queued on the transport's callback thread may
  // still run after the context is freed (only a started server serves,
  // and TF never frees one: server.cc).
  auto* served = new Served{std::move(call), std::move(cancel)};
  rdev_serve(ctx, &OnServeCall, &OnServeCancel, served);
}

void Transport::ServeInline(uint32_t method) {
  rdev_context* ctx = ctx_.load();
  if (ctx == nullptr) return;
  rdev_status st = rdev_serve_inline(ctx, method);
  if (st != RDEV_OK) LOG(WARNING) << "rdma_device: method " << method << " served on the callback thread: " << CallStatus(st);
}

void Transport::Reply(uint64_t handle, const absl::Status& status, const std::string& body) {
  rdev_context* ctx = ctx_.load();
  if (ctx == nullptr) return;
  if (status.ok()) {
    rdev_serve_reply(ctx, handle, 0, reinterpret_cast<const uint8_t*>(body.data()), body.size());
  } else {
    const std::string msg(status.message());
    rdev_serve_reply(ctx, handle, static_cast<uint32_t>(status.code()),
                     reinterpret_cast<const uint8_t*>(msg.data()), msg.size());
  }
}

void Transport::RecordWorkerRpcOverGrpc() { rdev_record_worker_rpc_over_grpc(); }

void Transport::RecordWorkerRpcServed(ServedOn where) {
  if (where == ServedOn::kReaderThread) {
    rdev_record_worker_rpc_served_inline();
  } else {
    rdev_record_worker_rpc_served_on_pool();
  }
}

void Transport::RecordLargeReply(uint64_t bytes) { rdev_record_worker_rpc_large_reply(bytes); }

void Transport::RecordFallback(uint64_t bytes, const std::string& reason) {
  rdev_record_fallback(bytes, reason.data(), reason.size());
}

void Transport::RecordCollective(CollectiveEvent event, uint64_t bytes, const std::string& reason) {
  uint32_t e = RDEV_COLLECTIVE_RECEIVED;
  if (event == CollectiveEvent::kSent) e = RDEV_COLLECTIVE_SENT;
  if (event == CollectiveEvent::kFallback) e = RDEV_COLLECTIVE_FALLBACK;
  rdev_record_collective(e, bytes, reason.data(), reason.size());
}

absl::Status Transport::CheckConfig() {
  size_t len = 0;
  // No buffer: only the validation (RDEV_CONFIG) matters here.
  rdev_status st = rdev_config_json(nullptr, 0, &len);
  if (st == RDEV_CONFIG) return CallStatus(st);
  return absl::OkStatus();
}

}  // namespace rdma_device
