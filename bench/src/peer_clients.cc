#include "peer_clients.h"

#include <fmt/format.h>
#include <hiredis/hiredis.h>
#include <libmemcached/memcached.h>
#include <sys/time.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <string_view>
#include <utility>

namespace kvstash::bench {
namespace {

// Every call to a peer fails after this long: a stuck server ends the round with errors
// instead of hanging it.
constexpr int kTimeoutMs = 10000;

// The key as text, in a buffer of its own (no allocation per operation).
class KeyText {
 public:
  explicit KeyText(uint64_t key) {
    const auto end = fmt::format_to_n(text_.data(), text_.size(), "kvstash-bench:{:016x}", key);
    size_ = end.size;
  }
  const char* data() const { return text_.data(); }
  size_t size() const { return size_; }
  std::string_view view() const { return {text_.data(), size_}; }

 private:
  std::array<char, 32> text_{};
  size_t size_ = 0;
};

// ---- Redis
// ---------------------------------------------------------------------------------------

// Where hiredis's reader puts the reply of the command in flight: a bulk string's bytes go
// straight into `out` (as many as fit), other replies are described. Set before each command.
struct RedisReply {
  std::span<std::byte> out;
  int type = 0;       // REDIS_REPLY_*; 0: none
  size_t length = 0;  // a bulk string's length
  std::string text;   // a status or an error
};

// hiredis's reply functions, replaced: instead of building a reply object (a malloc and a copy
// of the bytes), they fill the connection's RedisReply, which stands for the reply object.
void* CreateString(const redisReadTask* task, char* str, size_t length) {
  auto* reply = static_cast<RedisReply*>(task->privdata);
  reply->type = task->type;
  reply->length = length;
  if (task->type == REDIS_REPLY_STRING) {
    std::memcpy(reply->out.data(), str, std::min(length, reply->out.size()));
  } else {
    reply->text.assign(str, length);
  }
  return reply;
}
void* CreateArray(const redisReadTask* task, int /*elements*/) {
  auto* reply = static_cast<RedisReply*>(task->privdata);
  reply->type = REDIS_REPLY_ARRAY;
  return reply;
}
void* CreateInteger(const redisReadTask* task, long long /*value*/) {
  auto* reply = static_cast<RedisReply*>(task->privdata);
  reply->type = REDIS_REPLY_INTEGER;
  return reply;
}
void* CreateNil(const redisReadTask* task) {
  auto* reply = static_cast<RedisReply*>(task->privdata);
  reply->type = REDIS_REPLY_NIL;
  return reply;
}
void FreeObject(void* /*reply: the connection's own*/) {}

redisReplyObjectFunctions kReplyFunctions = {CreateString, CreateArray, CreateInteger, CreateNil,
                                             FreeObject};

// One hiredis context. Owns it; one thread at a time.
class RedisConnection final : public BlockConnection {
 public:
  explicit RedisConnection(redisContext* context) : context_(context) {
    context_->reader->fn = &kReplyFunctions;
    context_->reader->privdata = &reply_;
    // Keep the reader's buffer between replies: by default hiredis frees a buffer of more than
    // 16 KiB once it is empty, and every block read would grow a new one from nothing.
    context_->reader->maxbuf = 0;
  }
  ~RedisConnection() override { redisFree(context_); }
  RedisConnection(const RedisConnection&) = delete;
  RedisConnection& operator=(const RedisConnection&) = delete;

  Status Put(std::span<const uint64_t> keys,
             std::span<const std::span<const std::byte>> blocks) override {
    for (size_t i = 0; i < keys.size(); ++i) {
      const KeyText key(keys[i]);
      reply_ = RedisReply{};
      if (redisCommand(context_, "SET %b %b", key.data(), key.size(), blocks[i].data(),
                       blocks[i].size()) == nullptr) {
        return UnavailableError("redis SET {}: {}", key.view(), context_->errstr);
      }
      if (reply_.type != REDIS_REPLY_STATUS || reply_.text != "OK") {
        return InternalError("redis SET {}: {}", key.view(), Describe());
      }
    }
    return Status::OK();
  }

  std::vector<Result<size_t>> Get(std::span<const uint64_t> keys,
                                  std::span<const std::span<std::byte>> outs) override {
    std::vector<Result<size_t>> got;
    got.reserve(keys.size());
    for (size_t i = 0; i < keys.size(); ++i) {
      const KeyText key(keys[i]);
      reply_ = RedisReply{};
      reply_.out = outs[i];
      if (redisCommand(context_, "GET %b", key.data(), key.size()) == nullptr) {
        got.push_back(UnavailableError("redis GET {}: {}", key.view(), context_->errstr));
      } else if (reply_.type == REDIS_REPLY_NIL) {
        got.push_back(NotFoundError("redis GET {}: no such key", key.view()));
      } else if (reply_.type == REDIS_REPLY_STRING) {
        got.push_back(reply_.length);
      } else {
        got.push_back(InternalError("redis GET {}: {}", key.view(), Describe()));
      }
    }
    return got;
  }

