#include "pool.h"
#include "transport.h"

#include <chrono>
#include <climits>
#include <cstring>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "tensorflow/core/framework/allocation_description.pb.h"
#include "tensorflow/core/framework/tensor.pb.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/framework/types.h"
#include "tensorflow/core/platform/logging.h"

#include "rdma_device.h"
#include "recycle.h"
#include "transport_status.h"

namespace rdma_device {

namespace tf = ::tensorflow;

namespace {

struct BufferRelease {
  void operator()(rdev_buffer* buf) const { rdev_buffer_release(buf); }
};
using BufferPtr = std::unique_ptr<rdev_buffer, BufferRelease>;

// A Tensor's memory that *is* a receive slot: zero-copy receive. The slot
// goes back to the sender when TF drops the last reference.
class SlotBuffer : public tf::TensorBuffer {
 public:
  SlotBuffer(BufferPtr buf, const uint8_t* data, size_t len)
      : TensorBuffer(const_cast<uint8_t*>(data)), buf_(std::move(buf)), len_(len) {}

  size_t size() const override { return len_; }
  TensorBuffer* root_buffer() override { return this; }
  void FillAllocationDescription(tf::AllocationDescription* proto) const override {
    proto->set_requested_bytes(static_cast<int64_t>(len_));
    proto->set_allocated_bytes(static_cast<int64_t>(len_));
    proto->set_allocator_name("rdma_device");
  }
  // The transport hands the slot out read-only: never let a kernel forward
  // it as its output and write in place.
  bool OwnsMemory() const override { return false; }

 private:
  ~SlotBuffer() override = default;  // buf_ releases the slot

