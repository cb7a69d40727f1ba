#include "placement.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "tensorflow/core/common_runtime/shape_refiner.h"
#include "tensorflow/core/framework/attr_value.pb.h"
#include "tensorflow/core/framework/control_flow.h"
#include "tensorflow/core/framework/node_def_util.h"
#include "tensorflow/core/framework/rendezvous.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/framework/tensor_shape.pb.h"
#include "tensorflow/core/framework/types.h"
#include "tensorflow/core/graph/algorithm.h"
#include "tensorflow/core/graph/control_flow.h"
#include "tensorflow/core/platform/logging.h"
#include "tensorflow/core/platform/mutex.h"
#include "tensorflow/core/util/device_name_utils.h"
#include "pool.h"
#include "transport.h"

namespace rdma_device {

namespace tf = ::tensorflow;

namespace {

// How long one placement may wait for the receiver's answer. A live
// receiver answers within a round trip; this only bounds how long a graph
// registration can be held up by a receiver that stopped answering (its
// edges are then traced, and its steps fail on their own).
constexpr uint64_t kPlaceTimeoutMs = 5000;

// Placements in flight at once towards one task. Each waits one round trip
// on a thread of the plugin's control pool (pool.h); 16 brings a 200-edge graph
// from ~50 ms of sequential round trips to a few ms here.
constexpr size_t kPlaceConcurrency = 16;

// Shape inference over `graph` in topological order. A node whose shape
// function fails (or whose op has none) leaves its consumers' inputs
// unknown, which only makes fewer edges static.
void InferShapes(const tf::Graph& graph, const tf::FunctionLibraryDefinition* flib,
                 tf::ShapeRefiner* refiner) {
  refiner->set_require_shape_inference_fns(false);
  if (flib != nullptr) refiner->set_function_library_for_shape_inference(flib);
  std::vector<tf::Node*> order;
  tf::GetReversePostOrder(graph, &order);
  for (const tf::Node* n : order) {
    absl::Status s = refiner->AddNode(n);
    if (!s.ok()) VLOG(3) << "rdma_device: no shape for " << n->name() << ": " << s;
  }
}

// The task part of a device name, or "" when it does not parse.
std::string TaskOfDevice(const std::string& device) {
  tsl::DeviceNameUtils::ParsedName parsed;
  if (device.empty() || !tsl::DeviceNameUtils::ParseFullName(device, &parsed) ||
      !parsed.has_job || !parsed.has_task) {
    return "";
  }
  return TaskName(parsed.job, parsed.has_replica ? parsed.replica : 0, parsed.task);
}

// The shape the whole-graph pass recorded for output `index` of `node`.
bool AnnotatedShape(const tf::Node* node, int index, tf::TensorShape* shape) {
  const tf::AttrValue* attr = node->attrs().Find(kShapesAttr);
  if (attr == nullptr || !attr->has_list() || index < 0 || index >= attr->list().shape_size()) {
    return false;
  }
  // Validated, not assumed: the attr arrived in a GraphDef.
  tf::PartialTensorShape partial;
  return tf::PartialTensorShape::BuildPartialTensorShape(attr->list().shape(index), &partial)
             .ok() &&
         partial.IsFullyDefined() && partial.AsTensorShape(shape);
}

struct Candidate {
  const tf::Node* node;
  SendEdge edge;
};

// Payload bytes of the tensor feeding `send` when shape inference proves
// its shape; -1 (and `why`) otherwise.
int64_t StaticBytes(const tf::ShapeRefiner& refiner, const tf::Node* send, tf::DataType dtype,
                    std::string* why) {
  if (!tf::DataTypeCanUseMemcpy(dtype) || tf::DataTypeSize(dtype) <= 0) {
    *why = absl::StrCat(tf::DataTypeString(dtype), " has no fixed size");
    return -1;
  }
  const tf::Edge* in = nullptr;
  if (!send->input_edge(0, &in).ok() || in == nullptr) {
    *why = "no input edge";
    return -1;
  }
  int64_t elements = 1;
  tf::shape_inference::InferenceContext* ic = refiner.GetContext(in->src());
  tf::shape_inference::ShapeHandle shape;
  if (ic != nullptr) shape = ic->output(in->src_output());
  tf::TensorShape annotated;
  if (ic != nullptr && ic->FullyDefined(shape)) {
    for (int i = 0; i < ic->Rank(shape); ++i) {
      const int64_t d = ic->Value(ic->Dim(shape, i));
      if (d < 0 || (d > 0 && elements > INT64_MAX / d)) {
        *why = "shape overflows";
        return -1;
      }
      elements *= d;
    }
  } else if (AnnotatedShape(in->src(), in->src_output(), &annotated)) {
    elements = annotated.num_elements();  // TensorShape keeps it in range
  } else {
    *why = absl::StrCat("shape ", ic != nullptr ? ic->DebugString(shape) : "?",
                        " is not static");
    return -1;
  }
  const int64_t size = tf::DataTypeSize(dtype);
  if (elements > INT64_MAX / size) {
    *why = "shape overflows";
    return -1;
  }
  return elements * size;
}

// Whether tensors with `peer` go over the transport, or will once its
// route is chosen (not an error even in strict mode: placement only
// optimises; the transfers themselves fail then).
bool OverTransport(Transport* transport, const std::string& peer) {
  Route route;
  return transport->RouteTo(peer, &route).ok() && route.kind == Route::kDevice;
}

}  // namespace

int AnnotateCrossTaskShapes(tf::Graph* graph, const tf::FunctionLibraryDefinition* flib) {
  // Producers with an output consumed on another task, and which outputs.
  std::map<tf::Node*, std::vector<bool>> crossing;
  for (tf::Node* n : graph->op_nodes()) {
    const std::string task = TaskOfDevice(n->assigned_device_name());
    if (task.empty()) continue;
    for (const tf::Edge* e : n->out_edges()) {
      if (e->IsControlEdge() || !e->dst()->IsOp()) continue;
      const std::string dst = TaskOfDevice(e->dst()->assigned_device_name());
      if (dst.empty() || dst == task) continue;
      auto& outputs = crossing[n];
      outputs.resize(n->num_outputs(), false);
      if (e->src_output() >= 0 && e->src_output() < n->num_outputs()) {
        outputs[e->src_output()] = true;
      }
    }
  }
  if (crossing.empty()) return 0;
  tf::ShapeRefiner refiner(graph->versions(), graph->op_registry());
  InferShapes(*graph, flib, &refiner);
  int annotated = 0;
  for (auto& [node, outputs] : crossing) {
    tf::shape_inference::InferenceContext* ic = refiner.GetContext(node);
    if (ic == nullptr) continue;
    tf::AttrValue value;
    bool any = false;
    for (int i = 0; i < outputs.size(); ++i) {
      tf::TensorShapeProto* proto = value.mutable_list()->add_shape();
      if (!outputs[i] || i >= ic->num_outputs() || !ic->FullyDefined(ic->output(i))) {
        proto->set_unknown_rank(true);
        continue;
      }
      tf::shape_inference::ShapeHandle shape = ic->output(i);
      for (int d = 0; d < ic->Rank(shape); ++d) {
        proto->add_dim()->set_size(ic->Value(ic->Dim(shape, d)));
      }
      any = true;
    }
    if (!any) continue;
    node->AddAttr(kShapesAttr, value);
    ++annotated;
  }
  return annotated;
}

absl::Status FindSendEdges(const tf::Graph& graph, const std::string& sender_task,
                           std::vector<SendEdge>* out) {
  out->clear();
  std::vector<Candidate> found;
  for (const tf::Node* n : graph.op_nodes()) {
    if (n->type_string() != "_Send" && n->type_string() != "_HostSend") continue;
    std::string send_device, recv_device, tensor_name;
    int64_t incarnation = 0;
    bool client_terminated = false;
    tf::DataType dtype = tf::DT_INVALID;
    TF_RETURN_IF_ERROR(tf::GetNodeAttr(n->attrs(), "send_device", &send_device));
    TF_RETURN_IF_ERROR(tf::GetNodeAttr(n->attrs(), "recv_device", &recv_device));
    TF_RETURN_IF_ERROR(tf::GetNodeAttr(n->attrs(), "tensor_name", &tensor_name));
    TF_RETURN_IF_ERROR(tf::GetNodeAttr(n->attrs(), "send_device_incarnation", &incarnation));
    TF_RETURN_IF_ERROR(tf::GetNodeAttr(n->attrs(), "T", &dtype));
    if (tf::TryGetNodeAttr(n->attrs(), "client_terminated", &client_terminated) &&
        client_terminated) {
      continue;  // fetched by the client, not sent to a task
    }
    tsl::DeviceNameUtils::ParsedName src, dst;
    if (!tsl::DeviceNameUtils::ParseFullName(send_device, &src) ||
        !tsl::DeviceNameUtils::ParseFullName(recv_device, &dst) ||
        tsl::DeviceNameUtils::IsSameAddressSpace(src, dst) ||
        TaskName(src.job, src.replica, src.task) != sender_task) {
      continue;
    }
    Candidate c{n, {}};
    c.edge.sender = sender_task;
    c.edge.peer = TaskName(dst.job, dst.replica, dst.task);
    // Exactly the key the _Send kernel builds at run time (sendrecv_ops.cc)
    // for the top-level frame.
    c.edge.key = tf::Rendezvous::CreateKey(send_device, static_cast<uint64_t>(incarnation),
                                           recv_device, tensor_name, tf::FrameAndIter(0, 0));
    c.edge.dtype = tf::BaseType(dtype);
    found.push_back(std::move(c));
  }
  if (found.empty()) return absl::OkStatus();

  // Sends inside a while loop use a per-frame, per-iteration key: only the
  // top-level frame's key is known ahead of time.
  std::vector<tf::ControlFlowInfo> frames;
  const absl::Status frames_status = tf::BuildControlFlowInfo(&graph, &frames);

  tf::ShapeRefiner refiner(graph.versions(), graph.op_registry());
  InferShapes(graph, &graph.flib_def(), &refiner);

  for (Candidate& c : found) {
    const int id = c.node->id();
    if (!frames_status.ok()) {
      c.edge.why = absl::StrCat("control flow analysis failed: ", frames_status.message());
    } else if (id >= frames.size() || frames[id].frame == nullptr ||
               !frames[id].frame->IsSource()) {
      c.edge.why = "not in the top-level frame (inside a while loop, or unreachable)";
    } else {
      c.edge.bytes = StaticBytes(refiner, c.node, c.edge.dtype, &c.edge.why);
    }
    out->push_back(std::move(c.edge));
  }
  return absl::OkStatus();
}

// The state of one PlaceStaticEdges call, shared by its pool tasks.
struct PlacementRun::State {
  std::shared_ptr<Transport> transport;
  std::string what;
  std::string self;
  std::chrono::steady_clock::time_point start;
  int traced = 0;
  std::atomic<int> other_route{0}, placed{0}, no_room{0}, failed{0}, unreachable{0};
  Completion completion{0};

