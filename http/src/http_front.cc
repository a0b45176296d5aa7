#include "kvstash/http/http_front.h"

#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "kvstash/common/logging.h"
#include "kvstash/common/mutex.h"

namespace kvstash::http {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// How often the I/O thread looks for connections past their deadline.
constexpr milliseconds kScanInterval{50};
// The longest and shortest pause of accepting after it ran out of descriptors or memory.
constexpr milliseconds kFirstBackoff{10};
constexpr milliseconds kLastBackoff{1000};
constexpr size_t kReadChunk = 16384;

// One client connection: its socket and what has been read from it. Owned by one of the I/O
// thread (reading a request's head, or idle between requests), a lane's queue, or the lane
// thread serving its request; it moves between them with its unique_ptr, and only the owner
// touches it.
struct Connection {
  explicit Connection(int socket) : fd(socket) {}
  const int fd;
  std::string in;       // bytes read: the head of the request being served, and maybe more
  size_t used = 0;      // of `in`, consumed by the request being served
  size_t scanned = 0;   // of `in`, searched for the end of the head
  bool started = true;  // a byte of its next request has come (a new one: its first is due)
  bool waiting_writable = false;  // its head is in; it waits for room for the answer
  Clock::time_point deadline;     // when the I/O thread gives up on it
  Lane lane = Lane::kRequests;
  size_t served = 0;      // requests answered on it
  uint64_t accepted = 0;  // its place in the accept order
  // The serving thread's, for its request.
  std::atomic<bool> answering{false};  // read by Shutdown
  Clock::time_point read_deadline;
  bool close = false;  // its answer says Connection: close
  bool read_timed_out = false;
};

// The connection whose request this thread serves (a lane thread inside process_request).
thread_local Connection* current = nullptr;

// An answer that ends its connection before the request's body was read (a 413): the client may
// still be sending that body, and closing a socket with unread bytes resets the connection, which
// can make the client lose the answer it has not read yet (and, writing on, die of SIGPIPE). So
// the front stops writing and drops what still comes for a moment before it closes, as HTTP
// servers' "lingering close" does: at most kLingerTime and kLingerBytes, on the lane's thread.
constexpr std::chrono::milliseconds kLingerTime{200};
constexpr size_t kLingerBytes = size_t{1} << 20;

void Linger(int fd) {
  ::shutdown(fd, SHUT_WR);
  const Clock::time_point until = Clock::now() + kLingerTime;
  char dropped[16384];
  for (size_t total = 0; total < kLingerBytes;) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(until - Clock::now()).count();
    pollfd readable{fd, POLLIN, 0};
    if (left <= 0 || ::poll(&readable, 1, static_cast<int>(left)) <= 0) return;
    const ssize_t n = ::recv(fd, dropped, sizeof(dropped), MSG_DONTWAIT);
    if (n <= 0) return;  // the client finished (0) or reset
    total += static_cast<size_t>(n);
  }
}

bool IEquals(std::string_view a, std::string_view b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
           return std::tolower(static_cast<unsigned char>(x)) ==
                  std::tolower(static_cast<unsigned char>(y));
         });
}

std::string_view Trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

// What the I/O thread needs of a request's head to pick its lane; httplib parses it for real.
struct Head {
  std::string_view method;
  std::string_view path;
  bool has_body = false;  // a body, or anything that makes httplib write before the answer
};

std::optional<Head> ParseHead(std::string_view head) {
  size_t eol = head.find("\r\n");
  const std::string_view line = head.substr(0, eol);
  const size_t sp1 = line.find(' ');
  const size_t sp2 = sp1 == std::string_view::npos ? sp1 : line.find(' ', sp1 + 1);
  if (sp2 == std::string_view::npos) return std::nullopt;
  Head h;
  h.method = line.substr(0, sp1);
  const std::string_view target = line.substr(sp1 + 1, sp2 - sp1 - 1);
  h.path = target.substr(0, target.find_first_of("?#"));
  while (eol != std::string_view::npos) {
    const size_t start = eol + 2;
    eol = head.find("\r\n", start);
    const std::string_view field = head.substr(start, eol - start);
    const size_t colon = field.find(':');
    if (colon == std::string_view::npos) continue;
    const std::string_view name = Trim(field.substr(0, colon));
    const std::string_view value = Trim(field.substr(colon + 1));
    if ((IEquals(name, "Content-Length") && value != "0") || IEquals(name, "Transfer-Encoding") ||
        IEquals(name, "Expect")) {
      h.has_body = true;
    }
  }
  return h;
}

