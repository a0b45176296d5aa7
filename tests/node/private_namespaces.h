#pragma once

// A test process (and the programs it starts) in mount and IPC namespaces of its own: a test
// gives /dev/shm or an SSD directory a small tmpfs, and System V shared memory its own limits,
// without touching the host's. As root, or where unprivileged user namespaces are allowed
// (then as root of one); a test skips with the reason elsewhere.

#include <fcntl.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace kvstash::testing {

namespace internal {
inline bool WriteFile(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  out << text;
  out.flush();
  return static_cast<bool>(out);
}
}  // namespace internal

// Enters the namespaces, once per process; false with the reason in `why` where it may not.
// Call before the test starts threads (a user namespace needs a single-threaded process).
inline bool EnterPrivateNamespaces(std::string* why) {
  static int entered = -1;  // -1: not tried; 0: failed; 1: in
  static std::string reason;
  if (entered < 0) {
    entered = 0;
    const uid_t uid = ::geteuid();
    const gid_t gid = ::getegid();
    if (::unshare(CLONE_NEWNS | CLONE_NEWIPC) != 0) {
      if (::unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWIPC) != 0) {
        reason = std::string("cannot create mount and IPC namespaces: ") + std::strerror(errno);
      } else if (!internal::WriteFile("/proc/self/setgroups", "deny") ||
                 !internal::WriteFile("/proc/self/uid_map", "0 " + std::to_string(uid) + " 1") ||
                 !internal::WriteFile("/proc/self/gid_map", "0 " + std::to_string(gid) + " 1")) {
        reason = "cannot map this user into a user namespace";
      }
    }
    if (reason.empty() && ::mount("none", "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) {
      reason = std::string("cannot make mounts private: ") + std::strerror(errno);
    }
    if (reason.empty()) entered = 1;
  }
  if (entered == 0) *why = reason;
  return entered == 1;
}

// Mounts a fresh tmpfs of `bytes` at `dir` (over what is there) in this process's namespace.
inline bool MountTmpfs(const std::string& dir, uint64_t bytes, std::string* why) {
  const std::string options = "size=" + std::to_string(bytes) + ",mode=1777";
  if (::mount("tmpfs", dir.c_str(), "tmpfs", 0, options.c_str()) != 0) {
    *why = "cannot mount a tmpfs on " + dir + ": " + std::strerror(errno);
    return false;
  }
  return true;
}

// The largest System V segment in this IPC namespace (kernel.shmmax).
inline bool SetShmmax(uint64_t bytes, std::string* why) {
  if (!internal::WriteFile("/proc/sys/kernel/shmmax", std::to_string(bytes))) {
    *why = "cannot set kernel.shmmax in a private IPC namespace";
    return false;
  }
  return true;
}

// Bytes in use on the file system of `dir`.
inline uint64_t UsedBytes(const std::string& dir) {
  struct statvfs fs {};
  if (::statvfs(dir.c_str(), &fs) != 0) return 0;
  return static_cast<uint64_t>(fs.f_blocks - fs.f_bfree) * fs.f_frsize;
}

// Every file and directory under `dir`, as paths.
inline std::vector<std::string> EntriesUnder(const std::string& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  for (auto it = std::filesystem::recursive_directory_iterator(dir, ec);
       !ec && it != std::filesystem::recursive_directory_iterator(); it.increment(ec)) {
    out.push_back(it->path().string());
  }
  return out;
}

}  // namespace kvstash::testing
