// ServerFactory for protocol "grpc+rdma_device" and its GrpcServer subclass.
//
// Loading this library (tf.load_library) runs the static registrar below.
// The shim is compiled against one exact TensorFlow build (C++ classes,
// layouts): when the running TensorFlow is another build (another version,
// or the same version's other binaries: `tensorflow-cpu` for `tensorflow`)
// it registers nothing and says why (rdma_device_tf_load_error), however
// it was loaded (rdma_device.load() or tf.load_library by hand).
#include <dlfcn.h>
#include <link.h>

#include <atomic>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>

#include "collectives.h"
#include "rendezvous.h"
#include "session.h"
#include "transport.h"
#include "worker.h"
#include "worker_rpc.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "tensorflow/c/c_api.h"
#include "tensorflow/core/distributed_runtime/rpc/grpc_server_lib.h"
#include "tensorflow/core/distributed_runtime/server_lib.h"
#include "trace.h"

#if !defined(RDMA_DEVICE_TF_BUILT_VERSION) || !defined(RDMA_DEVICE_TF_BUILT_DISTRIBUTION) || \
    !defined(RDMA_DEVICE_TF_BUILT_FRAMEWORK_SEGMENTS) || !defined(RDMA_DEVICE_TF_BUILT_CC_SEGMENTS)
#error "RDMA_DEVICE_TF_BUILT_* (version, distribution, segments) must be defined by the build"
#endif