  // The task we talk to for an edge: its receiver when we send it, else
  // its sender (asked to place it).
  std::string Contact(const SendEdge& e) const { return e.sender == self ? e.peer : e.sender; }

  // Places edges[next..] of one contact, one round trip at a time.
  void PlaceSome(const std::shared_ptr<std::vector<SendEdge>>& edges,
                 const std::shared_ptr<std::atomic<size_t>>& next,
                 const std::shared_ptr<std::atomic<bool>>& peer_failed) {
    for (size_t i = (*next)++; i < edges->size(); i = (*next)++) {
      const SendEdge& e = (*edges)[i];
      if (peer_failed->load()) {
        ++failed;
        continue;
      }
      bool ok = false;
      const uint64_t bytes = static_cast<uint64_t>(e.bytes);
      absl::Status s = e.sender == self
                           ? transport->PlaceEdge(e.peer, e.key, bytes, kPlaceTimeoutMs, &ok)
                           : transport->RequestPlacement(e.sender, e.peer, e.key, bytes,
                                                         kPlaceTimeoutMs, &ok);
      if (!s.ok()) {
        ++failed;
        if (!peer_failed->exchange(true)) {
          LOG(WARNING) << "rdma_device: " << what << ": placing " << e.key << " (sent by "
                       << e.sender << ") failed; the edges through " << Contact(e)
                       << " not placed yet are placed on first use: " << s;
        }
        continue;
      }
      VLOG(2) << "rdma_device: " << what << ": " << e.key << " (" << e.bytes << " bytes) "
              << (ok ? "placed" : "not placed: no arena room at the receiver")
              << (e.sender == self ? "" : " (by its sender, on request)");
      ++(ok ? placed : no_room);
    }
  }

