#pragma once

// What this machine can give the CPU tier, read before anything is allocated.
//
// The tier is allocated through UCX (shared with local clients): UCX 1.13 tries a System V
// segment first (lazy: pages come as they are touched) and else its posix allocator, which
// writes the whole length into a file under UCX_POSIX_DIR before it maps it. A tier larger than
// the machine's memory fails the System V segment (the kernel's overcommit check), so the posix
// allocator fills /dev/shm, then RAM, before it fails; and one that fits the segment but not
// the memory is faulted in behind the node's start until the kernel kills something. Hence
// the node compares the tier with MemAvailable, with what the allocator UCX will take can
// hold, and with RLIMIT_MEMLOCK where registering it pins it, and refuses at start.

#include <cstdint>
#include <optional>
#include <string>

#include "kvstash/common/status.h"

namespace kvstash::node {

// The limits that bound a CPU tier, as read from the machine.
struct HostMemory {
  uint64_t available_bytes = 0;  // MemAvailable, or less under strict overcommit (mode 2)
  std::string available_source;  // where available_bytes comes from, for messages
  std::string shm_dir;           // where the posix allocator writes
  uint64_t shm_dir_free_bytes = 0;
  uint64_t sysv_max_segment_bytes = 0;  // kernel.shmmax
  uint64_t sysv_free_bytes = 0;         // (kernel.shmall - pages in use) in bytes
  // RLIMIT_MEMLOCK where registering memory pins it (an InfiniBand device UCX may use, and no
  // CAP_IPC_LOCK); nullopt where it does not apply.
  std::optional<uint64_t> memlock_bytes;
};

// Reads the limits for a tier whose posix files go to `shm_dir` (no free space there when it
// cannot be read), served over UCX transports `tls` (as --tls; empty: UCX_TLS or UCX's choice).
// Unavailable when /proc/meminfo cannot be read.
Result<HostMemory> ReadHostMemory(const std::string& shm_dir, const std::string& tls);

// OK when a tier of `cpu_bytes` fits `host`; else InvalidArgument naming both sizes and the
// limit that refuses it.
Status CheckCpuTierFits(uint64_t cpu_bytes, const HostMemory& host);

}  // namespace kvstash::node
