#include "memory_check.h"

#include <sys/resource.h>
#include <sys/shm.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

namespace kvstash::node {
namespace {

// "64 GiB" for a whole number of its largest unit, else "22.5 GiB (24159191040 bytes)": limits
// read from the machine are rarely whole units.
std::string Size(uint64_t bytes) {
  constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  size_t unit = 0;
  uint64_t scale = 1;
  while (unit + 1 < std::size(kUnits) && bytes / scale >= 1024) {
    scale *= 1024;
    ++unit;
  }
  if (bytes % scale == 0) return fmt::format("{} {}", bytes / scale, kUnits[unit]);
  return fmt::format("{:.1f} {} ({} bytes)",
                     static_cast<double>(bytes) / static_cast<double>(scale), kUnits[unit], bytes);
}

// The first number of a /proc file; nullopt when it cannot be read.
std::optional<uint64_t> ReadNumber(const char* path) {
  std::ifstream in(path);
  uint64_t value = 0;
  if (!(in >> value)) return std::nullopt;
  return value;
}

// /proc/meminfo's fields in bytes (its values are in kB).
std::map<std::string, uint64_t> ReadMeminfo() {
  std::map<std::string, uint64_t> fields;
  std::ifstream in("/proc/meminfo");
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream words(line);
    std::string name;
    uint64_t kib = 0;
    if (words >> name >> kib && !name.empty() && name.back() == ':') {
      name.pop_back();
      fields[name] = kib * 1024;
    }
  }
  return fields;
}

bool HasIpcLockCapability() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("CapEff:", 0) != 0) continue;
    const uint64_t caps = std::strtoull(line.c_str() + 7, nullptr, 16);
    constexpr int kCapIpcLock = 14;
    return (caps >> kCapIpcLock) & 1;
  }
  return false;
}

// Whether UCX may register the tier with an InfiniBand device, which pins it (RLIMIT_MEMLOCK).
bool MayUseInfiniband(const std::string& tls) {
  std::error_code ec;
  std::filesystem::directory_iterator devices("/sys/class/infiniband", ec);
  if (ec || devices == std::filesystem::directory_iterator()) return false;
  std::string chosen = tls;
  if (chosen.empty()) {
    const char* env = std::getenv("UCX_TLS");
    chosen = env != nullptr ? env : "";
  }
  if (chosen.empty() || chosen[0] == '^') return true;  // UCX's choice, or all but some
  std::istringstream names(chosen);
  for (std::string name; std::getline(names, name, ',');) {
    if (name == "all" || name == "ib" || name.rfind("rc", 0) == 0 || name.rfind("ud", 0) == 0 ||
        name.rfind("dc", 0) == 0) {
      return true;
    }
  }
  return false;
}

}  // namespace

Result<HostMemory> ReadHostMemory(const std::string& shm_dir, const std::string& tls) {
  HostMemory host;
  const std::map<std::string, uint64_t> meminfo = ReadMeminfo();
  const auto available = meminfo.find("MemAvailable");
  if (available == meminfo.end()) {
    return UnavailableError("cannot read MemAvailable from /proc/meminfo");
  }
  host.available_bytes = available->second;
  host.available_source = "MemAvailable in /proc/meminfo";
  // Strict overcommit: an allocation past the commit limit fails whatever is free.
  if (ReadNumber("/proc/sys/vm/overcommit_memory") == 2u) {
    const auto limit = meminfo.find("CommitLimit");
    const auto committed = meminfo.find("Committed_AS");
    if (limit != meminfo.end() && committed != meminfo.end()) {
      const uint64_t room =
          limit->second > committed->second ? limit->second - committed->second : 0;
      if (room < host.available_bytes) {
        host.available_bytes = room;
        host.available_source = "CommitLimit - Committed_AS in /proc/meminfo, overcommit mode 2";
      }
    }
  }

  // A directory that cannot be read holds nothing: UCX's posix allocator cannot write there.
  struct statvfs fs {};
  host.shm_dir = shm_dir;
  host.shm_dir_free_bytes =
      ::statvfs(shm_dir.c_str(), &fs) == 0 ? static_cast<uint64_t>(fs.f_bavail) * fs.f_frsize : 0;

  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  host.sysv_max_segment_bytes = ReadNumber("/proc/sys/kernel/shmmax").value_or(0);
  const uint64_t shmall_pages = ReadNumber("/proc/sys/kernel/shmall").value_or(0);
  shm_info info{};
  const uint64_t used_pages =
      ::shmctl(0, SHM_INFO, reinterpret_cast<shmid_ds*>(&info)) >= 0 ? info.shm_tot : 0;
  const uint64_t free_pages = shmall_pages > used_pages ? shmall_pages - used_pages : 0;
  // shmall is often near 2^64 pages: saturate instead of overflowing into a small number.
  host.sysv_free_bytes = free_pages > UINT64_MAX / page ? UINT64_MAX : free_pages * page;

  rlimit memlock{};
  if (::getrlimit(RLIMIT_MEMLOCK, &memlock) == 0 && memlock.rlim_cur != RLIM_INFINITY &&
      !HasIpcLockCapability() && MayUseInfiniband(tls)) {
    host.memlock_bytes = memlock.rlim_cur;
  }
  return host;
}

Status CheckCpuTierFits(uint64_t cpu_bytes, const HostMemory& host) {
  if (cpu_bytes > host.available_bytes) {
    return InvalidArgumentError(
        "cpu-bytes: {} is more than this machine can give: {} of memory available ({})",
        Size(cpu_bytes), Size(host.available_bytes), host.available_source);
  }
  if (host.memlock_bytes && cpu_bytes > *host.memlock_bytes) {
    return InvalidArgumentError(
        "cpu-bytes: {} is more than the {} this process may lock (RLIMIT_MEMLOCK, ulimit -l), "
        "which registering it with an InfiniBand device needs: raise the limit, or serve "
        "without IB transports (--tls)",
        Size(cpu_bytes), Size(*host.memlock_bytes));
  }
  // UCX takes a System V segment where one can hold the tier, else the posix allocator's file.
  const bool sysv_fits =
      cpu_bytes <= host.sysv_max_segment_bytes && cpu_bytes <= host.sysv_free_bytes;
  if (!sysv_fits && cpu_bytes > host.shm_dir_free_bytes) {
    return InvalidArgumentError(
        "cpu-bytes: {} does not fit in shared memory: {} free in {}, and a System V segment "
        "holds at most {} (kernel.shmmax, kernel.shmall)",
        Size(cpu_bytes), Size(host.shm_dir_free_bytes), host.shm_dir,
        Size(std::min(host.sysv_max_segment_bytes, host.sysv_free_bytes)));
  }
  return Status::OK();
}

}  // namespace kvstash::node