// Waits until `fd` is ready for `events` or `deadline` passes: 1 ready (or failed: the next
// read or write says how), 0 timed out, -1 on a poll error.
int PollUntil(int fd, short events, Clock::time_point deadline) {
  for (;;) {
    const auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now()).count() + 1;
    pollfd p{fd, events, 0};
    const int n = ::poll(&p, 1, static_cast<int>(std::clamp<int64_t>(left, 0, 60000)));
    if (n > 0) return 1;
    if (n < 0 && errno != EINTR) return -1;
    if (n == 0 && Clock::now() >= deadline) return 0;
  }
}

std::string Reason(int status) {
  switch (status) {
    case 408:
      return "Request Timeout";
    case 431:
      return "Request Header Fields Too Large";
    default:
      return "Error";
  }
}

// httplib's request parsing, routing and answering, run on a stream the front gives it.
class Router final : public httplib::Server {
 public:
  using httplib::Server::process_request;
  // httplib ends a streamed answer early once its own listening socket is gone (it never
  // opened one here): it is the front's, which closes connections itself.
  void SetListening(int fd) { svr_sock_ = fd; }
};

// A request's connection as httplib reads and writes it: first what the I/O thread read of
// it, then the socket, each read within the request's read deadline and each write within the
// write timeout.
class ConnectionStream final : public httplib::Stream {
 public:
  ConnectionStream(Connection& c, milliseconds write_timeout)
      : c_(c), write_timeout_(write_timeout) {}

  bool is_readable() const override {
    return c_.used < c_.in.size() || PollUntil(c_.fd, POLLIN, c_.read_deadline) > 0;
  }
  bool is_writable() const override {
    return PollUntil(c_.fd, POLLOUT, Clock::now() + write_timeout_) > 0;
  }

  ssize_t read(char* ptr, size_t size) override {
    if (c_.used == c_.in.size()) {
      c_.in.clear();
      c_.used = 0;
      if (size >= kReadChunk) return Receive(ptr, size);
      // Small reads (httplib reads lines a byte at a time) come from a buffer; what is read
      // past this request stays in it for the next.
      char buffer[kReadChunk];
      const ssize_t n = Receive(buffer, sizeof buffer);
      if (n <= 0) return n;
      c_.in.assign(buffer, static_cast<size_t>(n));
    }
    const size_t n = std::min(size, c_.in.size() - c_.used);
    std::memcpy(ptr, c_.in.data() + c_.used, n);
    c_.used += n;
    return static_cast<ssize_t>(n);
  }

  ssize_t write(const char* ptr, size_t size) override {
    const Clock::time_point deadline = Clock::now() + write_timeout_;
    for (;;) {
      const ssize_t n = ::send(c_.fd, ptr, size, MSG_NOSIGNAL);
      if (n >= 0) return n;
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) return -1;
      if (PollUntil(c_.fd, POLLOUT, deadline) <= 0) return -1;
    }
  }

  void get_remote_ip_and_port(std::string& ip, int& port) const override {
    Address(&::getpeername, ip, port);
  }
  void get_local_ip_and_port(std::string& ip, int& port) const override {
    Address(&::getsockname, ip, port);
  }
  socket_t socket() const override { return c_.fd; }

 private:
  ssize_t Receive(char* ptr, size_t size) {
    for (;;) {
      const int ready = PollUntil(c_.fd, POLLIN, c_.read_deadline);
      if (ready == 0) c_.read_timed_out = true;
      if (ready <= 0) return -1;
      const ssize_t n = ::recv(c_.fd, ptr, size, 0);
      if (n >= 0) return n;
      if (errno != EINTR && errno != EAGAIN && errno != EWOULDBLOCK) return -1;
    }
  }

  void Address(int (*name)(int, sockaddr*, socklen_t*), std::string& ip, int& port) const {
    sockaddr_storage addr{};
    socklen_t len = sizeof addr;
    char host[NI_MAXHOST];
    char service[NI_MAXSERV];
    if (name(c_.fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0 &&
        ::getnameinfo(reinterpret_cast<sockaddr*>(&addr), len, host, sizeof host, service,
                      sizeof service, NI_NUMERICHOST | NI_NUMERICSERV) == 0) {
      ip = host;
      port = std::atoi(service);
    }
  }

  Connection& c_;
  const milliseconds write_timeout_;
};

}  // namespace

