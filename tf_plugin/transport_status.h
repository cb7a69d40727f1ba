// TensorFlow statuses for the transport's C ABI (include/rdma_device.h):
// the one mapping of its status codes, and the wording TF's fault
// handling expects. For transport*.cc only.
#ifndef RDMA_DEVICE_TF_PLUGIN_TRANSPORT_STATUS_H_
#define RDMA_DEVICE_TF_PLUGIN_TRANSPORT_STATUS_H_

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "rdma_device.h"

namespace rdma_device {

// Marks a status as "the peer does not take this transport from us".
inline constexpr char kNotViablePayload[] = "type.googleapis.com/rdma_device.NotViable";

// The one mapping from the transport's status codes to TensorFlow's.
absl::Status FromRdev(rdev_status status, absl::string_view msg);

// A failed receive's status, inside its callback: as FromRdev, except that
// a step a peer aborted because it failed there with `cause` (from
// rdev_abort_cause) fails with the cause's code, not derived, as a
// RecvTensor pull from that peer fails under stock gRPC (its rendezvous
// holds the cause's status; TF marks only cancelled and aborted ones
// derived). Then TF's master reports the cause's class whichever task's
// failure reaches it first.
absl::Status FromRdevReceive(rdev_status status, absl::string_view msg, uint32_t cause);

// A failed transfer with `peer`, worded as TF's gRPC errors are: its
// fault handling (ClusterCoordinator) tells a ps failure from a worker
// failure by "GRPC error information from remote target /job:ps/...", and
// retries only Unavailable/Aborted errors. NotViable refusals stay as they
// are (the shim routes around them).
absl::Status WithPeer(absl::Status status, const std::string& peer);

// The calling thread's last error message from the transport.
std::string LastError();

// Status of a synchronous call that just returned `status`.
absl::Status CallStatus(rdev_status status);

}  // namespace rdma_device

#endif  // RDMA_DEVICE_TF_PLUGIN_TRANSPORT_STATUS_H_
