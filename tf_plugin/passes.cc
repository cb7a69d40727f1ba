// Graph optimization passes for static placement (placement.h).
//
// POST_REWRITE_FOR_EXEC (ShapeAnnotationPass): the whole placed graph, just
// before TF partitions it: in the TF1 master, and in the process that
// instantiates a tf.function. Records the shapes of cross-task outputs on
// their producers, for the partitions' analysis.
//
// POST_PARTITIONING (FunctionPlacementPass), for tf.function (multi-device
// functions): TF partitions a multi-device function in the process that
// instantiates it and runs the POST_PARTITIONING passes there, on every
// partition, before the function's first run. The component functions it
// ships to other tasks are instantiated there with every pass skipped
// (optimize_function_graph_utils.cc: `!options.is_component_function`), and
// no RegisterGraph happens. So this pass places every partition's static
// edges from here: its own directly, the other tasks' by asking each sender
// (rdev_request_placement), and on a thread of the user's waits for them, so the
// function's first run already pushes. See docs/design.md, "Placement
// at graph-registration time".
//
// TF1 sessions do not come here: their workers run POST_PARTITIONING with
// is_function_graph false, and are handled at RegisterGraph (worker.h).
#include <dlfcn.h>
#include <pthread.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "placement.h"
#include "tensorflow/core/common_runtime/optimization_registry.h"
#include "tensorflow/core/platform/logging.h"
#include "tensorflow/core/util/device_name_utils.h"
#include "transport.h"

namespace rdma_device {

namespace tf = ::tensorflow;

namespace {

class ShapeAnnotationPass : public tf::GraphOptimizationPass {
 public:
  absl::Status Run(const tf::GraphOptimizationPassOptions& options) override {
    // Only in processes running our transport, with static placement on
    // (DirectSession graphs run here too: they have no cross-task edges).
    if (options.graph == nullptr || *options.graph == nullptr ||
        Transport::AnyWithStaticPlacement() == nullptr) {
      return absl::OkStatus();
    }
    const auto start = std::chrono::steady_clock::now();
    const int n = AnnotateCrossTaskShapes(options.graph->get(), options.flib_def);
    VLOG(1) << "rdma_device: recorded static shapes of " << n
            << " nodes with outputs crossing tasks in "
            << std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
                   .count()
            << " ms";
    return absl::OkStatus();  // never fails the graph
  }
};


// How long a caller's thread instantiating a multi-task function waits for
// its edges' placement (the same bound as RegisterGraph's, worker.cc).
constexpr int64_t kFunctionPlacementWaitMs = 2000;

// True on a thread of the user's program: the process's main thread, or a
// thread Python runs (the user's own threads, a ParameterServerStrategy
// coordinator's closure threads). Such a thread calls the function next and
// would wait for its run anyway, so it waits for the placement first. Every
// other thread (TF's and the plugin's pools, gRPC's handler threads, TF's
// executor threads instantiating a nested function) starts the placement and
// goes on: nothing on TF's threads waits on the network, and a function's
// first run places what is not placed yet, so not waiting costs that run
// only time, never correctness.
//
// Python is asked through its C API, looked up in the process, never linked:
// PyGILState_GetThisThreadState needs no GIL and returns the state Python
// keeps for this thread, null where Python never ran on it. A process
// without Python (a C++ client) has only its main thread waiting. One TF
// thread counts as Python's while it runs Python: an op's `tf.py_function`
// body calling a multi-task function waits there, at most the same 2 s.
bool OnUsersThread() {
  if (gettid() == getpid()) return true;
  using ThisThreadState = void* (*)();
  static const ThisThreadState python_state =
      reinterpret_cast<ThisThreadState>(dlsym(RTLD_DEFAULT, "PyGILState_GetThisThreadState"));
  return python_state != nullptr && python_state() != nullptr;
}

class FunctionPlacementPass : public tf::GraphOptimizationPass {
 public:
  absl::Status Run(const tf::GraphOptimizationPassOptions& options) override {
    if (!options.is_function_graph || options.partition_graphs == nullptr) {
      return absl::OkStatus();
    }
    // This process's transport: it places the edges its own task sends and
    // asks the other tasks to place theirs.
    std::shared_ptr<Transport> here = Transport::AnyWithStaticPlacement();
    if (here == nullptr) return absl::OkStatus();
    // Every partition's placement runs at once on the plugin's control
    // pool; this thread (the one instantiating the function) waits for
    // them, bounded, only on a thread of the user's program (above).
    const bool wait = OnUsersThread();
    const auto deadline =
        std::chrono::steady_clock::now() + std::chrono::milliseconds(kFunctionPlacementWaitMs);
    std::vector<PlacementRun> runs;
    size_t edge_count = 0;
    for (const auto& [device, graph] : *options.partition_graphs) {
      tsl::DeviceNameUtils::ParsedName parsed;
      if (graph == nullptr || !tsl::DeviceNameUtils::ParseFullName(device, &parsed)) continue;
      const std::string task = TaskName(parsed.job, parsed.replica, parsed.task);
      std::vector<SendEdge> edges;
      absl::Status s = FindSendEdges(*graph, task, &edges);
      if (!s.ok()) {
        LOG(WARNING) << "rdma_device: cannot analyse a partition of function "
                     << options.debug_filename_prefix << " on " << device
                     << "; its edges are placed on first use: " << s;
        continue;
      }
      edge_count += edges.size();
      // A partition of a task served by a server of this process: that
      // server's transport sends its edges.
      std::shared_ptr<Transport> local = Transport::ForTask(task);
      std::shared_ptr<Transport> transport =
          local != nullptr && local->static_placement() ? local : here;
      runs.push_back(PlaceStaticEdges(
          transport, edges, absl::StrCat(transport->self_task(), " function partition on ", task)));
    }
    if (edge_count == 0) return absl::OkStatus();
    if (!wait) {
      char thread[16] = "?";
      pthread_getname_np(pthread_self(), thread, sizeof thread);
      VLOG(1) << "rdma_device: function " << options.debug_filename_prefix
              << " instantiated on a runtime thread (" << thread
              << "): placement goes on in the background";
      return absl::OkStatus();
    }
    const auto start = std::chrono::steady_clock::now();
    for (const PlacementRun& run : runs) {
      if (!run.WaitUntil(deadline)) {
        VLOG(1) << "rdma_device: function " << options.debug_filename_prefix
                << ": placement still running after " << kFunctionPlacementWaitMs
                << " ms; its first run places what is left";
        return absl::OkStatus();
      }
    }
    VLOG(1) << "rdma_device: function " << options.debug_filename_prefix
            << " placed before its first run (waited "
            << std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
                   .count()
            << " ms on a thread of the user's)";
    return absl::OkStatus();  // never fails the function
  }
};

// Registered only into the TensorFlow the shim was built against: a pass
// compiled for other class layouts must never run.
struct RegisterPasses {
  RegisterPasses() {
    if (!TensorFlowVersionError().empty()) return;
    // Phase 1000: last, so the shapes are those of the graph TF partitions.
    tf::OptimizationPassRegistry::Global()->Register(
        tf::OptimizationPassRegistry::POST_REWRITE_FOR_EXEC, 1000,
        std::make_unique<ShapeAnnotationPass>());
    // Phase 1000: last, after TF's own POST_PARTITIONING passes.
    tf::OptimizationPassRegistry::Global()->Register(
        tf::OptimizationPassRegistry::POST_PARTITIONING, 1000,
        std::make_unique<FunctionPlacementPass>());
  }
};
const RegisterPasses register_passes;

}  // namespace

}  // namespace rdma_device
