// An LD_PRELOAD for a TF task that stands in for TF's NCCL communicator, so
// that a CPU-only TensorFlow (whose MaybeCreateNcclCommunicator returns
// null) shows where the communicator it creates goes.
//
// It defines tensorflow::MaybeCreateNcclCommunicator(const ConfigProto&),
// which the shim and libtensorflow_cc.so.2 both call through the dynamic
// linker, so this definition is the one they get. It returns a
// FakeCommunicator, numbered from 1 in the process, and appends a line to
// the file $FAKE_NCCL_LOG for each thing done to one:
//   created <n> <library that called MaybeCreateNcclCommunicator>
//   key <n>                 GenerateCommunicatorKey (a param resolver)
//   enqueue <n>             Enqueue (an NCCL collective, GPU builds only;
//                           the fake then aborts the process)
//   start_abort <n> <code> <message, newlines as \n>
//   destroyed <n>
// Built against TensorFlow's own header for the interface (with the shim's
// compile flags), so a change of the interface fails the build here. It
// calls nothing of TensorFlow's or absl's that is not inline: a stock task
// has no TensorFlow library in the global scope a preload's calls reach.
#include <dlfcn.h>
#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <memory>
#include <string>

#include "tensorflow/core/nccl/collective_communicator.h"

namespace {

// One write(2) per line, O_APPEND: lines from several threads never mix.
void Log(const std::string& line) {
  const char* path = std::getenv("FAKE_NCCL_LOG");
  if (path == nullptr) return;
  int fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) return;
  std::string out = line + "\n";
  ssize_t ignored = write(fd, out.data(), out.size());
  (void)ignored;
  close(fd);
}

std::string OneLine(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

std::atomic<int> next_id{1};

class FakeCommunicator : public tensorflow::NcclCommunicatorInterface {
 public:
  explicit FakeCommunicator(const std::string& caller) : id_(next_id++) {
    Log("created " + std::to_string(id_) + " " + caller);
  }
  ~FakeCommunicator() override { Log("destroyed " + std::to_string(id_)); }

  std::string GenerateCommunicatorKey() override {
    Log("key " + std::to_string(id_));
    return "fake-nccl-key";
  }

  void Enqueue(std::shared_ptr<tensorflow::CollectiveContext> col_ctx,
               tensorflow::StatusCallback done) override {
    // Only a GPU build runs NCCL collectives; making a status here would
    // need absl's code, which this library does not link.
    Log("enqueue " + std::to_string(id_));
    std::abort();
  }

  void StartAbort(const absl::Status& s) override {
    Log("start_abort " + std::to_string(id_) + " " + std::to_string(s.raw_code()) +
        " " + OneLine(std::string(s.message())));
  }

 private:
  const int id_;
};

// The file name of the library holding `address`.
std::string LibraryOf(const void* address) {
  Dl_info info;
  if (dladdr(address, &info) == 0 || info.dli_fname == nullptr) return "?";
  std::string name = info.dli_fname;
  size_t slash = name.rfind('/');
  return slash == std::string::npos ? name : name.substr(slash + 1);
}

}  // namespace

namespace tensorflow {

__attribute__((visibility("default"), noinline)) std::unique_ptr<NcclCommunicatorInterface>
MaybeCreateNcclCommunicator(const ConfigProto& config) {
  (void)config;
  return std::make_unique<FakeCommunicator>(LibraryOf(__builtin_return_address(0)));
}

}  // namespace tensorflow