namespace rdma_device {

namespace tf = ::tensorflow;

namespace {

constexpr char kProtocol[] = "grpc+rdma_device";

}  // namespace

namespace {

// One of the two libraries the shim links, as the dynamic loader mapped it.
struct TfLibrary {
  const char* name;           // its file name
  const void* symbol;         // a function of it the shim binds to
  const char* built;          // its PT_LOAD segments when the shim was built
  std::string path;           // where the running one was mapped from
  std::string segments;       // its PT_LOAD segments now, as `built` spells them
};

struct FindLibrary {
  TfLibrary* lib;
  const char* mapped_from;  // dladdr's file name for `symbol`, or null
};

// The PT_LOAD segments of one mapped object, "vaddr:filesz:memsz" in hex
// joined by "," (CMakeLists.txt reads the files' program headers the same
// way at configure time).
std::string LoadSegments(const dl_phdr_info* info) {
  std::string out;
  for (int i = 0; i < info->dlpi_phnum; ++i) {
    const ElfW(Phdr)& ph = info->dlpi_phdr[i];
    if (ph.p_type != PT_LOAD) continue;
    char buf[3 * 17 + 4];
    std::snprintf(buf, sizeof(buf), "%" PRIx64 ":%" PRIx64 ":%" PRIx64,
                  static_cast<uint64_t>(ph.p_vaddr), static_cast<uint64_t>(ph.p_filesz),
                  static_cast<uint64_t>(ph.p_memsz));
    if (!out.empty()) out += ',';
    out += buf;
  }
  return out;
}

const char* BaseName(const char* path) {
  const char* slash = std::strrchr(path, '/');
  return slash != nullptr ? slash + 1 : path;
}

// The object the shim's symbol resolved into (dladdr's file name), else the
// first one of that file name.
int VisitObject(dl_phdr_info* info, size_t, void* data) {
  auto* find = static_cast<FindLibrary*>(data);
  const char* name = info->dlpi_name != nullptr ? info->dlpi_name : "";
  const bool match = find->mapped_from != nullptr
                         ? std::strcmp(name, find->mapped_from) == 0
                         : std::strcmp(BaseName(name), find->lib->name) == 0;
  if (!match) return 0;
  find->lib->path = name;
  find->lib->segments = LoadSegments(info);
  return 1;  // found: stop
}

// "" when the running TensorFlow's binaries are those the shim was built
// against, else what differs. In memory only (no file is read): dladdr and
// dl_iterate_phdr over the mapped objects, some microseconds.
std::string TensorFlowBinariesDiffer() {
  // TF_Version lives in libtensorflow_cc.so.2, ServerFactory::Register in
  // libtensorflow_framework.so.2: the objects the shim's symbols bind to,
  // whatever their path.
  void (*const register_factory)(const std::string&, tf::ServerFactory*) =
      &tf::ServerFactory::Register;
  TfLibrary libs[] = {
      {"libtensorflow_framework.so.2", reinterpret_cast<const void*>(register_factory),
       RDMA_DEVICE_TF_BUILT_FRAMEWORK_SEGMENTS, "", ""},
      {"libtensorflow_cc.so.2", reinterpret_cast<const void*>(&TF_Version),
       RDMA_DEVICE_TF_BUILT_CC_SEGMENTS, "", ""},
  };
  std::string differ;
  for (TfLibrary& lib : libs) {
    Dl_info where{};
    FindLibrary find{&lib, nullptr};
    if (dladdr(lib.symbol, &where) != 0 && where.dli_fname != nullptr) {
      find.mapped_from = where.dli_fname;
    }
    dl_iterate_phdr(VisitObject, &find);
    if (lib.segments == lib.built) continue;
    if (!differ.empty()) differ += "; ";
    differ += std::string(lib.name) + " (" + (lib.path.empty() ? "not found" : lib.path) +
              ") has the load segments [" + lib.segments + "], the build's had [" + lib.built +
              "]";
  }
  return differ;
}

}  // namespace

// Empty when the running TensorFlow is the build the shim was compiled
// against: the same version string and the same binaries (two builds share
// a version string, and `tensorflow` and `tensorflow-cpu` 2.21.0 even their
// git version, compiler and compile flags).
const std::string& TensorFlowVersionError() {
  static const std::string* const error = [] {
    const char* running = TF_Version();
    if (running == nullptr || std::strcmp(running, RDMA_DEVICE_TF_BUILT_VERSION) != 0) {
      return new std::string(
          std::string("rdma_device: librdma_device_tf.so was built against "
                      "TensorFlow " RDMA_DEVICE_TF_BUILT_VERSION
                      " but the running TensorFlow is ") +
          (running ? running : "(unknown)") +
          "; nothing is registered (no \"grpc+rdma_device\" server); rebuild the plugin in "
          "this environment (pip install --no-build-isolation ./python)");
    }
    const std::string differ = TensorFlowBinariesDiffer();
    if (differ.empty()) return new std::string();
    return new std::string(
        "rdma_device: librdma_device_tf.so was built against another build of TensorFlow " +
        std::string(running) +
        " than the one running (distribution " RDMA_DEVICE_TF_BUILT_DISTRIBUTION
        " when built; the same version string, other binaries, as `tensorflow-cpu` has for "
        "`tensorflow`): " +
        differ +
        "; nothing is registered (no \"grpc+rdma_device\" server); rebuild the plugin in "
        "this environment (pip install --no-build-isolation ./python)");
  }();
  return *error;
}

namespace {

const std::string& VersionError() { return TensorFlowVersionError(); }

class RdmaServer : public tf::GrpcServer {
 public:
  static absl::Status Create(const tf::ServerDef& server_def,
                             tf::DeviceMgr* local_device_mgr,
                             std::unique_ptr<tf::ServerInterface>* out) {
    std::unique_ptr<RdmaServer> server(
        new RdmaServer(server_def, tsl::Env::Default()));
    TF_RETURN_IF_ERROR(server->Init(local_device_mgr));
    *out = std::move(server);
    return absl::OkStatus();
  }