// HttpFront's state. The I/O thread owns the connections it reads (idle_) and the accept
// state; a lane owns its queue; what they hand each other (returned_, busy_, shut_) is under
// mu_.
class HttpFront::Impl {
 public:
  explicit Impl(FrontOptions options) : options_(std::move(options)) {}
  ~Impl() { Shutdown({}); }

  Status Bind();
  void Start();
  void Closing() { closing_ = true; }
  void Shutdown(Clock::time_point drain_until);

  Router router_;
  const FrontOptions options_;
  uint16_t port_ = 0;

 private:
  // The threads of one lane and the connections waiting for one.
  class LaneThreads {
   public:
    LaneThreads(Impl* front, size_t threads) : front_(front) {
      for (size_t i = 0; i < threads; ++i) threads_.emplace_back([this] { Run(); });
    }
    void Push(std::unique_ptr<Connection> c) {
      MutexLock lock(&mu_);
      queue_.push_back(std::move(c));
      ready_.Signal();
    }
    // Joins the threads once the queue is empty (its connections were shut down).
    void Stop() {
      {
        MutexLock lock(&mu_);
        stop_ = true;
        ready_.SignalAll();
      }
      for (std::thread& t : threads_) t.join();
      threads_.clear();
    }

   private:
    void Run() {
      for (;;) {
        std::unique_ptr<Connection> c;
        {
          MutexLock lock(&mu_);
          while (queue_.empty() && !stop_) ready_.Wait(&mu_);
          if (queue_.empty()) return;
          c = std::move(queue_.front());
          queue_.pop_front();
        }
        front_->Serve(std::move(c));
      }
    }

    Impl* const front_;
    Mutex mu_;
    CondVar ready_;
    std::deque<std::unique_ptr<Connection>> queue_ GUARDED_BY(mu_);
    bool stop_ GUARDED_BY(mu_) = false;
    std::vector<std::thread> threads_;
  };

  // The I/O thread.
  void RunIo();
  void AcceptAll(Clock::time_point now);
  void PauseAccepting(Clock::time_point now, int error);
  // At the limit (AtLimit::kCloseOldestWaiting): closes the oldest connection waiting for a
  // request; false when there is none.
  bool CloseOldestWaiting();
  void ResumeAccepting();
  void Read(int fd, uint32_t events, Clock::time_point now);
  // The head of `c`'s next request is in (or not yet): hand it to its lane, or keep reading.
  void Examine(std::unique_ptr<Connection>& c, Clock::time_point now);
  void Dispatch(std::unique_ptr<Connection> c);
  void TakeReturned(Clock::time_point now);
  void Expire(Clock::time_point now);
  void CloseIdle(int fd);
  // Answers an error the I/O thread found itself (as well as the socket takes it), then
  // closes the connection.
  void Refuse(int fd, int status, std::string_view code, const std::string& message);
  void Watch(int fd, uint32_t events, int op);

  // Lane threads.
  void Serve(std::unique_ptr<Connection> c);
  void Return(std::unique_ptr<Connection> c);
  void CloseBusy(std::unique_ptr<Connection> c);

  void Wake();
  void Closed();
  bool AnyAnswering() REQUIRES(mu_) {
    return std::any_of(busy_.begin(), busy_.end(),
                       [](const Connection* c) { return c->answering.load(); });
  }