  BufferPtr buf_;
  const size_t len_;
};

// Takes ownership of `raw`.
absl::Status TensorFromBuffer(rdev_buffer* raw, tf::Tensor* out, bool* is_dead) {
  BufferPtr buf(raw);
  if (buf == nullptr) return absl::InternalError("rdma_device: receive completed without a buffer");
  const uint32_t flags = rdev_buffer_flags(buf.get());
  *is_dead = (flags & RDEV_FLAG_DEAD) != 0;
  if (*is_dead) {
    *out = tf::Tensor();
    return absl::OkStatus();
  }
  const uint8_t* data = rdev_buffer_data(buf.get());
  const size_t len = rdev_buffer_len(buf.get());

  if (flags & RDEV_FLAG_SERIALIZED) {
    tf::TensorProto proto;
    if (len > static_cast<size_t>(INT_MAX) ||
        !proto.ParseFromArray(data, static_cast<int>(len))) {
      return absl::DataLossError("rdma_device: received an unparsable serialized tensor");
    }
    tf::Tensor t;
    if (!t.FromProto(tsl::cpu_allocator(), proto)) {
      return absl::DataLossError("rdma_device: received an invalid serialized tensor");
    }
    *out = std::move(t);
    return absl::OkStatus();
  }

  const uint32_t raw_dtype = rdev_buffer_dtype(buf.get());
  if (!tf::DataType_IsValid(static_cast<int>(raw_dtype)) || raw_dtype == tf::DT_INVALID ||
      !tf::DataTypeCanUseMemcpy(static_cast<tf::DataType>(raw_dtype))) {
    return absl::DataLossError(absl::StrCat("rdma_device: received raw bytes for dtype ", raw_dtype));
  }
  const tf::DataType dtype = static_cast<tf::DataType>(raw_dtype);
  const uint32_t ndims = rdev_buffer_ndims(buf.get());
  const int64_t* dims = rdev_buffer_dims(buf.get());
  tf::TensorShape shape;
  TF_RETURN_IF_ERROR(tf::TensorShape::BuildTensorShape(
      absl::Span<const int64_t>(dims, ndims == 0 ? 0 : ndims), &shape));
  const uint64_t want = static_cast<uint64_t>(shape.num_elements()) * tf::DataTypeSize(dtype);
  if (want != len) {
    return absl::DataLossError(absl::StrCat("rdma_device: received ", len, " bytes for a ",
                                            tf::DataTypeString(dtype), shape.DebugString(),
                                            " tensor of ", want, " bytes"));
  }
  if (len == 0) {
    *out = tf::Tensor(dtype, shape);
    return absl::OkStatus();
  }
  if (reinterpret_cast<uintptr_t>(data) % EIGEN_MAX_ALIGN_BYTES != 0) {
    // The ABI promises 64-byte alignment and TF kernels rely on it; copy
    // rather than hand TF a misaligned buffer should that ever break.
    tf::Tensor copy(tsl::cpu_allocator(), dtype, shape);
    std::memcpy(const_cast<char*>(copy.tensor_data().data()), data, len);
    *out = std::move(copy);
    return absl::OkStatus();
  }
  auto* slot = new SlotBuffer(std::move(buf), data, len);
  *out = tf::Tensor(dtype, shape, slot);  // takes its own reference
  slot->Unref();
  return absl::OkStatus();
}

// Keeps a sent tensor's bytes alive until the transport is done with them.
// A send in flight; recycled (recycle.h): its strings keep their capacity.
struct SendState {
  tf::Tensor tensor;       // memcpy-able dtypes: the bytes are the tensor's
  std::string serialized;  // strings, variants, resources: a TensorProto
  std::string peer;
  Transport::SendDone done;
};

FreeList<SendState>& SendStates() {
  static auto* list = new FreeList<SendState>();  // never destroyed (recycle.h)
  return *list;
}

void RecycleSend(std::unique_ptr<SendState> state) {
  state->tensor = tf::Tensor();
  state->serialized.clear();
  state->done = nullptr;
  SendStates().Put(std::move(state));
}

void OnSendDone(void* userdata, rdev_status status, const char* msg, size_t msg_len) {
  // Runs on a transport thread: SendDone must not block (it may only
  // queue work or call non-blocking rdev_* functions).
  std::unique_ptr<SendState> state(static_cast<SendState*>(userdata));
  absl::Status s = WithPeer(FromRdev(status, absl::string_view(msg, msg ? msg_len : 0)), state->peer);
  Transport::SendDone done = std::move(state->done);
  RecycleSend(std::move(state));
  done(s);
}

// A receive posted; recycled like SendState.
struct RecvState {
  std::string peer;
  Transport::RecvDone done;
};

FreeList<RecvState>& RecvStates() {
  static auto* list = new FreeList<RecvState>();  // never destroyed (recycle.h)
  return *list;
}

void RecycleRecv(std::unique_ptr<RecvState> state) {
  state->done = nullptr;
  RecvStates().Put(std::move(state));
}

void OnRecvDone(void* userdata, rdev_status status, const char* msg, size_t msg_len,
                rdev_buffer* buf) {
  std::unique_ptr<RecvState> state(static_cast<RecvState*>(userdata));
  Transport::RecvDone done = std::move(state->done);
  if (status != RDEV_OK) {
    rdev_buffer_release(buf);
    absl::Status s = WithPeer(
        FromRdevReceive(status, absl::string_view(msg, msg ? msg_len : 0), rdev_abort_cause()),
        state->peer);
    RecycleRecv(std::move(state));
    done(s, tf::Tensor(), false);
    return;
  }
  RecycleRecv(std::move(state));
  tf::Tensor tensor;
  bool is_dead = false;
  absl::Status s = TensorFromBuffer(buf, &tensor, &is_dead);
  done(s, tensor, is_dead);
}

// Started transports of this process by task name (normally one: one
// server per process), for graph passes that TF runs without a server.
tf::mutex registry_mu(tf::LINKER_INITIALIZED);
std::map<std::string, std::weak_ptr<Transport>>& Registry() TF_EXCLUSIVE_LOCKS_REQUIRED(registry_mu) {
  static auto* registry = new std::map<std::string, std::weak_ptr<Transport>>();
  return *registry;
}

}  // namespace

std::shared_ptr<Transport> Transport::ForTask(const std::string& task) {
  tf::mutex_lock l(registry_mu);
  auto it = Registry().find(task);
  return it == Registry().end() ? nullptr : it->second.lock();
}

std::shared_ptr<Transport> Transport::AnyWithStaticPlacement() {
  std::vector<std::shared_ptr<Transport>> live;
  {
    tf::mutex_lock l(registry_mu);
    for (const auto& [task, weak] : Registry()) {
      if (auto t = weak.lock()) live.push_back(std::move(t));
    }
  }
  for (auto& t : live) {
    if (t->static_placement()) return std::move(t);
  }
  return nullptr;
}

std::string TaskName(absl::string_view job, int replica, int task) {
  return absl::StrCat("/job:", job, "/replica:", replica, "/task:", task);
}

Transport::~Transport() { rdev_context_free(ctx_.exchange(nullptr)); }

absl::Status Transport::Start(const std::string& self_task, const std::string& addr) {
  {
    tf::mutex_lock l(mu_);
    self_task_ = self_task;
  }
  // If this fails, the server routes every peer over gRPC, and in strict
  // mode each such step fails (RouteTo: rdev_grpc_fallback reads the
  // environment's settings).
  rdev_context* ctx = nullptr;
  TF_RETURN_IF_ERROR(CallStatus(
      rdev_context_new(self_task.data(), self_task.size(), addr.data(), addr.size(), &ctx)));
  rdev_settings settings = {};
  absl::Status read = CallStatus(rdev_settings_get(ctx, &settings));
  if (!read.ok()) {
    rdev_context_free(ctx);
    return read;
  }
  std::map<std::string, std::string> peers;
  {
    tf::mutex_lock l(mu_);
    static_placement_ = settings.static_placement;
    worker_rpcs_ = settings.worker_rpcs;
    ctx_.store(ctx);
    peers.swap(early_peers_);
  }
  // The peers seen before: their routes are chosen on the transport's
  // threads, all at once; this does not wait.
  for (const auto& [task, peer_addr] : peers) {
    if (task == self_task) continue;
    rdev_status st =
        rdev_context_set_peer(ctx, task.data(), task.size(), peer_addr.data(), peer_addr.size());
    if (st != RDEV_OK) {
      LOG(WARNING) << "rdma_device: " << self_task << ": cannot add " << task << " ("
                   << peer_addr << "): " << FromRdev(st, LastError()).message();
    }
  }
  LOG(INFO) << "rdma_device: " << self_task << " transport at " << addr
            << (settings.strict ? " (strict)" : "")
            << (settings.static_placement ? "" : " (static placement off)");
  {
    // A server created later for the same task (eager clients re-connect)
    // replaces this one.
    tf::mutex_lock l(registry_mu);
    Registry()[self_task] = weak_from_this();
  }
  return absl::OkStatus();
}

absl::Status Transport::ConnectPeer(const std::string& peer_task) {
  rdev_context* ctx = ctx_.load();
  if (ctx == nullptr) return absl::FailedPreconditionError("rdma_device: transport not started");
  return CallStatus(rdev_connect_peer(ctx, peer_task.data(), peer_task.size()));
}

void Transport::ConnectSoon(const std::string& peer_task) {
  constexpr int64_t kConnectRetryMs = 5000;
  {
    tf::mutex_lock l(mu_);
    const auto now = std::chrono::steady_clock::now();
    auto it = connect_tried_.find(peer_task);
    if (it != connect_tried_.end() && now - it->second < std::chrono::milliseconds(kConnectRetryMs)) {
      return;
    }
    connect_tried_[peer_task] = now;
  }
  std::weak_ptr<Transport> weak = weak_from_this();
  ScheduleControl([weak, peer_task] {
    auto self = weak.lock();
    if (self == nullptr) return;
    absl::Status s = self->ConnectPeer(peer_task);
    VLOG(1) << "rdma_device: connecting to " << peer_task << " for its worker RPCs: " << s;
  });
}

absl::Status Transport::PlaceEdge(const std::string& peer_task, absl::string_view key,
                                  uint64_t bytes, uint64_t timeout_ms, bool* placed) {
  *placed = false;
  rdev_context* ctx = ctx_.load();
  if (ctx == nullptr) return absl::FailedPreconditionError("rdma_device: transport not started");
  bool ok = false;
  TF_RETURN_IF_ERROR(CallStatus(rdev_place_edge(ctx, peer_task.data(), peer_task.size(),
                                                key.data(), key.size(), bytes, timeout_ms, &ok)));
  *placed = ok;
  return absl::OkStatus();
}

absl::Status Transport::RequestPlacement(const std::string& sender_task,
                                         const std::string& receiver_task, absl::string_view key,
                                         uint64_t bytes, uint64_t timeout_ms, bool* placed) {
  *placed = false;
  rdev_context* ctx = ctx_.load();
  if (ctx == nullptr) return absl::FailedPreconditionError("rdma_device: transport not started");
  bool ok = false;
  TF_RETURN_IF_ERROR(CallStatus(rdev_request_placement(
      ctx, sender_task.data(), sender_task.size(), receiver_task.data(), receiver_task.size(),
      key.data(), key.size(), bytes, timeout_ms, &ok)));
  *placed = ok;
  return absl::OkStatus();
}

absl::Status Transport::Send(const std::string& peer_task, absl::string_view key,
                             int64_t step_id, const tf::Tensor& val, bool is_dead,
                             SendDone done, bool* refused) {
  *refused = false;
  rdev_context* ctx = ctx_.load();
  if (ctx == nullptr) return absl::FailedPreconditionError("rdma_device: transport not started");
  std::unique_ptr<SendState> state = SendStates().Get();
  state->peer.assign(peer_task);
  state->done = std::move(done);
  absl::InlinedVector<int64_t, 8> dims;
  rdev_tensor_meta meta{};
  meta.dtype = static_cast<uint32_t>(val.dtype());
  const uint8_t* data = nullptr;
  size_t len = 0;
  if (is_dead) {
    meta.flags = RDEV_FLAG_DEAD;
  } else if (tf::DataTypeCanUseMemcpy(val.dtype())) {
    dims.reserve(val.dims());
    for (int i = 0; i < val.dims(); ++i) dims.push_back(val.dim_size(i));
    meta.ndims = static_cast<uint32_t>(dims.size());
    meta.dims = dims.data();
    state->tensor = val;  // a reference, not a copy
    absl::string_view bytes = state->tensor.tensor_data();
    data = reinterpret_cast<const uint8_t*>(bytes.data());
    len = bytes.size();
  } else {
    // Strings, variants, resource handles: no flat bytes. The receiver
    // parses the proto back (the same encoding stock gRPC uses).
    tf::TensorProto proto;
    val.AsProtoTensorContent(&proto);
    if (!proto.SerializeToString(&state->serialized)) {
      RecycleSend(std::move(state));
      return absl::InternalError(absl::StrCat("rdma_device: cannot serialize ",
                                              tf::DataTypeString(val.dtype()), " tensor ", key));
    }
    meta.flags = RDEV_FLAG_SERIALIZED;
    data = reinterpret_cast<const uint8_t*>(state->serialized.data());
    len = state->serialized.size();
  }
  // On RDEV_OK the callback owns `state` (and may already have run).
  SendState* raw = state.release();
  rdev_status st = rdev_send(ctx, peer_task.data(), peer_task.size(), key.data(), key.size(),
                             static_cast<uint64_t>(step_id), &meta, data, len, OnSendDone, raw);
  if (st != RDEV_OK) {
    absl::Status s = WithPeer(CallStatus(st), peer_task);
    RecycleSend(std::unique_ptr<SendState>(raw));
    *refused = st == RDEV_NOT_VIABLE;
    return s;
  }
  return absl::OkStatus();
}

absl::Status Transport::Recv(const std::string& peer_task, absl::string_view key,
                             int64_t step_id, RecvDone done, bool on_event_thread) {
  rdev_context* ctx = ctx_.load();
  if (ctx == nullptr) return absl::FailedPreconditionError("rdma_device: transport not started");
  std::unique_ptr<RecvState> owned = RecvStates().Get();
  owned->peer.assign(peer_task);
  owned->done = std::move(done);
  RecvState* state = owned.release();  // the callback's on RDEV_OK
  rdev_status st = (on_event_thread ? rdev_recv_inline : rdev_recv)(
      ctx, peer_task.data(), peer_task.size(), key.data(), key.size(),
      static_cast<uint64_t>(step_id), OnRecvDone, state);
  if (st != RDEV_OK) {
    absl::Status s = WithPeer(CallStatus(st), peer_task);
    RecycleRecv(std::unique_ptr<RecvState>(state));
    return s;
  }
  return absl::OkStatus();
}

void Transport::AbortStep(int64_t step_id, const absl::Status& status, bool propagate) {
  rdev_context* ctx = ctx_.load();
  if (ctx == nullptr) return;
  std::string msg = status.ToString();
  rdev_status st =
      rdev_abort_step(ctx, static_cast<uint64_t>(step_id), static_cast<uint32_t>(status.code()),
                      msg.data(), msg.size(), propagate);
  if (st != RDEV_OK) LOG(WARNING) << "rdma_device: abort of step " << step_id << ": " << LastError();
}

void Transport::CancelRecv(const std::string& key, int64_t step_id, const absl::Status& status) {
  rdev_context* ctx = ctx_.load();
  if (ctx == nullptr) return;
  std::string msg = status.ToString();
  rdev_status st = rdev_cancel_recv(ctx, key.data(), key.size(), static_cast<uint64_t>(step_id),
                                    msg.data(), msg.size());
  if (st != RDEV_OK) LOG(WARNING) << "rdma_device: cancel of " << key << ": " << LastError();
}

namespace {

// `fn(ctx, step)` for one of the step calls that cannot fail but for a bad
// argument; a failure is logged with `what`.
void StepCall(rdev_context* ctx, rdev_status (*fn)(const rdev_context*, uint64_t),
              int64_t step_id, const char* what) {
  if (ctx == nullptr) return;
  if (fn(ctx, static_cast<uint64_t>(step_id)) != RDEV_OK) {
    LOG(WARNING) << "rdma_device: " << what << " step " << step_id << ": " << LastError();
  }
}

}  // namespace

void Transport::StepDone(int64_t step_id) {
  StepCall(ctx_.load(), rdev_step_done, step_id, "end of");
}

void Transport::StepIdle(int64_t step_id) {
  StepCall(ctx_.load(), rdev_step_idle, step_id, "idle");
}

void Transport::StepActive(int64_t step_id) {
  StepCall(ctx_.load(), rdev_step_active, step_id, "active");
}

}  // namespace rdma_device
