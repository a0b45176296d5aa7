#include "kvstash/common/subprocess.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <thread>

extern char** environ;

namespace kvstash {
namespace {

using Clock = std::chrono::steady_clock;

int StatusOf(int wstatus) {
  return WIFEXITED(wstatus) ? WEXITSTATUS(wstatus) : 128 + WTERMSIG(wstatus);
}

void CloseAll(std::initializer_list<int> fds) {
  for (int fd : fds) {
    if (fd >= 0) close(fd);
  }
}

// What the child's standard streams become: a descriptor each (-1: /dev/null for stdin,
// inherited for stdout and stderr).
struct Streams {
  int in = -1;
  int out = -1;
  int err = -1;
};

// Forks and execs `argv` with `streams`. Only async-signal-safe calls run in the child; an exec
// that fails reports its errno through a close-on-exec pipe, so the caller learns it here.
Result<pid_t> Spawn(const std::vector<std::string>& argv, const std::vector<std::string>& env,
                    const Streams& streams) {
  if (argv.empty()) return InvalidArgumentError("no program to run");
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  std::vector<char*> envp;
  for (const std::string& e : env) envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);
  char** const child_env = env.empty() ? environ : envp.data();
  const bool search = argv[0].find('/') == std::string::npos;
  int status_pipe[2];
  if (pipe2(status_pipe, O_CLOEXEC) != 0) return FromErrno(errno, "pipe");
  const pid_t pid = fork();
  if (pid < 0) {
    const int e = errno;
    CloseAll({status_pipe[0], status_pipe[1]});
    return FromErrno(e, fmt::format("fork for {}", argv[0]));
  }
  if (pid == 0) {
    // The child dies with its parent: a crashed test or tool leaves nothing running.
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    const int in = streams.in >= 0 ? streams.in : open("/dev/null", O_RDONLY);
    if (in >= 0) dup2(in, 0);
    if (streams.out >= 0) dup2(streams.out, 1);
    if (streams.err >= 0) dup2(streams.err, 2);
    if (search) {
      execvpe(args[0], args.data(), child_env);
    } else {
      execve(args[0], args.data(), child_env);
    }
    const int e = errno;
    (void)!write(status_pipe[1], &e, sizeof e);
    _exit(127);
  }
  close(status_pipe[1]);
  int exec_errno = 0;
  ssize_t n;
  do {
    n = read(status_pipe[0], &exec_errno, sizeof exec_errno);
  } while (n < 0 && errno == EINTR);
  close(status_pipe[0]);
  if (n == static_cast<ssize_t>(sizeof exec_errno)) {
    int ignored = 0;
    waitpid(pid, &ignored, 0);
    if (exec_errno == ENOENT) {
      return NotFoundError("{} is not installed (not found{})", argv[0], search ? " on PATH" : "");
    }
    return FromErrno(exec_errno, fmt::format("cannot run {}", argv[0]));
  }
  return pid;
}

// A memory file holding `bytes`, read from the start.
Result<int> MemoryFileWith(std::string_view bytes) {
  const int fd = memfd_create("kvstash-input", MFD_CLOEXEC);
  if (fd < 0) return FromErrno(errno, "memfd_create");
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int e = errno;
      close(fd);
      return FromErrno(e, "writing a program's input");
    }
    done += static_cast<size_t>(n);
  }
  lseek(fd, 0, SEEK_SET);
  return fd;
}

}  // namespace

Result<ProcessOutput> RunProgram(const std::vector<std::string>& argv, const RunOptions& options) {
  Streams streams;
  if (!options.input.empty()) {
    KVSTASH_ASSIGN_OR_RETURN(streams.in, MemoryFileWith(options.input));
  }
  int out_pipe[2] = {-1, -1};
  int err_pipe[2] = {-1, -1};
  if (pipe2(out_pipe, O_CLOEXEC) != 0 || pipe2(err_pipe, O_CLOEXEC) != 0) {
    const int e = errno;
    CloseAll({streams.in, out_pipe[0], out_pipe[1], err_pipe[0], err_pipe[1]});
    return FromErrno(e, "pipe");
  }
  streams.out = out_pipe[1];
  streams.err = err_pipe[1];
  Result<pid_t> spawned = Spawn(argv, options.env, streams);
  CloseAll({streams.in, out_pipe[1], err_pipe[1]});
  if (!spawned.ok()) {
    CloseAll({out_pipe[0], err_pipe[0]});
    return spawned.status();
  }
  const pid_t pid = *spawned;

  // Both pipes at once: a child blocked on a full stderr pipe would never finish its stdout.
  const bool bounded = options.timeout.count() > 0;
  const Clock::time_point deadline = Clock::now() + options.timeout;
  bool timed_out = false;
  ProcessOutput result;
  pollfd fds[2] = {{out_pipe[0], POLLIN, 0}, {err_pipe[0], POLLIN, 0}};
  std::string* sinks[2] = {&result.out, &result.err};
  int open_fds = 2;
  char buf[65536];
  while (open_fds > 0) {
    int wait_ms = -1;
    if (bounded) {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      if (left <= 0) {
        timed_out = true;
        break;
      }
      wait_ms = static_cast<int>(std::min<int64_t>(left, std::numeric_limits<int>::max()));
    }
    const int ready = poll(fds, 2, wait_ms);
    if (ready < 0) {
      if (errno == EINTR) continue;
      break;
    }
    for (int i = 0; i < 2; ++i) {
      if (fds[i].fd < 0 || fds[i].revents == 0) continue;
      const ssize_t n = read(fds[i].fd, buf, sizeof(buf));
      if (n > 0) {
        sinks[i]->append(buf, static_cast<size_t>(n));
      } else if (n == 0 || errno != EINTR) {
        close(fds[i].fd);
        fds[i].fd = -1;
        --open_fds;
      }
    }
  }
  for (pollfd& p : fds) {
    if (p.fd >= 0) close(p.fd);
  }
  if (timed_out) kill(pid, SIGKILL);
  int wstatus = 0;
  while (waitpid(pid, &wstatus, 0) < 0) {
    if (errno != EINTR) return FromErrno(errno, fmt::format("waitpid for {}", argv[0]));
  }
  if (timed_out) {
    return DeadlineExceededError("{} did not finish within {} ms", argv[0],
                                 options.timeout.count());
  }
  result.exit_code = StatusOf(wstatus);
  return result;
}

