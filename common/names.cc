// Name rules (see names.h).
#include "common/names.h"

#include <cctype>
#include <cstdio>

namespace isthmus {
namespace {

// 1-`max` of [A-Za-z0-9._-], not starting with '.'.
bool IsPlainName(std::string_view name, size_t max) {
  if (name.empty() || name.size() > max || name[0] == '.') return false;
  for (char c : name) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_' && c != '-') {
      return false;
    }
  }
  return true;
}

}  // namespace

bool IsValidName(const std::string& name) { return IsPlainName(name, 64); }

const char* ValidNameRule() {
  return "1-64 characters of A-Z a-z 0-9 . _ -, not starting with '.'";
}

bool IsValidSiteName(const std::string& name) { return IsValidName(name); }

const char* SiteNameRule() { return ValidNameRule(); }

bool IsValidShardId(const std::string& id) { return IsPlainName(id, 128); }

const char* ShardIdRule() { return "1-128 characters of A-Z a-z 0-9 . _ -, not starting with '.'"; }

bool IsValidTensorName(std::string_view name) {
  if (name.empty() || name.size() > 512 || name[0] == '/') return false;
  for (char c : name) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x20 || u == 0x7f) return false;
  }
  size_t start = 0;
  while (start <= name.size()) {
    size_t end = name.find('/', start);
    if (end == std::string_view::npos) end = name.size();
    const std::string_view part = name.substr(start, end - start);
    if (part == "." || part == "..") return false;
    start = end + 1;
  }
  return true;
}

const char* TensorNameRule() {
  return "1-512 bytes without control characters (NUL, newline, ...), not starting with '/', "
         "and no path component '.' or '..'";
}

std::string PrintableName(std::string_view name) {
  constexpr size_t kShown = 64;
  std::string out;
  for (size_t i = 0; i < name.size() && i < kShown; ++i) {
    const auto u = static_cast<unsigned char>(name[i]);
    if (u < 0x20 || u == 0x7f || name[i] == '\\') {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", u);
      out += buf;
    } else {
      out += name[i];
    }
  }
  if (name.size() > kShown) out += "...(" + std::to_string(name.size()) + " bytes)";
  return out;
}

}  // namespace isthmus