  int listen_fd_ = -1;
  int epoll_fd_ = -1;
  int wake_fd_ = -1;
  std::thread io_;
  std::vector<std::unique_ptr<LaneThreads>> lanes_;  // by Lane
  std::atomic<bool> closing_{false};
  std::atomic<bool> stop_io_{false};
  std::atomic<bool> accept_paused_{false};
  std::atomic<bool> freed_{false};  // a connection closed while accepting was paused
  std::atomic<size_t> open_{0};
  std::once_flag shutdown_once_;

  Mutex mu_;
  std::deque<std::unique_ptr<Connection>> returned_ GUARDED_BY(mu_);  // for the I/O thread
  std::unordered_set<Connection*> busy_ GUARDED_BY(mu_);  // in a lane (queued or served)
  CondVar drained_;                                       // a connection left busy_
  bool draining_ GUARDED_BY(mu_) = false;  // Shutdown began: new requests are cut at once
  bool shut_ GUARDED_BY(mu_) = false;

  // The I/O thread's own.
  std::unordered_map<int, std::unique_ptr<Connection>> idle_;
  uint64_t accepted_ = 0;  // connections accepted so far
  bool paused_ = false;
  int pause_error_ = 0;   // why: accept's errno, or 0 for the connection limit
  bool episode_ = false;  // accepting failed (or hit the limit) since it last succeeded
  Clock::time_point episode_start_;
  Clock::time_point resume_at_;
  milliseconds backoff_{0};
  Clock::time_point next_scan_;
};

Status HttpFront::Impl::Bind() {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(options_.port);
  if (const int e = ::getaddrinfo(options_.listen.c_str(), service.c_str(), &hints, &found);
      e != 0) {
    return UnavailableError("cannot listen on {}:{} ({})", options_.listen, options_.port,
                            ::gai_strerror(e));
  }
  std::string error = "no address";
  for (addrinfo* a = found; a != nullptr && listen_fd_ < 0; a = a->ai_next) {
    const int fd =
        ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      error = std::strerror(errno);
      continue;
    }
    // SO_REUSEADDR only: with SO_REUSEPORT a second server on a taken port would start and
    // share it instead of failing.
    int yes = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
    if (::bind(fd, a->ai_addr, a->ai_addrlen) != 0 || ::listen(fd, options_.backlog) != 0) {
      error = std::strerror(errno);
      ::close(fd);
      continue;
    }
    listen_fd_ = fd;
  }
  ::freeaddrinfo(found);
  if (listen_fd_ < 0) {
    return UnavailableError("cannot listen on {}:{} ({})", options_.listen, options_.port, error);
  }
  sockaddr_storage addr{};
  socklen_t len = sizeof addr;
  ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len);
  port_ = ntohs(addr.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port
                                           : reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  epoll_fd_ = ::epoll_create1(EPOLL_CLOEXEC);
  wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (epoll_fd_ < 0 || wake_fd_ < 0) {
    return UnavailableError("cannot poll connections: {}", std::strerror(errno));
  }
  router_.SetListening(listen_fd_);
  // An answer that says Connection: close (a 413 whose body was left unread) ends it.
  router_.set_post_routing_handler([](const httplib::Request&, httplib::Response& res) {
    if (current != nullptr && res.get_header_value("Connection") == "close") current->close = true;
  });
  router_.set_keep_alive_timeout(std::max<time_t>(
      1, std::chrono::duration_cast<std::chrono::seconds>(options_.keep_alive).count()));
  router_.set_keep_alive_max_count(options_.max_requests_per_connection);
  return Status::OK();
}

void HttpFront::Impl::Start() {
  lanes_.push_back(std::make_unique<LaneThreads>(this, options_.request_threads));
  lanes_.push_back(std::make_unique<LaneThreads>(this, options_.info_threads));
  lanes_.push_back(std::make_unique<LaneThreads>(this, options_.health_threads));
  io_ = std::thread([this] { RunIo(); });
}

