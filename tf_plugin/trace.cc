#include "trace.h"

#include <string>

#include "rdma_device.h"
#include "xla/tsl/profiler/backends/cpu/traceme_recorder.h"

namespace rdma_device {

int64_t TraceStart() { return rdev_trace_active() ? rdev_trace_now() : 0; }

void TraceEnd(absl::string_view name, int64_t start, uint64_t step_id, uint64_t bytes,
              absl::string_view key) {
  if (start == 0) return;
  rdev_trace_span(name.data(), name.size(), start, rdev_trace_now(), step_id, bytes,
                  key.empty() ? nullptr : key.data(), key.size());
}

namespace {

// Runs on the thread that ended the span (any thread, progress threads
// included): one append to TensorFlow's per-thread event queue.
void ToProfiler(const char* name, size_t name_len, int64_t start_ns, int64_t end_ns) {
  tsl::profiler::TraceMeRecorder::Record({std::string(name, name_len), start_ns, end_ns});
}

}  // namespace

void AttachProfiler() {
  static_assert(sizeof(tsl::profiler::internal::g_trace_level) == sizeof(int32_t),
                "TensorFlow's trace level is an atomic int");
  rdev_trace_attach_tf(
      reinterpret_cast<const int32_t*>(&tsl::profiler::internal::g_trace_level), &ToProfiler);
}

}  // namespace rdma_device