 protected:
  // Every worker cache TF builds (the server's own, each session's, each
  // eager context's) sees the cluster of that session: the peers' addresses
  // come from here, so clients that join later (eager) are known too.
  // TF installs its stock collective manager here, on this task only: put
  // a handle on ours back (collectives.h), reaching the new cluster and
  // resolving groups under the new definition (its leader), as TF's would.
  absl::Status UpdateServerDef(const tf::ServerDef& server_def) override {
    TF_RETURN_IF_ERROR(GrpcServer::UpdateServerDef(server_def));
    transport_->AddPeers(server_def.cluster());
    if (collectives_ == nullptr) return absl::OkStatus();
    tf::WorkerCacheInterface* cache = nullptr;
    TF_RETURN_IF_ERROR(WorkerCacheFactory(tf::WorkerCacheFactoryOptions(server_def), &cache));
    collectives_->Update(server_def.default_session_config(),
                         std::unique_ptr<tf::WorkerCacheInterface>(cache));
    worker_env()->collective_executor_mgr = collectives_->NewHandle();
    master_env()->collective_executor_mgr = worker_env()->collective_executor_mgr.get();
    return absl::OkStatus();
  }

  // Per-step worker RPCs are served over the transport from Start(), as
  // TF's own services are (c_api.h: a server "will not serve any requests
  // until TF_ServerStart"), never from Init. A server never started is the
  // one TF destroys: TF_DeleteServer, and the eager context on an error
  // between creating its server and starting it
  // (context_distributed_manager.cc); ~GrpcServer then frees the session
  // manager and the worker that serving calls into (a raw pointer). A
  // started server is never destroyed (~GrpcServer CHECK-fails on Stop()
  // first; EagerContext and tf.distribute.Server release it instead), so
  // once serving, `worker_impl()` lives as long as the process. Served
  // from Init, a stale master's RunGraph and CleanupGraph ran on a server
  // being deleted: SIGSEGV in Worker::CleanupGraphAsync
  // (tests/python/test_teardown.py).
  absl::Status Start() override {
    TF_RETURN_IF_ERROR(GrpcServer::Start());
    if (transport_started_ && !serving_.exchange(true)) {
      ServeWorkerRpcs(transport_, worker_impl(), worker_env()->compute_pool);
    }
    return absl::OkStatus();
  }

  absl::Status WorkerCacheFactory(const tf::WorkerCacheFactoryOptions& options,
                                  tf::WorkerCacheInterface** worker_cache) override {
    transport_->AddPeers(options.cluster_def);
    tf::WorkerCacheInterface* stock = nullptr;
    TF_RETURN_IF_ERROR(GrpcServer::WorkerCacheFactory(options, &stock));
    // Per-step worker RPCs over the transport where it connects the tasks
    // (worker_rpc.h); all else through the stock cache.
    *worker_cache = NewTransportWorkerCache(stock, transport_);
    return absl::OkStatus();
  }

 private:
  RdmaServer(const tf::ServerDef& server_def, tsl::Env* env)
      : GrpcServer(server_def, env), transport_(std::make_shared<Transport>()) {}

