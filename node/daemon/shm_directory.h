#pragma once

// The directory where a node's UCX posix allocator creates its shared-memory files.
//
// UCX 1.13 (uct_posix_mem_alloc) creates ucx_shm_posix_<random>, writes its whole length and
// only then unlinks it; a node killed meanwhile (the fill of a large CPU tier takes seconds)
// leaves a file that holds its memory until someone removes it, and in /dev/shm nothing says
// whose it is. So each node makes a directory of its own, <base>/kvstashd-<uid>/node-<pid>-XXXXXX,
// and holds an flock on it while it lives: the kernel drops the lock when the process dies,
// however it dies. A node starting finds the directories whose lock is free and removes them
// with their files. A lock file in kvstashd-<uid> is held while a node scans and while it makes
// its own directory, so no node sees another's directory before it is locked.
//
// Why not the file names: UCX chooses them (random ids); its setting is the directory only.
// Why per user: /dev/shm is shared by every user, so the parent must belong to this one (0700,
// checked, never followed through a link).

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "kvstash/common/status.h"

namespace kvstash::node {

// Owns the node's directory and its lock; the destructor removes the directory (and any file
// left in it). Not thread-safe, except RemoveNow, which may run on another thread while the
// owner is blocked in a start-up step.
class ShmDirectory {
 public:
  // Under `base` (a tmpfs such as /dev/shm): removes what dead nodes left, then makes and locks
  // this node's directory. FailedPrecondition when kvstashd-<uid> exists and is not a private
  // directory of this user; Unavailable (naming the path) when it cannot be made.
  static Result<std::unique_ptr<ShmDirectory>> Create(const std::string& base);
  ~ShmDirectory();
  ShmDirectory(const ShmDirectory&) = delete;
  ShmDirectory& operator=(const ShmDirectory&) = delete;

  const std::string& path() const { return path_; }
  // Removes the directory and its files now (a start-up abandoned at a signal), and
  // kvstashd-<uid> when no other node uses it. Idempotent.
  void RemoveNow();

  // What Create removed of dead nodes: files, and the bytes they held.
  size_t stale_files() const { return stale_files_; }
  uint64_t stale_bytes() const { return stale_bytes_; }

 private:
  ShmDirectory() = default;

  std::mutex mu_;     // RemoveNow and the destructor
  std::string root_;  // kvstashd-<uid>
  std::string path_;
  int fd_ = -1;  // the directory, locked; -1 once removed
  size_t stale_files_ = 0;
  uint64_t stale_bytes_ = 0;
};

}  // namespace kvstash::node
