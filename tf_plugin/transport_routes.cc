// Routes: how tensors with each peer travel, chosen off TensorFlow's
// threads (transport.h: AddPeers, WhenRouted). A peer's route is pending
// while the control pool chooses it; work that meets a pending route
// queues behind it and runs, in order, on the data-path pool once it is
// chosen, or fails once kRouteWaitMs has passed.
#include <algorithm>
#include <chrono>
#include <deque>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "pool.h"
#include "rdma_device.h"
#include "tensorflow/core/platform/env.h"
#include "tensorflow/core/platform/logging.h"
#include "transport.h"
#include "transport_status.h"

namespace rdma_device {

namespace tf = ::tensorflow;

namespace {

// How long work may wait for a pending route: a choice resolves the
// peer's name (the resolver's own timeouts: 5 s a try by default) and may
// probe it (rdma_cm: up to 500 ms), and may queue behind connects on the
// control pool.
constexpr int64_t kRouteWaitMs = 20000;

}  // namespace

void Transport::AddPeers(const tf::ClusterDef& cluster) {
  bool any = false;
  {
    tf::mutex_lock l(mu_);
    const bool started = ctx_.load() != nullptr;
    for (const auto& job : cluster.job()) {
      for (const auto& [index, addr] : job.tasks()) {
        // Replica 0: TF's own worker caches name every task so (its gRPC
        // channel cache refuses any other replica).
        std::string task = TaskName(job.name(), 0, index);
        if (task == self_task_ || addr.empty()) continue;
        auto it = addrs_.find(task);
        if (it != addrs_.end() && it->second == addr) continue;
        addrs_[task] = addr;
        if (!started) continue;  // Start() chooses it
        ChooseRoute(task, addr);
        any = true;
      }
    }
  }
  if (any) ArmExpiry();
}

void Transport::ChooseRoute(const std::string& task, const std::string& addr) {
  // The old route (if the peer moved) is no longer known to be right.
  routes_.erase(task);
  Pending& p = pending_[task];
  p.deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(kRouteWaitMs);
  std::weak_ptr<Transport> weak = weak_from_this();
  ScheduleControl([weak, task, addr] {
    if (auto self = weak.lock()) self->AddPeer(task, addr);
  });
}

void Transport::ArmExpiry() {
  // TF's Env runs this after the delay (the POSIX Env on a thread of its
  // own; the Env contract allows a pool, and requires the closure not to
  // block: ExpirePending takes mu_ briefly and hands the failures to our
  // data-path pool). No thread, TF's or ours, waits for it: work that
  // meets a pending route is queued, never waited for, and the one bounded
  // wait that can sit behind a route (RegisterGraph's placement wait,
  // kRegisterPlacementWaitMs) ends on its own deadline first.
  int64_t delay_us = 0;
  {
    tf::mutex_lock l(mu_);
    if (expiry_armed_) return;  // it re-arms for what is left when it fires
    const auto now = std::chrono::steady_clock::now();
    bool any = false;
    std::chrono::steady_clock::time_point earliest;
    for (const auto& [task, p] : pending_) {
      // Past its deadline: work that meets it fails at once (WhenRouted).
      if (routes_.count(task) > 0 || p.deadline <= now) continue;
      if (!any || p.deadline < earliest) earliest = p.deadline;
      any = true;
    }
    if (!any) return;
    expiry_armed_ = true;
    const auto left = earliest - now;
    delay_us = std::max<int64_t>(
        0, std::chrono::duration_cast<std::chrono::microseconds>(left).count());
  }
  std::weak_ptr<Transport> weak = weak_from_this();
  // A millisecond late, so that the deadline has passed when it runs.
  tsl::Env::Default()->SchedClosureAfter(delay_us + 1000, [weak] {
    if (auto self = weak.lock()) self->ExpirePending();
  });
}

void Transport::AddPeer(const std::string& task, const std::string& addr) {
  rdev_transport kind = RDEV_TRANSPORT_NONE;
  Route route;
  rdev_status st = rdev_context_add_peer(ctx_.load(), task.data(), task.size(), addr.data(),
                                         addr.size(), &kind);
  if (st != RDEV_OK) {
    route.reason = absl::StrCat("adding the peer failed: ", FromRdev(st, LastError()).message());
  } else if (kind == RDEV_TRANSPORT_NONE) {
    route.reason = LastError();
  } else {
    route.kind = Route::kDevice;
  }
  tf::mutex_lock l(mu_);
  auto now = addrs_.find(task);
  if (now == addrs_.end() || now->second != addr) return;  // moved: a newer choice follows
  if (route.kind == Route::kGrpc) {
    LOG(WARNING) << "rdma_device: " << self_task_ << " -> " << task << " (" << addr
                 << ") uses stock gRPC: " << route.reason;
  } else {
    VLOG(1) << "rdma_device: " << self_task_ << " -> " << task << " (" << addr << ") over "
            << (kind == RDEV_TRANSPORT_SHM ? "shm" : "verbs");
  }
  routes_[task] = std::move(route);
  auto it = pending_.find(task);
  if (it == pending_.end() || it->second.draining) return;  // a drain running sees the route
  if (it->second.queued.empty()) {
    pending_.erase(it);
    return;
  }
  it->second.draining = true;
  std::weak_ptr<Transport> weak = weak_from_this();
  Schedule([weak, task] {
    if (auto self = weak.lock()) self->Drain(task);
  });
}

void Transport::ExpirePending() {
  std::vector<std::string> due;
  {
    tf::mutex_lock l(mu_);
    expiry_armed_ = false;
    const auto now = std::chrono::steady_clock::now();
    for (auto& [task, p] : pending_) {
      if (routes_.count(task) > 0 || p.draining || p.queued.empty() || now < p.deadline) continue;
      LOG(WARNING) << "rdma_device: " << self_task_ << ": the route to " << task
                   << " is still being chosen after " << kRouteWaitMs << " ms; "
                   << p.queued.size() << " transfers waiting for it fail";
      p.draining = true;
      due.push_back(task);
    }
  }
  for (std::string& task : due) {
    std::weak_ptr<Transport> weak = weak_from_this();
    Schedule([weak, task = std::move(task)] {
      if (auto self = weak.lock()) self->Drain(task);
    });
  }
  // Routes chosen later than this one's deadline, if any, still wait.
  ArmExpiry();
}

void Transport::Drain(const std::string& task) {
  for (;;) {
    std::function<void()> fn;
    {
      tf::mutex_lock l(mu_);
      auto it = pending_.find(task);
      if (it == pending_.end()) return;
      if (it->second.queued.empty()) {
        if (routes_.count(task) > 0) {
          pending_.erase(it);  // chosen: later work runs at once
        } else {
          it->second.draining = false;  // timed out: later work fails at once
        }
        return;
      }
      fn = std::move(it->second.queued.front());
      it->second.queued.pop_front();
    }
    fn();
  }
}

void Transport::WhenRouted(const std::string& peer_task, std::function<void()> fn) {
  {
    tf::mutex_lock l(mu_);
    auto it = pending_.find(peer_task);
    if (it != pending_.end()) {
      Pending& p = it->second;
      const bool chosen = routes_.count(peer_task) > 0;
      const bool expired = std::chrono::steady_clock::now() >= p.deadline;
      // Behind work already queued (order), or waiting for the choice.
      if (p.draining || (!chosen && !expired)) {
        p.queued.push_back(std::move(fn));
        return;
      }
    }
  }
  fn();
}

bool Transport::IsNotViable(const absl::Status& status) {
  return status.GetPayload(kNotViablePayload).has_value();
}

absl::Status Transport::Demote(const std::string& peer_task, const absl::Status& why) {
  const std::string reason(why.message());
  bool strict;
  {
    tf::mutex_lock l(mu_);
    Route& route = routes_[peer_task];
    if (route.kind == Route::kDevice) {
      LOG(WARNING) << "rdma_device: " << self_task_ << " -> " << peer_task
                   << " uses stock gRPC from now on: " << reason;
    }
    route.kind = Route::kGrpc;
    route.reason = reason;
    strict = strict_;
  }
  if (!strict) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("rdma_device: RDMA_DEVICE_STRICT is set but tensors with ", peer_task,
                   " would use stock gRPC: ", reason));
}