 private:
  std::string Describe() const {
    if (reply_.type == REDIS_REPLY_ERROR) return "error " + reply_.text;
    if (reply_.type == REDIS_REPLY_STATUS) return "status " + reply_.text;
    return fmt::format("a reply of type {}", reply_.type);
  }

  redisContext* context_;
  RedisReply reply_;
};

// ---- memcached
// -----------------------------------------------------------------------------------

// One libmemcached handle with one server. Owns it; one thread at a time.
class MemcachedConnection final : public BlockConnection {
 public:
  explicit MemcachedConnection(memcached_st* memc) : memc_(memc) {}
  ~MemcachedConnection() override { memcached_free(memc_); }
  MemcachedConnection(const MemcachedConnection&) = delete;
  MemcachedConnection& operator=(const MemcachedConnection&) = delete;

  Status Put(std::span<const uint64_t> keys,
             std::span<const std::span<const std::byte>> blocks) override {
    for (size_t i = 0; i < keys.size(); ++i) {
      const KeyText key(keys[i]);
      const memcached_return_t rc =
          memcached_set(memc_, key.data(), key.size(),
                        reinterpret_cast<const char*>(blocks[i].data()), blocks[i].size(), 0, 0);
      if (rc != MEMCACHED_SUCCESS) {
        return UnavailableError("memcached set {}: {}", key.view(),
                                memcached_last_error_message(memc_));
      }
    }
    return Status::OK();
  }

  std::vector<Result<size_t>> Get(std::span<const uint64_t> keys,
                                  std::span<const std::span<std::byte>> outs) override {
    std::vector<Result<size_t>> got;
    got.reserve(keys.size());
    for (size_t i = 0; i < keys.size(); ++i) {
      const KeyText key(keys[i]);
      size_t length = 0;
      uint32_t flags = 0;
      memcached_return_t rc = MEMCACHED_SUCCESS;
      char* value = memcached_get(memc_, key.data(), key.size(), &length, &flags, &rc);
      if (value != nullptr) {
        std::memcpy(outs[i].data(), value, std::min(length, outs[i].size()));
        std::free(value);
        got.push_back(length);
      } else if (rc == MEMCACHED_NOTFOUND) {
        got.push_back(NotFoundError("memcached get {}: no such key", key.view()));
      } else {
        got.push_back(UnavailableError("memcached get {}: {}", key.view(),
                                       memcached_last_error_message(memc_)));
      }
    }
    return got;
  }

 private:
  memcached_st* memc_;
};

}  // namespace

std::string PeerKey(uint64_t key) { return std::string(KeyText(key).view()); }

Result<std::unique_ptr<BlockConnection>> ConnectRedis(const RedisAddress& address) {
  const timeval timeout = {kTimeoutMs / 1000, (kTimeoutMs % 1000) * 1000};
  redisContext* context = address.unix_path.empty()
                              ? redisConnectWithTimeout(address.host.c_str(), address.port, timeout)
                              : redisConnectUnixWithTimeout(address.unix_path.c_str(), timeout);
  const std::string where = address.unix_path.empty()
                                ? fmt::format("{}:{}", address.host, address.port)
                                : address.unix_path;
  if (context == nullptr) return UnavailableError("redis at {}: cannot allocate a context", where);
  if (context->err != 0) {
    const std::string message = context->errstr;
    redisFree(context);
    return UnavailableError("redis at {}: {}", where, message);
  }
  if (redisSetTimeout(context, timeout) != REDIS_OK) {
    redisFree(context);
    return UnavailableError("redis at {}: cannot set its timeout", where);
  }
  return std::unique_ptr<BlockConnection>(std::make_unique<RedisConnection>(context));
}

Result<std::unique_ptr<BlockConnection>> ConnectMemcached(const std::string& host, uint16_t port,
                                                          MemcachedProtocol protocol) {
  memcached_st* memc = memcached_create(nullptr);
  if (memc == nullptr) return UnavailableError("memcached: cannot allocate a handle");
  auto connection = std::make_unique<MemcachedConnection>(memc);
  const std::pair<memcached_behavior_t, uint64_t> behaviours[] = {
      {MEMCACHED_BEHAVIOR_BINARY_PROTOCOL, protocol == MemcachedProtocol::kBinary ? 1 : 0},
      {MEMCACHED_BEHAVIOR_TCP_NODELAY, 1},
      {MEMCACHED_BEHAVIOR_CONNECT_TIMEOUT, kTimeoutMs},
      {MEMCACHED_BEHAVIOR_POLL_TIMEOUT, kTimeoutMs},
  };
  for (const auto& [behaviour, value] : behaviours) {
    if (memcached_behavior_set(memc, behaviour, value) != MEMCACHED_SUCCESS) {
      return UnavailableError("memcached: behaviour {}: {}", static_cast<int>(behaviour),
                              memcached_last_error_message(memc));
    }
  }
  if (memcached_server_add(memc, host.c_str(), port) != MEMCACHED_SUCCESS) {
    return UnavailableError("memcached at {}:{}: {}", host, port,
                            memcached_last_error_message(memc));
  }
  return std::unique_ptr<BlockConnection>(std::move(connection));
}

}  // namespace kvstash::bench
