#include "subprocess.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

namespace kvstash::testing {
namespace {

std::string TempPath(const char* tag) {
  const char* dir = std::getenv("TMPDIR");
  std::string path = std::string(dir ? dir : "/tmp") + "/kvstash_test_" + tag + "_XXXXXX";
  int fd = mkstemp(path.data());
  if (fd >= 0) close(fd);
  return path;
}

std::string Slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

}  // namespace

ProcessResult RunProcess(const std::vector<std::string>& argv, const std::string& input) {
  const std::string in_path = TempPath("in");
  const std::string out_path = TempPath("out");
  const std::string err_path = TempPath("err");
  std::ofstream(in_path) << input;
  ProcessResult result;
  pid_t pid = fork();
  if (pid == 0) {
    int in = open(in_path.c_str(), O_RDONLY);
    int out = open(out_path.c_str(), O_WRONLY | O_TRUNC);
    int err = open(err_path.c_str(), O_WRONLY | O_TRUNC);
    if (in < 0 || out < 0 || err < 0) _exit(126);
    dup2(in, 0);
    dup2(out, 1);
    dup2(err, 2);
    std::vector<char*> args;
    for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    execv(args[0], args.data());
    _exit(127);
  }
  int status = 0;
  if (pid > 0 && waitpid(pid, &status, 0) == pid) {
    result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }
  result.out = Slurp(out_path);
  result.err = Slurp(err_path);
  for (const std::string& p : {in_path, out_path, err_path}) std::remove(p.c_str());
  return result;
}

ChildProcess::ChildProcess(const std::vector<std::string>& argv) {
  int fds[2], in[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return;
  if (pipe2(in, O_CLOEXEC) != 0) {
    close(fds[0]);
    close(fds[1]);
    return;
  }
  pid_ = fork();
  if (pid_ == 0) {
    // Dies with the test: a test that crashes or times out leaves no daemon behind.
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    dup2(fds[1], 1);
    dup2(in[0], 0);
    std::vector<char*> args;
    for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    execv(args[0], args.data());
    _exit(127);
  }
  close(fds[1]);
  close(in[0]);
  out_fd_ = fds[0];
  in_fd_ = in[1];
  if (pid_ < 0) {
    close(out_fd_);
    close(in_fd_);
    out_fd_ = in_fd_ = -1;
  }
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

ChildProcess::~ChildProcess() {
  if (pid_ > 0 && status_ < 0) Kill(SIGKILL);
  if (out_fd_ >= 0) close(out_fd_);
  if (in_fd_ >= 0) close(in_fd_);
}

std::optional<std::string> ChildProcess::ReadLine(int timeout_ms) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  for (;;) {
    const size_t newline = buffer_.find('\n');
    if (newline != std::string::npos) {
      std::string line = buffer_.substr(0, newline);
      buffer_.erase(0, newline + 1);
      return line;
    }
    if (out_fd_ < 0) return std::nullopt;
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                          deadline - std::chrono::steady_clock::now())
                          .count();
    if (left <= 0) return std::nullopt;
    pollfd p{out_fd_, POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(left)) <= 0) continue;
    char chunk[4096];
    const ssize_t n = read(out_fd_, chunk, sizeof chunk);
    if (n <= 0) {
      close(out_fd_);
      out_fd_ = -1;
      continue;
    }
    buffer_.append(chunk, static_cast<size_t>(n));
  }
}

int ChildProcess::Kill(int signal) {
  if (pid_ > 0 && status_ < 0) kill(pid_, signal);
  return Wait();
}

int ChildProcess::Wait() {
  if (pid_ <= 0) return -1;
  if (status_ >= 0) return status_;
  int status = 0;
  while (waitpid(pid_, &status, 0) < 0) {
    if (errno != EINTR) return -1;
  }
  status_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return status_;
}

}  // namespace kvstash::testing
