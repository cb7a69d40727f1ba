// Peers and routes: translations of the transport's (rdma_device.h:
// rdev_context_set_peer, rdev_route, rdev_grpc_fallback). The transport
// chooses each peer's route on its own threads, keeps what waits for a
// route still being chosen, demotes peers that do not take it, and applies
// strict mode; the shim only asks.
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "rdma_device.h"
#include "transport.h"
#include "transport_status.h"

namespace rdma_device {

namespace tf = ::tensorflow;

void Transport::AddPeers(const tf::ClusterDef& cluster) {
  tf::mutex_lock l(mu_);
  rdev_context* ctx = ctx_.load();
  for (const auto& job : cluster.job()) {
    for (const auto& [index, addr] : job.tasks()) {
      // Replica 0: TF's own worker caches name every task so (its gRPC
      // channel cache refuses any other replica).
      std::string task = TaskName(job.name(), 0, index);
      if (task == self_task_ || addr.empty()) continue;
      if (ctx == nullptr) {
        early_peers_[task] = addr;  // Start() hands it over
        continue;
      }
      // Never waits: a new or moved peer's route is chosen on the
      // transport's threads; the same address again changes nothing.
      rdev_status st = rdev_context_set_peer(ctx, task.data(), task.size(), addr.data(), addr.size());
      if (st != RDEV_OK) {
        LOG(WARNING) << "rdma_device: " << self_task_ << ": cannot add " << task << " (" << addr
                     << "): " << FromRdev(st, LastError()).message();
      }
    }
  }
}

absl::Status Transport::RouteTo(const std::string& peer_task, Route* route) {
  rdev_context* ctx = ctx_.load();
  if (ctx == nullptr) {
    route->kind = Route::kGrpc;
    route->reason = "transport not started";
    return GrpcFallback(peer_task, route->reason);
  }
  rdev_route_kind kind = RDEV_ROUTE_GRPC;
  rdev_status st = rdev_route(ctx, peer_task.data(), peer_task.size(), &kind);
  if (st != RDEV_OK) return FromRdev(st, LastError());
  if (kind == RDEV_ROUTE_GRPC) {
    route->kind = Route::kGrpc;
    route->reason = LastError();
  } else {
    route->kind = Route::kDevice;
    route->reason.clear();
  }
  return absl::OkStatus();
}

absl::Status Transport::GrpcFallback(const std::string& peer_task, const std::string& why) {
  rdev_status st = rdev_grpc_fallback(ctx_.load(), peer_task.data(), peer_task.size(), why.data(),
                                      why.size());
  return st == RDEV_OK ? absl::OkStatus() : FromRdev(st, LastError());
}

bool Transport::IsNotViable(const absl::Status& status) {
  return status.GetPayload(kNotViablePayload).has_value();
}

bool Transport::Serves(const std::string& peer_task) {
  rdev_context* ctx = ctx_.load();
  if (ctx == nullptr) return false;
  rdev_route_kind kind = RDEV_ROUTE_GRPC;
  return rdev_route(ctx, peer_task.data(), peer_task.size(), &kind) == RDEV_OK &&
         (kind == RDEV_ROUTE_SHM || kind == RDEV_ROUTE_VERBS);
}

}  // namespace rdma_device