void HttpFront::Impl::Shutdown(Clock::time_point drain_until) {
  std::call_once(shutdown_once_, [this, drain_until] {
    closing_ = true;
    {
      MutexLock lock(&mu_);
      draining_ = true;
      // Their reads and writes fail from now on: the lane threads let them go. Answers being
      // written get until drain_until.
      for (Connection* c : busy_) {
        if (!c->answering) ::shutdown(c->fd, SHUT_RDWR);
      }
      while (Clock::now() < drain_until && AnyAnswering()) {
        drained_.WaitFor(&mu_, milliseconds(10));
      }
      shut_ = true;
      for (Connection* c : busy_) ::shutdown(c->fd, SHUT_RDWR);
    }
    stop_io_ = true;
    Wake();
    if (io_.joinable()) io_.join();
    for (auto& lane : lanes_) lane->Stop();
    if (listen_fd_ >= 0) ::close(listen_fd_);
    if (epoll_fd_ >= 0) ::close(epoll_fd_);
    if (wake_fd_ >= 0) ::close(wake_fd_);
    listen_fd_ = epoll_fd_ = wake_fd_ = -1;
  });
}

void HttpFront::Impl::Wake() {
  const uint64_t one = 1;
  [[maybe_unused]] const ssize_t n = ::write(wake_fd_, &one, sizeof one);
}

void HttpFront::Impl::Closed() {
  open_.fetch_sub(1);
  // An accept that waits for a free descriptor or for the connection limit may go on.
  if (accept_paused_.load()) {
    freed_ = true;
    Wake();
  }
}

void HttpFront::Impl::Watch(int fd, uint32_t events, int op) {
  epoll_event e{};
  e.events = events;
  e.data.fd = fd;
  ::epoll_ctl(epoll_fd_, op, fd, &e);
}

void HttpFront::Impl::RunIo() {
  Watch(listen_fd_, EPOLLIN, EPOLL_CTL_ADD);
  Watch(wake_fd_, EPOLLIN, EPOLL_CTL_ADD);
  std::vector<epoll_event> events(256);
  next_scan_ = Clock::now() + kScanInterval;
  while (!stop_io_) {
    const int n = ::epoll_wait(epoll_fd_, events.data(), static_cast<int>(events.size()),
                               static_cast<int>(kScanInterval.count()));
    if (n < 0 && errno != EINTR) {
      const Status failed = InternalError("{}: epoll_wait on port {}: {}", options_.name, port_,
                                          std::strerror(errno));
      KVSTASH_LOG_ERROR("{}", failed.ToString());
      if (options_.on_failure) options_.on_failure(failed);
      break;
    }
    const Clock::time_point now = Clock::now();
    for (int i = 0; i < n && !stop_io_; ++i) {
      const int fd = events[i].data.fd;
      if (fd == listen_fd_) {
        AcceptAll(now);
      } else if (fd == wake_fd_) {
        uint64_t count;
        [[maybe_unused]] const ssize_t r = ::read(wake_fd_, &count, sizeof count);
        TakeReturned(now);
      } else {
        Read(fd, events[i].events, now);
      }
    }
    if (paused_) {
      // Under the limit again; or, out of descriptors or memory, a connection closed (freeing
      // some) or the back-off ran out: try again.
      const bool freed = freed_.exchange(false);
      if (open_.load() < options_.max_connections &&
          (pause_error_ == 0 || freed || now >= resume_at_)) {
        ResumeAccepting();
        // At once, not on the next readable event: with the backlog empty there is none, and
        // only an accept that finds nothing ends the episode (and says so).
        AcceptAll(now);
      }
    }
    if (now >= next_scan_) {
      Expire(now);
      next_scan_ = now + kScanInterval;
    }
  }
  // Idle connections and the ones handed back go now; busy ones were shut down.
  std::vector<int> fds;
  for (const auto& [fd, c] : idle_) fds.push_back(fd);
  for (int fd : fds) CloseIdle(fd);
  std::deque<std::unique_ptr<Connection>> returned;
  {
    MutexLock lock(&mu_);
    returned.swap(returned_);
  }
  for (auto& c : returned) {
    ::close(c->fd);
    Closed();
  }
}

