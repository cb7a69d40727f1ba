// Static placement: find the cross-task edges a graph partition sends, and
// their sizes when shape inference proves them, and place them on the
// receivers before the graph's first step (rdev_place_edge), so that step 1
// already moves every such tensor with one one-sided write.
//
// Two hooks feed this (both never fail the graph: a failed placement only
// means the edge is placed on first use, "traced", as without them):
// - TF1 sessions: the worker's RegisterGraph (worker.h), per partition;
// - tf.function: a POST_PARTITIONING pass in the process that instantiates
//   the function. It sees every partition; TF runs no pass where the other
//   tasks' parts (component functions) are instantiated, so this process
//   asks each sending task to place its edges (rdev_request_placement).
//
// Shape inference on one partition alone cannot see through its _Recv
// nodes (their shape function says "unknown"), so e.g. a gradient computed
// from a received tensor would never be static. So a POST_REWRITE_FOR_EXEC
// pass (passes.cc), which runs on the whole placed graph before TF
// partitions it (in the TF1 master, and in the process instantiating a
// function), records the inferred shape of every output that crosses tasks
// on its producer (attr kShapesAttr); the partition's analysis uses it
// where its own inference falls short.
#ifndef RDMA_DEVICE_TF_PLUGIN_PLACEMENT_H_
#define RDMA_DEVICE_TF_PLUGIN_PLACEMENT_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "tensorflow/core/framework/types.pb.h"
#include "tensorflow/core/graph/graph.h"

namespace rdma_device {

class Transport;

// list(shape) attr on a producer node: the shape inferred on the whole graph
// for each output (unknown rank where not static or not crossing tasks).
inline constexpr char kShapesAttr[] = "_rdma_device_shapes";

// Records kShapesAttr on every node of `graph` (placed, not partitioned)
// with an output consumed on another task, when shape inference makes at
// least one such output static. Returns how many nodes it annotated.
int AnnotateCrossTaskShapes(tensorflow::Graph* graph,
                            const tensorflow::FunctionLibraryDefinition* flib);

// One tensor a partition sends to another task, as its _Send node says.
struct SendEdge {
  std::string sender;  // sending task, "/job:x/replica:r/task:t"
  std::string peer;    // receiving task
  std::string key;   // the rendezvous key at frame 0, iteration 0
  tensorflow::DataType dtype = tensorflow::DT_INVALID;
  // Payload bytes when static (fully defined shape, fixed-size dtype, not
  // inside a loop); -1 otherwise, with the reason in `why`.
  int64_t bytes = -1;
  std::string why;
};

// The _Send/_HostSend nodes of `graph` on task `sender_task` whose receiver
// is another task (client-terminated sends excluded). Runs shape inference
// only when there is at least one.
absl::Status FindSendEdges(const tensorflow::Graph& graph, const std::string& sender_task,
                           std::vector<SendEdge>* out);

// A placement started by PlaceStaticEdges, running on the plugin's
// control pool.
class PlacementRun {
 public:
  struct State;
  PlacementRun() = default;
  explicit PlacementRun(std::shared_ptr<State> state) : state_(std::move(state)) {}
  // Waits until every edge has its outcome or `deadline` passes (true: all
  // done). Placement goes on in the background after a deadline; an edge
  // whose first step comes first is placed then (a send waits for a
  // placement in flight, it does not race it). Never call from a plugin
  // pool.
  bool WaitUntil(std::chrono::steady_clock::time_point deadline) const;

 private:
  std::shared_ptr<State> state_;
};

// Starts placing every static edge of `edges` through `transport`, on the
// plugin's control pool, and returns at once: directly when its task is the sender
// (and serves the receiver), else by asking the sender to (when `transport`
// serves the sender). Never fails: problems are logged and leave edges to
// be traced. `what` names the graph in logs.
PlacementRun PlaceStaticEdges(std::shared_ptr<Transport> transport,
                              const std::vector<SendEdge>& edges, const std::string& what);

}  // namespace rdma_device

#endif  // RDMA_DEVICE_TF_PLUGIN_PLACEMENT_H_
