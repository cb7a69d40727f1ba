// The session factory for "grpc+rdma_device://" targets (session.cc).
#ifndef RDMA_DEVICE_TF_PLUGIN_SESSION_H_
#define RDMA_DEVICE_TF_PLUGIN_SESSION_H_

namespace rdma_device {

// Register it (once, at load; skipped when the running TensorFlow is not
// the one the shim was built against).
void RegisterSessionFactory();

}  // namespace rdma_device

#endif  // RDMA_DEVICE_TF_PLUGIN_SESSION_H_