void HttpFront::Impl::AcceptAll(Clock::time_point now) {
  while (!paused_) {
    if (open_.load() >= options_.max_connections) {
      if (options_.at_limit == AtLimit::kCloseOldestWaiting) {
        // Room is made only for a connection that is there to take.
        pollfd p{listen_fd_, POLLIN, 0};
        if (::poll(&p, 1, 0) != 1 || (p.revents & POLLIN) == 0) return;
      }
      if (options_.at_limit == AtLimit::kWait || !CloseOldestWaiting()) {
        PauseAccepting(now, 0);
        return;
      }
    }
    const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      const int e = errno;
      if (e == EAGAIN || e == EWOULDBLOCK) {
        // Every connection that waited has been taken: the episode is over (said at the level
        // its start was, so that a log showing one shows the other).
        if (episode_) {
          KVSTASH_LOG_WARN(
              "{} on port {}: accepting connections again: those that waited were taken "
              "within {} ms",
              options_.name, port_,
              std::chrono::duration_cast<milliseconds>(now - episode_start_).count());
          episode_ = false;
          backoff_ = milliseconds{0};
        }
        return;
      }
      // That one connection failed (reset before it was taken): the next may not.
      if (e == EINTR || e == ECONNABORTED || e == EPROTO || e == EPERM) continue;
      // EMFILE, ENFILE, ENOBUFS, ENOMEM: nothing can be accepted until something is freed.
      PauseAccepting(now, e);
      return;
    }
    open_.fetch_add(1);
    int yes = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &yes, sizeof yes);  // stream events leave at once
    auto c = std::make_unique<Connection>(fd);
    c->accepted = accepted_++;
    c->deadline = now + options_.header_timeout;
    Watch(fd, EPOLLIN | EPOLLRDHUP, EPOLL_CTL_ADD);
    idle_[fd] = std::move(c);
  }
}

void HttpFront::Impl::PauseAccepting(Clock::time_point now, int error) {
  paused_ = true;
  pause_error_ = error;
  freed_ = false;
  accept_paused_ = true;
  Watch(listen_fd_, 0, EPOLL_CTL_MOD);
  backoff_ = std::min(kLastBackoff, backoff_ == milliseconds{0} ? kFirstBackoff : backoff_ * 2);
  resume_at_ = now + backoff_;
  if (episode_) return;  // logged once per episode
  episode_ = true;
  episode_start_ = now;
  if (error == 0) {
    KVSTASH_LOG_WARN(
        "{} on port {}: {} connections open, its limit: new ones wait in the listen backlog "
        "until one closes",
        options_.name, port_, open_.load());
    return;
  }
  rlimit files{};
  ::getrlimit(RLIMIT_NOFILE, &files);
  KVSTASH_LOG_WARN(
      "{} on port {}: cannot accept connections ({}): {} connections open, RLIMIT_NOFILE {}; "
      "new ones wait in the listen backlog, retried as connections close and at most {} ms "
      "apart, and the open ones are served",
      options_.name, port_, std::strerror(error), open_.load(), files.rlim_cur,
      kLastBackoff.count());
}

bool HttpFront::Impl::CloseOldestWaiting() {
  // Connections waiting for room for their answer have their request: not theirs to lose.
  int oldest = -1;
  uint64_t oldest_accepted = 0;
  for (const auto& [fd, c] : idle_) {
    if (!c->waiting_writable && (oldest < 0 || c->accepted < oldest_accepted)) {
      oldest = fd;
      oldest_accepted = c->accepted;
    }
  }
  if (oldest < 0) return false;
  CloseIdle(oldest);
  return true;
}

void HttpFront::Impl::ResumeAccepting() {
  paused_ = false;
  accept_paused_ = false;
  Watch(listen_fd_, EPOLLIN, EPOLL_CTL_MOD);
}

