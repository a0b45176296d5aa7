// A std::mutex and a condition variable that the clang thread-safety analysis understands.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>

#include "kvstash/common/thread_annotations.h"

namespace kvstash {

// Thread-safe (it is the lock).
class CAPABILITY("mutex") Mutex {
 public:
  void Lock() ACQUIRE() { mu_.lock(); }
  void Unlock() RELEASE() { mu_.unlock(); }
  // Tells the analysis the lock is held where it cannot see so (a lambda run by a locked
  // caller). Checks nothing at run time.
  void AssertHeld() const ASSERT_CAPABILITY(this) {}

 private:
  friend class CondVar;
  std::mutex mu_;
};

// Holds a Mutex for its scope.
class SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex* mu) ACQUIRE(mu) : mu_(mu) { mu_->Lock(); }
  ~MutexLock() RELEASE() { mu_->Unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex* const mu_;
};

// A condition variable waited on with a Mutex held. Waits may wake spuriously: wait in a loop
// on the condition, with the lock held where the analysis sees it:
//
//   MutexLock lock(&mu_);
//   while (queue_.empty() && !stopping_) work_.Wait(&mu_);
//
// Thread-safe.
class CondVar {
 public:
  // Releases `mu`, waits for a signal, and holds `mu` again before returning.
  void Wait(Mutex* mu) REQUIRES(mu) {
    std::unique_lock<std::mutex> lock(mu->mu_, std::adopt_lock);
    cv_.wait(lock);
    lock.release();  // still held, by the caller
  }
  // As Wait, for at most `timeout`; false when it timed out.
  template <typename Rep, typename Period>
  bool WaitFor(Mutex* mu, std::chrono::duration<Rep, Period> timeout) REQUIRES(mu) {
    std::unique_lock<std::mutex> lock(mu->mu_, std::adopt_lock);
    const bool signalled = cv_.wait_for(lock, timeout) == std::cv_status::no_timeout;
    lock.release();
    return signalled;
  }
  void Signal() { cv_.notify_one(); }
  void SignalAll() { cv_.notify_all(); }

 private:
  std::condition_variable cv_;
};

}  // namespace kvstash
