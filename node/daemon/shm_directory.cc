#include "shm_directory.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "kvstash/common/logging.h"

namespace kvstash::node {
namespace {

constexpr std::string_view kNodePrefix = "node-";

// Closes a descriptor on every path out of a function.
class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  Fd& operator=(Fd&& other) noexcept {
    if (fd_ >= 0) ::close(fd_);
    fd_ = other.release();
    return *this;
  }
  int get() const { return fd_; }
  int release() { return std::exchange(fd_, -1); }

 private:
  int fd_;
};

// Unlinks every entry of the directory `dir_fd` but subdirectories (UCX makes none); the files
// and the bytes they held.
std::pair<size_t, uint64_t> RemoveFiles(int dir_fd) {
  size_t files = 0;
  uint64_t bytes = 0;
  // fdopendir takes the descriptor it is given; the caller keeps its own (and its lock).
  const int copy = ::dup(dir_fd);
  if (copy < 0) return {0, 0};
  DIR* dir = ::fdopendir(copy);
  if (dir == nullptr) {
    ::close(copy);
    return {0, 0};
  }
  std::vector<std::string> names;
  while (const dirent* entry = ::readdir(dir)) {
    const std::string_view name = entry->d_name;
    if (name != "." && name != "..") names.emplace_back(name);
  }
  ::closedir(dir);
  for (const std::string& name : names) {
    struct stat st {};
    if (::fstatat(dir_fd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0 || S_ISDIR(st.st_mode)) {
      continue;
    }
    if (::unlinkat(dir_fd, name.c_str(), 0) == 0) {
      ++files;
      bytes += static_cast<uint64_t>(st.st_blocks) * 512;
    }
  }
  return {files, bytes};
}

// Takes `fd`'s lock within about two seconds (another node holds it only while it scans).
bool LockWithin(int fd, std::chrono::milliseconds limit) {
  const auto give_up = std::chrono::steady_clock::now() + limit;
  while (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    if (errno != EWOULDBLOCK && errno != EINTR) return false;
    if (std::chrono::steady_clock::now() > give_up) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

// Opens kvstashd-<uid> under `base` (made if missing) and takes its lock file's lock. The last
// node to leave removes both (Leave), so a lock taken on a file that is gone by then is dropped
// and taken again.
Status OpenRoot(const std::string& root, Fd* root_fd, Fd* lock) {
  const uid_t uid = ::geteuid();
  for (int attempt = 0; attempt < 10; ++attempt) {
    if (::mkdir(root.c_str(), 0700) != 0 && errno != EEXIST) {
      return UnavailableError("shm-dir: cannot create {}: {}", root, std::strerror(errno));
    }
    // /dev/shm is writable by everyone: the directory must be ours and private, never a link.
    Fd dir(::open(root.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
    if (dir.get() < 0) {
      if (errno == ENOENT) continue;
      return FailedPreconditionError("shm-dir: cannot open {} as a directory: {}", root,
                                     std::strerror(errno));
    }
    struct stat st {};
    if (::fstat(dir.get(), &st) != 0 || st.st_uid != uid || (st.st_mode & 077) != 0) {
      return FailedPreconditionError(
          "shm-dir: {} is not a private directory of user {} (owner {}, mode {:o}); remove it "
          "or choose another --shm-dir",
          root, uid, st.st_uid, st.st_mode & 07777);
    }
    Fd file(::openat(dir.get(), "lock", O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600));
    if (file.get() < 0) {
      if (errno == ENOENT) continue;  // the directory went meanwhile
      return UnavailableError("shm-dir: cannot open {}/lock: {}", root, std::strerror(errno));
    }
    if (!LockWithin(file.get(), std::chrono::milliseconds(2000))) {
      return UnavailableError("shm-dir: cannot lock {}/lock: {}", root, std::strerror(errno));
    }
    struct stat locked {};
    if (::fstat(file.get(), &locked) == 0 && locked.st_nlink > 0) {
      *root_fd = std::move(dir);
      *lock = std::move(file);
      return Status::OK();
    }
  }
  return UnavailableError("shm-dir: {} keeps disappearing", root);
}

}  // namespace

Result<std::unique_ptr<ShmDirectory>> ShmDirectory::Create(const std::string& base) {
  const std::string root = fmt::format("{}/kvstashd-{}", base, ::geteuid());
  Fd root_fd(-1);
  Fd lock(-1);
  KVSTASH_RETURN_IF_ERROR(OpenRoot(root, &root_fd, &lock));

  auto self = std::unique_ptr<ShmDirectory>(new ShmDirectory());
  // The directories of nodes that are gone: their lock is free.
  {
    std::vector<std::string> stale;
    const int copy = ::dup(root_fd.get());
    DIR* dir = copy < 0 ? nullptr : ::fdopendir(copy);
    if (dir == nullptr && copy >= 0) ::close(copy);
    while (dir != nullptr) {
      const dirent* entry = ::readdir(dir);
      if (entry == nullptr) break;
      const std::string_view name = entry->d_name;
      if (name.substr(0, kNodePrefix.size()) == kNodePrefix) stale.emplace_back(name);
    }
    if (dir != nullptr) ::closedir(dir);
    for (const std::string& name : stale) {
      Fd node(
          ::openat(root_fd.get(), name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
      if (node.get() < 0 || ::flock(node.get(), LOCK_EX | LOCK_NB) != 0) continue;  // alive
      const auto [files, bytes] = RemoveFiles(node.get());
      self->stale_files_ += files;
      self->stale_bytes_ += bytes;
      if (::unlinkat(root_fd.get(), name.c_str(), AT_REMOVEDIR) != 0) {
        KVSTASH_LOG_WARN("shm-dir: cannot remove {}/{}: {}", root, name, std::strerror(errno));
      }
    }
  }

  std::string path = fmt::format("{}/{}{}-XXXXXX", root, kNodePrefix, ::getpid());
  if (::mkdtemp(path.data()) == nullptr) {
    return UnavailableError("shm-dir: cannot create a directory in {}: {}", root,
                            std::strerror(errno));
  }
  Fd own(::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (own.get() < 0 || ::flock(own.get(), LOCK_EX | LOCK_NB) != 0) {
    const int error = errno;
    ::rmdir(path.c_str());
    return UnavailableError("shm-dir: cannot lock {}: {}", path, std::strerror(error));
  }
  self->root_ = root;
  self->path_ = std::move(path);
  self->fd_ = own.release();
  return self;  // `lock` is released here: the new directory is locked before others scan
}

void ShmDirectory::RemoveNow() {
  std::lock_guard<std::mutex> lock(mu_);
  if (fd_ < 0) return;
  RemoveFiles(fd_);
  if (::rmdir(path_.c_str()) != 0) {
    KVSTASH_LOG_WARN("shm-dir: cannot remove {}: {}", path_, std::strerror(errno));
  }
  ::close(std::exchange(fd_, -1));
  // The last node out removes kvstashd-<uid> too, so a host without nodes has nothing there. A
  // node opening it meanwhile waits for the lock, sees its file unlinked, and makes it anew.
  Fd root_fd(-1);
  Fd root_lock(-1);
  if (!OpenRoot(root_, &root_fd, &root_lock).ok()) return;
  const int copy = ::dup(root_fd.get());
  DIR* dir = copy < 0 ? nullptr : ::fdopendir(copy);
  if (dir == nullptr) {
    if (copy >= 0) ::close(copy);
    return;
  }
  bool empty = true;
  while (const dirent* entry = ::readdir(dir)) {
    const std::string_view name = entry->d_name;
    if (name != "." && name != ".." && name != "lock") empty = false;
  }
  ::closedir(dir);
  if (empty && ::unlinkat(root_fd.get(), "lock", 0) == 0) ::rmdir(root_.c_str());
}

ShmDirectory::~ShmDirectory() { RemoveNow(); }

}  // namespace kvstash::node
