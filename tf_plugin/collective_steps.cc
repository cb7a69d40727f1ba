#include "collective_steps.h"

#include "absl/strings/str_cat.h"
#include "pool.h"
#include "tensorflow/core/platform/logging.h"
#include "tensorflow/core/util/device_name_utils.h"
#include "transport.h"

namespace rdma_device {

uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

uint64_t Fnv1a(const std::string& s) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ULL;
  return h;
}

SplitKey Split(const std::string& key) {
  std::vector<size_t> colons;
  for (size_t i = 0; i < key.size() && colons.size() < 4; ++i) {
    if (key[i] == ':') colons.push_back(i);
  }
  if (colons.size() < 4) return {key, key};
  return {key.substr(0, colons[3]),
          absl::StrCat(key.substr(0, colons[0]), key.substr(colons[1], colons[3] - colons[1]),
                       key.substr(colons[3]))};
}

bool IsCpu(const std::string& device_name) {
  tsl::DeviceNameUtils::ParsedName parsed;
  return tsl::DeviceNameUtils::ParseFullName(device_name, &parsed) && parsed.has_type &&
         parsed.type == "CPU";
}

std::string WireKey(const std::string& src_device, const std::string& dst_device,
                    const std::string& edge, uint64_t bytes) {
  return absl::StrCat(src_device, ";0;", dst_device, ";__collective/", edge, "/", bytes, "B;0:0");
}

std::string SentinelKey(const std::string& peer_task, const std::string& self_task) {
  return absl::StrCat(peer_task, ";0;", self_task, ";__collective_abort;0:0");
}

void AbortTransfers(const std::shared_ptr<Transport>& transport,
                    const std::shared_ptr<Steps>& steps, const absl::Status& s, bool* first) {
  std::vector<tf::StatusCallback> sends;
  std::vector<uint64_t> ids = steps->Abort(s, first, &sends);
  if (!*first) return;
  VLOG(1) << "rdma_device: collective executor aborts " << ids.size() << " local steps and "
          << sends.size() << " sends: " << s;
  const uint64_t sentinel = steps->sentinel_step();
  Schedule([transport, ids = std::move(ids), sends = std::move(sends), s, sentinel] {
    // Sends the transport still holds end now; their bytes stay referenced
    // by the transport until it lets go, and whatever it still delivers is
    // for a step the receivers drop.
    for (const auto& done : sends) done(s);
    if (transport == nullptr) return;
    // Peers first (their executors abort, failing their receives), then
    // this task's own transfers, locally.
    transport->AbortStep(sentinel, s, /*propagate=*/true);
    for (uint64_t step : ids) transport->AbortStep(step, s, /*propagate=*/false);
  });
}

}  // namespace rdma_device
