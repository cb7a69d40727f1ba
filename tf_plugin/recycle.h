// Per-tensor state objects of the shim, reused instead of allocated anew
// for every tensor: a steady stream of tensors takes its objects from a
// free list and gives them back on completion, and their strings and
// vectors keep their capacity, so the hot path makes no heap allocation
// once warm (tests/python/test_allocs.py counts them in real tasks).
#ifndef RDMA_DEVICE_TF_PLUGIN_RECYCLE_H_
#define RDMA_DEVICE_TF_PLUGIN_RECYCLE_H_

#include <cstddef>
#include <memory>
#include <mutex>
#include <vector>

namespace rdma_device {

// A free list of T (default-constructible), keeping at most kKeep: more
// than the tensors in flight at once in any job measured, and a bound on
// the memory the kept objects hold. Two uncontended lock operations per
// object. Instances live for the process (never destroyed: completions may
// run during exit).
template <typename T, size_t kKeep = 4096>
class FreeList {
 public:
  FreeList() { free_.reserve(kKeep); }

  // An object, reused when one is free. The caller resets what it uses.
  std::unique_ptr<T> Get() {
    {
      std::lock_guard<std::mutex> l(mu_);
      if (!free_.empty()) {
        std::unique_ptr<T> p = std::move(free_.back());
        free_.pop_back();
        return p;
      }
    }
    return std::make_unique<T>();
  }

  // Keep `p` for a later Get (freed when kKeep are kept already). The
  // caller has released what `p` refers to (tensors, callbacks).
  void Put(std::unique_ptr<T> p) {
    std::lock_guard<std::mutex> l(mu_);
    if (free_.size() < kKeep) free_.push_back(std::move(p));
  }

 private:
  std::mutex mu_;
  std::vector<std::unique_ptr<T>> free_;
};

}  // namespace rdma_device

#endif  // RDMA_DEVICE_TF_PLUGIN_RECYCLE_H_
