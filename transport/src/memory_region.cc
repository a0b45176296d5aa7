#include <utility>

#include "kvstash/transport/channel.h"

namespace kvstash::transport {

MemoryRegion::MemoryRegion(MutableBytes bytes, void* handle, uint64_t id, std::string packed_rkey,
                           std::function<void()> release)
    : handle_(handle),
      data_(bytes.data()),
      size_(bytes.size()),
      id_(id),
      rkey_(std::move(packed_rkey)),
      release_(std::move(release)) {}

MemoryRegion::MemoryRegion(MemoryRegion&& other) noexcept
    : handle_(std::exchange(other.handle_, nullptr)),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      id_(std::exchange(other.id_, 0)),
      rkey_(std::exchange(other.rkey_, {})),
      release_(std::exchange(other.release_, {})) {}

MemoryRegion& MemoryRegion::operator=(MemoryRegion&& other) noexcept {
  if (this != &other) {
    Reset();
    handle_ = std::exchange(other.handle_, nullptr);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    id_ = std::exchange(other.id_, 0);
    rkey_ = std::exchange(other.rkey_, {});
    release_ = std::exchange(other.release_, {});
  }
  return *this;
}

MemoryRegion::~MemoryRegion() { Reset(); }

void MemoryRegion::Reset() {
  if (release_) std::exchange(release_, {})();
  handle_ = nullptr;
  data_ = nullptr;
  size_ = 0;
  id_ = 0;
  rkey_.clear();
}

}  // namespace kvstash::transport
