#include "transport_status.h"

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "tensorflow/core/platform/status.h"

namespace rdma_device {

absl::Status FromRdev(rdev_status status, absl::string_view msg) {
  if (status == RDEV_OK) return absl::OkStatus();
  std::string text = absl::StrCat("rdma_device: ", msg.empty() ? rdev_status_str(status) : msg);
  switch (status) {
    case RDEV_INVALID_ARGUMENT:
      return absl::InvalidArgumentError(text);
    case RDEV_NOT_VIABLE: {
      absl::Status s = absl::FailedPreconditionError(text);
      s.SetPayload(kNotViablePayload, absl::Cord("1"));
      return s;
    }
    case RDEV_PEER_LOST:
    case RDEV_IO:
      return absl::UnavailableError(text);
    case RDEV_ABORTED:
      // The step was aborted (here or by a peer, which sends its reason):
      // a consequence of some other failure. Derived, as TF's rendezvous
      // marks its own aborts, so TF's master reports that failure, not
      // this one, and cancels nothing because of it.
      return tensorflow::StatusGroup::MakeDerived(absl::AbortedError(text));
    case RDEV_RESOURCE_EXHAUSTED:
      return absl::ResourceExhaustedError(text);
    case RDEV_CONFIG:
      return absl::InvalidArgumentError(text);
    case RDEV_TIMEOUT:
      return absl::DeadlineExceededError(text);
    case RDEV_STRICT:
      // RDMA_DEVICE_STRICT: the stock path would be taken; fail instead.
      return absl::FailedPreconditionError(text);
    case RDEV_PROTOCOL:
      return absl::DataLossError(text);
    case RDEV_INTERNAL:
    case RDEV_PANIC:
    default:
      return absl::InternalError(text);
  }
}

absl::Status FromRdevReceive(rdev_status status, absl::string_view msg, uint32_t cause) {
  // The code comes from the peer: only a real TF error code that is not
  // itself an abort or a cancellation.
  const bool failure = status == RDEV_ABORTED && cause != 0 && cause <= 16 &&
                       cause != static_cast<uint32_t>(absl::StatusCode::kAborted) &&
                       cause != static_cast<uint32_t>(absl::StatusCode::kCancelled);
  if (!failure) return FromRdev(status, msg);
  return absl::Status(static_cast<absl::StatusCode>(cause), absl::StrCat("rdma_device: ", msg));
}

absl::Status WithPeer(absl::Status status, const std::string& peer) {
  // A not-viable status is the caller's to act on (the stock path).
  if (status.ok() || status.GetPayload(kNotViablePayload).has_value()) return status;
  absl::Status out(status.code(),
                   absl::StrCat(status.message(), "\nAdditional GRPC error information from remote "
                                "target ", peer, " while calling the rdma_device transport"));
  status.ForEachPayload([&out](absl::string_view url, const absl::Cord& payload) {
    out.SetPayload(url, payload);
  });
  return out;
}

std::string LastError() {
  char buf[1024];
  size_t n = rdev_last_error(buf, sizeof(buf));
  return std::string(buf, n < sizeof(buf) ? n : sizeof(buf) - 1);
}

absl::Status CallStatus(rdev_status status) {
  return status == RDEV_OK ? absl::OkStatus() : FromRdev(status, LastError());
}

}  // namespace rdma_device
