// Status and Result<T>: the one error model of kvstash.
//
// Codes are modelled on gRPC's so that they map one to one onto the wire. No exceptions cross a
// component boundary: a miss is the hot path, completions run on transport threads, and every
// dependency returns codes anyway. Each dependency's codes are translated in exactly one function
// (FromUcs, FromRocks, FromCuda, FromErrno) next to the code that calls it.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "fmt/format.h"

namespace kvstash {

enum class StatusCode : uint8_t {
  kOk = 0,
  kCancelled = 1,
  kUnknown = 2,
  kInvalidArgument = 3,
  kDeadlineExceeded = 4,
  kNotFound = 5,
  kAlreadyExists = 6,
  kPermissionDenied = 7,
  kResourceExhausted = 8,
  kFailedPrecondition = 9,
  kAborted = 10,
  kOutOfRange = 11,
  kUnimplemented = 12,
  kInternal = 13,
  kUnavailable = 14,
  kDataLoss = 15,
  kUnauthenticated = 16,
};

// "OK", "INVALID_ARGUMENT", ... as gRPC spells them.
std::string_view StatusCodeName(StatusCode code);

// The outcome of an operation: OK, or a code with a message that says what failed and with
// which value. OK carries no allocation. Thread-compatible (a value type).
class [[nodiscard]] Status {
 public:
  Status() = default;  // OK
  Status(StatusCode code, std::string message);

  Status(const Status& other);
  Status& operator=(const Status& other);
  Status(Status&&) noexcept = default;
  Status& operator=(Status&&) noexcept = default;

  static Status OK() { return Status(); }

  bool ok() const { return rep_ == nullptr; }
  StatusCode code() const { return rep_ ? rep_->code : StatusCode::kOk; }
  std::string_view message() const { return rep_ ? std::string_view(rep_->message) : ""; }
  // "OK" or "NOT_FOUND: key ... is not stored".
  std::string ToString() const;

  // Explicitly drops a status the caller has decided not to act on.
  void IgnoreError() const {}

  friend bool operator==(const Status& a, const Status& b) {
    return a.code() == b.code() && a.message() == b.message();
  }

 private:
  struct Rep {
    StatusCode code;
    std::string message;
  };
  std::unique_ptr<Rep> rep_;
};

// Factories, one per code, taking fmt-style arguments:
//   return InvalidArgumentError("block of {} bytes exceeds slot size {}", n, slot);
#define KVSTASH_DEFINE_STATUS_FACTORY(name, code)                                      \
  template <typename... Args>                                                          \
  Status name(fmt::format_string<Args...> format, Args&&... args) {                    \
    return Status(StatusCode::code, fmt::format(format, std::forward<Args>(args)...)); \
  }
KVSTASH_DEFINE_STATUS_FACTORY(CancelledError, kCancelled)
KVSTASH_DEFINE_STATUS_FACTORY(UnknownError, kUnknown)
KVSTASH_DEFINE_STATUS_FACTORY(InvalidArgumentError, kInvalidArgument)
KVSTASH_DEFINE_STATUS_FACTORY(DeadlineExceededError, kDeadlineExceeded)
KVSTASH_DEFINE_STATUS_FACTORY(NotFoundError, kNotFound)
KVSTASH_DEFINE_STATUS_FACTORY(AlreadyExistsError, kAlreadyExists)
KVSTASH_DEFINE_STATUS_FACTORY(PermissionDeniedError, kPermissionDenied)
KVSTASH_DEFINE_STATUS_FACTORY(ResourceExhaustedError, kResourceExhausted)
KVSTASH_DEFINE_STATUS_FACTORY(FailedPreconditionError, kFailedPrecondition)
KVSTASH_DEFINE_STATUS_FACTORY(AbortedError, kAborted)
KVSTASH_DEFINE_STATUS_FACTORY(OutOfRangeError, kOutOfRange)
KVSTASH_DEFINE_STATUS_FACTORY(UnimplementedError, kUnimplemented)
KVSTASH_DEFINE_STATUS_FACTORY(InternalError, kInternal)
KVSTASH_DEFINE_STATUS_FACTORY(UnavailableError, kUnavailable)
KVSTASH_DEFINE_STATUS_FACTORY(DataLossError, kDataLoss)
KVSTASH_DEFINE_STATUS_FACTORY(UnauthenticatedError, kUnauthenticated)
#undef KVSTASH_DEFINE_STATUS_FACTORY

// Translates an errno value: `FromErrno(errno, "mmap of {} bytes", n)`.
Status FromErrno(int error_number, std::string_view what);

// A value or the Status that explains its absence. Never holds an OK status without a value.
// Thread-compatible.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : value_(std::move(value)) {}         // NOLINT: implicit by design
  Result(Status status) : status_(std::move(status)) {  // NOLINT: implicit by design
    if (status_.ok()) status_ = Status(StatusCode::kInternal, "Result built from an OK status");
  }

  bool ok() const { return value_.has_value(); }
  const Status& status() const { return status_; }

  // Preconditions: ok().
  T& value() & { return *value_; }
  const T& value() const& { return *value_; }
  T&& value() && { return std::move(*value_); }
  T& operator*() & { return *value_; }
  const T& operator*() const& { return *value_; }
  T&& operator*() && { return std::move(*value_); }
  T* operator->() { return &*value_; }
  const T* operator->() const { return &*value_; }

 private:
  Status status_;
  std::optional<T> value_;
};

}  // namespace kvstash

#define KVSTASH_STATUS_CONCAT_INNER(a, b) a##b
#define KVSTASH_STATUS_CONCAT(a, b) KVSTASH_STATUS_CONCAT_INNER(a, b)

// Returns the status from the enclosing function if `expr` is not OK.
#define KVSTASH_RETURN_IF_ERROR(expr)                  \
  do {                                                 \
    ::kvstash::Status _kvstash_status = (expr);        \
    if (!_kvstash_status.ok()) return _kvstash_status; \
  } while (false)

// `KVSTASH_ASSIGN_OR_RETURN(auto slab, BlockSlab::Create(options));`
#define KVSTASH_ASSIGN_OR_RETURN(lhs, expr) \
  KVSTASH_ASSIGN_OR_RETURN_IMPL(KVSTASH_STATUS_CONCAT(_kvstash_result_, __LINE__), lhs, expr)
#define KVSTASH_ASSIGN_OR_RETURN_IMPL(result, lhs, expr) \
  auto result = (expr);                                  \
  if (!result.ok()) return result.status();              \
  lhs = std::move(result).value()
