// The one error model of storage, protocol and client code: functions return a Status
// (or a Result<T>, a value or a Status) instead of throwing. "Would block" and timeouts
// are ordinary results (Code::kTimeout, Code::kUnavailable), not exceptions. Exceptions
// appear only at documented edges: argument and config parsing in main().
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace isthmus {

// Codes are also carried on the wire (schemas/isthmus.fbs ErrorCode mirrors them one to
// one), so never renumber an existing code.
enum class Code : uint8_t {
  kOk = 0,
  kInvalidArgument = 1,     // the request is malformed: bad shape, dtype, size, NaN, ...
  kNotFound = 2,            // job, tensor, snapshot or file does not exist
  kAlreadyExists = 3,       // job or snapshot with that name exists
  kPermissionDenied = 4,    // key not allowed, secret key file too open
  kFailedPrecondition = 5,  // the state does not allow this now (e.g. base hash mismatch)
  kUnavailable = 6,         // peer not reachable; retrying may help
  kTimeout = 7,             // no answer in time; retrying may help
  kIoError = 8,             // disk or RocksDB failure
  kCorruption = 9,          // stored data fails its checks
  kInternal = 10,           // a bug: an invariant did not hold
  kResourceExhausted = 11,  // message or tensor larger than the configured limit
};

std::string_view CodeName(Code code);

class [[nodiscard]] Status {
 public:
  Status() = default;  // OK
  Status(Code code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return Status(); }
  static Status InvalidArgument(std::string m) { return {Code::kInvalidArgument, std::move(m)}; }
  static Status NotFound(std::string m) { return {Code::kNotFound, std::move(m)}; }
  static Status AlreadyExists(std::string m) { return {Code::kAlreadyExists, std::move(m)}; }
  static Status PermissionDenied(std::string m) { return {Code::kPermissionDenied, std::move(m)}; }
  static Status FailedPrecondition(std::string m) {
    return {Code::kFailedPrecondition, std::move(m)};
  }
  static Status Unavailable(std::string m) { return {Code::kUnavailable, std::move(m)}; }
  static Status Timeout(std::string m) { return {Code::kTimeout, std::move(m)}; }
  static Status IoError(std::string m) { return {Code::kIoError, std::move(m)}; }
  static Status Corruption(std::string m) { return {Code::kCorruption, std::move(m)}; }
  static Status Internal(std::string m) { return {Code::kInternal, std::move(m)}; }
  static Status ResourceExhausted(std::string m) {
    return {Code::kResourceExhausted, std::move(m)};
  }

  bool ok() const { return code_ == Code::kOk; }
  Code code() const { return code_; }
  const std::string& message() const { return message_; }
  // "InvalidArgument: tensor 'wte' has 3 dims, expected 2"; "OK" when ok().
  std::string ToString() const;

 private:
  Code code_ = Code::kOk;
  std::string message_;
};

// A value or the Status explaining why there is none. Access the value only when ok().
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}         // NOLINT: implicit by design
  Result(Status status) : v_(std::move(status)) {}  // NOLINT: must not be OK

  bool ok() const { return std::holds_alternative<T>(v_); }
  const Status& status() const {
    static const Status kOkStatus;
    return ok() ? kOkStatus : std::get<Status>(v_);
  }
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace isthmus

// Returns the Status from the enclosing function when `expr` is not OK.
#define ISTHMUS_RETURN_IF_ERROR(expr)                  \
  do {                                                 \
    ::isthmus::Status isthmus_status_ = (expr);        \
    if (!isthmus_status_.ok()) return isthmus_status_; \
  } while (0)

#define ISTHMUS_CONCAT_INNER_(a, b) a##b
#define ISTHMUS_CONCAT_(a, b) ISTHMUS_CONCAT_INNER_(a, b)
// Declares `lhs` from a Result, or returns its Status from the enclosing function.
#define ISTHMUS_ASSIGN_OR_RETURN(lhs, expr) \
  ISTHMUS_ASSIGN_OR_RETURN_IMPL_(ISTHMUS_CONCAT_(isthmus_result_, __LINE__), lhs, expr)
#define ISTHMUS_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                   \
  if (!tmp.ok()) return tmp.status();                  \
  lhs = std::move(tmp).value()