  void PartDone() {
    if (!completion.Done()) return;
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
            .count();
    VLOG(1) << "rdma_device: " << what << ": " << placed << " edges placed ahead, " << no_room
            << " without arena room, " << failed + unreachable << " failed, " << traced
            << " traced (no static size), " << other_route << " over gRPC; " << ms << " ms";
  }
};

PlacementRun PlaceStaticEdges(std::shared_ptr<Transport> transport,
                              const std::vector<SendEdge>& edges, const std::string& what) {
  auto st = std::make_shared<PlacementRun::State>();
  st->transport = std::move(transport);
  st->what = what;
  st->self = st->transport->self_task();
  st->start = std::chrono::steady_clock::now();
  std::map<std::string, std::vector<SendEdge>> by_contact;
  for (const SendEdge& e : edges) {
    if (e.bytes < 0) {
      ++st->traced;
      VLOG(2) << "rdma_device: " << what << ": " << e.key << " is traced: " << e.why;
    } else if (!OverTransport(st->transport.get(), st->Contact(e))) {
      ++st->other_route;
    } else {
      by_contact[st->Contact(e)].push_back(e);
    }
  }
  // One part per contacted task: it connects (on the control pool: a
  // connect may wait up to the connect timeout), then fans its edges out to up to
  // kPlaceConcurrency parts, each placing one edge at a time (a placement
  // waits one round trip). No part waits for another.
  st->completion.Add(static_cast<int>(by_contact.size()) + 1);
  for (auto& [peer, list] : by_contact) {
    auto mine = std::make_shared<std::vector<SendEdge>>(std::move(list));
    // A route still being chosen: the connect waits for it (within the
    // connect timeout) in the transport.
    ScheduleControl([st, peer = peer, mine] {
      absl::Status s = st->transport->ConnectPeer(peer);
      if (Transport::IsNotViable(s)) {  // the route turned out to be gRPC
        st->other_route += static_cast<int>(mine->size());
        st->PartDone();
        return;
      }
      if (!s.ok()) {
        LOG(WARNING) << "rdma_device: " << st->what << ": cannot reach " << peer
                     << " to place edges ahead of time (they are placed on first use): " << s;
        st->unreachable += mine->size();
        st->PartDone();
        return;
      }
      auto next = std::make_shared<std::atomic<size_t>>(0);
      auto peer_failed = std::make_shared<std::atomic<bool>>(false);
      const int parts = static_cast<int>(std::min(mine->size(), kPlaceConcurrency));
      st->completion.Add(parts - 1);  // this part becomes one of them
      for (int i = 1; i < parts; ++i) {
        ScheduleControl([st, mine, next, peer_failed] {
          st->PlaceSome(mine, next, peer_failed);
          st->PartDone();
        });
      }
      st->PlaceSome(mine, next, peer_failed);
      st->PartDone();
    });
  }
  st->PartDone();  // the +1 above: no part could finish the run before now
  return PlacementRun(std::move(st));
}

bool PlacementRun::WaitUntil(std::chrono::steady_clock::time_point deadline) const {
  return state_ == nullptr || state_->completion.WaitUntil(deadline);
}

}  // namespace rdma_device