void HttpFront::Impl::Read(int fd, uint32_t events, Clock::time_point now) {
  const auto it = idle_.find(fd);
  if (it == idle_.end()) return;
  std::unique_ptr<Connection>& c = it->second;
  if (c->waiting_writable) {
    if ((events & (EPOLLERR | EPOLLHUP | EPOLLRDHUP)) != 0) return CloseIdle(fd);
    if ((events & EPOLLOUT) != 0) {
      c->waiting_writable = false;
      std::unique_ptr<Connection> taken = std::move(c);
      idle_.erase(it);
      Dispatch(std::move(taken));
    }
    return;
  }
  while (c->in.size() < options_.max_header_bytes) {
    char buffer[kReadChunk];
    const size_t want = std::min(sizeof buffer, options_.max_header_bytes - c->in.size());
    const ssize_t n = ::recv(fd, buffer, want, 0);
    if (n == 0) return CloseIdle(fd);  // closed: a request it had not finished goes too
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) break;
      return CloseIdle(fd);
    }
    if (!c->started) {
      c->started = true;
      c->deadline = now + options_.header_timeout;
    }
    c->in.append(buffer, static_cast<size_t>(n));
    if (c->in.find("\r\n\r\n", c->scanned >= 3 ? c->scanned - 3 : 0) != std::string::npos) break;
    c->scanned = c->in.size();
  }
  Examine(it->second, now);
}

void HttpFront::Impl::Examine(std::unique_ptr<Connection>& c, Clock::time_point now) {
  const int fd = c->fd;
  const size_t end = c->in.find("\r\n\r\n", c->scanned >= 3 ? c->scanned - 3 : 0);
  if (end == std::string::npos) {
    c->scanned = c->in.size();
    if (c->in.size() >= options_.max_header_bytes) {
      Refuse(fd, 431, "request_header_too_large",
             fmt::format("the request line and headers are longer than {} bytes",
                         options_.max_header_bytes));
    }
    return;
  }
  const std::optional<Head> head = ParseHead(std::string_view(c->in).substr(0, end + 2));
  c->lane = Lane::kRequests;
  if (head && !head->has_body && options_.classify) {
    c->lane = options_.classify(head->method, head->path);
  }
  // Health and info answers are written at once: the client must have room for them first,
  // so that their few threads never wait on a client.
  if (c->lane != Lane::kRequests) {
    pollfd p{fd, POLLOUT, 0};
    if (::poll(&p, 1, 0) != 1 || (p.revents & POLLOUT) == 0) {
      c->waiting_writable = true;
      c->deadline = now + options_.write_timeout;
      Watch(fd, EPOLLOUT | EPOLLRDHUP, EPOLL_CTL_MOD);
      return;
    }
  }
  std::unique_ptr<Connection> taken = std::move(c);
  idle_.erase(fd);
  Dispatch(std::move(taken));
}

void HttpFront::Impl::Dispatch(std::unique_ptr<Connection> c) {
  ::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, c->fd, nullptr);
  c->scanned = 0;
  const Lane lane = c->lane;
  {
    MutexLock lock(&mu_);
    busy_.insert(c.get());
    if (draining_) ::shutdown(c->fd, SHUT_RDWR);  // shutting down: it fails at once
  }
  lanes_[static_cast<size_t>(lane)]->Push(std::move(c));
}

void HttpFront::Impl::TakeReturned(Clock::time_point now) {
  std::deque<std::unique_ptr<Connection>> returned;
  {
    MutexLock lock(&mu_);
    returned.swap(returned_);
  }
  for (std::unique_ptr<Connection>& c : returned) {
    const int fd = c->fd;
    // Its next request may be here already (pipelined): its head is due within the header
    // timeout; else the connection waits the keep-alive for one.
    c->started = !c->in.empty();
    c->deadline = now + (c->started ? options_.header_timeout : options_.keep_alive);
    Watch(fd, EPOLLIN | EPOLLRDHUP, EPOLL_CTL_ADD);
    auto [it, inserted] = idle_.emplace(fd, std::move(c));
    if (it->second->started) Examine(it->second, now);
  }
}

void HttpFront::Impl::Expire(Clock::time_point now) {
  std::vector<int> late;
  for (const auto& [fd, c] : idle_) {
    if (c->deadline <= now) late.push_back(fd);
  }
  for (const int fd : late) {
    const Connection& c = *idle_.at(fd);
    if (c.started && !c.in.empty() && !c.waiting_writable) {
      Refuse(fd, 408, "request_timeout",
             fmt::format("the request line and headers did not arrive within {} ms",
                         options_.header_timeout.count()));
    } else {
      CloseIdle(fd);
    }
  }
}