std::vector<std::string> EnvironmentWith(std::string_view name, std::string_view value) {
  std::vector<std::string> env;
  const std::string prefix = fmt::format("{}=", name);
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    const std::string_view entry(*e);
    if (entry.substr(0, prefix.size()) != prefix) env.emplace_back(entry);
  }
  env.push_back(prefix + std::string(value));
  return env;
}

int ReapChild(pid_t pid, std::chrono::milliseconds timeout) {
  const Clock::time_point deadline = Clock::now() + timeout;
  int wstatus = 0;
  for (;;) {
    const pid_t done = waitpid(pid, &wstatus, WNOHANG);
    if (done == pid) break;
    if (done < 0 && errno != EINTR) return -1;
    if (Clock::now() >= deadline) {
      kill(pid, SIGKILL);
      while (waitpid(pid, &wstatus, 0) < 0) {
        if (errno != EINTR) return -1;
      }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return StatusOf(wstatus);
}

Result<std::unique_ptr<ChildProcess>> ChildProcess::Create(const std::vector<std::string>& argv,
                                                           const ChildOptions& options) {
  std::unique_ptr<ChildProcess> child(new ChildProcess());
  int in[2];
  if (pipe2(in, O_CLOEXEC) != 0) return FromErrno(errno, "pipe");
  int out[2] = {-1, -1};
  if (options.output == ChildOptions::Output::kMemory) {
    out[0] = memfd_create("kvstash-child-output", MFD_CLOEXEC);
    if (out[0] < 0) {
      const int e = errno;
      CloseAll({in[0], in[1]});
      return FromErrno(e, "memfd_create");
    }
    out[1] = out[0];
    child->memory_ = true;
  } else if (pipe2(out, O_CLOEXEC) != 0) {
    const int e = errno;
    CloseAll({in[0], in[1]});
    return FromErrno(e, "pipe");
  }
  Streams streams;
  streams.in = in[0];
  streams.out = out[1];
  if (options.merge_stderr) streams.err = out[1];
  Result<pid_t> spawned = Spawn(argv, options.env, streams);
  close(in[0]);
  if (!child->memory_) close(out[1]);
  child->in_fd_ = in[1];
  child->out_fd_ = out[0];
  if (!spawned.ok()) return spawned.status();  // the destructor closes the descriptors
  child->pid_ = *spawned;
  return child;
}

ChildProcess::~ChildProcess() {
  if (pid_ > 0 && status_ < 0) Kill(SIGKILL);
  CloseAll({out_fd_, in_fd_});
}

bool ChildProcess::WriteLine(const std::string& line) {
  if (in_fd_ < 0) return false;
  const std::string data = line + "\n";
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = write(in_fd_, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    done += static_cast<size_t>(n);
  }
  return true;
}

std::optional<std::string> ChildProcess::ReadLine(int timeout_ms) {
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  for (;;) {
    const size_t newline = buffer_.find('\n');
    if (newline != std::string::npos) {
      std::string line = buffer_.substr(0, newline);
      buffer_.erase(0, newline + 1);
      return line;
    }
    if (out_fd_ < 0 || memory_) return std::nullopt;
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) return std::nullopt;
    pollfd p{out_fd_, POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(left)) <= 0) continue;
    char chunk[4096];
    const ssize_t n = read(out_fd_, chunk, sizeof chunk);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      close(out_fd_);
      out_fd_ = -1;
      continue;
    }
    buffer_.append(chunk, static_cast<size_t>(n));
  }
}

std::string ChildProcess::Output() const {
  std::string text;
  if (!memory_ || out_fd_ < 0) return text;
  char buf[4096];
  off_t offset = 0;
  for (;;) {
    const ssize_t n = pread(out_fd_, buf, sizeof(buf), offset);
    if (n <= 0) break;
    text.append(buf, static_cast<size_t>(n));
    offset += n;
  }
  return text;
}

bool ChildProcess::Exited() {
  if (pid_ <= 0 || status_ >= 0) return true;
  int wstatus = 0;
  if (waitpid(pid_, &wstatus, WNOHANG) == pid_) {
    status_ = StatusOf(wstatus);
    return true;
  }
  return false;
}

int ChildProcess::Kill(int signal) {
  if (pid_ > 0 && status_ < 0) kill(pid_, signal);
  return Wait();
}

int ChildProcess::Wait() {
  if (pid_ <= 0) return -1;
  if (status_ >= 0) return status_;
  int wstatus = 0;
  while (waitpid(pid_, &wstatus, 0) < 0) {
    if (errno != EINTR) return -1;
  }
  status_ = StatusOf(wstatus);
  return status_;
}

int ChildProcess::Wait(std::chrono::milliseconds timeout) {
  if (pid_ <= 0) return -1;
  if (status_ >= 0) return status_;
  status_ = ReapChild(pid_, timeout);
  return status_;
}

}  // namespace kvstash
