// HugeArray: a fixed-size, zero-filled array in its own anonymous mapping, advised to use
// transparent huge pages.
#pragma once

#include <sys/mman.h>

#include <cstddef>
#include <cstring>
#include <new>
#include <type_traits>
#include <utility>

namespace kvstash::store {

// The block manager's large metadata arrays are touched at random; with 4 KiB pages every
// access to a million-entry table misses the TLB as well as the cache. Fresh anonymous memory
// reads as zero, so T's all-zero bytes must be its empty state. Throws std::bad_alloc when the
// mapping fails, like std::vector. Move-only; not thread-safe.
template <typename T>
class HugeArray {
  static_assert(std::is_trivially_copyable_v<T>);

 public:
  HugeArray() = default;
  explicit HugeArray(size_t size) : size_(size) {
    if (size == 0) return;
    bytes_ = (size * sizeof(T) + kHugePage - 1) / kHugePage * kHugePage;
    void* p = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    madvise(p, bytes_, MADV_HUGEPAGE);  // advisory
    data_ = static_cast<T*>(p);
  }
  ~HugeArray() {
    if (data_ != nullptr) munmap(data_, bytes_);
  }
  HugeArray(HugeArray&& other) noexcept { *this = std::move(other); }
  HugeArray& operator=(HugeArray&& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(size_, other.size_);
    std::swap(bytes_, other.bytes_);
    return *this;
  }

  T& operator[](size_t i) { return data_[i]; }
  const T& operator[](size_t i) const { return data_[i]; }
  T* data() { return data_; }
  const T* data() const { return data_; }
  size_t size() const { return size_; }
  // Sets every element back to all-zero bytes.
  void Zero() {
    if (data_ != nullptr) std::memset(static_cast<void*>(data_), 0, size_ * sizeof(T));
  }
  size_t MemoryBytes() const { return size_ * sizeof(T); }

 private:
  static constexpr size_t kHugePage = size_t{2} << 20;

  T* data_ = nullptr;
  size_t size_ = 0;
  size_t bytes_ = 0;
};

}  // namespace kvstash::store
