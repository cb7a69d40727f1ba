#include "worker.h"

#include <chrono>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "placement.h"
#include "pool.h"
#include "tensorflow/core/common_runtime/graph_constructor.h"
#include "tensorflow/core/distributed_runtime/worker_env.h"
#include "tensorflow/core/framework/function.h"
#include "tensorflow/core/platform/env.h"
#include "tensorflow/core/platform/logging.h"
#include "tensorflow/core/platform/mutex.h"
#include "transport.h"
#include "trace.h"

namespace rdma_device {

namespace tf = ::tensorflow;

namespace {

// How long RegisterGraph waits for the placement of its partition's edges.
// A healthy receiver answers in well under a millisecond; this bound only
// matters when a receiver is slow or gone, and then the edges not placed in
// time are placed on first use instead (see pool.h for the rule).
constexpr int64_t kRegisterPlacementWaitMs = 2000;

// Shape inference on the partition TF1's master registers, and the start
// of its placement; an empty run when there is nothing to place.
PlacementRun StartPlacement(const std::shared_ptr<Transport>& transport,
                            const tf::GraphDef& def) {
  const std::string self = transport->self_task();
  // Cheap check first: most partitions of a multi-task graph send something,
  // but registering the client's own fetch-only graphs should cost nothing.
  bool any = false;
  for (const tf::NodeDef& n : def.node()) {
    if (n.op() == "_Send" || n.op() == "_HostSend") {
      any = true;
      break;
    }
  }
  if (!any) return PlacementRun();
  const auto start = std::chrono::steady_clock::now();
  tf::FunctionLibraryDefinition flib(tf::OpRegistry::Global(), def.library());
  tf::Graph graph(flib);
  tf::GraphConstructorOptions opts;
  opts.allow_internal_ops = true;  // _Send, _Recv
  opts.expect_device_spec = false;
  absl::Status s = tf::ConvertGraphDefToGraph(opts, def, &graph);
  std::vector<SendEdge> edges;
  if (s.ok()) s = FindSendEdges(graph, self, &edges);
  if (!s.ok()) {
    LOG(WARNING) << "rdma_device: " << self << ": cannot analyse a registered graph; its "
                 << "edges are placed on first use: " << s;
    return PlacementRun();
  }
  VLOG(1) << "rdma_device: " << self << ": analysed a registered graph of " << def.node_size()
          << " nodes in "
          << std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
                 .count()
          << " ms";
  return PlaceStaticEdges(transport, edges, absl::StrCat(self, " graph registration"));
}

}  // namespace

RdmaWorker::RdmaWorker(tf::WorkerEnv* env, const tf::ConfigProto& config,
                       std::shared_ptr<Transport> transport)
    : GrpcWorker(env, config), transport_(std::move(transport)) {}

void RdmaWorker::RegisterGraphAsync(const tf::RegisterGraphRequest* request,
                                    tf::RegisterGraphResponse* response,
                                    tf::StatusCallback done) {
  if (transport_ == nullptr || !transport_->static_placement()) {
    GrpcWorker::RegisterGraphAsync(request, response, std::move(done));
    return;
  }
  // Placement runs on the plugin's pool while TF registers the graph here.
  // This thread (a compute_pool thread inside TF's RegisterGraphHandler,
  // which blocks on `done` anyway, or the master's registration loop) then
  // waits for it, but never longer than kRegisterPlacementWaitMs, and never
  // for anything queued on a TF pool. `done` gets TF's status: placement
  // never fails the registration.
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::milliseconds(kRegisterPlacementWaitMs);
  PlacementRun run = StartPlacement(transport_, request->graph_def());
  struct Join {
    tf::mutex mu;
    int left = 2;
    absl::Status status;
    tf::StatusCallback done;
  };
  auto join = std::make_shared<Join>();
  join->done = std::move(done);
  auto finish = [join](const absl::Status* registered) {
    tf::StatusCallback cb;
    absl::Status s;
    {
      tf::mutex_lock l(join->mu);
      if (registered != nullptr) join->status = *registered;
      if (--join->left > 0) return;
      cb = std::move(join->done);
      s = join->status;
    }
    cb(s);
  };
  GrpcWorker::RegisterGraphAsync(request, response,
                                 [finish](const absl::Status& s) { finish(&s); });
  if (!run.WaitUntil(deadline)) {
    VLOG(1) << "rdma_device: " << transport_->self_task() << ": placement still running after "
            << kRegisterPlacementWaitMs << " ms; the graph's first step places what is left";
  }
  finish(nullptr);
}

void RdmaWorker::RunGraphAsync(tf::CallOptions* opts, tf::RunGraphRequestWrapper* request,
                               tf::MutableRunGraphResponseWrapper* response,
                               tf::StatusCallback done) {
  const int64_t start = TraceStart();
  if (start == 0) {
    GrpcWorker::RunGraphAsync(opts, request, response, std::move(done));
    return;
  }
  const uint64_t step = static_cast<uint64_t>(request->step_id());
  GrpcWorker::RunGraphAsync(opts, request, response,
                            [start, step, done = std::move(done)](const absl::Status& s) {
                              TraceEnd("RunGraph", start, step);
                              done(s);
                            });
}

void RdmaWorker::CleanupGraphAsync(const tf::CleanupGraphRequest* request,
                                   tf::CleanupGraphResponse* response, tf::StatusCallback done) {
  const int64_t start = TraceStart();
  const uint64_t step = static_cast<uint64_t>(request->step_id());
  GrpcWorker::CleanupGraphAsync(request, response,
                                [start, step, done = std::move(done)](const absl::Status& s) {
                                  TraceEnd("CleanupGraph", start, step);
                                  done(s);
                                });
}

}  // namespace rdma_device
