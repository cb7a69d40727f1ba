// A SessionFactory for "grpc+rdma_device://host:port" targets: what a
// cluster resolver with rpc_layer="grpc+rdma_device" hands out as
// master(), and what a user writes after reading "grpc+rdma_device".
//
// A TF1 session talks to its master over gRPC whatever the servers'
// protocol (the master service of this server is stock gRPC); the tensors
// of the steps it runs move over the transport, chosen by the servers.
// So such a target is the "grpc://" session to the same address: this
// factory hands the rewritten options to the factory TensorFlow registered
// for "grpc://" (found through the public registry, not built here).
#include "session.h"

#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "tensorflow/core/common_runtime/session_factory.h"
#include "tensorflow/core/public/session_options.h"

namespace rdma_device {

namespace tf = ::tensorflow;

namespace {

constexpr char kScheme[] = "grpc+rdma_device://";

tf::SessionOptions AsGrpc(const tf::SessionOptions& options) {
  tf::SessionOptions o = options;
  o.target = absl::StrCat("grpc://", options.target.substr(sizeof(kScheme) - 1));
  return o;
}

absl::Status GrpcFactory(const tf::SessionOptions& o,
                         tf::SessionFactory** out) {
  absl::Status s = tf::SessionFactory::GetFactory(o, out);
  if (!s.ok()) {
    return absl::Status(
        s.code(), absl::StrCat("a ", kScheme, " target is a grpc:// session "
                               "to the same master, but: ",
                               s.message()));
  }
  return absl::OkStatus();
}

class RdmaSessionFactory : public tf::SessionFactory {
 public:
  bool AcceptsOptions(const tf::SessionOptions& options) override {
    return absl::StartsWith(options.target, kScheme);
  }

  absl::Status NewSession(const tf::SessionOptions& options,
                          tf::Session** out_session) override {
    const tf::SessionOptions o = AsGrpc(options);
    tf::SessionFactory* f = nullptr;
    TF_RETURN_IF_ERROR(GrpcFactory(o, &f));
    return f->NewSession(o, out_session);
  }

  absl::Status Reset(const tf::SessionOptions& options,
                     const std::vector<std::string>& containers) override {
    const tf::SessionOptions o = AsGrpc(options);
    tf::SessionFactory* f = nullptr;
    TF_RETURN_IF_ERROR(GrpcFactory(o, &f));
    return f->Reset(o, containers);
  }
};

}  // namespace

void RegisterSessionFactory() {
  tf::SessionFactory::Register("GRPC_RDMA_DEVICE_SESSION",
                               new RdmaSessionFactory());
}

}  // namespace rdma_device
