// Spans of the shim in the transport's timeline (src/trace.rs): recorded
// into the library's buffer while RDMA_DEVICE_TRACE / rdma_device.trace_*
// records, and into TensorFlow's profiler (TensorBoard's trace viewer)
// while it records. Off, a span costs one call that reads two atomics.
#ifndef RDMA_DEVICE_TF_PLUGIN_TRACE_H_
#define RDMA_DEVICE_TF_PLUGIN_TRACE_H_

#include <cstdint>

#include "absl/strings/string_view.h"

namespace rdma_device {

// The start of a span: now in the trace's clock, or 0 when nothing records.
int64_t TraceStart();

// The end of a span begun at `start` (0: nothing recorded).
void TraceEnd(absl::string_view name, int64_t start, uint64_t step_id, uint64_t bytes = 0,
              absl::string_view key = {});

// Once, when the library is loaded: let the transport's spans reach
// TensorFlow's profiler.
void AttachProfiler();

}  // namespace rdma_device

#endif  // RDMA_DEVICE_TF_PLUGIN_TRACE_H_