void HttpFront::Impl::Refuse(int fd, int status, std::string_view code,
                             const std::string& message) {
  const std::string body =
      options_.error_body ? options_.error_body(status, code, message) : message;
  const std::string answer = fmt::format(
      "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\n"
      "Connection: close\r\n\r\n{}",
      status, Reason(status), options_.error_content_type, body.size(), body);
  [[maybe_unused]] const ssize_t n =
      ::send(fd, answer.data(), answer.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
  CloseIdle(fd);
}

void HttpFront::Impl::CloseIdle(int fd) {
  ::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, fd, nullptr);
  idle_.erase(fd);
  ::close(fd);
  Closed();
}

void HttpFront::Impl::Serve(std::unique_ptr<Connection> c) {
  c->read_deadline = Clock::now() + options_.read_timeout;
  c->answering = c->lane != Lane::kRequests;
  c->close = false;
  c->read_timed_out = false;
  ConnectionStream stream(*c, options_.write_timeout);
  const bool last = c->served + 1 >= options_.max_requests_per_connection || closing_.load();
  bool closed = false;
  current = c.get();
  const bool ok = router_.process_request(stream, last, closed, nullptr);
  current = nullptr;
  ++c->served;
  c->in.erase(0, c->used);
  c->used = 0;
  if (c->close) Linger(c->fd);
  if (!ok || closed || last || c->close || closing_.load()) return CloseBusy(std::move(c));
  Return(std::move(c));
}

void HttpFront::Impl::Return(std::unique_ptr<Connection> c) {
  {
    MutexLock lock(&mu_);
    busy_.erase(c.get());
    drained_.SignalAll();
    if (!shut_) {
      returned_.push_back(std::move(c));
      Wake();
      return;
    }
  }
  ::close(c->fd);
  Closed();
}

void HttpFront::Impl::CloseBusy(std::unique_ptr<Connection> c) {
  {
    // Under mu_: Shutdown shuts down only sockets still open.
    MutexLock lock(&mu_);
    busy_.erase(c.get());
    drained_.SignalAll();
    ::close(c->fd);
  }
  Closed();
}

Result<std::unique_ptr<HttpFront>> HttpFront::Create(FrontOptions options) {
  if (options.request_threads == 0 || options.info_threads == 0 || options.health_threads == 0) {
    return InvalidArgumentError("an HTTP front needs threads in every lane");
  }
  if (options.max_connections == 0) return InvalidArgumentError("a limit of 0 connections");
  if (options.backlog < 1) return InvalidArgumentError("a listen backlog of {}", options.backlog);
  for (const auto& [name, value] :
       {std::pair{"header", options.header_timeout}, std::pair{"read", options.read_timeout},
        std::pair{"write", options.write_timeout}, std::pair{"keep-alive", options.keep_alive}}) {
    if (value.count() < 1) {
      return InvalidArgumentError("a {} timeout of {} ms: at least 1", name, value.count());
    }
  }
  auto impl = std::make_unique<Impl>(std::move(options));
  KVSTASH_RETURN_IF_ERROR(impl->Bind());
  return std::unique_ptr<HttpFront>(new HttpFront(std::move(impl)));
}

HttpFront::HttpFront(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
HttpFront::~HttpFront() { impl_->Shutdown({}); }
uint16_t HttpFront::port() const { return impl_->port_; }
httplib::Server& HttpFront::router() { return impl_->router_; }
void HttpFront::Start() { impl_->Start(); }
void HttpFront::Closing() { impl_->Closing(); }
void HttpFront::Shutdown(Clock::time_point drain_until) { impl_->Shutdown(drain_until); }

bool HttpFront::ClientGone() {
  if (current == nullptr) return false;
  pollfd p{current->fd, POLLRDHUP, 0};
  return ::poll(&p, 1, 0) == 1 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0;
}

bool HttpFront::ReadTimedOut() { return current != nullptr && current->read_timed_out; }

void HttpFront::Answering() {
  if (current != nullptr) current->answering = true;
}

}  // namespace kvstash::http
