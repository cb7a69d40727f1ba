#include "pool.h"

#include <utility>

#include "tensorflow/core/platform/env.h"
#include "tensorflow/core/platform/threadpool.h"

namespace rdma_device {

void Schedule(std::function<void()> fn) {
  // Leaked on purpose: a pool destroyed at exit would join threads that
  // may be inside the transport.
  static tsl::thread::ThreadPool* const pool =
      new tsl::thread::ThreadPool(tsl::Env::Default(), "rdev_plugin", kPoolThreads);
  pool->Schedule(std::move(fn));
}

void ScheduleControl(std::function<void()> fn) {
  // Leaked on purpose, as above.
  static tsl::thread::ThreadPool* const pool =
      new tsl::thread::ThreadPool(tsl::Env::Default(), "rdev_control", kControlThreads);
  pool->Schedule(std::move(fn));
}

}  // namespace rdma_device