absl::Status Transport::RouteTo(const std::string& peer_task, Route* route) {
  {
    tf::tf_shared_lock l(mu_);
    auto it = routes_.find(peer_task);
    if (it != routes_.end()) {
      *route = it->second;
    } else if (pending_.count(peer_task) > 0) {
      const bool expired = std::chrono::steady_clock::now() >= pending_.at(peer_task).deadline;
      return absl::Status(
          expired ? absl::StatusCode::kDeadlineExceeded : absl::StatusCode::kUnavailable,
          absl::StrCat("rdma_device: the route to ", peer_task, " is still being chosen",
                       expired ? absl::StrCat(" after ", kRouteWaitMs, " ms") : std::string(),
                       " (resolving its name, probing RDMA)"));
    } else {
      route->kind = Route::kGrpc;
      route->reason = ctx_.load() == nullptr ? "transport not started"
                                             : "task not in any cluster spec seen here";
    }
    if (route->kind == Route::kDevice || !strict_) return absl::OkStatus();
  }
  return absl::FailedPreconditionError(
      absl::StrCat("rdma_device: RDMA_DEVICE_STRICT is set but tensors with ", peer_task,
                   " would use stock gRPC: ", route->reason));
}

bool Transport::Serves(const std::string& peer_task) {
  tf::tf_shared_lock l(mu_);
  auto it = routes_.find(peer_task);
  return it != routes_.end() && it->second.kind == Route::kDevice;
}

}  // namespace rdma_device
