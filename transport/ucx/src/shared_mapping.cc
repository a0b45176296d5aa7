// SharedMapping and SharedMappings (shared_mapping.h): one mapping per process of each server
// region its connections copy through.

#include "shared_mapping.h"

#include <fmt/format.h>

#include <functional>
#include <unordered_map>
#include <utility>

#include "kvstash/common/mutex.h"

namespace kvstash::transport::internal {

namespace {

struct KeyHash {
  size_t operator()(const SharedRegionKey& key) const {
    size_t h = std::hash<std::string>()(key.packed_rkey);
    for (uint64_t v : {key.server_cookie, key.region_id, key.address, key.size}) {
      h ^= std::hash<uint64_t>()(v) + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
    }
    return h;
  }
};

struct Registry {
  Mutex mu;
  std::unordered_map<SharedRegionKey, std::weak_ptr<SharedMapping>, KeyHash> mappings
      GUARDED_BY(mu);
};

Registry& TheRegistry() {
  // Never destroyed: a mapping released during static destruction still finds it.
  static Registry* registry = new Registry;
  return *registry;
}

// Destroys its rkey when destroyed: run on the worker's thread, or dropped unrun where the
// thread has exited (Worker::Run drops it at once, or the worker's io_context destroys it
// before the UCX worker), in both cases with no other thread using the worker.
class RkeyDestroyer {
 public:
  explicit RkeyDestroyer(ucp_rkey_h rkey) : rkey_(rkey) {}
  RkeyDestroyer(RkeyDestroyer&& other) noexcept : rkey_(std::exchange(other.rkey_, nullptr)) {}
  RkeyDestroyer& operator=(RkeyDestroyer&&) = delete;
  ~RkeyDestroyer() { Destroy(); }
  void Destroy() {
    if (rkey_ != nullptr) ucp_rkey_destroy(std::exchange(rkey_, nullptr));
  }

 private:
  ucp_rkey_h rkey_;
};

}  // namespace

SharedMapping::~SharedMapping() {
  SharedMappings::Forget(key_);
  // The handler holds no Worker: a handler the exiting thread left queued is destroyed with
  // the worker's io_context, which goes before the UCX worker (worker.h's member order).
  worker_->Run([destroyer = RkeyDestroyer(rkey_)]() mutable { destroyer.Destroy(); });
}

Result<std::shared_ptr<SharedMapping>> SharedMappings::Acquire(
    const SharedRegionKey& key, ucp_ep_h ep, const std::shared_ptr<Worker>& worker) {
  Registry& registry = TheRegistry();
  MutexLock lock(&registry.mu);
  auto it = registry.mappings.find(key);
  if (it != registry.mappings.end()) {
    if (std::shared_ptr<SharedMapping> live = it->second.lock()) return live;
  }
  ucp_rkey_h rkey = nullptr;
  KVSTASH_RETURN_IF_ERROR(
      FromUcs(ucp_ep_rkey_unpack(ep, key.packed_rkey.data(), &rkey),
              fmt::format("unpacking the key of the server's shared region {}", key.region_id)));
  void* local = nullptr;
  const ucs_status_t mapped = ucp_rkey_ptr(rkey, key.address, &local);
  if (mapped != UCS_OK || local == nullptr) {
    ucp_rkey_destroy(rkey);
    return FromUcs(
        mapped == UCS_OK ? UCS_ERR_UNREACHABLE : mapped,
        fmt::format("mapping the server's shared region {} of {} bytes", key.region_id, key.size));
  }
  std::shared_ptr<SharedMapping> mapping(
      new SharedMapping(key, rkey, static_cast<std::byte*>(local), worker));
  registry.mappings[key] = mapping;
  return mapping;
}

void SharedMappings::Forget(const SharedRegionKey& key) {
  Registry& registry = TheRegistry();
  MutexLock lock(&registry.mu);
  auto it = registry.mappings.find(key);
  // A mapping acquired again after this one expired is another's entry: kept.
  if (it != registry.mappings.end() && it->second.expired()) registry.mappings.erase(it);
}

}  // namespace kvstash::transport::internal