  absl::Status Init(tf::DeviceMgr* local_device_mgr) {
    tf::GrpcServerOptions opts;
    // The eager context passes its device manager in; reuse it.
    opts.local_device_mgr = local_device_mgr;
    opts.rendezvous_mgr_func = [transport = transport_](const tf::WorkerEnv* env) {
      return new RdmaRendezvousMgr(env, transport);
    };
    // Stock GrpcWorker but for RegisterGraph, where static placement hooks in.
    opts.worker_func = [transport = transport_](tf::WorkerEnv* env,
                                                const tf::ConfigProto& config) {
      return std::unique_ptr<tf::GrpcWorker>(new RdmaWorker(env, config, transport));
    };
    // Collectives (MultiWorkerMirroredStrategy): chunks pushed through the
    // transport instead of RecvBuf RPCs (collectives.h). The manager is
    // ours for the server's life; worker_env holds a handle on it. It gets
    // its own worker cache: TF's default one goes when the cluster changes.
    opts.collective_mgr_func =
        [this](const tf::ConfigProto& config, const tf::WorkerEnv* env,
               tf::WorkerCacheInterface*) -> tf::CollectiveExecutorMgrInterface* {
      tf::WorkerCacheInterface* cache = nullptr;
      absl::Status s = WorkerCacheFactory(tf::WorkerCacheFactoryOptions(server_def()), &cache);
      if (!s.ok()) {
        LOG(ERROR) << "rdma_device: no worker cache for collectives: " << s;
        return nullptr;  // GrpcServer::Init fails
      }
      collectives_ = Collectives::Create(
          config, env, std::unique_ptr<tf::WorkerCacheInterface>(cache), transport_);
      return collectives_ == nullptr ? nullptr : collectives_->NewHandle().release();
    };
    // What can fail the transport's start fails here, before Init binds
    // the port and registers the master (LocalMaster keeps a pointer to it
    // that a server torn down after Init would leave dangling).
    TF_RETURN_IF_ERROR(Transport::CheckConfig());
    TF_RETURN_IF_ERROR(GrpcServer::Init(opts));
    const tf::ServerDef& def = server_def();
    transport_->AddPeers(def.cluster());
    const std::string self = TaskName(def.job_name(), def.replica(), def.task_index());
    absl::Status started = transport_->Start(self, SelfAddress());
    if (!started.ok()) {
      // Past Init the server must stay whole: it runs, every tensor over
      // stock gRPC (counted; in strict mode each such step fails, saying why).
      LOG(ERROR) << "rdma_device: " << self << ": the transport did not start, every tensor of "
                 << "this server goes over stock gRPC: " << started;
      return absl::OkStatus();
    }
    transport_started_ = true;
    return absl::OkStatus();
  }

  // This task's address as its peers know it (the cluster spec's spelling:
  // the shm backend keys its socket by it); the bound port if the spec
  // left the port to the OS.
  std::string SelfAddress() const {
    const tf::ServerDef& def = server_def();
    const std::string bound = absl::StrCat(":", bound_port());
    for (const auto& job : def.cluster().job()) {
      if (job.name() != def.job_name()) continue;
      auto it = job.tasks().find(def.task_index());
      if (it != job.tasks().end() && absl::EndsWith(it->second, bound)) return it->second;
    }
    return absl::StrCat(host_name(), bound);
  }

  const std::shared_ptr<Transport> transport_;
  // Init started the transport (set before any Start); the first Start
  // serves worker RPCs over it.
  bool transport_started_ = false;
  std::atomic<bool> serving_{false};
  // Set in Init (collective_mgr_func), kept across UpdateServerDef.
  std::shared_ptr<Collectives> collectives_;
};

class RdmaServerFactory : public tf::ServerFactory {
 public:
  bool AcceptsOptions(const tf::ServerDef& server_def) override {
    return server_def.protocol() == kProtocol;
  }

  absl::Status NewServer(const tf::ServerDef& server_def,
                         const Options& options,
                         std::unique_ptr<tf::ServerInterface>* out) override {
    if (!VersionError().empty()) {
      return absl::FailedPreconditionError(VersionError());
    }
    return RdmaServer::Create(server_def, options.local_device_mgr, out);
  }
};

struct Registrar {
  Registrar() {
    if (!VersionError().empty()) {
      // Nothing is registered: every class here is laid out for another
      // TensorFlow. (The Python loader refuses before loading us at all.)
      LOG(ERROR) << VersionError();
      return;
    }
    RegisterSessionFactory();
    tf::ServerFactory::Register(kProtocol, new RdmaServerFactory());
    AttachProfiler();
  }
};
const Registrar registrar;

}  // namespace

}  // namespace rdma_device

// For the Python loader: NUL-terminated reason the shim cannot be used in
// this process, or "" when it can. The pointer stays valid for the process.
extern "C" __attribute__((visibility("default"))) const char*
rdma_device_tf_load_error() {
  return rdma_device::VersionError().c_str();
}
