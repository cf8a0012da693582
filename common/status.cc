// Names for status codes, used in logs, CLI output and error replies.
#include "common/status.h"

namespace isthmus {

std::string_view CodeName(Code code) {
  switch (code) {
    case Code::kOk:
      return "OK";
    case Code::kInvalidArgument:
      return "InvalidArgument";
    case Code::kNotFound:
      return "NotFound";
    case Code::kAlreadyExists:
      return "AlreadyExists";
    case Code::kPermissionDenied:
      return "PermissionDenied";
    case Code::kFailedPrecondition:
      return "FailedPrecondition";
    case Code::kUnavailable:
      return "Unavailable";
    case Code::kTimeout:
      return "Timeout";
    case Code::kIoError:
      return "IoError";
    case Code::kCorruption:
      return "Corruption";
    case Code::kInternal:
      return "Internal";
    case Code::kResourceExhausted:
      return "ResourceExhausted";
  }
  return "Unknown";
}

std::string Status::ToString() const {
  if (ok()) return "OK";
  std::string s(CodeName(code_));
  s += ": ";
  s += message_;
  return s;
}

}  // namespace isthmus
